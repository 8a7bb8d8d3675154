#include "models/module.h"

#include <set>

#include "core/autograd.h"

namespace kiln::nn {

namespace {

// Makes `t`'s TensorImpl view `src`'s data, so every copy of the handle sees the conversion.
void repoint(const Tensor& t, const Tensor& src) {
  TensorImpl& dst = t.impl();
  const TensorImpl& s = src.impl();
  dst.storage = s.storage;
  dst.offset = s.offset;
  dst.shape = s.shape;
  dst.strides = s.strides;
  dst.dtype = s.dtype;
  dst.device = s.device;
}

template <typename Convert>
void convert_in_place(const Tensor& t, Convert&& convert) {
  NoGradGuard no_grad;
  Tensor c = convert(t.detach());
  Tensor g = t.grad();
  // A new storage or layout (dtype, device or memory format changed): re-point the handle.
  if (!c.shares_storage(t) || c.strides() != t.strides()) repoint(t, c);
  if (g.defined()) t.set_grad(convert(g));
}

}  // namespace

void Module::check_new_name(const std::string& name, const char* what) const {
  KILN_CHECK(!name.empty() && name.find('.') == std::string::npos, type_name(), ": ", what,
             " name '", name, "' must be non-empty and contain no '.'");
  auto taken = [&](const auto& list) {
    for (const auto& [n, _] : list)
      if (n == name) return true;
    return false;
  };
  KILN_CHECK(!taken(params_) && !taken(buffers_) && !taken(children_), type_name(), ": ", what,
             " name '", name, "' is already registered");
}

Tensor Module::register_parameter(const std::string& name, Tensor t) {
  check_new_name(name, "parameter");
  KILN_CHECK(t.defined() && t.is_leaf(), type_name(), ": parameter '", name,
             "' must be a defined leaf tensor");
  t.set_requires_grad(true);
  params_.emplace_back(name, t);
  return t;
}

Tensor Module::register_buffer(const std::string& name, Tensor t) {
  check_new_name(name, "buffer");
  KILN_CHECK(t.defined() && !t.requires_grad(), type_name(), ": buffer '", name,
             "' must be a defined tensor that does not require grad");
  buffers_.emplace_back(name, t);
  return t;
}

void Module::add_child(const std::string& name, ModulePtr m) {
  check_new_name(name, "module");
  KILN_CHECK(m != nullptr, type_name(), ": module '", name, "' is null");
  children_.emplace_back(name, std::move(m));
}

std::vector<std::pair<std::string, const Module*>> Module::named_modules() const {
  std::vector<std::pair<std::string, const Module*>> out;
  std::set<const Module*> seen;
  auto walk = [&](auto&& self, const Module* m, const std::string& prefix) -> void {
    if (!seen.insert(m).second) return;
    out.emplace_back(prefix, m);
    for (const auto& [n, c] : m->children_)
      self(self, c.get(), prefix.empty() ? n : prefix + "." + n);
  };
  walk(walk, this, "");
  return out;
}

std::vector<NamedTensor> Module::collect(bool params) const {
  std::vector<NamedTensor> out;
  std::set<const TensorImpl*> seen;
  for (const auto& [prefix, m] : named_modules()) {
    for (const auto& [n, t] : params ? m->params_ : m->buffers_) {
      if (!seen.insert(t.impl_ptr().get()).second) continue;
      out.emplace_back(prefix.empty() ? n : prefix + "." + n, t);
    }
  }
  return out;
}

std::vector<NamedTensor> Module::named_parameters() const { return collect(true); }
std::vector<NamedTensor> Module::named_buffers() const { return collect(false); }

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [_, t] : collect(true)) out.push_back(t);
  return out;
}

std::vector<Tensor> Module::buffers() const {
  std::vector<Tensor> out;
  for (auto& [_, t] : collect(false)) out.push_back(t);
  return out;
}

std::vector<NamedTensor> Module::state() const {
  std::vector<NamedTensor> out = collect(true);
  for (auto& nt : collect(false)) out.push_back(std::move(nt));
  return out;
}

std::vector<ModulePtr> Module::children() const {
  std::vector<ModulePtr> out;
  for (const auto& [_, c] : children_) out.push_back(c);
  return out;
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (const Tensor& p : parameters()) n += p.numel();
  return n;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [_, c] : children_) c->train(on);
}

void Module::zero_grad(bool set_to_none) {
  for (const Tensor& p : parameters()) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    if (set_to_none) {
      p.set_grad(Tensor());
    } else {
      NoGradGuard no_grad;
      g.zero_();
    }
  }
}

void Module::to(Device device) {
  for (const Tensor& t : parameters()) convert_in_place(t, [&](const Tensor& x) { return x.to(device); });
  for (const Tensor& t : buffers()) convert_in_place(t, [&](const Tensor& x) { return x.to(device); });
}

void Module::to(DType dtype) {
  KILN_CHECK(is_floating(dtype), type_name(), ".to: target dtype must be floating, got ",
             dtype_name(dtype));
  auto conv = [&](const Tensor& x) { return is_floating(x.dtype()) ? x.to(dtype) : x; };
  for (const Tensor& t : parameters()) convert_in_place(t, conv);
  for (const Tensor& t : buffers()) convert_in_place(t, conv);
}

void Module::convert(const std::string& name, DType dtype, Device device, MemoryFormat fmt) {
  for (const auto& [n, t] : state()) {
    if (n != name) continue;
    KILN_CHECK(is_floating(t.dtype()) && is_floating(dtype), type_name(), ".convert: '", name,
               "' is ", t.desc(), "; only floating tensors convert to floating dtypes (got ",
               dtype_name(dtype), ")");
    KILN_CHECK(fmt == MemoryFormat::Contiguous || t.dim() == 4, type_name(), ".convert: '", name,
               "' is ", t.desc(), "; channels-last needs a 4-D tensor");
    convert_in_place(t, [&](const Tensor& x) { return x.to(device).to(dtype).contiguous(fmt); });
    return;
  }
  KILN_FAIL(type_name(), ".convert: no parameter or buffer named '", name, "'");
}

void Module::print_into(std::string& out, const std::string& name, int depth) const {
  out += std::string(size_t(depth) * 2, ' ');
  if (!name.empty()) out += "(" + name + "): ";
  out += describe() + "\n";
  for (const auto& [n, c] : children_) c->print_into(out, n, depth + 1);
}

std::string Module::print() const {
  std::string out;
  print_into(out, "", 0);
  return out;
}

}  // namespace kiln::nn
