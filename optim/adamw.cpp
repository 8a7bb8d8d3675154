#include "optim/adamw.h"

#include <cmath>

#include "core/autograd.h"
#include "ops/ops.h"

namespace kiln::optim {

ParamGroup AdamWOptions::group(std::vector<Tensor> params) const {
  ParamGroup g;
  g.params = std::move(params);
  g.lr = lr;
  g.beta1 = beta1;
  g.beta2 = beta2;
  g.eps = eps;
  g.weight_decay = weight_decay;
  return g;
}

static std::vector<ParamGroup> checked(std::vector<ParamGroup> groups) {
  for (size_t i = 0; i < groups.size(); ++i) {
    const ParamGroup& g = groups[i];
    KILN_CHECK(g.beta1 >= 0.0 && g.beta1 < 1.0 && g.beta2 >= 0.0 && g.beta2 < 1.0, "AdamW: group ",
               i, " has betas (", g.beta1, ", ", g.beta2, "); both must be in [0, 1)");
    KILN_CHECK(g.eps >= 0.0, "AdamW: group ", i, " has eps ", g.eps, " < 0");
  }
  return groups;
}

AdamW::AdamW(std::vector<Tensor> params, const AdamWOptions& opts)
    : Optimizer(checked({opts.group(std::move(params))})) {}

AdamW::AdamW(std::vector<ParamGroup> groups) : Optimizer(checked(std::move(groups))) {}

void AdamW::step() {
  NoGradGuard no_grad;
  for_each_param_with_grad([&](const ParamGroup& group, const Tensor& p, size_t i) {
    const Tensor g = p.grad();
    ParamState& st = state(i);
    Tensor& m = st["exp_avg"];
    Tensor& v = st["exp_avg_sq"];
    Tensor& step = st["step"];
    if (!step.defined()) {
      step = zeros({}, DType::f64);
      m = zeros_like(p);
      v = zeros_like(p);
    }
    const double t = ++*step.data<double>();

    if (group.weight_decay != 0.0) p.mul_(1.0 - group.lr * group.weight_decay);
    m.mul_(group.beta1).add_(g, 1.0 - group.beta1);
    v.mul_(group.beta2).add_(F::mul(g, g), 1.0 - group.beta2);
    const double bias_correction1 = 1.0 - std::pow(group.beta1, t);
    const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(group.beta2, t));
    Tensor denom = F::add(F::mul(F::sqrt(v), 1.0 / bias_correction2_sqrt), group.eps);
    p.add_(F::div(m, denom), -group.lr / bias_correction1);
  });
}

}  // namespace kiln::optim
