#pragma once
// Fused optimizers over flat arenas: FusedSGD and FusedAdamW, the same updates as optim::SGD
// and optim::AdamW (optim/sgd.h, optim/adamw.h) done by ONE kernel launch over all parameters.
//
// At construction the optimizer builds, on the parameters' device:
//   master  f32 arena: FP32 master copy of every parameter (initialised from the parameter);
//   state   f32 arenas: SGD's momentum buffers, AdamW's exp_avg and exp_avg_sq (zeros);
//   grads   byte arena: parameter i's gradient in the parameter's own dtype (f16 for the FP16
//           weights of mixed precision, f32 for BN parameters and on the CPU). Each
//           parameter's .grad is set to a view of its slot (same shape and strides as the
//           parameter), so backward accumulates (`+=`) straight into the arena;
//   a device table of (offsets, numel, group, parameter pointer) per parameter, the per-group
//   options, an f64 learning rate per group and an i32 step counter.
// Each parameter stays its own tensor (the model's weights): step() writes it from the updated
// master in the same kernel (rounded to its dtype).
//
// Differences from optim::SGD/AdamW, all deliberate:
//  * Gradients are always defined (a view of the arena): zero_grad() is one fill of the whole
//    arena and never sets them to none; a parameter that got no gradient is still updated with
//    a zero gradient (weight decay, momentum) — as PyTorch with set_to_none=False.
//  * One step counter for all parameters (AdamW's bias correction, SGD's first momentum step);
//    a step skipped by the loss scaler does not count.
//  * The gradient arena is read-only to the optimizer: unscaling and clipping are applied
//    inside the step kernel as a multiplier (1/scale · clip_coef) read from device memory, so
//    the values in .grad stay scaled after DynamicLossScaler::unscale_.
// Construct the optimizer after the model is on its device and precision (optim/amp.h), and
// do not move or convert the model afterwards (step() checks that parameters and gradients
// still are where the table points, and fails with a clear message otherwise).
//
// The host never waits for the device: lr is copied H2D from pinned memory before each step
// (eager mode) on current_stream(); step counter, skip flag and multipliers stay on the device.
#include <memory>
#include <string>
#include <vector>

#include "optim/adamw.h"
#include "core/fused_optim.h"
#include "optim/sgd.h"

namespace kiln::optim {

class DynamicLossScaler;
class HostStager;

class FusedOptimizer : public Optimizer {
 public:
  ~FusedOptimizer() override;

  // Updates every parameter; with a scaler, runs its unscale_ first unless already done this
  // step and skips the update on the device when it found inf/NaN (scaler.update() is then up
  // to the caller, as with PyTorch's GradScaler; DynamicLossScaler::step does both).
  void step() override { step(nullptr); }
  void step(DynamicLossScaler* scaler);
  // One fill of the gradient arena with zeros; set_to_none is ignored (see above).
  void zero_grad(bool set_to_none = true) override;

  Device device() const { return device_; }
  size_t num_params() const { return slots_.size(); }
  const Tensor& master_arena() const { return master_; }  // f32
  const Tensor& grad_arena() const { return grads_; }     // u8 bytes
  // Views shaped and strided like parameter i (numbered across groups in order).
  Tensor master(size_t i) const;
  Tensor grad(size_t i) const;
  Tensor state(size_t arena, size_t i) const;  // arena 0: momentum / exp_avg, 1: exp_avg_sq
  // Successful steps taken (i32 scalar, on the device).
  const Tensor& step_count() const { return step_count_; }

  // Checkpointable state (optim/checkpoint.h): "group.<g>.lr" (0-d f64), "step" (the i32
  // counter), and per parameter i "state.<i>.master" (FP32 master) and "state.<i>.<key>" for
  // each state arena (FusedSGD: momentum_buffer; FusedAdamW: exp_avg, exp_avg_sq). Tensors are
  // live views of the arenas (no copy). load_state_dict checks every key, shape and element
  // count before copying anything in (a load that throws changes nothing); every key must be
  // present and no other key may be.
  std::map<std::string, Tensor> state_dict() const override;
  void load_state_dict(const std::map<std::string, Tensor>& dict) override;

  // ---- used by DynamicLossScaler and clip_grad_norm_ (optim/amp.h) ----
  // One pass over the gradient arena: *found_inf |= non-finite, per-chunk Σg² kept for the norm.
  void check_grads(const Tensor& found_inf);
  // The multiplier and skip flag the next step applies: scale (1-element f32, grads are
  // divided by it) and found_inf; remembered until the step. Set by DynamicLossScaler::unscale_.
  void set_unscale(const Tensor& scale, const Tensor& found_inf);
  bool unscaled() const { return pending_.scale != nullptr; }
  // Total gradient norm (after unscaling) and clip coefficient into device memory; returns the
  // norm (f32 0-d, on the device). Runs check_grads itself unless unscale_ already did.
  Tensor clip_grad_norm(double max_norm);

  // For a captured step (CUDA graph): copies the groups' current lr into the device array the
  // captured kernels read, on the current stream (ordered before a replay launched after it on
  // that stream, and after the replays before it). Call before each replay; a replay without it
  // uses the lr staged (or uploaded by an eager step) last.
  void stage_lr();

  // Chunk table size (for tests and the graph executor's accounting).
  int64_t num_chunks() const { return int64_t(chunks_.size()); }

 protected:
  explicit FusedOptimizer(std::vector<ParamGroup> groups);
  virtual void launch(const fused::StepArgs& a) = 0;
  // Options of group g as the kernels see them.
  virtual fused::GroupOptions group_options(const ParamGroup& g) const = 0;
  virtual int num_state_arenas() const = 0;
  // The state_dict key of state arena k ("momentum_buffer", "exp_avg", ...).
  virtual std::string state_key(int arena) const = 0;
  // Builds arenas and tables; called by the derived constructor (it needs the virtuals above).
  void build();

 private:
  void validate_bindings() const;
  void upload_lr();
  void upload_group_options();
  fused::Table table() const;

  Device device_;
  int num_state_ = 0;
  std::vector<Tensor> params_;
  std::vector<fused::Slot> slots_;
  std::vector<fused::Chunk> chunks_;
  std::vector<fused::GroupOptions> group_opts_;  // last uploaded
  Tensor master_, grads_, state_[2];
  Tensor table_;        // u8 on the device: slots, chunks, group options
  size_t chunk_bytes_off_ = 0, group_bytes_off_ = 0;
  Tensor lr_;           // f64 (G)
  Tensor step_count_;   // i32 (1)
  Tensor partials_;     // f32 (num_chunks): Σg² per chunk
  Tensor norm_;         // f32 (3): total norm, clip coefficient, found-inf scratch
  fused::GradScaling pending_;
  bool norm_ready_ = false;
  Tensor pending_scale_, pending_found_inf_;  // keep the scaler's tensors alive
  std::unique_ptr<HostStager> ring_;  // CUDA: stages lr_ (optim/host_stager.h)
};

// torch.optim.SGD's update (optim/sgd.h) over the arenas.
class FusedSGD : public FusedOptimizer {
 public:
  FusedSGD(std::vector<Tensor> params, const SGDOptions& opts);
  explicit FusedSGD(std::vector<ParamGroup> groups);
  std::string name() const override { return "FusedSGD"; }

 protected:
  void launch(const fused::StepArgs& a) override;
  fused::GroupOptions group_options(const ParamGroup& g) const override;
  int num_state_arenas() const override;
  std::string state_key(int) const override { return "momentum_buffer"; }
};

// torch.optim.AdamW's update (optim/adamw.h) over the arenas.
class FusedAdamW : public FusedOptimizer {
 public:
  FusedAdamW(std::vector<Tensor> params, const AdamWOptions& opts);
  explicit FusedAdamW(std::vector<ParamGroup> groups);
  std::string name() const override { return "FusedAdamW"; }

 protected:
  void launch(const fused::StepArgs& a) override;
  fused::GroupOptions group_options(const ParamGroup& g) const override;
  int num_state_arenas() const override;
  std::string state_key(int arena) const override { return arena == 0 ? "exp_avg" : "exp_avg_sq"; }
};

}  // namespace kiln::optim
