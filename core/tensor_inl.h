#pragma once
// Template definitions for core/tensor.h.
#include <cstring>

namespace kiln {
namespace detail {

template <typename F>
void for_each_offset(const Shape& shape, const Shape& s0, const Shape& s1, F&& f) {
  const int64_t nd = int64_t(shape.size());
  for (int64_t d : shape)
    if (d == 0) return;
  if (nd == 0) {
    f(int64_t(0), int64_t(0));
    return;
  }
  // Iterate the innermost dim in a tight loop, the rest with an odometer.
  const int64_t inner = shape[nd - 1], i0 = s0[nd - 1], i1 = s1[nd - 1];
  std::vector<int64_t> idx(size_t(nd), 0);
  int64_t o0 = 0, o1 = 0;
  while (true) {
    for (int64_t i = 0; i < inner; ++i) f(o0 + i * i0, o1 + i * i1);
    int64_t d = nd - 2;
    for (; d >= 0; --d) {
      if (++idx[size_t(d)] < shape[size_t(d)]) {
        o0 += s0[size_t(d)];
        o1 += s1[size_t(d)];
        break;
      }
      o0 -= s0[size_t(d)] * (shape[size_t(d)] - 1);
      o1 -= s1[size_t(d)] * (shape[size_t(d)] - 1);
      idx[size_t(d)] = 0;
    }
    if (d < 0) return;
  }
}

}  // namespace detail

template <typename T>
std::vector<T> Tensor::to_vector() const {
  Tensor host = to(Device::cpu());
  std::vector<T> out;
  out.reserve(size_t(numel()));
  dispatch_all(dtype(), [&]<typename S>() {
    const S* p = static_cast<const S*>(host.raw_data());
    Shape zero(size_t(dim()), 0);
    detail::for_each_offset(shape(), host.strides(), zero,
                            [&](int64_t o, int64_t) { out.push_back(convert<T>(p[o])); });
  });
  return out;
}

template <typename T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, TensorOptions opts) {
  KILN_CHECK(int64_t(values.size()) == shape_numel(shape), "from_vector: ", values.size(),
             " values for shape ", shape_str(shape));
  TensorOptions host_opts = opts;
  host_opts.device = Device::cpu();
  host_opts.requires_grad = false;
  host_opts.memory_format = MemoryFormat::Contiguous;
  Tensor t = empty(shape, host_opts);
  dispatch_all(opts.dtype, [&]<typename D>() {
    D* p = static_cast<D*>(t.raw_data());
    for (size_t i = 0; i < values.size(); ++i) p[i] = convert<D>(values[i]);
  });
  if (!opts.device.is_cpu() || opts.memory_format != MemoryFormat::Contiguous) {
    Tensor d = empty(shape, opts.with_requires_grad(false));
    d.copy_(t);
    t = d;
  }
  if (opts.requires_grad) t.set_requires_grad(true);
  return t;
}

}  // namespace kiln
