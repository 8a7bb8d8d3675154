// Optimizers and LR schedules against hand-worked values and scalar re-implementations of
// torch.optim's published update formulas (SGD, AdamW); parameter groups, the weight-decay
// split, state export/import and error paths.
#include <doctest/doctest.h>

#include <cmath>
#include <map>

#include "models/nn.h"
#include "optim/adamw.h"
#include "optim/schedule.h"
#include "optim/fused.h"
#include "optim/sgd.h"
#include "optim/weight_average.h"

using namespace kiln;
using namespace kiln::optim;

namespace {

Tensor param(const std::vector<double>& v) {
  return from_vector(v, {int64_t(v.size())}, DType::f64).set_requires_grad(true);
}
void set_grad(const Tensor& p, const std::vector<double>& g) {
  p.set_grad(from_vector(g, p.shape(), DType::f64));
}

// Gradients for steps 1..3 of a 3-element parameter.
const std::vector<std::vector<double>> kGrads = {
    {0.5, -1.0, 2.0}, {-0.25, 0.75, 1.5}, {1.0, 0.1, -3.0}};
const std::vector<double> kInit = {1.0, -0.5, 0.25};

// torch.optim.SGD, one scalar at a time.
std::vector<double> sgd_reference(const SGDOptions& o) {
  std::vector<double> p = kInit, buf(3, 0.0);
  for (size_t s = 0; s < kGrads.size(); ++s) {
    for (size_t i = 0; i < 3; ++i) {
      double g = kGrads[s][i] + o.weight_decay * p[i];
      if (o.momentum != 0.0) {
        buf[i] = s == 0 ? g : o.momentum * buf[i] + (1.0 - o.dampening) * g;
        g = o.nesterov ? g + o.momentum * buf[i] : buf[i];
      }
      p[i] -= o.lr * g;
    }
  }
  return p;
}

// torch.optim.AdamW, one scalar at a time.
std::vector<double> adamw_reference(const AdamWOptions& o) {
  std::vector<double> p = kInit, m(3, 0.0), v(3, 0.0);
  for (size_t s = 0; s < kGrads.size(); ++s) {
    const double t = double(s + 1);
    for (size_t i = 0; i < 3; ++i) {
      const double g = kGrads[s][i];
      p[i] *= 1.0 - o.lr * o.weight_decay;
      m[i] = o.beta1 * m[i] + (1.0 - o.beta1) * g;
      v[i] = o.beta2 * v[i] + (1.0 - o.beta2) * g * g;
      const double mhat = m[i] / (1.0 - std::pow(o.beta1, t));
      const double denom = std::sqrt(v[i]) / std::sqrt(1.0 - std::pow(o.beta2, t)) + o.eps;
      p[i] -= o.lr * mhat / denom;
    }
  }
  return p;
}

template <typename Opt, typename Options>
std::vector<double> run_three_steps(const Options& o) {
  Tensor p = param(kInit);
  Opt opt({p}, o);
  for (const auto& g : kGrads) {
    set_grad(p, g);
    opt.step();
  }
  return p.to_vector<double>();
}

void check_close(const std::vector<double>& a, const std::vector<double>& b, double tol = 1e-12) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) CHECK(a[i] == doctest::Approx(b[i]).epsilon(tol));
}

}  // namespace

TEST_CASE("SGD with momentum, hand-worked: the first step copies the gradient into the buffer") {
  // g = 1 each step, lr 0.1, momentum 0.9: buf 1, 1.9, 2.71; p 0.9, 0.71, 0.439.
  Tensor p = param({1.0});
  SGD opt({p}, SGDOptions{.lr = 0.1, .momentum = 0.9});
  std::vector<double> expected = {0.9, 0.71, 0.439};
  for (double e : expected) {
    set_grad(p, {1.0});
    opt.step();
    CHECK(p.item() == doctest::Approx(e).epsilon(1e-14));
  }
  CHECK(opt.state_dict().at("state.0.momentum_buffer").item() == doctest::Approx(2.71));
}

TEST_CASE("SGD variants match torch.optim.SGD's formulas over three steps") {
  std::vector<SGDOptions> variants = {
      {.lr = 0.1},
      {.lr = 0.1, .weight_decay = 0.1},
      {.lr = 0.05, .momentum = 0.9},
      {.lr = 0.05, .momentum = 0.9, .dampening = 0.3, .weight_decay = 0.01},
      {.lr = 0.05, .momentum = 0.8, .weight_decay = 0.05, .nesterov = true},
  };
  for (const auto& o : variants) {
    CAPTURE(o.momentum);
    CAPTURE(o.dampening);
    CAPTURE(o.nesterov);
    CAPTURE(o.weight_decay);
    check_close(run_three_steps<SGD>(o), sgd_reference(o));
  }
  // Nesterov differs from plain momentum (so the flag is honoured).
  SGDOptions n{.lr = 0.05, .momentum = 0.8, .nesterov = true}, m{.lr = 0.05, .momentum = 0.8};
  CHECK(sgd_reference(n)[0] != doctest::Approx(sgd_reference(m)[0]));
  CHECK(run_three_steps<SGD>(n)[0] == doctest::Approx(sgd_reference(n)[0]).epsilon(1e-12));
}

TEST_CASE("AdamW, hand-worked: constant gradient gives unit bias-corrected moments") {
  // g = 1: m̂ = v̂ = 1 every step, so p <- p·(1 - lr·wd) - lr/(1 + eps).
  Tensor p = param({1.0});
  AdamW opt({p}, AdamWOptions{.lr = 0.1, .weight_decay = 0.1});
  std::vector<double> expected = {0.89, 0.7811, 0.673289};
  for (double e : expected) {
    set_grad(p, {1.0});
    opt.step();
    CHECK(p.item() == doctest::Approx(e).epsilon(1e-7));
  }
  auto sd = opt.state_dict();
  CHECK(sd.at("state.0.step").item() == 3.0);
  CHECK(sd.at("state.0.exp_avg").item() == doctest::Approx(0.271));
  CHECK(sd.at("state.0.exp_avg_sq").item() == doctest::Approx(1 - std::pow(0.999, 3)));
}

TEST_CASE("AdamW variants match torch.optim.AdamW's formulas over three steps") {
  std::vector<AdamWOptions> variants = {
      {.lr = 1e-2, .weight_decay = 0.0},
      {.lr = 1e-2},  // default weight decay 0.01
      {.lr = 0.05, .beta1 = 0.5, .beta2 = 0.9, .eps = 1e-3, .weight_decay = 0.2},
  };
  for (const auto& o : variants) {
    CAPTURE(o.beta1);
    CAPTURE(o.weight_decay);
    check_close(run_three_steps<AdamW>(o), adamw_reference(o));
  }
}

TEST_CASE("parameters without a gradient are skipped; zero_grad clears") {
  Tensor a = param({1.0, 2.0}), b = param({3.0});
  SGD opt({a, b}, SGDOptions{.lr = 0.5, .momentum = 0.9, .weight_decay = 0.1});
  set_grad(a, {1.0, 1.0});
  opt.step();
  CHECK(b.to_vector<double>() == std::vector<double>{3.0});
  CHECK(a.to_vector<double>()[0] == doctest::Approx(1.0 - 0.5 * 1.1));
  auto sd = opt.state_dict();
  CHECK(sd.count("state.0.momentum_buffer") == 1);
  CHECK(sd.count("state.1.momentum_buffer") == 0);
  opt.zero_grad(/*set_to_none=*/false);
  CHECK(a.grad().to_vector<double>() == std::vector<double>{0.0, 0.0});
  opt.zero_grad();
  CHECK_FALSE(a.grad().defined());
}

TEST_CASE("split_weight_decay: no decay on biases and BN parameters; per-group options") {
  nn::Sequential net{std::make_shared<nn::Linear>(4, 3), std::make_shared<nn::BatchNorm2d>(3),
                     std::make_shared<nn::Conv2d>(3, 2, 3)};
  auto groups = split_weight_decay(net, SGDOptions{.lr = 0.1, .momentum = 0.9,
                                                   .weight_decay = 0.5}.group());
  REQUIRE(groups.size() == 2);
  CHECK(groups[0].params.size() == 2);  // Linear weight, Conv2d weight
  CHECK(groups[1].params.size() == 4);  // Linear bias, BN weight/bias, Conv2d bias
  CHECK(groups[0].weight_decay == 0.5);
  CHECK(groups[1].weight_decay == 0.0);
  CHECK(groups[1].momentum == 0.9);
  for (const Tensor& p : groups[0].params) CHECK(p.dim() >= 2);
  for (const Tensor& p : groups[1].params) CHECK(p.dim() == 1);

  net.to(DType::f64);
  std::vector<std::vector<double>> before;
  for (const Tensor& p : net.parameters()) {
    before.push_back(p.to_vector<double>());
    p.set_grad(zeros_like(p));
  }
  groups[1].lr = 0.2;  // per-group lr is honoured (no visible effect with zero grads/decay)
  SGD opt(groups);
  opt.step();
  // Zero gradients: decayed params shrink by lr·wd, the others stay put.
  auto params = net.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    auto now = params[i].to_vector<double>();
    const double scale = params[i].dim() >= 2 ? 1.0 - 0.1 * 0.5 : 1.0;
    for (size_t j = 0; j < now.size(); ++j)
      CHECK(now[j] == doctest::Approx(before[i][j] * scale).epsilon(1e-12));
  }
}

TEST_CASE("state_dict / load_state_dict resume gives identical updates") {
  for (int kind = 0; kind < 2; ++kind) {
    CAPTURE(kind);
    auto make = [&](const Tensor& p) -> std::unique_ptr<Optimizer> {
      if (kind == 0) return std::make_unique<SGD>(std::vector<Tensor>{p}, SGDOptions{.lr = 0.1, .momentum = 0.9});
      return std::make_unique<AdamW>(std::vector<Tensor>{p}, AdamWOptions{.lr = 0.05});
    };
    Tensor a = param(kInit);
    auto opt_a = make(a);
    for (size_t s = 0; s < 2; ++s) {
      set_grad(a, kGrads[s]);
      opt_a->step();
    }
    opt_a->param_groups[0].lr *= 0.5;
    // A fresh parameter with a's values and a fresh optimizer loaded from a's state.
    Tensor b = param(a.to_vector<double>());
    auto opt_b = make(b);
    opt_b->load_state_dict(opt_a->state_dict());
    CHECK(opt_b->param_groups[0].lr == opt_a->param_groups[0].lr);
    set_grad(a, kGrads[2]);
    set_grad(b, kGrads[2]);
    opt_a->step();
    opt_b->step();
    CHECK(b.to_vector<double>() == a.to_vector<double>());
    // Loaded state is a copy, not an alias.
    auto sa = opt_a->state_dict(), sb = opt_b->state_dict();
    for (const auto& [k, t] : sa) {
      REQUIRE(sb.count(k));
      if (k.starts_with("state.")) CHECK_FALSE(sb.at(k).shares_storage(t));
    }
  }
  Tensor p = param({1.0, 2.0});
  SGD opt({p}, SGDOptions{.lr = 0.1, .momentum = 0.9});
  CHECK_THROWS_AS(opt.load_state_dict({{"state.0.momentum_buffer", zeros({3}, DType::f64)}}), Error);
  CHECK_THROWS_AS(opt.load_state_dict({{"state.5.momentum_buffer", zeros({2}, DType::f64)}}), Error);
  CHECK_THROWS_AS(opt.load_state_dict({{"bogus", zeros({2})}}), Error);
}

TEST_CASE("optimizer argument errors") {
  Tensor p = param({1.0});
  CHECK_THROWS_AS(SGD({p}, SGDOptions{.lr = 0.1, .dampening = 0.1, .nesterov = true}), Error);
  CHECK_THROWS_AS(SGD({p}, SGDOptions{.lr = 0.1, .nesterov = true}), Error);  // no momentum
  CHECK_THROWS_AS(SGD({p}, SGDOptions{.lr = -1.0}), Error);
  CHECK_THROWS_AS(SGD({p, p}, SGDOptions{}), Error);
  CHECK_THROWS_AS(SGD({F::mul(p, 2.0)}, SGDOptions{}), Error);  // not a leaf
  CHECK_THROWS_AS(SGD({ones({2})}, SGDOptions{}), Error);       // no requires_grad
  CHECK_THROWS_AS(AdamW({p}, AdamWOptions{.beta1 = 1.0}), Error);
  CHECK_THROWS_AS(SGD(std::vector<ParamGroup>{}), Error);
}

TEST_CASE("StepLR and MultiStepLR with warmup") {
  StepLR step(3, 0.1, Warmup{.steps = 2, .start_factor = 0.0});
  std::vector<double> expected = {0.0, 0.5, 1.0, 0.1, 0.1, 0.1, 0.01, 0.01, 0.01, 0.001};
  for (int64_t t = 0; t < 10; ++t) {
    CAPTURE(t);
    CHECK(step.factor(t) == doctest::Approx(expected[size_t(t)]).epsilon(1e-12));
  }
  // Goyal et al.: 5 warmup epochs from 0.1·lr, decay ×0.1 at 30, 60, 80.
  MultiStepLR ms({60, 30, 80}, 0.1, Warmup{.steps = 5, .start_factor = 0.1});
  CHECK(ms.factor(0) == doctest::Approx(0.1));
  CHECK(ms.factor(1) == doctest::Approx(0.28));
  CHECK(ms.factor(4) == doctest::Approx(0.82));
  CHECK(ms.factor(5) == 1.0);
  CHECK(ms.factor(29) == 1.0);
  CHECK(ms.factor(30) == doctest::Approx(0.1));
  CHECK(ms.factor(59) == doctest::Approx(0.1));
  CHECK(ms.factor(60) == doctest::Approx(0.01));
  CHECK(ms.factor(80) == doctest::Approx(0.001));
  CHECK(ms.factor(1000) == doctest::Approx(0.001));
  CHECK(ms.lr(30, 0.4) == doctest::Approx(0.04));
  // No warmup: the schedule from t = 0.
  CHECK(StepLR(2, 0.5).factor(0) == 1.0);
  CHECK(StepLR(2, 0.5).factor(5) == 0.25);
  CHECK_THROWS_AS(StepLR(0), Error);
  CHECK_THROWS_AS(step.factor(-1), Error);
  CHECK_THROWS_AS(StepLR(3, 0.1, Warmup{.steps = 2, .start_factor = 1.5}), Error);
}

TEST_CASE("CosineLR with warmup anneals over the steps after warmup") {
  CosineLR cos(10, 0.0, Warmup{.steps = 2, .start_factor = 0.0});
  CHECK(cos.factor(0) == 0.0);
  CHECK(cos.factor(1) == doctest::Approx(0.5));
  CHECK(cos.factor(2) == doctest::Approx(1.0));
  CHECK(cos.factor(4) == doctest::Approx(0.5 * (1 + std::cos(M_PI / 4))));  // 0.853553
  CHECK(cos.factor(6) == doctest::Approx(0.5));
  CHECK(cos.factor(10) == 0.0);
  CHECK(cos.factor(15) == 0.0);
  CosineLR floor(10, 0.1);
  CHECK(floor.factor(0) == doctest::Approx(1.0));
  CHECK(floor.factor(5) == doctest::Approx(0.55));
  CHECK(floor.factor(10) == doctest::Approx(0.1));
  CHECK_THROWS_AS(CosineLR(5, 0.0, Warmup{.steps = 5}), Error);
}

TEST_CASE("LinearLR with warmup is a triangle: up from start_factor, straight down to end_factor") {
  // The CIFAR-10 speedrun's shape: 0.2 -> 1 over the first 23 of 100 steps, then -> 0.07.
  LinearLR tri(100, 0.07, Warmup{.steps = 23, .start_factor = 0.2});
  CHECK(tri.factor(0) == doctest::Approx(0.2));
  CHECK(tri.factor(23) == doctest::Approx(1.0));
  CHECK(tri.factor(11) == doctest::Approx(0.2 + 0.8 * 11 / 23.0));
  CHECK(tri.factor(50) == doctest::Approx(1.0 - 0.93 * 27 / 77.0));
  CHECK(tri.factor(100) == doctest::Approx(0.07));
  CHECK(tri.factor(150) == doctest::Approx(0.07));
  CHECK(LinearLR(4).factor(2) == doctest::Approx(0.5));
  CHECK_THROWS_AS(LinearLR(5, 0.0, Warmup{.steps = 5}), Error);
  CHECK_THROWS_AS(LinearLR(5, -0.1), Error);
}

TEST_CASE("a schedule sets every group's lr from its initial lr") {
  Tensor a = param({1.0}), b = param({2.0});
  auto ga = SGDOptions{.lr = 0.1}.group({a}), gb = SGDOptions{.lr = 0.01}.group({b});
  SGD opt({ga, gb});
  MultiStepLR sched({2}, 0.1, Warmup{.steps = 1, .start_factor = 0.5});
  sched.apply(opt, 0);
  CHECK(opt.param_groups[0].lr == doctest::Approx(0.05));
  CHECK(opt.param_groups[1].lr == doctest::Approx(0.005));
  sched.apply(opt, 5);
  CHECK(opt.param_groups[0].lr == doctest::Approx(0.01));
  CHECK(opt.param_groups[1].lr == doctest::Approx(0.001));
  CHECK(opt.param_groups[0].initial_lr == 0.1);
  // The scheduled lr is the one step() uses.
  set_grad(a, {1.0});
  set_grad(b, {1.0});
  opt.step();
  CHECK(a.item() == doctest::Approx(1.0 - 0.01));
  CHECK(b.item() == doctest::Approx(2.0 - 0.001));
}

TEST_CASE("WeightAverage: update mixes, pull writes parameters, masters and buffers") {
  Generator g(3);
  auto conv = std::make_shared<nn::Conv2d>(2, 3, 1, 1, 0, 1, 1, true, &g);
  nn::Sequential model{conv, std::make_shared<nn::BatchNorm2d>(3)};
  FusedSGD opt(model.parameters(), SGDOptions{.lr = 0.1});
  WeightAverage avg(model, &opt);
  auto snapshot = [&] {
    std::map<std::string, std::vector<float>> m;
    for (const auto& [name, t] : model.named_parameters()) m[name] = t.to_vector<float>();
    for (const auto& [name, t] : model.named_buffers())
      if (is_floating(t.dtype())) m[name] = t.to_vector<float>();
    return m;
  };
  const auto w0 = snapshot();
  // One step: the parameters move, and the forward moves the running statistics.
  const Tensor x = randn({4, 2, 3, 3}, {}, &g);
  opt.zero_grad();
  F::sum(F::mul(model.forward(x), model.forward(x))).backward();
  opt.step();
  const auto w1 = snapshot();
  REQUIRE(w1.at("0.weight") != w0.at("0.weight"));
  REQUIRE(w1.at("1.running_mean") != w0.at("1.running_mean"));
  avg.update(0.75);
  const auto a = avg.averages();
  CHECK(a.size() == w0.size());  // num_batches_tracked (i64) is not averaged
  for (const auto& [name, t] : a) {
    CAPTURE(name);
    const std::vector<float> got = t.to_vector<float>();
    for (size_t i = 0; i < got.size(); ++i)
      CHECK(got[i] == doctest::Approx(0.75 * w0.at(name)[i] + 0.25 * w1.at(name)[i]));
  }
  // Nothing moved yet; pull() moves parameters, buffers and masters to the average.
  CHECK(snapshot() == w1);
  avg.pull();
  for (const auto& [name, t] : a) CHECK(snapshot().at(name) == t.to_vector<float>());
  CHECK(opt.master(0).to_vector<float>() == a[0].second.to_vector<float>());
  // A step with zero gradients (no momentum, no weight decay) keeps the average: it continues
  // from the master the pull wrote, not from the weights before it.
  opt.zero_grad();
  opt.step();
  CHECK(conv->weight().to_vector<float>() == a[0].second.to_vector<float>());
  CHECK_THROWS_AS(avg.update(1.5), Error);
  CHECK_THROWS_AS(avg.update(-0.1), Error);
}
