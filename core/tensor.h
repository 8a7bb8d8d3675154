#pragma once
// Tensor: a cheap handle (shared pointer) to {storage, element offset, shape, strides, dtype,
// device, autograd meta}. Copying a Tensor copies the handle, never the data.
//
// Shapes are always logical (a 4-D image batch is (N, C, H, W)); the strides decide the
// physical layout. MemoryFormat::ChannelsLast is NHWC in memory, as cuDNN's fast kernels and
// tensor cores want it; MemoryFormat::Contiguous is row-major (NCHW for 4-D).
//
// Views (reshape of a contiguous tensor, permute, transpose, narrow, expand, squeeze,
// unsqueeze) share storage and the storage's version counter. In-place ops bump the counter.
// Every differentiable view and op records an autograd Node (see core/autograd.h).
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/storage.h"

namespace kiln {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);  // "[2, 3, 4]"
int64_t shape_numel(const Shape& s);
Shape contiguous_strides(const Shape& shape);

enum class MemoryFormat : uint8_t { Contiguous, ChannelsLast };
Shape channels_last_strides(const Shape& shape);  // 4-D only

class Node;
class Tensor;
class Generator;

struct TensorOptions {
  DType dtype = DType::f32;
  Device device = Device::cpu();
  bool requires_grad = false;
  MemoryFormat memory_format = MemoryFormat::Contiguous;

  TensorOptions() = default;
  TensorOptions(DType d) : dtype(d) {}    // NOLINT: zeros({2}, DType::f64)
  TensorOptions(Device d) : device(d) {}  // NOLINT
  TensorOptions with_dtype(DType d) const { auto o = *this; o.dtype = d; return o; }
  TensorOptions with_device(Device d) const { auto o = *this; o.device = d; return o; }
  TensorOptions with_requires_grad(bool r = true) const { auto o = *this; o.requires_grad = r; return o; }
  TensorOptions with_memory_format(MemoryFormat m) const { auto o = *this; o.memory_format = m; return o; }
};

struct AutogradMeta {
  bool requires_grad = false;
  std::shared_ptr<Node> grad_fn;  // null for leaves
  uint32_t output_nr = 0;         // which output of grad_fn this tensor is
  std::shared_ptr<class TensorImpl> grad;  // accumulated gradient (leaves)
  std::weak_ptr<Node> grad_accumulator;   // leaves: the AccumulateGrad node, created lazily
  // Leaves: run by AccumulateGrad after each accumulation (autograd::add_post_accumulate_grad_hook).
  std::vector<std::pair<uint64_t, std::function<void(const Tensor&)>>> post_accumulate_hooks;
};

class TensorImpl {
 public:
  std::shared_ptr<Storage> storage;
  int64_t offset = 0;  // in elements
  Shape shape;
  Shape strides;  // in elements
  DType dtype = DType::f32;
  Device device;
  std::unique_ptr<AutogradMeta> autograd;  // null until needed
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- metadata ----
  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl().shape; }
  const Shape& strides() const { return impl().strides; }
  int64_t dim() const { return int64_t(impl().shape.size()); }
  int64_t size(int64_t d) const;    // negative d counts from the end
  int64_t stride(int64_t d) const;
  int64_t numel() const { return shape_numel(impl().shape); }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().device; }
  bool is_cuda() const { return device().is_cuda(); }
  bool is_cpu() const { return device().is_cpu(); }
  int64_t offset() const { return impl().offset; }
  size_t element_size() const { return dtype_size(dtype()); }
  size_t nbytes() const { return size_t(numel()) * element_size(); }
  bool is_contiguous(MemoryFormat fmt = MemoryFormat::Contiguous) const;
  // ChannelsLast when 4-D and NHWC-contiguous but not plain contiguous, else Contiguous. When
  // both hold (a size-1 channel or spatial dimension: (N, 1, H, W), (N, C, 1, 1)) the two
  // layouts put every element at the same address, and the strides the tensor was made with
  // decide: exactly channels_last_strides() (empty(..., ChannelsLast), clone(ChannelsLast))
  // suggests ChannelsLast, anything else Contiguous. Ops allocate their outputs in the layout
  // their input suggests, so a 1-channel NHWC input keeps a whole network NHWC (with plain
  // strides it would run NCHW: cuDNN's slow NCHW kernels and layout conversions in every conv).
  MemoryFormat suggest_memory_format() const;
  std::string shape_str() const { return kiln::shape_str(shape()); }
  // "f32[2, 3] cpu" — used in error messages.
  std::string desc() const;

  // ---- data ----
  const std::shared_ptr<Storage>& storage() const { return impl().storage; }
  void* raw_data() const;  // pointer to the first element (offset applied)
  template <typename T>
  T* data() const {
    KILN_CHECK(dtype_of<T>::value == dtype(), "data<", dtype_name(dtype_of<T>::value),
               ">() on a tensor of dtype ", dtype_name(dtype()));
    return static_cast<T*>(raw_data());
  }
  // The single element of a one-element tensor, as double (synchronises for cuda tensors).
  double item() const;
  template <typename T>
  T item() const { return static_cast<T>(item()); }
  // Copy out all elements in logical (row-major) order, converted to T.
  template <typename T>
  std::vector<T> to_vector() const;
  uint64_t version() const { return storage()->version(); }
  void bump_version() const { storage()->bump_version(); }
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }
  bool shares_storage(const Tensor& o) const { return storage() == o.storage(); }

  // ---- autograd ----
  bool requires_grad() const { return impl_ && impl_->autograd && impl_->autograd->requires_grad; }
  // Leaves only. Returns *this.
  const Tensor& set_requires_grad(bool r) const;
  bool is_leaf() const { return !grad_fn(); }
  const std::shared_ptr<Node>& grad_fn() const;
  uint32_t output_nr() const { return impl_->autograd ? impl_->autograd->output_nr : 0; }
  // Accumulated gradient (undefined until a backward reaches this tensor).
  Tensor grad() const;
  void set_grad(const Tensor& g) const;
  // Runs the engine from this tensor. `gradient` may be omitted only for one-element tensors.
  void backward(const Tensor& gradient = Tensor(), bool retain_graph = false) const;
  // Same storage, no autograd history, requires_grad false.
  Tensor detach() const;
  AutogradMeta& autograd_meta() const;  // creates it if missing

  // ---- views (differentiable) ----
  Tensor view(const Shape& shape) const;     // requires compatible strides
  Tensor reshape(const Shape& shape) const;  // view when possible, else a copy; one -1 allowed
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor permute(const std::vector<int64_t>& dims) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const;  // transpose of a <= 2-D tensor; 0-D and 1-D come back as a view of self
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;  // drops `dim`
  Tensor expand(const Shape& shape) const;           // -1 keeps a size (defined in ops/)
  // expand's view without the autograd record: stride 0 along broadcast dims. For the floors
  // below ops/ (core's copy_, the backends), which cannot call expand.
  Tensor broadcast_to(const Shape& shape) const;
  Tensor squeeze(std::optional<int64_t> dim = std::nullopt) const;
  Tensor unsqueeze(int64_t dim) const;

  // ---- copies and conversions ----
  Tensor contiguous(MemoryFormat fmt = MemoryFormat::Contiguous) const;  // self if already so
  Tensor to(DType dtype) const;    // self if same dtype; differentiable between float dtypes
  Tensor to(Device device) const;  // self if same device; differentiable
  Tensor clone(std::optional<MemoryFormat> fmt = std::nullopt) const;  // differentiable
  // In-place, not differentiable: copies src (broadcast to self's shape, any dtype/device).
  const Tensor& copy_(const Tensor& src) const;
  const Tensor& fill_(double value) const;
  const Tensor& zero_() const { return fill_(0.0); }

  // ---- arithmetic (differentiable; see ops/ops.h) ----
  // Defined by the ops floor (ops/tensor_ops.cpp) over kiln::F: core/ and the backends never
  // call them (CMakeLists.txt links each floor on its own, so the linker would refuse).
  Tensor operator-() const;
  // In-place arithmetic: not recorded by autograd, so refused on tensors that require grad
  // while grad mode is on. Used by optimizers (under NoGradGuard) and engines.
  const Tensor& add_(const Tensor& other, double alpha = 1.0) const;
  const Tensor& add_(double value) const;
  const Tensor& mul_(const Tensor& other) const;
  const Tensor& mul_(double value) const;

  TensorImpl& impl() const {
    KILN_CHECK(impl_, "use of an undefined tensor");
    return *impl_;
  }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, double b);
Tensor operator-(const Tensor& a, double b);
Tensor operator*(const Tensor& a, double b);
Tensor operator/(const Tensor& a, double b);
Tensor operator+(double a, const Tensor& b);
Tensor operator-(double a, const Tensor& b);
Tensor operator*(double a, const Tensor& b);
Tensor operator/(double a, const Tensor& b);

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// ---- factories ----
// A tensor that views `storage` (used by views and by code that wraps foreign memory).
namespace detail {
// The CPU backend's copy and fill (Backend::copy, Backend::fill), strided with dtype conversion.
void copy_cpu(const Tensor& dst, const Tensor& src);
void fill_cpu(const Tensor& dst, double value);
}  // namespace detail

Tensor make_tensor(std::shared_ptr<Storage> storage, int64_t offset, Shape shape, Shape strides,
                   DType dtype);
Tensor empty(const Shape& shape, TensorOptions opts = {});
Tensor empty_like(const Tensor& t);  // same shape, dtype, device and memory format
Tensor zeros(const Shape& shape, TensorOptions opts = {});
Tensor zeros_like(const Tensor& t);
Tensor ones(const Shape& shape, TensorOptions opts = {});
Tensor ones_like(const Tensor& t);
Tensor full(const Shape& shape, double value, TensorOptions opts = {});
Tensor full_like(const Tensor& t, double value);
// [start, end) in steps of `step`; the dtype defaults to f32.
Tensor arange(double start, double end, double step = 1.0, TensorOptions opts = {});
Tensor arange(int64_t end, TensorOptions opts = {});
// Random tensors from `gen` (the default generator when null). Values are generated on the
// host and copied, so a seed gives the same values on every device.
Tensor rand(const Shape& shape, TensorOptions opts = {}, Generator* gen = nullptr);   // U[0,1)
Tensor randn(const Shape& shape, TensorOptions opts = {}, Generator* gen = nullptr);  // N(0,1)
Tensor uniform(const Shape& shape, double lo, double hi, TensorOptions opts = {},
               Generator* gen = nullptr);
Tensor randint(int64_t low, int64_t high, const Shape& shape, TensorOptions opts = DType::i64,
               Generator* gen = nullptr);
// From host values in row-major order; values.size() must equal the shape's element count.
template <typename T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, TensorOptions opts = {});
Tensor tensor(std::initializer_list<double> values, TensorOptions opts = {});  // 1-D

// ---- element-type-generic helpers used by the CPU backend ----
namespace detail {
// Calls f(dst_offset, src_offset) for every element of `shape`, in row-major order, with
// element offsets computed from the two stride vectors.
template <typename F>
void for_each_offset(const Shape& shape, const Shape& s0, const Shape& s1, F&& f);
}  // namespace detail

}  // namespace kiln

#include "core/tensor_inl.h"
