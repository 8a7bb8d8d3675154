#pragma once
// nn::Module: a tree of named parameters, buffers and child modules, like torch.nn.Module.
//
// Names are dotted paths in registration order, a module's own entries before its
// children's (PyTorch's named_modules order): `conv1.weight`, `layer1.0.bn1.running_var`.
// Modules are held by std::shared_ptr. Parameters are leaf tensors with requires_grad set;
// buffers (running statistics, counters) never require grad.
//
// Subclasses keep Tensor copies of what they register (`weight_ = register_parameter(...)`).
// That is safe: to(Device)/to(DType) convert a tensor by re-pointing its TensorImpl at the
// converted data (PyTorch's `param.data = ...`), so every handle — the module's members, an
// optimizer's param list — sees the new tensor. Gradients are converted along with it.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace kiln::nn {

class Module;
using ModulePtr = std::shared_ptr<Module>;
using NamedTensor = std::pair<std::string, Tensor>;

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  virtual Tensor forward(const Tensor& x) = 0;
  Tensor operator()(const Tensor& x) { return forward(x); }
  // "Conv2d", "BatchNorm2d", ... used in messages and by print().
  virtual std::string type_name() const = 0;
  // One line describing this module's configuration, e.g. "Conv2d(3, 64, kernel=7, ...)".
  virtual std::string describe() const { return type_name(); }
  // The names of this module's own parameters that mixed precision (optim/amp.h) stores in its
  // 16-bit compute dtype; the rest stay f32 (normalisation parameters, statistics). Conv2d,
  // Linear: all of theirs.
  virtual std::vector<std::string> half_parameters() const { return {}; }
  // The names of this module's own parameters of more than one dimension that training recipes
  // keep out of weight decay (optim::split_weight_decay; those of dim <= 1 are out anyway): a
  // ViT's class token and position embedding.
  virtual std::vector<std::string> no_weight_decay() const { return {}; }

  // ---- registration (names must be unique within a module and contain no '.') ----
  // Sets requires_grad on `t` (which must be a floating leaf) and returns it.
  Tensor register_parameter(const std::string& name, Tensor t);
  Tensor register_buffer(const std::string& name, Tensor t);
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    add_child(name, m);
    return m;
  }

  // ---- traversal (recursive; a tensor or module reachable twice is listed once) ----
  std::vector<Tensor> parameters() const;
  std::vector<NamedTensor> named_parameters() const;
  std::vector<Tensor> buffers() const;
  std::vector<NamedTensor> named_buffers() const;
  // Parameters then buffers, as a flat name -> tensor list (for checkpoints).
  std::vector<NamedTensor> state() const;
  // Direct children in registration order.
  const std::vector<std::pair<std::string, ModulePtr>>& named_children() const { return children_; }
  std::vector<ModulePtr> children() const;
  // This module (name "") and all descendants, depth first, parents before children.
  std::vector<std::pair<std::string, const Module*>> named_modules() const;
  // This module's own entries (not recursive).
  const std::vector<NamedTensor>& own_parameters() const { return params_; }
  const std::vector<NamedTensor>& own_buffers() const { return buffers_; }
  int64_t num_parameters() const;  // total element count of parameters()

  // ---- modes and conversions (recursive) ----
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  // set_to_none (PyTorch's default): grads become undefined; otherwise they are zeroed.
  void zero_grad(bool set_to_none = true);
  // Moves parameters, buffers and existing gradients. Handles stay valid (see above).
  void to(Device device);
  // Converts floating parameters, buffers and gradients; integer buffers are kept.
  void to(DType dtype);
  // Converts the one parameter or buffer called `name` (a dotted path as in state()) to
  // `dtype` on `device`, dense in `fmt` (4-D only for ChannelsLast), in place: handles stay
  // valid and an existing gradient is converted along. Used by mixed precision (optim/amp.h).
  void convert(const std::string& name, DType dtype, Device device,
               MemoryFormat fmt = MemoryFormat::Contiguous);

  // Indented tree of describe() lines.
  std::string print() const;

 private:
  void add_child(const std::string& name, ModulePtr m);
  void check_new_name(const std::string& name, const char* what) const;
  std::vector<NamedTensor> collect(bool params) const;
  void print_into(std::string& out, const std::string& name, int depth) const;

  std::vector<NamedTensor> params_;
  std::vector<NamedTensor> buffers_;
  std::vector<std::pair<std::string, ModulePtr>> children_;
  bool training_ = true;
};

}  // namespace kiln::nn
