// The README's C++ example, verbatim in its training logic: it must build, run and learn. It
// includes the umbrella header as the README does, so <kiln/kiln.h> works in the build tree too
// (tests/consumer/ builds the same example against an installed kiln).
#include <doctest/doctest.h>

#include <kiln/kiln.h>

using namespace kiln;

TEST_CASE("README example trains") {
  manual_seed(0);
  auto net = std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Conv2d>(1, 16, 3, 1, 1), std::make_shared<nn::BatchNorm2d>(16),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::AdaptiveAvgPool2d>(1),
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(16, 10)});
  optim::SGDOptions o;
  o.lr = 0.1;
  o.momentum = 0.9;
  optim::SGD opt(net->parameters(), o);
  Tensor y = randint(0, 10, {32});                   // labels; the images' brightness encodes them
  Tensor x = randn({32, 1, 28, 28}) + y.to(DType::f32).reshape({32, 1, 1, 1});
  double first = 0, last = 0;
  for (int step = 0; step < 100; ++step) {
    Tensor loss = F::cross_entropy((*net)(x), y);
    if (step == 0) first = loss.item();
    last = loss.item();
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  MESSAGE("loss " << first << " -> " << last);
  CHECK(first > 2.0);        // ~ln(10) at the start
  CHECK(last < 0.5 * first);
}
