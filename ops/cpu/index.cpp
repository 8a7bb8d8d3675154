// CPU gathers and selections: embedding lookup and its scatter-add backward, where.
#include <cstring>

#include "ops/cpu/kernels.h"

namespace kiln::cpu {

void embedding_forward(const Tensor& out, const Tensor& weight, const Tensor& indices) {
  dispatch_float(weight.dtype(), "embedding", [&]<typename T>() {
    const int64_t n = indices.numel(), d = weight.size(1);
    const int64_t* idx = indices.data<int64_t>();
    const T* w = weight.data<T>();
    T* o = out.data<T>();
#pragma omp parallel for if (n * d > 65536) schedule(static)
    for (int64_t i = 0; i < n; ++i) std::memcpy(o + i * d, w + idx[i] * d, size_t(d) * sizeof(T));
  });
}

void embedding_backward(const Tensor& dweight, const Tensor& dout, const Tensor& indices,
                        GradientMode mode) {
  dispatch_float(dweight.dtype(), "embedding_backward", [&]<typename T>() {
    const int64_t n = indices.numel(), d = dweight.size(1), rows = dweight.size(0);
    const int64_t* idx = indices.data<int64_t>();
    const T* g = dout.data<T>();
    T* dw = dweight.data<T>();
    if (mode == GradientMode::Set) std::memset(dw, 0, size_t(rows * d) * sizeof(T));
    // In index order: the same sums, in the same order, as the CUDA kernel's per-row walk.
    for (int64_t i = 0; i < n; ++i) {
      T* row = dw + idx[i] * d;
      const T* src = g + i * d;
      for (int64_t j = 0; j < d; ++j) row[j] += src[j];
    }
  });
}

void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  dispatch_all(out.dtype(), [&]<typename T>() {
    T* o = static_cast<T*>(out.raw_data());
    const bool* c = static_cast<const bool*>(cond.raw_data());
    const T* pa = static_cast<const T*>(a.raw_data());
    const T* pb = static_cast<const T*>(b.raw_data());
    const int64_t n = out.numel();
#pragma omp parallel for if (n > 65536) schedule(static)
    for (int64_t i = 0; i < n; ++i) o[i] = c[i] ? pa[i] : pb[i];
  });
}

}  // namespace kiln::cpu
