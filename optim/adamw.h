#pragma once
// AdamW (Loshchilov & Hutter) — torch.optim.AdamW's update, per parameter at step t = 1, 2, ...:
//   p   *= 1 - lr·weight_decay                      (decoupled decay)
//   m    = beta1·m + (1 - beta1)·g
//   v    = beta2·v + (1 - beta2)·g²
//   p   -= (lr / (1 - beta1^t)) · m / (√v / √(1 - beta2^t) + eps)
// State per parameter: "exp_avg" (m), "exp_avg_sq" (v), "step" (host f64 scalar).
#include "optim/optimizer.h"

namespace kiln::optim {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;  // PyTorch's AdamW default
  ParamGroup group(std::vector<Tensor> params = {}) const;
};

class AdamW : public Optimizer {
 public:
  AdamW(std::vector<Tensor> params, const AdamWOptions& opts);
  explicit AdamW(std::vector<ParamGroup> groups);
  void step() override;
  std::string name() const override { return "AdamW"; }
};

}  // namespace kiln::optim
