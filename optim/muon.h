#pragma once
// Muon (Jordan et al., 2024): momentum SGD whose update for each weight matrix is first
// orthogonalised by a Newton–Schulz iteration, for the weights of convolutions and linear layers
// (everything else stays with an ordinary optimizer). Per parameter W (rows = size(0), the rest
// flattened), at each step with gradient g:
//   b = momentum·b + g;   d = nesterov ? g + momentum·b : b
//   X = d / ‖d‖_F, transposed when rows > columns; ns_steps times: A = X·Xᵀ, X = a·X + (b·A +
//   c·A·A)·X with (a, b, c) = (3.4445, -4.7750, 2.0315) (a quintic that pushes every singular
//   value of X towards 1, not exactly to it); transposed back
//   [normalize_weights: W = W · sqrt(rows) / ‖W‖_F]
//   W = W - lr · X
// The update's scale does not depend on the gradient's, so lr is in units of the weights.
//
// Muon works on top of a fused optimizer (optim/fused.h) and takes over one of its parameter
// groups: construct that group with lr 0 and weight decay 0 (the fused step then leaves those
// parameters as they are), and call step() after the fused step and before the loss scaler's
// update (ClassifierStep::set_after_step does). Muon reads the group's gradients from the
// fused optimizer's arena (unscaled by the scaler's scale; a step the scaler skips changes
// nothing here either), updates the fused optimizer's f32 master weights and writes the
// parameters from them, so checkpoints and weight averages of the fused optimizer see Muon's
// weights. Gradient clipping does not apply to Muon's group (its update is normalised anyway).
// Everything runs on the device, on the current stream, without host synchronisation: a step
// can be captured in a CUDA graph, with stage_lr() before each replay as for the fused optimizer.
// The iteration runs in ns_dtype: f32 by default (on the GPU it equals the CPU to 1e-5); bf16
// (the published recipe's, kiln-speedrun --recipe muon) and f16 are options on CUDA, checked op
// by op against f32 and as a whole against the f32 optimizer (gpu_test_muon).
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "optim/fused.h"

namespace kiln::optim {

class DynamicLossScaler;
class HostStager;

struct MuonOptions {
  double lr = 0.02;
  double momentum = 0.95;
  bool nesterov = true;
  int ns_steps = 5;
  bool normalize_weights = false;
  // The Newton–Schulz iteration's dtype: f32, or bf16 / f16 on CUDA (see above).
  DType ns_dtype = DType::f32;
};

class Muon {
 public:
  // `group`: the index of base's parameter group Muon takes over (lr 0 and weight_decay 0 there;
  // every parameter at least 2-D).
  Muon(FusedOptimizer& base, size_t group, const MuonOptions& opts);
  ~Muon();

  // One update of the group's parameters from their gradients in base's arena. With `scaler`
  // (enabled): the gradients are divided by its scale, and nothing changes when its found_inf is
  // set — call after scaler.step(base) and before scaler.update().
  void step(const DynamicLossScaler* scaler = nullptr);
  // The learning rate the next step uses (a schedule sets it each step). On CUDA it reaches the
  // device through stage_lr(), which eager steps call themselves; before each replay of a
  // captured step, call stage_lr().
  double lr = 0.02;
  void stage_lr();

  // Momentum buffers back to zero (a fresh run on the same tensors).
  void reset_state();
  // "muon.<i>.momentum_buffer" for the group's parameter i (live views); load copies in, every
  // key required.
  std::map<std::string, Tensor> state_dict() const;
  void load_state_dict(const std::map<std::string, Tensor>& dict);

  const MuonOptions& options() const { return opts_; }
  size_t num_params() const { return index_.size(); }

  // The orthogonalised direction for one matrix d (rows, cols), as step() computes it: X in
  // `dtype` after `steps` iterations (for tests and for callers with their own update rule).
  static Tensor newton_schulz(const Tensor& d, int steps, DType dtype);

 private:
  FusedOptimizer& base_;
  MuonOptions opts_;
  std::vector<size_t> index_;    // base's parameter numbers of the group
  std::vector<Tensor> params_;   // the group's parameters
  std::vector<Tensor> momentum_;  // f32, shaped like each parameter
  Tensor lr_;                     // f64 (1) on the device
  Tensor zero_;                   // f32 (1): a skipped step's gradient
  std::unique_ptr<HostStager> stager_;
  bool capturing() const;
};

}  // namespace kiln::optim
