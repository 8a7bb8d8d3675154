// A data-parallel training step on 2 GPUs against one GPU: the parent case launches 2 ranks of
// this binary (core/launcher.h); each rank runs train::DataParallel's step (bucketed FP16
// gradient all-reduce, agreed found-inf, SyncBN) on half of a batch and, on its own GPU, a
// plain ClassifierStep on the whole batch, and compares. With SyncBN the two are the same
// computation up to FP16 rounding: batch statistics over all 16 images, gradients averaged over
// ranks of per-rank means = the mean over the batch. Then rank 1 gets an inf in its input and
// both ranks must skip the step. With fewer than 2 GPUs (or without NCCL) the case prints
// "SKIPPED: needs 2 GPUs" and passes.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "cuda/runtime.h"
#include "tests/gpu/gpu_test_util.h"

#ifdef KILN_WITH_NCCL
#include "core/launcher.h"
#include "models/resnet.h"
#include "ops/ops.h"
#include "optim/amp.h"
#include "optim/fused.h"
#include "optim/train_dist.h"
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

Setup make_setup(Device dev) {
  Setup s;
  s.model = models::resnet_small(10, 16);  // same initial weights on every call
  amp::prepare_model(*s.model, dev);
  optim::ParamGroup proto;
  proto.lr = 0.1;
  proto.momentum = 0.9;
  proto.weight_decay = 5e-4;
  s.opt = std::make_unique<optim::FusedSGD>(optim::split_weight_decay(*s.model, proto));
  // A small scale so that no step of this tiny model overflows by itself.
  s.scaler = std::make_unique<optim::DynamicLossScaler>(dev, optim::LossScalerOptions{.init_scale = 256.0});
  return s;
}

// max |a - b| <= tol · max |b| (+ tiny), for same-named tensors of two modules.
void check_close_named(const std::vector<std::pair<std::string, Tensor>>& a,
                       const std::vector<std::pair<std::string, Tensor>>& b, double tol,
                       const char* what) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CAPTURE(what);
    CAPTURE(a[i].first);
    REQUIRE(a[i].second.defined());
    REQUIRE(b[i].second.defined());
    const Tensor want = ref_check::to_cpu64(b[i].second);
    KILN_CHECK_OK(ref_check::compare_scaled(a[i].second, want, tol));
  }
}

std::vector<std::pair<std::string, Tensor>> grads_of(const nn::Module& m) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, p] : m.named_parameters()) out.emplace_back(name, p.grad());
  return out;
}

std::vector<std::pair<std::string, Tensor>> snapshot(const nn::Module& m) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, p] : m.named_parameters()) out.emplace_back(name, p.detach().clone());
  return out;
}

void worker() {
  const DistEnv env = DistEnv::from_env();
  REQUIRE(env.world_size == kWorld);
  cuda::set_device(env.local_rank);
  const Device dev = Device::cuda(env.local_rank);

  // The whole batch, identical on both ranks (a fixed generator on the host).
  Generator gen(2024);
  Tensor x_all = randn({kBatch, 1, 28, 28}, DType::f32, &gen);
  Tensor y_all = randint(0, 10, {kBatch}, TensorOptions(DType::i64), &gen);
  const int64_t half = kBatch / kWorld;
  Tensor x_mine = x_all.narrow(0, env.rank * half, half).contiguous();
  Tensor y_mine = y_all.narrow(0, env.rank * half, half).contiguous();

  // Data-parallel: half the batch per rank, SyncBN, one step.
  Setup dp_setup = make_setup(dev);
  train::DataParallel dp(env, *dp_setup.model);
  CHECK(dp.enable_sync_batch_norm(*dp_setup.model) > 0);
  auto dp_step = dp.make_step(*dp_setup.model, *dp_setup.opt, *dp_setup.scaler, 0.0);
  dp_step->run(amp::prepare_input(x_mine, dev), y_mine.to(dev));

  // Reference: one GPU, the whole batch, plain BN.
  Setup ref = make_setup(dev);
  optim::ClassifierStep ref_step(*ref.model, *ref.opt, *ref.scaler);
  ref_step.run(amp::prepare_input(x_all, dev), y_all.to(dev));
  cuda::synchronize();

  CHECK(dp_setup.scaler->scale_value() == 256.0);
  CHECK(ref.scaler->scale_value() == 256.0);
  // Gradients (f16, scaled by 256 in both) and the updated parameters and BN statistics.
  check_close_named(grads_of(*dp_setup.model), grads_of(*ref.model), 2e-2, "gradient");
  check_close_named(dp_setup.model->named_parameters(), ref.model->named_parameters(), 5e-3,
                    "parameter after the step");
  check_close_named(dp_setup.model->named_buffers(), ref.model->named_buffers(), 5e-3,
                    "buffer after the step");
  // The comparison above can fail: the parameters did move by more than its tolerance.
  {
    Setup fresh = make_setup(dev);
    double moved = 0;
    const auto now = dp_setup.model->named_parameters();
    const auto before = fresh.model->named_parameters();
    for (size_t i = 0; i < now.size(); ++i) {
      Tensor d = ref_check::to_cpu64(now[i].second) - ref_check::to_cpu64(before[i].second);
      moved = std::max(moved, ref_check::max_abs(d));
    }
    CHECK(moved > 1e-2);
  }

  // Overflow on rank 1 only: both ranks skip (parameters unchanged, scale halved, one skip).
  const auto before_skip = snapshot(*dp_setup.model);
  Tensor x_bad = x_mine.clone();
  if (env.rank == 1) x_bad.data<float>()[5] = std::numeric_limits<float>::infinity();
  dp_step->run(amp::prepare_input(x_bad, dev), y_mine.to(dev));
  cuda::synchronize();
  CHECK(dp_setup.scaler->scale_value() == 128.0);
  CHECK(dp_setup.scaler->skipped_steps().to(Device::cpu()).to(DType::i64).item<int64_t>() == 1);
  const auto after_skip = dp_setup.model->named_parameters();
  for (size_t i = 0; i < after_skip.size(); ++i) {
    CAPTURE(after_skip[i].first);
    CHECK(ref_check::to_cpu64(after_skip[i].second).to_vector<double>() ==
          ref_check::to_cpu64(before_skip[i].second).to_vector<double>());
  }
  cuda::synchronize();
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
