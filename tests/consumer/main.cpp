// The README's example, built outside kiln's tree through <kiln/kiln.h> (tests/consumer/run.cmake):
// exits 0 only when the loss falls to under half its first value.
#include <kiln/kiln.h>

#include <cstdio>

using namespace kiln;

int main() {
  std::printf("kiln %s (headers %s), CUDA devices: %d\n", kiln::version(), KILN_VERSION,
              kiln::cuda_device_count());
  manual_seed(0);
  auto net = std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Conv2d>(1, 16, 3, 1, 1),   // (N, 1, 28, 28) -> (N, 16, 28, 28)
      std::make_shared<nn::BatchNorm2d>(16),
      std::make_shared<nn::ReLU>(),
      std::make_shared<nn::AdaptiveAvgPool2d>(1),     // -> (N, 16, 1, 1)
      std::make_shared<nn::Flatten>(),                // -> (N, 16)
      std::make_shared<nn::Linear>(16, 10)});         // -> (N, 10)
  optim::SGDOptions o;
  o.lr = 0.1;
  o.momentum = 0.9;
  optim::SGD opt(net->parameters(), o);
  Tensor y = randint(0, 10, {32});                   // labels; the images' brightness encodes them
  Tensor x = randn({32, 1, 28, 28}) + y.to(DType::f32).reshape({32, 1, 1, 1});
  double first = 0, last = 0;
  for (int step = 0; step < 100; ++step) {
    Tensor loss = F::cross_entropy((*net)(x), y);     // mean over the batch
    if (step == 0) first = loss.item();
    last = loss.item();
    opt.zero_grad();
    loss.backward();                                  // gradients accumulate into .grad
    opt.step();
  }
  const bool learned = first > 2.0 && last < 0.5 * first;
  std::printf("loss %.4f -> %.4f: %s\n", first, last, learned ? "learned" : "DID NOT LEARN");
  return learned ? 0 : 1;
}
