#include "optim/sgd.h"

#include "core/autograd.h"
#include "ops/ops.h"

namespace kiln::optim {

ParamGroup SGDOptions::group(std::vector<Tensor> params) const {
  ParamGroup g;
  g.params = std::move(params);
  g.lr = lr;
  g.momentum = momentum;
  g.dampening = dampening;
  g.weight_decay = weight_decay;
  g.nesterov = nesterov;
  return g;
}

static std::vector<ParamGroup> checked(std::vector<ParamGroup> groups) {
  for (size_t i = 0; i < groups.size(); ++i) {
    const ParamGroup& g = groups[i];
    KILN_CHECK(g.momentum >= 0.0, "SGD: group ", i, " has momentum ", g.momentum, " < 0");
    // Nesterov needs a momentum buffer that is not damped (PyTorch refuses the same).
    KILN_CHECK(!g.nesterov || (g.momentum > 0.0 && g.dampening == 0.0), "SGD: group ", i,
               ": nesterov requires momentum > 0 and dampening 0 (got momentum ", g.momentum,
               ", dampening ", g.dampening, ")");
  }
  return groups;
}

SGD::SGD(std::vector<Tensor> params, const SGDOptions& opts)
    : Optimizer(checked({opts.group(std::move(params))})) {}

SGD::SGD(std::vector<ParamGroup> groups) : Optimizer(checked(std::move(groups))) {}

void SGD::step() {
  NoGradGuard no_grad;
  for_each_param_with_grad([&](const ParamGroup& group, const Tensor& p, size_t i) {
    Tensor g = p.grad();
    if (group.weight_decay != 0.0) g = F::add(g, p, group.weight_decay);
    if (group.momentum != 0.0) {
      Tensor& buf = state(i)["momentum_buffer"];
      if (!buf.defined()) {
        buf = g.clone();
      } else {
        buf.mul_(group.momentum).add_(g, 1.0 - group.dampening);
      }
      g = group.nesterov ? F::add(g, buf, group.momentum) : buf;
    }
    p.add_(g, -group.lr);
  });
}

}  // namespace kiln::optim
