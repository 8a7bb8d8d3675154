#pragma once
// Optimizer base: parameter groups with per-group hyper-parameters, per-parameter state and
// its export as named tensors (for checkpoints), as in torch.optim.
//
// Every group carries every option; an optimizer reads the ones it knows (SGD: lr, momentum,
// dampening, nesterov, weight_decay; AdamW: lr, beta1, beta2, eps, weight_decay).
// initial_lr is the group's lr at construction; LR schedules (optim/schedule.h) set
// lr = initial_lr * factor(t).
//
// step() updates every parameter that has a gradient, in place under NoGradGuard;
// parameters without a gradient (undefined .grad) are skipped and their state is untouched.
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "models/module.h"
#include "core/tensor.h"

namespace kiln::optim {

struct ParamGroup {
  std::vector<Tensor> params;
  double lr = 1e-3;
  double weight_decay = 0.0;
  // SGD
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  // AdamW
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  // Set by the optimizer at construction when left at 0.
  double initial_lr = 0.0;
};

// Splits a module's parameters into {decay, no_decay}: parameters with dim <= 1 (biases, BN
// weights and biases) and those a module names in no_weight_decay() (a ViT's class token and
// position embedding) get weight_decay 0. Both groups copy `proto`'s other options; an empty
// group is dropped.
std::vector<ParamGroup> split_weight_decay(const nn::Module& module, const ParamGroup& proto);

// State of one parameter: named tensors ("momentum_buffer", "exp_avg", "step", ...).
using ParamState = std::map<std::string, Tensor>;

class Optimizer {
 public:
  explicit Optimizer(std::vector<ParamGroup> groups);
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  virtual void step() = 0;
  virtual std::string name() const = 0;
  // set_to_none (PyTorch's default): grads become undefined; otherwise they are zeroed.
  // Virtual: fused optimizers (optim/fused.h) keep gradients in an arena and always zero it.
  virtual void zero_grad(bool set_to_none = true);

  std::vector<ParamGroup> param_groups;

  // Flat, checkpointable view: "state.<i>.<key>" for parameter i (numbered across groups in
  // order, as PyTorch does) and "group.<g>.lr" (0-d f64). Tensors are the live state (no copy).
  // Virtual: fused optimizers (optim/fused.h) keep their state in arenas.
  virtual std::map<std::string, Tensor> state_dict() const;
  // Restores from state_dict()'s form. Shapes must match; values are copied onto each
  // parameter's device and dtype ("step" becomes a host f64 scalar). Missing keys leave the
  // state empty (a parameter that never had a gradient).
  virtual void load_state_dict(const std::map<std::string, Tensor>& dict);

 protected:
  // State of parameter i (numbered as above); created empty on first access.
  ParamState& state(size_t i);
  // Visits every (group, param, global index) whose param has a defined gradient.
  template <typename Fn>
  void for_each_param_with_grad(Fn&& fn) {
    size_t i = 0;
    for (ParamGroup& g : param_groups)
      for (const Tensor& p : g.params) {
        if (p.grad().defined()) fn(g, p, i);
        ++i;
      }
  }

 private:
  std::unordered_map<size_t, ParamState> state_;
};

}  // namespace kiln::optim
