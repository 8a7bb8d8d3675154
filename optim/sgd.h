#pragma once
// SGD with momentum, dampening, Nesterov and L2 weight decay — torch.optim.SGD's update:
//   g = grad + weight_decay·p
//   buf = g                                   (first step of a parameter)
//   buf = momentum·buf + (1 - dampening)·g    (later steps)
//   g = g + momentum·buf  (nesterov)   or   g = buf
//   p -= lr·g
// State per parameter: "momentum_buffer" (only when momentum != 0).
#include "optim/optimizer.h"

namespace kiln::optim {

struct SGDOptions {
  double lr = 0.1;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  // A group holding `params` with these options.
  ParamGroup group(std::vector<Tensor> params = {}) const;
};

class SGD : public Optimizer {
 public:
  SGD(std::vector<Tensor> params, const SGDOptions& opts);
  // Each group keeps its own options.
  explicit SGD(std::vector<ParamGroup> groups);
  void step() override;
  std::string name() const override { return "SGD"; }
};

}  // namespace kiln::optim
