// Fused optimizers, the dynamic loss scaler and mixed-precision helpers on the CPU (the
// reference path): FusedSGD/FusedAdamW against optim::SGD/AdamW bitwise over several steps and
// groups, overflow skipping, growth/backoff, the FLT_MAX cap, the gradient arena and
// clip_grad_norm_ against hand computations.
#include <doctest/doctest.h>

#include <cfloat>
#include <cmath>
#include <cstring>

#include "core/autograd.h"
#include "core/generator.h"
#include "models/nn.h"
#include "optim/adamw.h"
#include "optim/amp.h"
#include "optim/fused.h"
#include "optim/sgd.h"

using namespace kiln;
using namespace kiln::optim;

namespace {

// Bit patterns of an f32 tensor, in logical order.
std::vector<uint32_t> bits(const Tensor& t) {
  std::vector<float> v = t.contiguous().to_vector<float>();
  std::vector<uint32_t> out(v.size());
  std::memcpy(out.data(), v.data(), v.size() * sizeof(float));
  return out;
}

void check_bitwise(const Tensor& got, const Tensor& want, const std::string& what) {
  REQUIRE(got.shape() == want.shape());
  auto g = bits(got), w = bits(want);
  int bad = 0;
  for (size_t i = 0; i < g.size(); ++i)
    if (g[i] != w[i] && bad++ < 3) {
      float a, b;
      std::memcpy(&a, &g[i], 4);
      std::memcpy(&b, &w[i], 4);
      FAIL_CHECK(what << " element " << i << ": " << a << " vs " << b);
    }
  CHECK_MESSAGE(bad == 0, what, ": ", bad, " elements differ");
}

// Shapes of a small parameter set: a channels-last conv weight, vectors, a matrix, one bigger
// than a chunk so several chunks cover one parameter.
struct ParamSet {
  std::vector<Tensor> a, b;  // identical values, independent tensors
};
ParamSet make_params(uint64_t seed) {
  const std::vector<Shape> shapes = {{4, 3, 3, 3}, {4}, {5, 7}, {3000}, {1}, {2, 2}};
  Generator gen(seed);
  ParamSet s;
  for (size_t i = 0; i < shapes.size(); ++i) {
    Tensor v = randn(shapes[i], DType::f32, &gen);
    if (shapes[i].size() == 4) v = v.contiguous(MemoryFormat::ChannelsLast);
    s.a.push_back(v.clone().set_requires_grad(true));
    s.b.push_back(v.clone(v.suggest_memory_format()).set_requires_grad(true));
  }
  return s;
}

// Three groups over the parameter set, options from `proto` with per-group changes.
std::vector<ParamGroup> groups_of(const std::vector<Tensor>& p, const ParamGroup& g0,
                                  const ParamGroup& g1, const ParamGroup& g2) {
  std::vector<ParamGroup> gs = {g0, g1, g2};
  gs[0].params = {p[0], p[1]};
  gs[1].params = {p[2], p[3]};
  gs[2].params = {p[4], p[5]};
  return gs;
}

// Runs `steps` steps of `ref` and `fused` with identical random gradients; the fused grads are
// written as grad·scale (scale a power of two, exactly undone by the step) when a scaler is
// given. Changes group 0's lr midway (the lr array upload).
void run_pair(Optimizer& ref, FusedOptimizer& fused, const ParamSet& ps, int steps,
              DynamicLossScaler* scaler = nullptr) {
  Generator gen(99);
  for (int s = 0; s < steps; ++s) {
    if (s == 2) {
      ref.param_groups[0].lr *= 0.5;
      fused.param_groups[0].lr *= 0.5;
    }
    fused.zero_grad();
    for (size_t i = 0; i < ps.a.size(); ++i) {
      Tensor g = randn(ps.a[i].shape(), DType::f32, &gen);
      ps.a[i].set_grad(g.contiguous(ps.a[i].suggest_memory_format()));
      NoGradGuard ng;
      const double scale = scaler ? scaler->scale_value() : 1.0;
      ps.b[i].grad().copy_(g * scale);
    }
    ref.step();
    if (scaler) {
      scaler->step(fused);
      scaler->update();
    } else {
      fused.step();
    }
  }
  for (size_t i = 0; i < ps.a.size(); ++i) {
    check_bitwise(ps.b[i], ps.a[i], "param " + std::to_string(i));
    check_bitwise(fused.master(i), ps.a[i], "master " + std::to_string(i));
  }
}

ParamGroup sgd_group(double lr, double momentum, double dampening, double wd, bool nesterov) {
  ParamGroup g;
  g.lr = lr;
  g.momentum = momentum;
  g.dampening = dampening;
  g.weight_decay = wd;
  g.nesterov = nesterov;
  return g;
}

ParamGroup adamw_group(double lr, double b1, double b2, double eps, double wd) {
  ParamGroup g;
  g.lr = lr;
  g.beta1 = b1;
  g.beta2 = b2;
  g.eps = eps;
  g.weight_decay = wd;
  return g;
}

// A one-parameter SGD setup for scaler tests: p (8), momentum 0.9.
struct Tiny {
  Tensor p = from_vector(std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8}, {8}).set_requires_grad(true);
  FusedSGD opt{{p}, SGDOptions{0.1, 0.9}};
  void set_grad(float v) {
    NoGradGuard ng;
    p.grad().fill_(v);
  }
};

}  // namespace

TEST_CASE("FusedSGD equals optim::SGD bitwise over steps and groups") {
  SUBCASE("momentum, nesterov, dampening, weight decay") {
    ParamSet ps = make_params(1);
    SGD ref(groups_of(ps.a, sgd_group(0.1, 0.9, 0.0, 1e-2, true), sgd_group(0.05, 0.8, 0.1, 0.0, false),
                      sgd_group(0.2, 0.0, 0.0, 5e-4, false)));
    FusedSGD fused(groups_of(ps.b, sgd_group(0.1, 0.9, 0.0, 1e-2, true),
                             sgd_group(0.05, 0.8, 0.1, 0.0, false), sgd_group(0.2, 0.0, 0.0, 5e-4, false)));
    CHECK(fused.num_chunks() == 1 + 1 + 1 + 2 + 1 + 1);  // 3000 elements take two chunks
    run_pair(ref, fused, ps, 5);
    // Momentum buffers equal the reference's state.
    auto sd = ref.state_dict();
    check_bitwise(fused.state(0, 3), sd.at("state.3.momentum_buffer"), "momentum 3");
  }
  SUBCASE("plain SGD, no state arena") {
    ParamSet ps = make_params(2);
    SGD ref(ps.a, SGDOptions{0.3});
    FusedSGD fused(ps.b, SGDOptions{0.3});
    run_pair(ref, fused, ps, 3);
    CHECK_THROWS_AS(fused.state(0, 0), Error);
  }
  SUBCASE("through the loss scaler (power-of-two scale is exact)") {
    ParamSet ps = make_params(3);
    SGD ref(groups_of(ps.a, sgd_group(0.1, 0.9, 0.0, 1e-2, false), sgd_group(0.05, 0.5, 0.0, 0.0, true),
                      sgd_group(0.2, 0.0, 0.0, 0.0, false)));
    FusedSGD fused(groups_of(ps.b, sgd_group(0.1, 0.9, 0.0, 1e-2, false),
                             sgd_group(0.05, 0.5, 0.0, 0.0, true), sgd_group(0.2, 0.0, 0.0, 0.0, false)));
    DynamicLossScaler scaler(Device::cpu(), {1024.0, 2.0, 0.5, 2});
    run_pair(ref, fused, ps, 5, &scaler);
    CHECK(scaler.scale_value() == 4096.0);  // grew twice (every 2 clean steps)
  }
}

TEST_CASE("FusedAdamW equals optim::AdamW bitwise over steps and groups") {
  ParamSet ps = make_params(4);
  AdamW ref(groups_of(ps.a, adamw_group(1e-2, 0.9, 0.999, 1e-8, 1e-2), adamw_group(3e-3, 0.8, 0.99, 1e-6, 0.0),
                      adamw_group(1e-3, 0.5, 0.9, 1e-8, 0.1)));
  FusedAdamW fused(groups_of(ps.b, adamw_group(1e-2, 0.9, 0.999, 1e-8, 1e-2),
                             adamw_group(3e-3, 0.8, 0.99, 1e-6, 0.0), adamw_group(1e-3, 0.5, 0.9, 1e-8, 0.1)));
  run_pair(ref, fused, ps, 6);
  auto sd = ref.state_dict();
  check_bitwise(fused.state(0, 2), sd.at("state.2.exp_avg"), "exp_avg 2");
  check_bitwise(fused.state(1, 3), sd.at("state.3.exp_avg_sq"), "exp_avg_sq 3");
  CHECK(fused.step_count().item() == 6);
}

TEST_CASE("an overflow step changes nothing, halves the scale, and the next step proceeds") {
  Tiny t;
  DynamicLossScaler scaler(Device::cpu(), {256.0, 2.0, 0.5, 1000});
  auto clean_step = [&] {
    t.opt.zero_grad();
    t.set_grad(float(scaler.scale_value()));  // unscaled gradient 1
    scaler.step(t.opt);
    scaler.update();
  };
  clean_step();
  clean_step();
  const Tensor p0 = t.p.clone(), m0 = t.opt.master(0).clone(), b0 = t.opt.state(0, 0).clone();
  CHECK(scaler.growth_tracker().item() == 2);

  t.opt.zero_grad();
  t.set_grad(256.0f);
  {
    NoGradGuard ng;
    t.p.grad().narrow(0, 3, 1).fill_(INFINITY);
  }
  scaler.step(t.opt);
  CHECK(scaler.found_inf().item() == 1.0);
  scaler.update();
  check_bitwise(t.p, p0, "param after skipped step");
  check_bitwise(t.opt.master(0), m0, "master after skipped step");
  check_bitwise(t.opt.state(0, 0), b0, "momentum after skipped step");
  CHECK(t.opt.step_count().item() == 2);
  CHECK(scaler.scale_value() == 128.0);
  CHECK(scaler.growth_tracker().item() == 0);
  CHECK(scaler.skipped_steps().item() == 1);

  SUBCASE("NaN is an overflow too") {
    t.opt.zero_grad();
    t.set_grad(NAN);
    scaler.step(t.opt);
    scaler.update();
    check_bitwise(t.p, p0, "param after NaN step");
    CHECK(scaler.scale_value() == 64.0);
  }
  SUBCASE("the next clean step updates") {
    clean_step();
    CHECK(t.opt.step_count().item() == 3);
    CHECK(scaler.found_inf().item() == 0.0);
    // Momentum step with unscaled gradient 1: buf = 0.9·buf + 1, p -= 0.1·buf.
    std::vector<float> b = b0.to_vector<float>(), p = p0.to_vector<float>(),
                       got = t.p.to_vector<float>();
    for (size_t i = 0; i < p.size(); ++i)
      CHECK(got[i] == doctest::Approx(p[i] - 0.1f * (0.9f * b[i] + 1.0f)).epsilon(1e-6));
  }
}

TEST_CASE("loss scale growth and backoff") {
  SUBCASE("small growth_interval") {
    Tiny t;
    DynamicLossScaler scaler(Device::cpu(), {8.0, 2.0, 0.5, 3});
    std::vector<double> seen;
    const std::vector<bool> overflow = {false, false, false, false, true, false, false, false};
    for (bool o : overflow) {
      t.opt.zero_grad();
      t.set_grad(o ? INFINITY : 1.0f);
      scaler.step(t.opt);
      scaler.update();
      seen.push_back(scaler.scale_value());
    }
    CHECK(seen == std::vector<double>{8, 8, 16, 16, 8, 8, 8, 16});
  }
  SUBCASE("default options: growth after exactly 2000 clean steps") {
    Tiny t;
    DynamicLossScaler scaler(Device::cpu());
    CHECK(scaler.scale_value() == 65536.0);
    for (int s = 1; s <= 2000; ++s) {
      t.opt.zero_grad();
      scaler.step(t.opt);
      scaler.update();
      if (s == 1999) {
        CHECK(scaler.scale_value() == 65536.0);
        CHECK(scaler.growth_tracker().item() == 1999);
      }
    }
    CHECK(scaler.scale_value() == 131072.0);
    CHECK(scaler.growth_tracker().item() == 0);
  }
  SUBCASE("the scale never becomes inf") {
    Tiny t;
    const double near_max = double(FLT_MAX) * 0.75;
    DynamicLossScaler scaler(Device::cpu(), {near_max, 2.0, 0.5, 1});
    for (int s = 0; s < 3; ++s) {
      t.opt.zero_grad();
      scaler.step(t.opt);
      scaler.update();
      CHECK(std::isfinite(scaler.scale_value()));
      CHECK(scaler.scale_value() == double(float(near_max)));
    }
    DynamicLossScaler p127(Device::cpu(), {std::ldexp(1.0, 127), 2.0, 0.5, 1});
    t.opt.zero_grad();
    p127.step(t.opt);
    p127.update();
    CHECK(p127.scale_value() == std::ldexp(1.0, 127));
  }
  SUBCASE("options are validated; update needs an overflow check first") {
    CHECK_THROWS_AS(DynamicLossScaler(Device::cpu(), {0.0}), Error);
    CHECK_THROWS_AS(DynamicLossScaler(Device::cpu(), {1.0, 1.0}), Error);
    CHECK_THROWS_AS(DynamicLossScaler(Device::cpu(), {1.0, 2.0, 1.5}), Error);
    CHECK_THROWS_AS(DynamicLossScaler(Device::cpu(), {1.0, 2.0, 0.5, 0}), Error);
    DynamicLossScaler s(Device::cpu());
    CHECK_THROWS_AS(s.update(), Error);
    Tiny t;
    s.unscale_(t.opt);
    CHECK_THROWS_AS(s.unscale_(t.opt), Error);
  }
}

TEST_CASE("scale(loss) multiplies on the tensor path and backward lands in the arena") {
  Tensor w = from_vector(std::vector<float>{1, -2, 3}, {3}).set_requires_grad(true);
  FusedSGD opt({w}, SGDOptions{0.5});
  DynamicLossScaler scaler(Device::cpu(), {4.0});
  const Tensor x = from_vector(std::vector<float>{0.5f, 1.0f, -1.0f}, {3});
  Tensor loss = F::sum(F::mul(w, x));
  Tensor scaled = scaler.scale(loss);
  CHECK(scaled.dim() == 0);
  CHECK(scaled.item() == doctest::Approx(4.0 * loss.item()));
  scaled.backward();
  CHECK(w.grad().to_vector<float>() == std::vector<float>{2, 4, -4});
  CHECK(w.grad().shares_storage(opt.grad_arena()));
  scaler.step(opt);
  scaler.update();
  CHECK(w.to_vector<float>() == std::vector<float>{0.75f, -2.5f, 3.5f});
  DynamicLossScaler off(Device::cpu(), {65536.0, 2.0, 0.5, 2000, false});
  CHECK(off.scale(loss).is_same(loss));
}

TEST_CASE("zero_grad is one fill of the arena; grads stay views; backward accumulates into it") {
  Generator gen(5);
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Linear>(4, 3, true, &gen), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(3, 2, true, &gen)});
  FusedSGD opt(model->parameters(), SGDOptions{0.1, 0.9});
  const Tensor x = randn({5, 4}, DType::f32, &gen);
  std::vector<const void*> where;
  for (const Tensor& p : model->parameters()) where.push_back(p.grad().raw_data());

  F::sum((*model)(x)).backward();
  std::vector<std::vector<float>> first;
  for (const Tensor& p : model->parameters()) first.push_back(p.grad().to_vector<float>());
  F::sum((*model)(x)).backward();  // accumulates: twice the first gradients
  size_t i = 0;
  for (const Tensor& p : model->parameters()) {
    CHECK(p.grad().raw_data() == where[i]);
    CHECK(p.grad().shares_storage(opt.grad_arena()));
    auto g = p.grad().to_vector<float>();
    for (size_t k = 0; k < g.size(); ++k) CHECK(g[k] == 2.0f * first[i][k]);
    ++i;
  }
  opt.zero_grad();
  for (uint8_t b : opt.grad_arena().to_vector<uint8_t>()) REQUIRE(b == 0);
  i = 0;
  for (const Tensor& p : model->parameters()) CHECK(p.grad().raw_data() == where[i++]);

  // Setting grads to none behind the optimizer's back is caught at the next step.
  model->zero_grad(true);
  CHECK_THROWS_AS(opt.step(), Error);
}

TEST_CASE("clip_grad_norm_ matches a hand computation, with and without unscaling") {
  Tensor a = from_vector(std::vector<float>{3, 0, 0}, {3}).set_requires_grad(true);
  Tensor b = from_vector(std::vector<float>{0, 0}, {2}).set_requires_grad(true);
  FusedSGD opt({a, b}, SGDOptions{1.0});
  auto set = [&](float s) {
    NoGradGuard ng;
    a.grad().copy_(from_vector(std::vector<float>{3 * s, 0, 4 * s}, {3}));
    b.grad().copy_(from_vector(std::vector<float>{0, 12 * s}, {2}));  // total norm 13
  };
  SUBCASE("no scaler") {
    set(1.0f);
    Tensor n = clip_grad_norm_(opt, 6.5);
    CHECK(n.item() == doctest::Approx(13.0));
    opt.step();
    const float c = 6.5f / (13.0f + 1e-6f);
    CHECK(a.to_vector<float>()[0] == doctest::Approx(3.0 - 3.0 * c).epsilon(1e-6));
    CHECK(a.to_vector<float>()[2] == doctest::Approx(-4.0 * c).epsilon(1e-6));
    CHECK(b.to_vector<float>()[1] == doctest::Approx(-12.0 * c).epsilon(1e-6));
  }
  SUBCASE("after unscale_: the norm of the unscaled gradients") {
    DynamicLossScaler scaler(Device::cpu(), {1024.0});
    set(1024.0f);
    scaler.unscale_(opt);
    Tensor n = clip_grad_norm_(opt, 100.0);  // no clipping: coefficient 1
    CHECK(n.item() == doctest::Approx(13.0));
    scaler.step(opt);
    scaler.update();
    CHECK(a.to_vector<float>() == std::vector<float>{0, 0, -4});
    CHECK(b.to_vector<float>() == std::vector<float>{0, -12});
  }
  SUBCASE("max_norm must be positive") { CHECK_THROWS_AS(clip_grad_norm_(opt, 0.0), Error); }
}

TEST_CASE("fused optimizer errors: mixed devices/dtypes, non-dense params, moved params") {
  Tensor i = zeros({3}, DType::f64).set_requires_grad(true);
  CHECK_THROWS_AS(FusedSGD({i}, SGDOptions{}), Error);
  Tensor ok = zeros({3}).set_requires_grad(true);
  Tensor wide = zeros({4, 8});
  Tensor strided = wide.detach().narrow(1, 0, 4).set_requires_grad(true);
  CHECK_THROWS_AS(FusedSGD({strided}, SGDOptions{}), Error);
  CHECK_THROWS_AS(FusedSGD({ok}, SGDOptions{0.1, 0.0, 0.0, 0.0, true}), Error);  // nesterov w/o momentum
  CHECK_THROWS_AS(FusedAdamW({ok}, AdamWOptions{1e-3, 1.0}), Error);
  auto lin = std::make_shared<nn::Linear>(2, 2);
  FusedSGD opt(lin->parameters(), SGDOptions{0.1});
  lin->to(DType::f64);
  CHECK_THROWS_AS(opt.step(), Error);
}

TEST_CASE("prepare_model on the CPU keeps f32; mixed precision needs CUDA") {
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Conv2d>(3, 4, 3), std::make_shared<nn::BatchNorm2d>(4)});
  model->to(DType::f64);
  const Tensor w = model->parameters()[0];
  amp::prepare_model(*model, Device::cpu());
  for (const auto& [n, t] : model->state())
    if (is_floating(t.dtype())) CHECK_MESSAGE(t.dtype() == DType::f32, n);
  CHECK(w.dtype() == DType::f32);  // the handle held before sees the conversion
  CHECK_THROWS_AS(amp::prepare_model(*model, Device::cpu(), amp::Precision::Mixed16), Error);
  CHECK(amp::prepare_input(zeros({1, 3, 4, 4}, DType::f64), Device::cpu()).dtype() == DType::f32);

  // Module::convert: one tensor, channels-last, handle kept.
  model->convert("0.weight", DType::f32, Device::cpu(), MemoryFormat::ChannelsLast);
  CHECK(w.is_contiguous(MemoryFormat::ChannelsLast));
  CHECK_THROWS_AS(model->convert("1.running_mean", DType::f32, Device::cpu(),
                                 MemoryFormat::ChannelsLast), Error);
  CHECK_THROWS_AS(model->convert("nope", DType::f32, Device::cpu()), Error);
}

TEST_CASE("the same training loop trains a small net on the CPU (fused vs reference SGD)") {
  auto make = [] {
    Generator gen(11);
    return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
        std::make_shared<nn::Conv2d>(1, 4, 3, 1, 1, 1, 1, false, &gen),
        std::make_shared<nn::BatchNorm2d>(4), std::make_shared<nn::ReLU>(),
        std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(4 * 6 * 6, 3, true, &gen)});
  };
  auto ma = make(), mb = make();
  amp::prepare_model(*ma, Device::cpu());
  amp::prepare_model(*mb, Device::cpu());
  ParamGroup proto = sgd_group(0.05, 0.9, 0.0, 5e-4, true);
  SGD ref(split_weight_decay(*ma, proto));
  FusedSGD fused(split_weight_decay(*mb, proto));
  DynamicLossScaler scaler(Device::cpu(), {256.0});
  Generator gen(12);
  const Tensor x = randn({8, 1, 6, 6}, DType::f32, &gen);
  const Tensor y = randint(0, 3, {8}, DType::i64, &gen);
  double first = 0, last = 0;
  for (int s = 0; s < 15; ++s) {
    ref.zero_grad();
    Tensor la = F::cross_entropy((*ma)(x), y);
    la.backward();
    ref.step();

    fused.zero_grad();
    Tensor lb = F::cross_entropy((*mb)(amp::prepare_input(x, Device::cpu())), y);
    scaler.scale(lb).backward();
    scaler.step(fused);
    scaler.update();
    if (s == 0) first = lb.item();
    last = lb.item();
  }
  CHECK(last < 0.5 * first);
  // Scaling by a power of two commutes with every rounding of the backward, so the two
  // trajectories are bit-identical.
  auto pa = ma->parameters(), pb = mb->parameters();
  for (size_t i = 0; i < pa.size(); ++i) check_bitwise(pb[i], pa[i], "param " + std::to_string(i));
}
