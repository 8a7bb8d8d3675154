// Forward passes through the layers and the ResNets, BN running-statistics bookkeeping, one
// SGD step that lowers the loss of resnet_small on a fixed batch, and a 1-channel NHWC input
// that keeps the network NHWC.
#include <doctest/doctest.h>

#include <cmath>

#include "models/nn.h"
#include "models/resnet.h"
#include "ops/ops.h"
#include "optim/sgd.h"

using namespace kiln;
using namespace kiln::models;

namespace {
bool all_finite(const Tensor& t) {
  for (double v : t.to_vector<double>())
    if (!std::isfinite(v)) return false;
  return true;
}
}  // namespace

TEST_CASE("layers pass their configuration to the ops") {
  Generator gen(5);
  Tensor x = randn({2, 3, 9, 9}, {}, &gen);
  CHECK(nn::Conv2d(3, 8, 3, 2, 1)(x).shape() == Shape{2, 8, 5, 5});
  CHECK(nn::Conv2d(3, 8, 3, 1, 0, /*dilation=*/2)(x).shape() == Shape{2, 8, 5, 5});
  CHECK(nn::Conv2d(3, 6, {1, 3}, 1, {0, 1}, 1, /*groups=*/3)(x).shape() == Shape{2, 6, 9, 9});
  CHECK(nn::MaxPool2d(3, 2, 1)(x).shape() == Shape{2, 3, 5, 5});
  CHECK(nn::AvgPool2d(3)(x).shape() == Shape{2, 3, 3, 3});
  CHECK(nn::AdaptiveAvgPool2d(1)(x).shape() == Shape{2, 3, 1, 1});
  CHECK(nn::Flatten()(x).shape() == Shape{2, 243});

  // Linear: y = x·Wᵀ + b against a naive loop.
  nn::Linear lin(4, 3, true, &gen);
  Tensor in = randn({2, 4}, {}, &gen);
  auto y = lin(in).to_vector<double>();
  auto w = lin.weight().to_vector<double>(), b = lin.bias().to_vector<double>();
  auto xv = in.to_vector<double>();
  for (int n = 0; n < 2; ++n)
    for (int o = 0; o < 3; ++o) {
      double acc = b[size_t(o)];
      for (int i = 0; i < 4; ++i) acc += xv[size_t(n * 4 + i)] * w[size_t(o * 4 + i)];
      CHECK(y[size_t(n * 3 + o)] == doctest::Approx(acc).epsilon(1e-5));
    }
}

TEST_CASE("BatchNorm2d: training updates running stats and the counter; eval does not") {
  nn::BatchNorm2d bn(3, 1e-5, 0.1);
  Generator gen(9);
  Tensor x = F::add(F::mul(randn({4, 3, 5, 5}, {}, &gen), 2.0), 1.0);
  Tensor y = bn(x);
  CHECK(y.shape() == x.shape());
  CHECK(bn.num_batches_tracked().item() == 1.0);
  auto mean = F::mean(x, {0, 2, 3}).to_vector<double>();
  auto rm = bn.running_mean().to_vector<double>();
  for (size_t c = 0; c < 3; ++c) CHECK(rm[c] == doctest::Approx(0.1 * mean[c]).epsilon(1e-4));
  // Normalised output: per-channel mean ~0.
  for (double m : F::mean(y, {0, 2, 3}).to_vector<double>()) CHECK(std::abs(m) < 1e-4);
  bn.eval();
  Tensor before = bn.running_mean().clone();
  bn(x);
  CHECK(bn.num_batches_tracked().item() == 1.0);
  CHECK(bn.running_mean().to_vector<double>() == before.to_vector<double>());
}

TEST_CASE("BatchNormAct2d and ConvBn with an activation: the composition, BatchNorm2d's state") {
  Generator gen(9);
  auto conv = std::make_shared<nn::Conv2d>(3, 4, 3, 1, 1, 1, 1, false, &gen);
  auto bn = std::make_shared<nn::BatchNorm2d>(4);
  nn::ConvBn conv_bn(conv, bn, Activation::Gelu);
  nn::BatchNormAct2d bna(4, Activation::Gelu, 1e-3, 0.3);
  CHECK(bna.describe() == "BatchNormAct2d(4, eps=0.001, momentum=0.3, act=gelu)");
  nn::BatchNorm2d plain(4, 1e-3, 0.3), plain2(4);
  CHECK(bna.state().size() == plain.state().size());
  Tensor x = randn({2, 3, 5, 5});
  Tensor y = conv_bn.forward(x);
  Tensor want = F::gelu(plain2.forward(conv->forward(x)));
  CHECK(y.to_vector<double>() == want.to_vector<double>());
  Tensor z = bna.forward(y);
  Tensor zw = F::gelu(plain.forward(y));
  CHECK(z.to_vector<double>() == zw.to_vector<double>());
  CHECK(bna.running_var().to_vector<double>() == plain.running_var().to_vector<double>());
  CHECK(bna.num_batches_tracked().item() == 1.0);
  CHECK(bn->num_batches_tracked().item() == 1.0);
  // Eval: the running statistics, counters unchanged.
  bna.eval();
  plain.eval();
  CHECK(bna.forward(y).to_vector<double>() == F::gelu(plain.forward(y)).to_vector<double>());
  CHECK(bna.num_batches_tracked().item() == 1.0);
  // Relu and None through ConvBn.
  nn::ConvBn relu_bn(conv, std::make_shared<nn::BatchNorm2d>(4), Activation::Relu);
  for (double v : relu_bn.forward(x).to_vector<double>()) CHECK(v >= 0.0);
}

TEST_CASE("resnet_small: (2, 1, 28, 28) -> (2, 10)") {
  auto m = resnet_small();
  Generator gen(1);
  Tensor x = randn({2, 1, 28, 28}, {}, &gen);
  Tensor y = m->forward(x);
  CHECK(y.shape() == Shape{2, 10});
  CHECK(all_finite(y));
  m->eval();
  Tensor ye = m->forward(x);
  CHECK(ye.shape() == Shape{2, 10});
  CHECK(all_finite(ye));
}

TEST_CASE("resnet18: (1, 3, 64, 64) -> (1, 1000)") {
  auto m = resnet18();
  Generator gen(2);
  Tensor y = m->forward(randn({1, 3, 64, 64}, {}, &gen));
  CHECK(y.shape() == Shape{1, 1000});
  CHECK(all_finite(y));
  for (const auto& [n, t] : m->named_buffers())
    if (n.ends_with("num_batches_tracked")) CHECK(t.item() == 1.0);
}

TEST_CASE("one SGD step on resnet_small lowers the loss on a fixed batch") {
  auto m = resnet_small(10, 16);
  Generator gen(3);
  Tensor x = randn({8, 1, 28, 28}, {}, &gen);
  Tensor target = randint(0, 10, {8}, DType::i64, &gen);
  optim::SGD opt(optim::split_weight_decay(
      *m, optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-4}.group()));
  Tensor loss0 = F::cross_entropy(m->forward(x), target);
  REQUIRE(std::isfinite(loss0.item()));
  opt.zero_grad();
  loss0.backward();
  for (const auto& [n, p] : m->named_parameters()) {
    CAPTURE(n);
    CHECK(p.grad().defined());
  }
  opt.step();
  const double l0 = loss0.item();
  const double l1 = F::cross_entropy(m->forward(x), target).item();
  CAPTURE(l0);
  CAPTURE(l1);
  CHECK(l1 < l0);
}

TEST_CASE("a model converted to f64 runs f64 inputs") {
  auto m = resnet_small(10, 8);
  m->to(DType::f64);
  Generator gen(4);
  Tensor y = m->forward(randn({2, 1, 28, 28}, DType::f64, &gen));
  CHECK(y.dtype() == DType::f64);
  CHECK(y.shape() == Shape{2, 10});
}

TEST_CASE("a 1-channel NHWC input keeps resnet_small NHWC, with the NCHW run's values") {
  // A grayscale batch is dense in both layouts; made with NHWC strides (as amp::prepare_input
  // makes Mixed16 batches) every layer must follow it, as with RGB, or the GPU runs the whole
  // network on NCHW kernels. f64 on the CPU: the two layouts must agree to rounding.
  auto m = resnet_small(10, 8, 1);
  m->to(DType::f64);
  Generator gen(17);
  const Tensor x0 = randn({3, 1, 12, 12}, DType::f64, &gen);
  auto run = [&](MemoryFormat fmt) {
    m->zero_grad();
    Tensor x = x0.clone(fmt).detach().set_requires_grad(true);
    CHECK(x.suggest_memory_format() == fmt);
    Tensor y = (*m)(x);
    F::cross_entropy(y, tensor({1, 4, 7}, DType::i64)).backward();
    std::vector<Tensor> out{y.detach(), x.grad()};
    for (const Tensor& p : m->parameters()) out.push_back(p.grad());
    return out;
  };
  const std::vector<Tensor> nchw = run(MemoryFormat::Contiguous);
  const std::vector<Tensor> nhwc = run(MemoryFormat::ChannelsLast);
  REQUIRE(nchw.size() == nhwc.size());
  for (size_t i = 0; i < nchw.size(); ++i) {
    CAPTURE(i);
    const std::vector<double> a = nchw[i].to_vector<double>(), b = nhwc[i].to_vector<double>();
    REQUIRE(a.size() == b.size());
    double worst = 0;
    for (size_t k = 0; k < a.size(); ++k) worst = std::max(worst, std::abs(a[k] - b[k]));
    CHECK(worst < 1e-9);
  }
  CHECK(nhwc[1].suggest_memory_format() == MemoryFormat::ChannelsLast);  // the input's gradient
  // Stage by stage: the activations stay NHWC.
  NoGradGuard no_grad;
  auto child = [&](const std::string& name) -> nn::Module& {
    for (const auto& [n, c] : m->named_children())
      if (n == name) return *c;
    FAIL("no child ", name);
    throw;
  };
  Tensor h = F::relu(child("bn1")(child("conv1")(x0.clone(MemoryFormat::ChannelsLast))));
  CHECK(h.suggest_memory_format() == MemoryFormat::ChannelsLast);
  for (const char* stage : {"layer1", "layer2", "layer3"}) {
    CAPTURE(stage);
    h = child(stage)(h);
    CHECK(h.suggest_memory_format() == MemoryFormat::ChannelsLast);
  }
}
