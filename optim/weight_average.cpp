#include "optim/weight_average.h"

#include "core/autograd.h"
#include "core/error.h"

namespace kiln::optim {

WeightAverage::WeightAverage(nn::Module& model, FusedOptimizer* opt) {
  NoGradGuard no_grad;
  auto track = [&](const std::string& name, const Tensor& t) {
    if (!is_floating(t.dtype())) return;
    Entry e{name, t, Tensor(), Tensor()};
    if (opt) {  // the optimizer numbers its parameters across groups, in order
      size_t i = 0;
      for (const ParamGroup& g : opt->param_groups)
        for (const Tensor& p : g.params) {
          if (p.is_same(t)) e.master = opt->master(i);
          ++i;
        }
    }
    e.avg = e.current().to(DType::f32).clone();
    entries_.push_back(std::move(e));
  };
  for (const auto& [name, p] : model.named_parameters()) track(name, p);
  for (const auto& [name, b] : model.named_buffers()) track(name, b);
}

void WeightAverage::update(double decay) {
  KILN_CHECK(decay >= 0.0 && decay <= 1.0, "WeightAverage::update: decay must be in [0, 1], got ",
             decay);
  NoGradGuard no_grad;
  for (Entry& e : entries_) {
    e.avg.mul_(decay);
    e.avg.add_(e.current().dtype() == DType::f32 ? e.current() : e.current().to(DType::f32),
               1.0 - decay);
  }
}

void WeightAverage::pull() {
  NoGradGuard no_grad;
  for (Entry& e : entries_) {
    if (e.master.defined()) e.master.copy_(e.avg);
    e.target.copy_(e.avg);
  }
}

std::vector<std::pair<std::string, Tensor>> WeightAverage::averages() const {
  std::vector<std::pair<std::string, Tensor>> out;
  out.reserve(entries_.size());
  for (const Entry& e : entries_) out.emplace_back(e.name, e.avg);
  return out;
}

}  // namespace kiln::optim
