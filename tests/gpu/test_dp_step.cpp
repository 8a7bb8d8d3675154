// A data-parallel training step on 2 GPUs against one GPU: the parent case launches 2 ranks of
// this binary (tools/train/launcher.h); each rank runs train::DataParallel's step (bucketed FP16
// gradient all-reduce, agreed found-inf, SyncBN) on half of a batch and, on its own GPU, a
// plain ClassifierStep on the whole batch, and compares, in FP32 (elementwise, tight) and in
// mixed precision (relative L2 per tensor). With SyncBN the two are the same computation up to
// rounding: batch statistics over all 16 images, gradients averaged over ranks of per-rank
// means = the mean over the batch. Then rank 1 gets an inf in its input and both ranks must skip
// the step. With fewer than 2 GPUs (or without NCCL) the case prints
// "SKIPPED: needs 2 GPUs" and passes.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "cuda/runtime.h"
#include "tests/gpu/gpu_test_util.h"

#ifdef KILN_WITH_NCCL
#include "tools/train/launcher.h"
#include "models/resnet.h"
#include "ops/ops.h"
#include "optim/amp.h"
#include "optim/fused.h"
#include "tools/train/train_dist.h"
#include "optim/train_step.h"
#include "tests/gpu/ref_check.h"

using namespace kiln;

namespace {

constexpr int kWorld = 2;
constexpr int64_t kBatch = 16;  // whole batch; 8 per rank
const char* kWorkerVar = "KILN_DP_TEST_WORKER";

bool is_worker() { return std::getenv(kWorkerVar) != nullptr; }

struct Setup {
  std::shared_ptr<models::ResNet> model;
  std::unique_ptr<optim::FusedSGD> opt;
  std::unique_ptr<optim::DynamicLossScaler> scaler;
};

Setup make_setup(Device dev, amp::Precision prec) {
  Setup s;
  s.model = models::resnet_small(10, 16);  // same initial weights on every call
  amp::prepare_model(*s.model, dev, prec);
  optim::ParamGroup proto;
  proto.lr = 0.1;
  proto.momentum = 0.9;
  proto.weight_decay = 5e-4;
  s.opt = std::make_unique<optim::FusedSGD>(optim::split_weight_decay(*s.model, proto));
  // A small scale so that no step of this tiny model overflows by itself.
  s.scaler = std::make_unique<optim::DynamicLossScaler>(dev, optim::LossScalerOptions{.init_scale = 256.0});
  return s;
}

using Named = std::vector<std::pair<std::string, Tensor>>;

// FP32: elementwise, max |a - b| <= tol · max |b| + tol · |b|.
void check_close_named(const Named& a, const Named& b, double tol, const std::string& what) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CAPTURE(what);
    CAPTURE(a[i].first);
    REQUIRE(a[i].second.defined());
    REQUIRE(b[i].second.defined());
    KILN_CHECK_OK(ref_check::compare_scaled(a[i].second, ref_check::to_cpu64(b[i].second), tol));
  }
}

// FP16: two FP16 computations of a whole network differ elementwise wherever rounding flips a
// ReLU or a sum cancels (BN bias gradients are sums of dy that nearly cancel), so compare each
// tensor by its relative L2 error, ||a - b|| / ||b||.
void check_rel_l2_named(const Named& a, const Named& b, double tol, const std::string& what) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  std::string worst_name;
  for (size_t i = 0; i < a.size(); ++i) {
    CAPTURE(what);
    CAPTURE(a[i].first);
    REQUIRE(a[i].second.defined());
    REQUIRE(b[i].second.defined());
    const std::vector<double> x = ref_check::to_cpu64(a[i].second).to_vector<double>();
    const std::vector<double> y = ref_check::to_cpu64(b[i].second).to_vector<double>();
    double num = 0, den = 0;
    for (size_t k = 0; k < x.size(); ++k) {
      num += (x[k] - y[k]) * (x[k] - y[k]);
      den += y[k] * y[k];
    }
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    CHECK(rel <= tol);
    if (rel > worst) {
      worst = rel;
      worst_name = a[i].first;
    }
  }
  MESSAGE(what, ": worst relative L2 error ", worst, " (", worst_name, ")");
}

Named grads_of(const nn::Module& m) {
  Named out;
  for (const auto& [name, p] : m.named_parameters()) out.emplace_back(name, p.grad());
  return out;
}

Named snapshot(const nn::Module& m) {
  Named out;
  for (const auto& [name, p] : m.named_parameters()) out.emplace_back(name, p.detach().clone());
  return out;
}

// One data-parallel step with SyncBN on this rank's half against one single-GPU step on the
// whole batch; with Mixed16, then an overflow on rank 1 that both ranks must skip.
void run_case(train::DataParallel& dp, const DistEnv& env, Device dev, amp::Precision prec) {
  const bool fp16 = prec == amp::Precision::Mixed16;
  const std::string tag = fp16 ? "fp16" : "fp32";
  // The whole batch, identical on both ranks (a fixed generator on the host).
  Generator gen(2024);
  Tensor x_all = randn({kBatch, 1, 28, 28}, DType::f32, &gen);
  Tensor y_all = randint(0, 10, {kBatch}, TensorOptions(DType::i64), &gen);
  const int64_t half = kBatch / kWorld;
  Tensor x_mine = x_all.narrow(0, env.rank * half, half).contiguous();
  Tensor y_mine = y_all.narrow(0, env.rank * half, half).contiguous();

  Setup mine = make_setup(dev, prec);
  CHECK(dp.enable_sync_batch_norm(*mine.model) > 0);
  auto dp_step = dp.make_step(*mine.model, *mine.opt, *mine.scaler, 0.0);
  dp_step->run(amp::prepare_input(x_mine, dev, prec), y_mine.to(dev));

  Setup ref = make_setup(dev, prec);  // one GPU, the whole batch, plain BN
  optim::ClassifierStep ref_step(*ref.model, *ref.opt, *ref.scaler);
  ref_step.run(amp::prepare_input(x_all, dev, prec), y_all.to(dev));
  cuda::synchronize();

  CHECK(mine.scaler->scale_value() == 256.0);
  CHECK(ref.scaler->scale_value() == 256.0);
  // Gradients (scaled by 256 in both), the updated parameters and the BN statistics.
  if (fp16) {
    check_rel_l2_named(grads_of(*mine.model), grads_of(*ref.model), 5e-2, tag + " gradient");
    // BN biases start at 0, so after one step they carry their gradient's relative error.
    check_rel_l2_named(mine.model->named_parameters(), ref.model->named_parameters(), 5e-2,
                       tag + " parameter after the step");
    check_rel_l2_named(mine.model->named_buffers(), ref.model->named_buffers(), 1e-2,
                       tag + " buffer after the step");
  } else {
    check_close_named(grads_of(*mine.model), grads_of(*ref.model), 1e-3, tag + " gradient");
    check_close_named(mine.model->named_parameters(), ref.model->named_parameters(), 1e-4,
                      tag + " parameter after the step");
    check_close_named(mine.model->named_buffers(), ref.model->named_buffers(), 1e-4,
                      tag + " buffer after the step");
  }
  {  // the comparison can fail: the parameters did move by more than its tolerance
    Setup fresh = make_setup(dev, prec);
    double moved = 0;
    const auto now = mine.model->named_parameters();
    const auto before = fresh.model->named_parameters();
    for (size_t i = 0; i < now.size(); ++i) {
      Tensor d = ref_check::to_cpu64(now[i].second) - ref_check::to_cpu64(before[i].second);
      moved = std::max(moved, ref_check::max_abs(d));
    }
    CHECK(moved > 1e-2);
  }
  if (!fp16) return;

  // Overflow on rank 1 only: both ranks skip (parameters unchanged, scale halved, one skip).
  const Named before_skip = snapshot(*mine.model);
  Tensor x_bad = x_mine.clone();
  if (env.rank == 1) x_bad.data<float>()[5] = std::numeric_limits<float>::infinity();
  dp_step->run(amp::prepare_input(x_bad, dev, prec), y_mine.to(dev));
  cuda::synchronize();
  CHECK(mine.scaler->scale_value() == 128.0);
  CHECK(mine.scaler->skipped_steps().to(Device::cpu()).to(DType::i64).item<int64_t>() == 1);
  const Named after_skip = mine.model->named_parameters();
  for (size_t i = 0; i < after_skip.size(); ++i) {
    CAPTURE(after_skip[i].first);
    CHECK(ref_check::to_cpu64(after_skip[i].second).to_vector<double>() ==
          ref_check::to_cpu64(before_skip[i].second).to_vector<double>());
  }
  cuda::synchronize();
}

void worker() {
  const DistEnv env = DistEnv::from_env();
  REQUIRE(env.world_size == kWorld);
  cuda::set_device(env.local_rank);
  const Device dev = Device::cuda(env.local_rank);
  // One communicator for both cases; every rank builds identical models, so the start-up
  // broadcast of the first one is enough.
  Setup first = make_setup(dev, amp::Precision::FP32);
  train::DataParallel dp(env, *first.model);
  run_case(dp, env, dev, amp::Precision::FP32);
  run_case(dp, env, dev, amp::Precision::Mixed16);
}

}  // namespace

TEST_CASE("data-parallel step on 2 GPUs equals one step on the whole batch; overflow skips both") {
  if (is_worker()) return;
  if (cuda::device_count() < kWorld) {
    std::printf("SKIPPED: needs 2 GPUs (%d visible)\n", cuda::device_count());
    return;
  }
  ::setenv(kWorkerVar, "1", 1);
  LaunchResult r = launch_processes({"/proc/self/exe", "--test-case=dp step worker"},
                                    {.nproc = kWorld});
  ::unsetenv(kWorkerVar);
  INFO(r.message);
  CHECK(r.ok());
}

TEST_CASE("dp step worker") {
  if (!is_worker()) return;
  worker();
}

#else  // !KILN_WITH_NCCL

TEST_CASE("data-parallel step on 2 GPUs") {
  std::printf("SKIPPED: needs 2 GPUs and NCCL (built without NCCL)\n");
}

#endif
