// nn::Module tree: names and order, buffers, train/eval, zero_grad, to(dtype), Sequential,
// layer construction and PyTorch default init. No conv/bn/pool/linear forward here (those ops
// live on other branches; see tests/test_model_forward.cpp).
#include <doctest/doctest.h>

#include <cmath>

#include "models/nn.h"
#include "ops/ops.h"

using namespace kiln;
using namespace kiln::nn;

namespace {

// y = x * scale (elementwise over the last dim), with a counter buffer.
class Scale : public Module {
 public:
  explicit Scale(int64_t n) {
    scale_ = register_parameter("scale", full({n}, 2.0, DType::f64));
    calls_ = register_buffer("calls", zeros({}, DType::i64));
  }
  Tensor forward(const Tensor& x) override { return F::mul(x, scale_); }
  std::string type_name() const override { return "Scale"; }
  const Tensor& scale() const { return scale_; }

 private:
  Tensor scale_, calls_;
};

class Net : public Module {
 public:
  Net() {
    w_ = register_parameter("w", ones({2, 3}, DType::f64));
    a_ = register_module("a", std::make_shared<Scale>(3));
    b_ = register_module("b", std::make_shared<Sequential>(std::initializer_list<ModulePtr>{
                                  std::make_shared<Scale>(3), std::make_shared<ReLU>()}));
  }
  Tensor forward(const Tensor& x) override { return b_->forward(a_->forward(F::mul(x, w_))); }
  std::string type_name() const override { return "Net"; }
  std::shared_ptr<Scale> a_;
  std::shared_ptr<Sequential> b_;
  Tensor w_;
};

std::vector<std::string> names_of(const std::vector<NamedTensor>& v) {
  std::vector<std::string> out;
  for (const auto& [n, _] : v) out.push_back(n);
  return out;
}

double sample_std(const std::vector<double>& v) {
  double mean = 0, sq = 0;
  for (double x : v) mean += x;
  mean /= double(v.size());
  for (double x : v) sq += (x - mean) * (x - mean);
  return std::sqrt(sq / double(v.size() - 1));
}

}  // namespace

TEST_CASE("named parameters and buffers: own entries first, then children in order") {
  Net net;
  CHECK(names_of(net.named_parameters()) ==
        std::vector<std::string>{"w", "a.scale", "b.0.scale"});
  CHECK(names_of(net.named_buffers()) == std::vector<std::string>{"a.calls", "b.0.calls"});
  CHECK(net.parameters().size() == 3);
  CHECK(net.num_parameters() == 6 + 3 + 3);
  CHECK(names_of(net.state()) ==
        std::vector<std::string>{"w", "a.scale", "b.0.scale", "a.calls", "b.0.calls"});
  CHECK(net.children().size() == 2);
  CHECK(net.named_children()[1].first == "b");
  for (const Tensor& p : net.parameters()) {
    CHECK(p.requires_grad());
    CHECK(p.is_leaf());
  }
  for (const Tensor& b : net.buffers()) CHECK_FALSE(b.requires_grad());
  // Handles returned by traversal are the module's own tensors.
  CHECK(net.named_parameters()[1].second.is_same(net.a_->scale()));
}

TEST_CASE("a module or tensor reachable twice is listed once") {
  auto shared = std::make_shared<Scale>(2);
  Sequential seq{shared, shared};
  CHECK(names_of(seq.named_parameters()) == std::vector<std::string>{"0.scale"});
  CHECK(seq.size() == 2);
}

TEST_CASE("registration errors") {
  Net net;
  CHECK_THROWS_AS(net.register_parameter("w", ones({1})), Error);         // duplicate
  CHECK_THROWS_AS(net.register_buffer("a", ones({1})), Error);            // taken by a module
  CHECK_THROWS_AS(net.register_parameter("x.y", ones({1})), Error);       // dotted
  CHECK_THROWS_AS(net.register_parameter("i", zeros({1}, DType::i64)), Error);  // not floating
  Tensor leaf = ones({2}).set_requires_grad(true), non_leaf = F::mul(leaf, 2.0);
  CHECK_THROWS_AS(net.register_parameter("nl", non_leaf), Error);
  CHECK_THROWS_AS(net.register_buffer("rg", leaf), Error);
  CHECK_THROWS_AS(net.register_module("null", ModulePtr()), Error);
}

TEST_CASE("train / eval propagate to every descendant") {
  Net net;
  CHECK(net.is_training());
  net.eval();
  CHECK_FALSE(net.is_training());
  CHECK_FALSE(net.a_->is_training());
  CHECK_FALSE((*net.b_)[1]->is_training());
  net.train();
  CHECK((*net.b_)[0]->is_training());
}

TEST_CASE("zero_grad: set_to_none by default, zeros on request") {
  Net net;
  Tensor x = from_vector<double>({1, -2, 3, 4, 5, -6}, {2, 3}, DType::f64);
  F::sum(net.forward(x)).backward();
  for (const Tensor& p : net.parameters()) REQUIRE(p.grad().defined());
  // out = relu(4·w·x) with w = 1, so dw = 4x where x > 0
  CHECK(net.w_.grad().to_vector<double>() == std::vector<double>{4, 0, 12, 16, 20, 0});
  net.zero_grad(/*set_to_none=*/false);
  for (const Tensor& p : net.parameters()) {
    REQUIRE(p.grad().defined());
    for (double g : p.grad().to_vector<double>()) CHECK(g == 0.0);
  }
  net.zero_grad();
  for (const Tensor& p : net.parameters()) CHECK_FALSE(p.grad().defined());
}

TEST_CASE("to(dtype) converts floating tensors in place of the handles, keeps integer buffers") {
  BatchNorm2d bn(4);
  Tensor held = bn.weight();  // a handle taken before the conversion (as an optimizer holds)
  init::uniform_(bn.weight(), 0.5, 1.5);
  auto before = bn.weight().to_vector<double>();
  bn.weight().set_grad(full({4}, 3.0));
  bn.to(DType::f64);
  CHECK(held.dtype() == DType::f64);
  CHECK(bn.weight().dtype() == DType::f64);
  CHECK(bn.named_parameters()[0].second.is_same(held));
  CHECK(held.requires_grad());
  CHECK(held.is_leaf());
  CHECK(held.to_vector<double>() == before);  // f32 -> f64 is exact
  REQUIRE(held.grad().defined());
  CHECK(held.grad().dtype() == DType::f64);
  CHECK(held.grad().to_vector<double>() == std::vector<double>(4, 3.0));
  CHECK(bn.running_var().dtype() == DType::f64);
  CHECK(bn.num_batches_tracked().dtype() == DType::i64);
  // The converted parameter works in autograd as a leaf.
  F::sum(F::mul(held, held)).backward();
  CHECK(held.grad().to_vector<double>()[0] == doctest::Approx(3.0 + 2 * before[0]));
  bn.to(DType::f32);
  CHECK(held.dtype() == DType::f32);
  CHECK_THROWS_AS(bn.to(DType::i32), Error);
}

TEST_CASE("to(device) to the CPU is a no-op that keeps handles") {
  Linear lin(3, 2);
  Tensor w = lin.weight();
  lin.to(Device::cpu());
  CHECK(lin.weight().is_same(w));
  CHECK(w.is_cpu());
}

TEST_CASE("Sequential: children named 0, 1, ...; forward chains them") {
  auto s1 = std::make_shared<Scale>(3);
  Sequential seq{s1, std::make_shared<ReLU>()};
  seq.push_back(std::make_shared<Scale>(3));
  CHECK(seq.size() == 3);
  CHECK(seq.named_children()[2].first == "2");
  CHECK(names_of(seq.named_parameters()) == std::vector<std::string>{"0.scale", "2.scale"});
  CHECK(seq[0] == s1);
  CHECK_THROWS_AS(seq[3], Error);
  Tensor x = from_vector<double>({1, -1, 0.5}, {3}, DType::f64);
  CHECK(seq.forward(x).to_vector<double>() == std::vector<double>{4, 0, 2});
  CHECK(seq.print().find("(1): ReLU") != std::string::npos);
}

TEST_CASE("Conv2d, Linear, BatchNorm2d: shapes, names and PyTorch default init") {
  Generator gen(7);
  Conv2d conv(6, 8, 3, 1, 1, 1, /*groups=*/2, /*bias=*/true, &gen);
  CHECK(names_of(conv.named_parameters()) == std::vector<std::string>{"weight", "bias"});
  CHECK(conv.weight().shape() == Shape{8, 3, 3, 3});
  CHECK(conv.bias().shape() == Shape{8});
  const double bound = 1.0 / std::sqrt(3.0 * 9.0);  // fan_in = 3 * 3 * 3
  auto w = conv.weight().to_vector<double>();
  double lo = 1, hi = -1;
  for (double v : w) lo = std::min(lo, v), hi = std::max(hi, v);
  CHECK(lo >= -bound);
  CHECK(hi <= bound);
  CHECK(hi - lo > bound);  // actually spread, not constant
  for (double v : conv.bias().to_vector<double>()) CHECK(std::abs(v) <= bound);

  Conv2d no_bias(3, 4, {1, 3}, 1, 0, 1, 1, false);
  CHECK_FALSE(no_bias.bias().defined());
  CHECK(no_bias.parameters().size() == 1);
  CHECK(no_bias.weight().shape() == Shape{4, 3, 1, 3});
  CHECK_THROWS_AS(Conv2d(6, 8, 3, 1, 0, 1, /*groups=*/4), Error);

  // Same seed -> same weights; different seed -> different.
  Generator g1(3), g2(3), g3(4);
  Linear l1(5, 4, true, &g1), l2(5, 4, true, &g2), l3(5, 4, true, &g3);
  CHECK(l1.weight().to_vector<double>() == l2.weight().to_vector<double>());
  CHECK(l1.weight().to_vector<double>() != l3.weight().to_vector<double>());
  CHECK(l1.weight().shape() == Shape{4, 5});
  for (double v : l1.bias().to_vector<double>()) CHECK(std::abs(v) <= 1.0 / std::sqrt(5.0));

  BatchNorm2d bn(3);
  CHECK(names_of(bn.named_parameters()) == std::vector<std::string>{"weight", "bias"});
  CHECK(names_of(bn.named_buffers()) ==
        std::vector<std::string>{"running_mean", "running_var", "num_batches_tracked"});
  CHECK(bn.weight().to_vector<double>() == std::vector<double>{1, 1, 1});
  CHECK(bn.bias().to_vector<double>() == std::vector<double>{0, 0, 0});
  CHECK(bn.running_var().to_vector<double>() == std::vector<double>{1, 1, 1});
  CHECK(bn.num_batches_tracked().dim() == 0);
  CHECK(bn.num_batches_tracked().item() == 0.0);
  // One batch counted per training forward, none in eval.
  Tensor x = randn({2, 3, 4, 4});
  bn.forward(x);
  bn.forward(x);
  CHECK(bn.num_batches_tracked().item() == 2.0);
  bn.eval();
  bn.forward(x);
  CHECK(bn.num_batches_tracked().item() == 2.0);
}

TEST_CASE("init helpers: kaiming_normal fan_out/relu and kaiming_uniform statistics") {
  Generator gen(11);
  Tensor w = empty({64, 32, 3, 3});
  CHECK(init::fan_in_out(w) == std::pair<int64_t, int64_t>{288, 576});
  init::kaiming_normal_(w, 0.0, init::FanMode::FanOut, init::Nonlinearity::ReLU, &gen);
  const double expected = std::sqrt(2.0 / 576.0);
  CHECK(sample_std(w.to_vector<double>()) == doctest::Approx(expected).epsilon(0.03));
  init::kaiming_uniform_(w, 0.0, init::FanMode::FanIn, init::Nonlinearity::ReLU, &gen);
  // U(±b) has std b/√3 with b = √2·√(3/288)
  CHECK(sample_std(w.to_vector<double>()) == doctest::Approx(std::sqrt(2.0 / 288.0)).epsilon(0.03));
  CHECK(init::calculate_gain(init::Nonlinearity::LeakyReLU, std::sqrt(5.0)) ==
        doctest::Approx(std::sqrt(1.0 / 3.0)));
  CHECK_THROWS_AS(init::fan_in_out(empty({4})), Error);
  // Works on a parameter (requires grad) without recording.
  Tensor p = zeros({3}).set_requires_grad(true);
  init::constant_(p, 0.25);
  CHECK(p.to_vector<double>() == std::vector<double>{0.25, 0.25, 0.25});
  CHECK(p.is_leaf());
}

// The largest |x|.
static double max_abs(const Tensor& x) { return std::sqrt(F::max(F::mul(x, x)).item()); }

TEST_CASE("init::dirac_ passes the input through; init::whitening_ decorrelates patches") {
  // dirac_: conv(x, w) == x on the first min(out, in) channels, 0 on the others.
  Conv2d conv(3, 5, 3, 1, 1, 1, 1, false);
  init::dirac_(conv.weight());
  Generator g(1);
  const Tensor x = randn({2, 3, 6, 7}, {}, &g);
  const Tensor y = conv.forward(x);
  CHECK(max_abs(F::sub(y.narrow(1, 0, 3), x)) < 1e-6);
  CHECK(max_abs(y.narrow(1, 3, 2)) == 0.0);

  // whitening_: images whose channels are strongly correlated (c1 = c0 + small noise, c2 a
  // shifted copy of c0); the 2x2 filters it makes give outputs whose second moments are
  // diag(λ / (λ + eps)) over the first 12 channels: uncorrelated, near 1 where λ >> eps.
  const Tensor base = randn({64, 1, 10, 10}, {}, &g);
  const Tensor img = F::cat({base, F::add(base, F::mul(randn({64, 1, 10, 10}, {}, &g), 0.1)),
                             F::mul(base, -0.5)},
                            1);
  Conv2d white(3, 24, 2, 1, 0, 1, 1, false);
  const double eps = 1e-4;
  init::whitening_(white.weight(), img, eps);
  const Tensor out = white.forward(img);  // (64, 24, 9, 9)
  const int64_t M = 64 * 81;
  const Tensor z = out.narrow(1, 0, 12).permute({1, 0, 2, 3}).contiguous().reshape({12, M});
  const std::vector<float> m =
      F::mul(F::matmul(z, z.transpose(0, 1).contiguous()), 1.0 / double(M)).template to_vector<float>();
  int nearly_one = 0;
  for (int64_t i = 0; i < 12; ++i) {
    CAPTURE(i);
    for (int64_t j = 0; j < 12; ++j)
      if (i != j) CHECK(std::abs(m[size_t(i * 12 + j)]) < 1e-3);
    CHECK(m[size_t(i * 13)] <= 1.0 + 1e-4);
    if (i > 0) CHECK(m[size_t(i * 13)] <= m[size_t((i - 1) * 13)] + 1e-4);  // largest λ first
    nearly_one += m[size_t(i * 13)] > 0.99;
  }
  CHECK(nearly_one >= 4);  // the directions the data spans (the rest are tiny: c2 = -c0 / 2)
  // The second half is the first's negative.
  const Tensor w = white.weight();
  CHECK(max_abs(F::add(w.narrow(0, 0, 12), w.narrow(0, 12, 12))) == 0.0);
  // Shapes that cannot whiten are errors naming them.
  Conv2d wrong(3, 12, 2, 1, 0, 1, 1, false);
  CHECK_THROWS_AS(init::whitening_(wrong.weight(), img, eps), Error);
  CHECK_THROWS_AS(init::whitening_(white.weight(), img.narrow(1, 0, 2), eps), Error);
}
