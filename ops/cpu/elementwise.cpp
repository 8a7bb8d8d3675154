// CPU elementwise and row-reduction kernels.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/elementwise_math.h"
#include "ops/cpu/kernels.h"

namespace kiln::cpu {
namespace {

constexpr int64_t kParallelGrain = 32768;  // below this, one thread is faster

template <typename T>
inline T unary_scalar(UnaryOp op, T x, T s) {
  return math::unary_apply(op, x, s);
}

template <typename T>
inline T binary_scalar(BinaryOp op, T a, T b, T alpha) {
  return math::binary_apply(op, a, b, alpha);
}

// Same shape and strides, dense in some order: the elements can be walked as a flat array.
bool dense_same_layout(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.strides() != b.strides()) return false;
  return a.is_contiguous() || a.is_contiguous(MemoryFormat::ChannelsLast);
}

// Calls f(out_off, a_off, b_off) for every element of out's shape; parallel over dim 0.
template <typename F>
void for_each3(const Tensor& out, const Tensor& a, const Tensor& b, F&& f) {
  const Shape& shape = out.shape();
  const int64_t nd = out.dim();
  if (nd == 0) {
    f(0, 0, 0);
    return;
  }
  if (out.numel() == 0) return;
  const Shape &so = out.strides(), &sa = a.strides(), &sb = b.strides();
  const int64_t inner = shape[size_t(nd - 1)];
  const int64_t io = so[size_t(nd - 1)], ia = sa[size_t(nd - 1)], ib = sb[size_t(nd - 1)];
#pragma omp parallel for if (out.numel() > kParallelGrain) schedule(static)
  for (int64_t i0 = 0; i0 < (nd == 1 ? 1 : shape[0]); ++i0) {
    std::vector<int64_t> idx(size_t(nd), 0);
    int64_t po = 0, pa = 0, pb = 0;
    if (nd > 1) {
      idx[0] = i0;
      po = i0 * so[0];
      pa = i0 * sa[0];
      pb = i0 * sb[0];
    }
    while (true) {
      for (int64_t k = 0; k < inner; ++k) f(po + k * io, pa + k * ia, pb + k * ib);
      int64_t d = nd - 2;
      for (; d >= 1; --d) {
        const size_t u = size_t(d);
        if (++idx[u] < shape[u]) {
          po += so[u];
          pa += sa[u];
          pb += sb[u];
          break;
        }
        po -= so[u] * (shape[u] - 1);
        pa -= sa[u] * (shape[u] - 1);
        pb -= sb[u] * (shape[u] - 1);
        idx[u] = 0;
      }
      if (d < 1) break;
    }
  }
}

}  // namespace

void unary(UnaryOp op, const Tensor& out, const Tensor& a, double scalar) {
  dispatch_float(a.dtype(), unary_name(op), [&]<typename T>() {
    T* o = out.data<T>();
    const T* x = a.data<T>();
    const T s = T(scalar);
    if (dense_same_layout(out, a)) {
      const int64_t n = a.numel();
#pragma omp parallel for if (n > kParallelGrain) schedule(static)
      for (int64_t i = 0; i < n; ++i) o[i] = unary_scalar(op, x[i], s);
      return;
    }
    detail::for_each_offset(out.shape(), out.strides(), a.strides(),
                            [&](int64_t po, int64_t pa) { o[po] = unary_scalar(op, x[pa], s); });
  });
}

void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b, double alpha) {
  dispatch_float(a.dtype(), binary_name(op), [&]<typename T>() {
    T* o = out.data<T>();
    const T* x = a.data<T>();
    const T* y = b.data<T>();
    const T al = T(alpha);
    if (dense_same_layout(out, a) && dense_same_layout(out, b)) {
      const int64_t n = a.numel();
#pragma omp parallel for if (n > kParallelGrain) schedule(static)
      for (int64_t i = 0; i < n; ++i) o[i] = binary_scalar(op, x[i], y[i], al);
      return;
    }
    for_each3(out, a, b, [&](int64_t po, int64_t pa, int64_t pb) {
      o[po] = binary_scalar(op, x[pa], y[pb], al);
    });
  });
}

void reduce_rows(ReduceOp op, const Tensor& out, const Tensor& x, int64_t rows, int64_t inner) {
  dispatch_float(x.dtype(), "reduce", [&]<typename T>() {
    const T* p = x.data<T>();
    T* o = out.data<T>();
#pragma omp parallel for if (rows * inner > kParallelGrain) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = p + r * inner;
      if (op == ReduceOp::Sum) {
        // Accumulate in double for f32 so large reductions stay accurate.
        double acc = 0;
        for (int64_t i = 0; i < inner; ++i) acc += double(row[i]);
        o[r] = T(acc);
      } else {
        T m = -std::numeric_limits<T>::infinity();
        for (int64_t i = 0; i < inner; ++i)
          if (row[i] > m || std::isnan(row[i])) m = row[i];
        o[r] = m;
      }
    }
  });
}

void reduce_cols(const Tensor& out, const Tensor& x, int64_t outer, int64_t cols) {
  dispatch_float(x.dtype(), "reduce", [&]<typename T>() {
    const T* p = x.data<T>();
    T* o = out.data<T>();
    // Each column summed in double, row by row in order: the same bits as reduce_rows over the
    // transposed tensor.
    constexpr int64_t kCols = 64;  // columns per thread's block
    const int64_t blocks = (cols + kCols - 1) / kCols;
#pragma omp parallel for if (outer * cols > kParallelGrain) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t c0 = b * kCols, c1 = std::min(cols, c0 + kCols);
      double acc[kCols] = {};
      for (int64_t r = 0; r < outer; ++r) {
        const T* row = p + r * cols;
        for (int64_t c = c0; c < c1; ++c) acc[c - c0] += double(row[c]);
      }
      for (int64_t c = c0; c < c1; ++c) o[c] = T(acc[c - c0]);
    }
  });
}

}  // namespace kiln::cpu
