// Mixed precision on the GPU: the CUDA fused optimizers and loss scaler against their CPU
// reference (ops/cpu/fused_optim.cpp, run on the very same f16/f32 values), prepare_model, a small
// CNN trained in mixed precision tracking its FP32 twin, and a whole training step captured in
// a CUDA graph (proof that nothing on the step path synchronises the host).
//
// Tolerances: masters, momentum and f16 weights of FusedSGD are bitwise equal to the CPU
// reference (same f32 operations, explicit FMAs on both sides). FusedAdamW computes its bias
// corrections with the device's double pow, which may differ from glibc's by an ulp of a
// double; after rounding to f32 we allow 2 f32 ulps. Norms: f32 partial sums in another order,
// rtol 1e-5.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>

#include "core/autograd.h"
#include "core/generator.h"
#include "cuda/conv.h"
#include "models/resnet.h"
#include "models/vit.h"
#include "models/nn.h"
#include "cuda/runtime.h"
#include "cuda/check.h"
#include "optim/amp.h"
#include "optim/fused.h"
#include "optim/train_step.h"
#include "tests/gpu/gpu_test_util.h"

using namespace kiln;
using namespace kiln::optim;
using namespace kiln::gputest;

namespace {

// Largest distance in f32 ulps between two f32 tensors (any device); NaN anywhere: huge.
int64_t max_ulps(const Tensor& a, const Tensor& b) {
  auto x = a.to(Device::cpu()).contiguous().to_vector<float>();
  auto y = b.to(Device::cpu()).contiguous().to_vector<float>();
  REQUIRE(x.size() == y.size());
  int64_t worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) return INT64_MAX;
    int32_t ix, iy;
    std::memcpy(&ix, &x[i], 4);
    std::memcpy(&iy, &y[i], 4);
    if (ix < 0) ix = INT32_MIN - ix;  // monotone integer order of floats
    if (iy < 0) iy = INT32_MIN - iy;
    worst = std::max<int64_t>(worst, std::llabs(int64_t(ix) - int64_t(iy)));
  }
  return worst;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  Tensor x = a.to(Device::cpu()).contiguous(), y = b.to(Device::cpu()).contiguous();
  return x.dtype() == y.dtype() && x.nbytes() == y.nbytes() &&
         std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) == 0;
}

// The same parameters on the CPU and the GPU: f16 "weights" (one channels-last conv weight, a
// matrix, a vector spanning several chunks) and f32 "BN" vectors, in two groups.
struct Twin {
  std::vector<Tensor> cpu, gpu;
  std::vector<ParamGroup> groups(bool on_gpu, const ParamGroup& decay, const ParamGroup& no_decay) const {
    const auto& p = on_gpu ? gpu : cpu;
    ParamGroup a = decay, b = no_decay;
    a.params = {p[0], p[1], p[2]};
    b.params = {p[3], p[4]};
    return {a, b};
  }
};

Twin make_twin(uint64_t seed, DType weight_dtype) {
  Generator gen(seed);
  const std::vector<std::pair<Shape, DType>> specs = {
      {{8, 4, 3, 3}, weight_dtype}, {{10, 6}, weight_dtype}, {{5000}, weight_dtype},
      {{8}, DType::f32}, {{10}, DType::f32}};
  Twin t;
  for (const auto& [shape, dtype] : specs) {
    Tensor v = randn(shape, DType::f32, &gen).to(dtype);
    if (shape.size() == 4) v = v.contiguous(MemoryFormat::ChannelsLast);
    t.cpu.push_back(v.clone(v.suggest_memory_format()).set_requires_grad(true));
    t.gpu.push_back(v.to(kGpu).contiguous(v.suggest_memory_format()).set_requires_grad(true));
  }
  return t;
}

// Writes the same gradient values (grad·scale rounded to the parameter's dtype) into both
// optimizers' arenas; with inject_inf, row 2 of parameter 1's gradient is inf.
void set_grads(FusedOptimizer& c, FusedOptimizer& g, const Twin& t, Generator& gen, double scale,
               bool inject_inf) {
  NoGradGuard ng;
  c.zero_grad();
  g.zero_grad();
  for (size_t i = 0; i < t.cpu.size(); ++i) {
    Tensor v = (randn(t.cpu[i].shape(), DType::f32, &gen) * scale).to(t.cpu[i].dtype());
    if (inject_inf && i == 1) v.narrow(0, 2, 1).fill_(INFINITY);
    t.cpu[i].grad().copy_(v);
    t.gpu[i].grad().copy_(v.contiguous(t.gpu[i].suggest_memory_format()).to(kGpu));
  }
}

template <typename Opt>
void compare_to_reference(Opt& c, Opt& g, const Twin& t, bool bitwise, int num_state) {
  for (size_t i = 0; i < t.cpu.size(); ++i) {
    const std::string what = "parameter " + std::to_string(i);
    if (bitwise) {
      CHECK_MESSAGE(same_bits(g.master(i), c.master(i)), "master of ", what);
      CHECK_MESSAGE(same_bits(t.gpu[i], t.cpu[i]), what);
      for (int k = 0; k < num_state; ++k)
        CHECK_MESSAGE(same_bits(g.state(size_t(k), i), c.state(size_t(k), i)), "state ", k, " of ", what);
    } else {
      CHECK_MESSAGE(max_ulps(g.master(i), c.master(i)) <= 2, "master of ", what);
      for (int k = 0; k < num_state; ++k)
        CHECK_MESSAGE(max_ulps(g.state(size_t(k), i), c.state(size_t(k), i)) <= 2, "state ", k,
                      " of ", what);
      // The f16 copy is the master rounded: at most one f16 ulp apart when masters differ.
      check_close(t.gpu[i].to(DType::f32), t.cpu[i].to(DType::f32), {0, 1e-3}, what);
    }
  }
}

ParamGroup sgd(double lr, double momentum, double wd, bool nesterov) {
  ParamGroup g;
  g.lr = lr;
  g.momentum = momentum;
  g.weight_decay = wd;
  g.nesterov = nesterov;
  return g;
}

// Conv-BN-ReLU x2, global pool, Linear: the layers mixed precision touches.
std::shared_ptr<nn::Sequential> small_cnn(uint64_t seed) {
  Generator gen(seed);
  return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Conv2d>(3, 16, 3, 1, 1, 1, 1, false, &gen),
      std::make_shared<nn::BatchNorm2d>(16), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Conv2d>(16, 32, 3, 2, 1, 1, 1, false, &gen),
      std::make_shared<nn::BatchNorm2d>(32), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::AdaptiveAvgPool2d>(1), std::make_shared<nn::Flatten>(),
      std::make_shared<nn::Linear>(32, 10, true, &gen)});
}

// A learnable synthetic task: noise plus a per-class constant offset of each channel (what
// conv-BN-ReLU and global pooling can see).
struct Data {
  std::vector<Tensor> x, y;  // CPU batches
};
Data make_data(int batches, int64_t n) {
  Generator gen(77);
  const Tensor means = randn({10, 3, 1, 1}, DType::f32, &gen) * 1.5;
  Data d;
  for (int b = 0; b < batches; ++b) {
    Tensor y = randint(0, 10, {n}, DType::i64, &gen);
    Tensor x = randn({n, 3, 12, 12}, DType::f32, &gen);
    const auto labels = y.to_vector<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      NoGradGuard ng;
      x.select(0, i).add_(means.select(0, labels[size_t(i)]));
    }
    d.x.push_back(x);
    d.y.push_back(y);
  }
  return d;
}

}  // namespace

TEST_CASE("CUDA FusedSGD equals the CPU reference bitwise (f16 weights, f32 BN, scaler)") {
  for (DType wd : {DType::f16, DType::f32}) {
    INFO("weights ", dtype_name(wd));
    Twin t = make_twin(3, wd);
    FusedSGD c(t.groups(false, sgd(0.1, 0.9, 1e-2, true), sgd(0.1, 0.9, 0.0, false)));
    FusedSGD g(t.groups(true, sgd(0.1, 0.9, 1e-2, true), sgd(0.1, 0.9, 0.0, false)));
    DynamicLossScaler sc(Device::cpu(), {1024.0, 2.0, 0.5, 2});
    DynamicLossScaler sg(kGpu, {1024.0, 2.0, 0.5, 2});
    Generator gen(4);
    for (int s = 0; s < 6; ++s) {
      if (s == 3) c.param_groups[1].lr = g.param_groups[1].lr = 0.03;
      set_grads(c, g, t, gen, sc.scale_value(), s == 4);
      sc.step(c);
      sc.update();
      sg.step(g);
      sg.update();
      CHECK(same_bits(sg.found_inf(), sc.found_inf()));
      CHECK(same_bits(sg.scale_tensor(), sc.scale_tensor()));
      CHECK(same_bits(sg.growth_tracker(), sc.growth_tracker()));
      CHECK(same_bits(g.step_count(), c.step_count()));
    }
    CHECK(sg.skipped_steps().item() == 1);
    compare_to_reference(c, g, t, true, 1);
  }
}

TEST_CASE("CUDA FusedAdamW equals the CPU reference (2 ulps), skipping an overflow step") {
  Twin t = make_twin(5, DType::f16);
  ParamGroup a, b;
  a.lr = 1e-2, a.weight_decay = 0.05;
  b.lr = 1e-2, b.beta1 = 0.8, b.beta2 = 0.99;
  FusedAdamW c(t.groups(false, a, b)), g(t.groups(true, a, b));
  DynamicLossScaler sc(Device::cpu(), {256.0}), sg(kGpu, {256.0});
  Generator gen(6);
  for (int s = 0; s < 5; ++s) {
    set_grads(c, g, t, gen, sc.scale_value(), s == 2);
    Tensor before = g.master_arena().clone();
    sc.step(c);
    sc.update();
    sg.step(g);
    sg.update();
    if (s == 2) CHECK(same_bits(g.master_arena(), before));
  }
  CHECK(g.step_count().item() == 4);
  compare_to_reference(c, g, t, false, 2);
}

TEST_CASE("CUDA overflow check and clip_grad_norm_ match the reference") {
  Twin t = make_twin(7, DType::f16);
  FusedSGD c(t.groups(false, sgd(0.1, 0.0, 0.0, false), sgd(0.1, 0.0, 0.0, false)));
  FusedSGD g(t.groups(true, sgd(0.1, 0.0, 0.0, false), sgd(0.1, 0.0, 0.0, false)));
  DynamicLossScaler sc(Device::cpu(), {64.0}), sg(kGpu, {64.0});
  Generator gen(8);
  set_grads(c, g, t, gen, 64.0, false);
  sc.unscale_(c);
  sg.unscale_(g);
  Tensor nc = clip_grad_norm_(c, 1.0), ng = clip_grad_norm_(g, 1.0);
  CHECK(ng.is_cuda());
  CHECK(ng.item() == doctest::Approx(nc.item()).epsilon(1e-5));
  // Hand check of the norm from the f16 gradients: √Σ(g/64)².
  double ss = 0;
  for (const Tensor& p : t.cpu)
    for (double v : p.grad().to_vector<double>()) ss += (v / 64) * (v / 64);
  CHECK(nc.item() == doctest::Approx(std::sqrt(ss)).epsilon(1e-5));
  sc.step(c);
  sc.update();
  sg.step(g);
  sg.update();
  // The coefficients differ in their last bits (summation order), so the updates do too.
  for (size_t i = 0; i < t.cpu.size(); ++i)
    check_close(g.master(i), c.master(i), {1e-6, 1e-5}, "master " + std::to_string(i));
}

TEST_CASE("prepare_model: f16 channels-last conv weights, f16 linear, f32 BN") {
  auto m = small_cnn(1);
  amp::prepare_model(*m, kGpu);
  for (const auto& [name, t] : m->state()) {
    CAPTURE(name);
    CHECK(t.is_cuda());
    const bool half = name.rfind("0.", 0) == 0 || name.rfind("3.", 0) == 0 || name.rfind("8.", 0) == 0;
    if (name.find("num_batches_tracked") != std::string::npos) CHECK(t.dtype() == DType::i64);
    else CHECK(t.dtype() == (half ? DType::f16 : DType::f32));
    if (t.dim() == 4) CHECK(t.is_contiguous(MemoryFormat::ChannelsLast));
  }
  Tensor x = amp::prepare_input(zeros({2, 3, 8, 8}), kGpu);
  CHECK(x.dtype() == DType::f16);
  CHECK(x.is_contiguous(MemoryFormat::ChannelsLast));
}

TEST_CASE("a small CNN trained 200 steps in mixed precision tracks FP32") {
  const Data data = make_data(8, 64);
  auto train = [&](amp::Precision prec) {
    auto m = small_cnn(42);
    amp::prepare_model(*m, kGpu, prec);
    FusedSGD opt(split_weight_decay(*m, sgd(0.05, 0.9, 5e-4, true)));
    DynamicLossScaler scaler(kGpu, {65536.0, 2.0, 0.5, 2000, prec == amp::Precision::Mixed16});
    std::vector<Tensor> xs, ys;
    for (size_t b = 0; b < data.x.size(); ++b) {
      xs.push_back(amp::prepare_input(data.x[b], kGpu, prec));
      ys.push_back(data.y[b].to(kGpu));
    }
    std::vector<Tensor> losses;  // on the device; read once at the end
    for (int s = 0; s < 200; ++s) {
      opt.zero_grad();
      Tensor loss = F::cross_entropy((*m)(xs[size_t(s) % xs.size()]), ys[size_t(s) % ys.size()]);
      scaler.scale(loss).backward();
      scaler.step(opt);
      scaler.update();
      losses.push_back(loss.detach());
    }
    std::vector<double> out;
    for (const Tensor& l : losses) out.push_back(l.item());
    return std::make_pair(out, scaler.skipped_steps().item());
  };
  auto [fp32, skipped32] = train(amp::Precision::FP32);
  auto [mixed, skipped16] = train(amp::Precision::Mixed16);
  CHECK(skipped32 == 0);
  // A few early steps may overflow and be skipped while the scale settles.
  CHECK(skipped16 <= 3);
  // Mean loss per window of 20 steps: within 0.05 + 10% of FP32's; both learn.
  for (int w = 0; w < 10; ++w) {
    double a = 0, b = 0;
    for (int s = w * 20; s < w * 20 + 20; ++s) a += fp32[size_t(s)] / 20, b += mixed[size_t(s)] / 20;
    CAPTURE(w);
    CHECK(std::isfinite(b));
    CHECK(std::fabs(b - a) <= 0.05 + 0.1 * a);
  }
  CHECK(fp32.back() < 0.5 * fp32.front());
  CHECK(mixed.back() < 0.5 * mixed.front());
}

TEST_CASE("a whole mixed-precision step captures into a CUDA graph (no host sync)") {
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    cuda::StreamGuard guard(stream);
    auto m = small_cnn(9);
    amp::prepare_model(*m, kGpu);
    FusedAdamW opt(split_weight_decay(*m, [] {
      ParamGroup g;
      g.lr = 1e-3;
      g.weight_decay = 0.01;
      return g;
    }()));
    DynamicLossScaler scaler(kGpu, {1024.0});
    const Data data = make_data(1, 32);
    const Tensor x = amp::prepare_input(data.x[0], kGpu), y = data.y[0].to(kGpu);
    Tensor loss_out = zeros({}, TensorOptions(DType::f32).with_device(kGpu));
    auto step = [&] {
      opt.zero_grad();
      Tensor loss = F::cross_entropy((*m)(x), y);
      scaler.scale(loss).backward();
      scaler.unscale_(opt);
      clip_grad_norm_(opt, 5.0);
      scaler.step(opt);
      scaler.update();
      NoGradGuard ng;
      loss_out.copy_(loss);
    };
    step();  // eager warm-up: cuDNN/cuBLASLt choices, allocator growth
    step();
    CUDA_CHECK(cudaStreamSynchronize(stream));
    amp::AsyncScalars log;
    log.record({loss_out, scaler.scale_tensor(), scaler.skipped_steps(), opt.step_count()});
    const std::vector<double> v = log.values();
    CHECK(v[1] == scaler.scale_value());
    CHECK(v[3] == 2.0 - v[2]);

    const Tensor w0 = m->parameters()[0].clone();
    cudaGraph_t graph = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      step();
    } catch (...) {
      cudaStreamEndCapture(stream, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    opt.stage_lr();
    for (int r = 0; r < 3; ++r) CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CHECK(opt.step_count().item() + scaler.skipped_steps().item() == 5);
    CHECK(std::isfinite(loss_out.item()));
    CHECK_FALSE(same_bits(m->parameters()[0], w0));
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

namespace {

// Three ClassifierStep::runs of a fresh `make()` on (x, y), the .grads zero_grad has just
// cleared written (overwrite: autograd's AddToZeros) or added to; the last step's .grads and the
// parameters after it (f32 copies on the CPU), and how many .grads backward flagged zero.
struct StepResult {
  std::vector<Tensor> grads, params;
  uint64_t offered_zero = 0;
};
StepResult three_steps(const std::function<std::shared_ptr<nn::Module>()>& make,
                       const Tensor& x, const Tensor& y, bool overwrite) {
  auto m = make();
  amp::prepare_model(*m, kGpu);
  FusedSGD opt(split_weight_decay(*m, sgd(0.1, 0.9, 5e-4, false)));
  DynamicLossScaler scaler(kGpu, {256.0});
  ClassifierStep step(*m, opt, scaler);
  const Tensor xd = amp::prepare_input(x, kGpu), yd = y.to(kGpu);
  optim::set_grad_overwrite_enabled(overwrite);
  autograd::reset_accumulate_stats();
  for (int i = 0; i < 3; ++i) step.run(xd, yd);
  const autograd::AccumulateStats st = autograd::accumulate_stats();
  optim::set_grad_overwrite_enabled(true);
  CHECK(scaler.skipped_steps().item() == 0);
  StepResult out;
  out.offered_zero = st.offered_zero;
  for (const Tensor& p : m->parameters()) {
    REQUIRE(p.grad().defined());
    out.grads.push_back(p.grad().to(DType::f32).to(Device::cpu()).contiguous());
    out.params.push_back(p.detach().to(DType::f32).to(Device::cpu()).contiguous());
  }
  return out;
}

// Elements of a and b that differ in value (-0 equals +0).
int64_t differing(const Tensor& a, const Tensor& b) {
  const auto u = a.to_vector<double>(), v = b.to_vector<double>();
  REQUIRE(u.size() == v.size());
  int64_t n = 0;
  for (size_t i = 0; i < u.size(); ++i) n += !(u[i] == v[i]);
  return n;
}

// With deterministic convolutions the two ways give the same values: AddToZeros writes only
// where writing computes what adding into zeros does (core/kinds.h).
void check_overwrite_equals_add(const std::function<std::shared_ptr<nn::Module>()>& make,
                                const Tensor& x, const Tensor& y) {
  cuda::set_conv_deterministic(true);
  const StepResult add = three_steps(make, x, y, false), write = three_steps(make, x, y, true);
  cuda::set_conv_deterministic(false);
  CHECK(add.offered_zero == 0);
  CHECK(write.offered_zero > 0);
  REQUIRE(add.grads.size() == write.grads.size());
  int nonzero = 0;
  for (size_t i = 0; i < add.grads.size(); ++i) {
    CAPTURE(i);
    CHECK(differing(write.grads[i], add.grads[i]) == 0);
    CHECK(differing(write.params[i], add.params[i]) == 0);
    nonzero += differing(add.grads[i], zeros(add.grads[i].shape())) > 0;
  }
  // Every parameter has a gradient (so that equality says something).
  CHECK(nonzero == int(add.grads.size()));
}

// A batch of `n` random images with random labels (data seed `seed`), and `o`'s model.
void check_overwrite_equals_add(models::BlockKind kind, std::vector<int64_t> layers,
                                models::ResNetOptions o, int64_t n, int64_t side, uint64_t seed) {
  Generator gen(seed);
  const Tensor x = randn({n, o.in_channels, side, side}, DType::f32, &gen);
  const Tensor y = randint(0, o.num_classes, {n}, DType::i64, &gen);
  check_overwrite_equals_add(
      [&] { return std::make_shared<models::ResNet>(kind, layers, o); }, x, y);
}

}  // namespace

TEST_CASE("ClassifierStep: .grads written after zero_grad equal .grads added to (ResNet-18, 28x28)") {
  // kiln-train's Fashion-MNIST model: 3x3 stem, no max pool, 64..512 channels (cuDNN's fused BN
  // below 256, kiln's BN kernels from 256).
  models::ResNetOptions o;
  o.num_classes = 10;
  o.in_channels = 1;
  o.imagenet_stem = false;
  o.seed = 5;
  check_overwrite_equals_add(models::BlockKind::Basic, {2, 2, 2, 2}, o, 16, 28, 3);
}

TEST_CASE("ClassifierStep: .grads written after zero_grad equal .grads added to (ResNet-50, 64x64)") {
  // The ImageNet stem (fused BN + ReLU + max pool), bottlenecks, the block tail's fused GEMM.
  models::ResNetOptions o;
  o.num_classes = 10;
  o.seed = 6;
  check_overwrite_equals_add(models::BlockKind::Bottleneck, {3, 4, 6, 3}, o, 8, 64, 4);
}

TEST_CASE("ClassifierStep: .grads written after zero_grad equal .grads added to (ViT, 32x32)") {
  // The transformer's parameter gradients: Linear (cuBLASLt, written into the arena's .grads),
  // linear_gelu (the bias gradient from the bias-GELU pass) and the layer norms (AddToZeros).
  models::ViTOptions o;
  o.image_size = 32;
  o.patch_size = 8;
  o.num_layers = 2;
  o.num_heads = 2;
  o.hidden_dim = 128;
  o.mlp_dim = 256;
  o.num_classes = 10;
  Generator gen(8);
  const Tensor x = randn({8, 3, 32, 32}, DType::f32, &gen);
  const Tensor y = randint(0, 10, {8}, DType::i64, &gen);
  check_overwrite_equals_add(
      [&] {
        Generator init(9);
        return std::make_shared<models::VisionTransformer>(o, &init);
      },
      x, y);
}
