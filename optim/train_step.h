#pragma once
// One supervised training step for an image classifier, done entirely on the device so that it
// can be run eagerly or captured once and replayed as a CUDA graph (cuda/graph.h):
//
//   zero_grad (one memset) -> logits = model(x) -> loss = cross_entropy(logits, y)
//   -> scaler.scale(loss).backward() [-> unscale_, clip_grad_norm_] -> scaler.step(opt) (skip on
//   inf/NaN) -> scaler.update()
//   -> loss_sum += loss, correct_sum += #(argmax(logits) == y)      (device accumulators)
//
// x and y are the caller's static input tensors (fill them before each run); the accumulated
// loss and top-1 count are device tensors read asynchronously (amp::AsyncScalars) when the
// caller wants to log, then reset with reset_metrics(). Nothing in run() reads device memory on
// the host. On the CPU the same code runs in FP32 (the scaler may be disabled).
#include <functional>

#include "models/module.h"
#include "core/tensor.h"
#include "optim/amp.h"
#include "optim/fused.h"

namespace kiln::optim {

// Whether run()'s backward writes the .grads zero_grad has just zeroed instead of adding to them
// (autograd::backward's `zeroed`: the fused optimizer's gradient arena). The same sums either
// way; on by default, KILN_GRAD_OVERWRITE=0 or set_grad_overwrite_enabled(false) for A/B.
bool grad_overwrite_enabled();
void set_grad_overwrite_enabled(bool on);

class ClassifierStep {
 public:
  // `model`, `opt` and `scaler` must outlive the step. x: (N, C, H, W) as amp::prepare_input
  // makes it; y: i64 (N) on the same device.
  // clip_grad_norm > 0: after backward, the scaler's unscale_ and clip_grad_norm_ (the
  // gradients' total L2 norm capped at it, torch.nn.utils.clip_grad_norm_), before the step.
  ClassifierStep(nn::Module& model, FusedOptimizer& opt, DynamicLossScaler& scaler,
                 double label_smoothing = 0.0, double clip_grad_norm = 0.0);

  // One step on the current stream.
  void run(const Tensor& x, const Tensor& y);
  // Called in run() after the optimizer's step and before the scaler's update: a second update
  // rule over some of the parameters (optim::Muon over a group of `opt`). Device work only, as
  // the rest of run().
  void set_after_step(std::function<void()> f) { after_step_ = std::move(f); }
  // Device accumulators since the last reset: Σ loss·N (f64) and Σ correct (f32), 0-d each. The
  // caller counts samples on the host (a replayed graph runs no host code).
  const Tensor& loss_sum() const { return loss_sum_; }
  const Tensor& correct_sum() const { return correct_sum_; }
  // Zeroes the accumulators (a device fill on the current stream).
  void reset_metrics();

 private:
  nn::Module& model_;
  FusedOptimizer& opt_;
  DynamicLossScaler& scaler_;
  double label_smoothing_, max_grad_norm_;
  Tensor loss_sum_, correct_sum_;
  std::function<void()> after_step_;
};

}  // namespace kiln::optim
