#include "optim/optimizer.h"

#include <algorithm>
#include <set>

#include "core/autograd.h"

namespace kiln::optim {

std::vector<ParamGroup> split_weight_decay(const nn::Module& module, const ParamGroup& proto) {
  ParamGroup decay = proto, no_decay = proto;
  decay.params.clear();
  no_decay.params.clear();
  no_decay.weight_decay = 0.0;
  std::vector<Tensor> exempt;  // what the modules name (Module::no_weight_decay)
  for (const auto& [prefix, m] : module.named_modules())
    for (const std::string& n : m->no_weight_decay()) {
      const auto& own = m->own_parameters();
      auto it = std::find_if(own.begin(), own.end(), [&](const auto& p) { return p.first == n; });
      KILN_CHECK(it != own.end(), "split_weight_decay: ", m->type_name(), " '", prefix,
                 "' names no parameter '", n, "' among its own");
      exempt.push_back(it->second);
    }
  auto is_exempt = [&](const Tensor& p) {
    return std::any_of(exempt.begin(), exempt.end(), [&](const Tensor& e) { return e.is_same(p); });
  };
  for (const Tensor& p : module.parameters())
    (p.dim() <= 1 || is_exempt(p) ? no_decay : decay).params.push_back(p);
  std::vector<ParamGroup> out;
  if (!decay.params.empty()) out.push_back(std::move(decay));
  if (!no_decay.params.empty()) out.push_back(std::move(no_decay));
  return out;
}

Optimizer::Optimizer(std::vector<ParamGroup> groups) : param_groups(std::move(groups)) {
  KILN_CHECK(!param_groups.empty(), "optimizer: no parameter groups");
  std::set<const TensorImpl*> seen;
  for (size_t g = 0; g < param_groups.size(); ++g) {
    ParamGroup& group = param_groups[g];
    KILN_CHECK(group.lr >= 0.0 && group.weight_decay >= 0.0, "optimizer: group ", g,
               " has lr ", group.lr, " and weight_decay ", group.weight_decay,
               "; both must be >= 0");
    if (group.initial_lr == 0.0) group.initial_lr = group.lr;
    for (const Tensor& p : group.params) {
      KILN_CHECK(p.defined() && p.is_leaf() && p.requires_grad() && is_floating(p.dtype()),
                 "optimizer: group ", g, " holds a tensor that is not a floating leaf requiring "
                 "grad", p.defined() ? std::string(": ") + p.desc() : std::string());
      KILN_CHECK(seen.insert(p.impl_ptr().get()).second, "optimizer: parameter ", p.desc(),
                 " appears in more than one place");
    }
  }
}

void Optimizer::zero_grad(bool set_to_none) {
  for (const ParamGroup& g : param_groups)
    for (const Tensor& p : g.params) {
      Tensor grad = p.grad();
      if (!grad.defined()) continue;
      if (set_to_none) p.set_grad(Tensor());
      else grad.zero_();
    }
}

ParamState& Optimizer::state(size_t i) { return state_[i]; }

std::map<std::string, Tensor> Optimizer::state_dict() const {
  std::map<std::string, Tensor> out;
  for (const auto& [i, st] : state_)
    for (const auto& [key, t] : st)
      if (t.defined()) out["state." + std::to_string(i) + "." + key] = t;
  for (size_t g = 0; g < param_groups.size(); ++g)
    out["group." + std::to_string(g) + ".lr"] = full({}, param_groups[g].lr, DType::f64);
  return out;
}

void Optimizer::load_state_dict(const std::map<std::string, Tensor>& dict) {
  std::vector<Tensor> params;
  for (const ParamGroup& g : param_groups)
    for (const Tensor& p : g.params) params.push_back(p);
  NoGradGuard no_grad;
  std::unordered_map<size_t, ParamState> loaded;
  for (const auto& [name, t] : dict) {
    if (name.rfind("group.", 0) == 0) {
      size_t dot = name.find('.', 6);
      KILN_CHECK(dot != std::string::npos && name.substr(dot) == ".lr",
                 "optimizer load_state_dict: unexpected key '", name, "'");
      size_t g = std::stoul(name.substr(6, dot - 6));
      KILN_CHECK(g < param_groups.size(), "optimizer load_state_dict: '", name, "' but only ",
                 param_groups.size(), " groups");
      param_groups[g].lr = t.item();
      continue;
    }
    KILN_CHECK(name.rfind("state.", 0) == 0, "optimizer load_state_dict: unexpected key '", name,
               "'");
    size_t dot = name.find('.', 6);
    KILN_CHECK(dot != std::string::npos, "optimizer load_state_dict: malformed key '", name, "'");
    size_t i = std::stoul(name.substr(6, dot - 6));
    std::string key = name.substr(dot + 1);
    KILN_CHECK(i < params.size(), "optimizer load_state_dict: '", name, "' but only ",
               params.size(), " parameters");
    const Tensor& p = params[i];
    Tensor copy;
    if (key == "step") {  // the step counter is a host f64 scalar
      KILN_CHECK(t.numel() == 1, "optimizer load_state_dict: '", name, "' must be a scalar");
      copy = full({}, t.item(), DType::f64);
    } else {
      KILN_CHECK(t.shape() == p.shape(), "optimizer load_state_dict: '", name, "' has shape ",
                 t.shape_str(), " but parameter ", i, " is ", p.desc());
      copy = empty(p.shape(), TensorOptions(p.dtype()).with_device(p.device()));
      copy.copy_(t);
    }
    loaded[i][key] = copy;
  }
  state_ = std::move(loaded);
}

}  // namespace kiln::optim
