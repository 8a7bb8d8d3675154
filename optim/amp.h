#pragma once
// Mixed precision — "FP16 storage, FP32 master weights" — and the dynamic loss scaler.
//
// A training step, the same code on the CPU (FP32, scaler optional) and the GPU:
//
//   amp::prepare_model(model, device);                 // once, before building the optimizer
//   optim::FusedSGD opt(optim::split_weight_decay(model, proto));
//   optim::DynamicLossScaler scaler(device);
//   for (...) {
//     opt.zero_grad();                                   // one memset of the gradient arena
//     Tensor loss = F::cross_entropy(model(amp::prepare_input(x, device)), y);
//     scaler.scale(loss).backward();                     // grads (scaled) land in the arena
//     scaler.unscale_(opt);                              // optional, before clipping
//     optim::clip_grad_norm_(opt, 1.0);                  // optional
//     scaler.step(opt);                                  // skip-or-update on the device
//     scaler.update();                                   // <<<1,1>>>: scale, growth counter
//   }
//
// Nothing here reads device memory on the host: scale, growth counter, found-inf flag, skip
// count, step counter and learning rates live in device tensors (CPU tensors on the CPU), so
// a whole step can be captured in a CUDA graph. Read them for logging with AsyncScalars.
#include <map>
#include <string>
#include <vector>

#include "models/module.h"
#include "optim/fused.h"

namespace kiln::amp {

// Mixed16: f16 storage and compute with f32 master weights and the loss scaler (the default);
// MixedBF16: the same in bf16, whose range needs no loss scaling.
enum class Precision { FP32, Mixed16, MixedBF16 };
// f32, f16 or bf16: the dtype the model's 16-bit parameters and activations take.
DType compute_dtype(Precision p);
// Mixed16 on CUDA, FP32 on the CPU (whose backend computes in f32/f64).
Precision default_precision(Device device);

// Moves `model` to `device` and sets its dtypes, in place (handles stay valid; uses
// nn::Module::convert). Mixed16/MixedBF16 (CUDA only): the parameters each module names in
// Module::half_parameters (Conv2d and Linear weights and biases, attention projections, ...) in
// compute_dtype, 4-D conv weights channels-last; normalisation parameters, running statistics
// and every other floating tensor f32; integer buffers kept. FP32: every floating tensor f32,
// contiguous.
void prepare_model(nn::Module& model, Device device, Precision precision);
inline void prepare_model(nn::Module& model, Device device) {
  prepare_model(model, device, default_precision(device));
}
// An input batch as the prepared model wants it: on `device`, compute_dtype channels-last (4-D)
// for the mixed precisions, f32 otherwise. Not differentiable (inputs are data).
Tensor prepare_input(const Tensor& x, Device device, Precision precision);
inline Tensor prepare_input(const Tensor& x, Device device) {
  return prepare_input(x, device, default_precision(device));
}

// Copies a few one-element tensors (loss, scale, skip count, ...) to pinned host memory on the
// current stream and records an event; the values are read later, without stalling the step
// pipeline. On the CPU the values are read at record(). Not usable while capturing a graph.
class AsyncScalars {
 public:
  AsyncScalars();
  ~AsyncScalars();
  AsyncScalars(const AsyncScalars&) = delete;
  AsyncScalars& operator=(const AsyncScalars&) = delete;
  // Sources: one element each, any dtype, all on one device. Replaces any earlier record.
  void record(const std::vector<Tensor>& sources);
  bool ready() const;  // the copies have landed (true on the CPU)
  // Waits for this record's copies only (an event, not the device) and returns the values.
  std::vector<double> values();

 private:
  struct Impl;
  Impl* impl_;
};

}  // namespace kiln::amp

namespace kiln::optim {

struct LossScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int growth_interval = 2000;  // consecutive clean steps before growing
  bool enabled = true;         // false: scale() is the identity, step() a plain step
};

// PyTorch GradScaler semantics over a FusedOptimizer. State on `device`: scale (f32),
// growth tracker (i32), found_inf (f32, 1 when the last unscale_ saw inf/NaN), skipped (i32,
// steps skipped so far). The scale never becomes inf: a growth that would overflow f32 is
// not applied.
class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(Device device, LossScalerOptions opts = {});

  bool enabled() const { return opts_.enabled; }
  const LossScalerOptions& options() const { return opts_; }
  // loss · scale (differentiable, on the device; loss must be f32 on the scaler's device).
  Tensor scale(const Tensor& loss) const;
  // One pass over opt's gradient arena: found_inf = any inf/NaN, per-chunk Σg² kept for
  // clip_grad_norm_, and opt's next step divides gradients by the scale (the arena keeps the
  // scaled values). At most once per step.
  void unscale_(FusedOptimizer& opt);
  // unscale_ (unless done) and opt.step, which skips on the device when found_inf is set.
  void step(FusedOptimizer& opt);
  // Backoff on overflow, growth after growth_interval clean steps (<<<1,1>>> on CUDA). Needs an
  // unscale_ since the last update.
  void update();

  const Tensor& scale_tensor() const { return scale_; }  // f32 (1)
  const Tensor& growth_tracker() const { return growth_; }  // i32 (1)
  const Tensor& found_inf() const { return found_inf_; }    // f32 (1)
  const Tensor& skipped_steps() const { return skipped_; }  // i32 (1)
  // Synchronising read of the scale (tests, rare logging; prefer AsyncScalars).
  double scale_value() const;

  // "scale", "growth_tracker", "skipped" (live tensors) for checkpoints; load copies in.
  std::map<std::string, Tensor> state_dict() const;
  void load_state_dict(const std::map<std::string, Tensor>& dict);

 private:
  fused::ScalerArgs args();

  Device device_;
  LossScalerOptions opts_;
  Tensor scale_, growth_, found_inf_, skipped_;
  bool checked_ = false;  // unscale_ since the last update
};

// torch.nn.utils.clip_grad_norm_ over opt's gradients (unscaled when unscale_ ran this step):
// the total L2 norm and the clip coefficient min(1, max_norm / (norm + 1e-6)) are computed into
// device memory and the next step multiplies gradients by the coefficient. Returns the norm
// (f32 0-d on the device) without synchronising.
Tensor clip_grad_norm_(FusedOptimizer& opt, double max_norm);

}  // namespace kiln::optim
