#pragma once
// kiln-train's data parallelism (tools/train/trainer.h): one process per GPU, NCCL underneath
// (cuda/nccl.h). In builds without NCCL, data_parallel_available() is false and constructing a
// DataParallel throws kiln::Error.
#include <memory>
#include <vector>

#include "tools/train/dist_env.h"
#include "models/module.h"
#include "optim/amp.h"

#ifdef KILN_WITH_NCCL
#include "cuda/nccl.h"
#include "tools/train/rendezvous.h"
#endif

namespace kiln::train {

bool data_parallel_available();

#ifdef KILN_WITH_NCCL
// Rank 0 makes the ncclUniqueId and broadcasts it through `rv`; every rank then joins the
// communicator of rv.world_size() ranks on `device` (blocking until all have joined).
std::unique_ptr<cuda::Communicator> join_communicator(Rendezvous& rv, int device);
#endif

// A training step with device-side metrics, as optim::ClassifierStep.
class StepRunner {
 public:
  virtual ~StepRunner() = default;
  virtual void run(const Tensor& x, const Tensor& y) = 0;
  virtual const Tensor& loss_sum() const = 0;
  virtual const Tensor& correct_sum() const = 0;
  virtual void reset_metrics() = 0;
};

class DataParallel {
 public:
  // Rendezvous with the other ranks (MASTER_ADDR:env.rdzv_port), an NCCL communicator on GPU
  // env.local_rank (the current device), then every rank's `model` (already prepared on that
  // GPU) gets rank 0's parameters and buffers.
  DataParallel(const DistEnv& env, nn::Module& model);
  ~DataParallel();

  // ClassifierStep's work plus: gradients averaged across ranks in buckets overlapping backward
  // (cuda::GradBucketer), and the loss scaler's found-inf flag max-reduced before the step, so
  // every rank skips (and backs off) together; max_grad_norm > 0 clips the averaged gradients.
  // Capturable in a CUDA graph.
  std::unique_ptr<StepRunner> make_step(nn::Module& model, optim::FusedOptimizer& opt,
                                        optim::DynamicLossScaler& scaler, double label_smoothing,
                                        double max_grad_norm = 0.0);
  // SyncBN: every BatchNorm2d of `model` normalises training batches with the statistics of
  // all ranks' batches, reduced by an NCCL all-reduce (Sum) on the current stream. Returns how
  // many BatchNorm2d it set. This DataParallel must outlive the model's training steps.
  int64_t enable_sync_batch_norm(nn::Module& model);
  // Rank 0's BatchNorm statistics (and other buffers) to every rank, before evaluating.
  void sync_buffers(nn::Module& model);
  // values = element-wise sum over ranks (a blocking all-reduce; for per-epoch counts).
  void sum_host(std::vector<double>& values);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::train
