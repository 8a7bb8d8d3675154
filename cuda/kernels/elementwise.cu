// Elementwise unary and binary kernels: a vectorised flat path for dense operands that share
// one layout (16-byte loads and stores), and a strided path that also serves broadcasting
// (zero strides). No __restrict__: in-place ops pass out == a.
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/elementwise.cuh"
#include "cuda/kernels.h"

namespace kiln::cuda {
namespace {

template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// ---- unary ----
template <typename T>
__global__ void unary_flat(UnaryOp op, T* out, const T* a, acc_t<T> s, int64_t n) {
  pdl_start();
  using C = acc_t<T>;
  constexpr int V = Vec16<T>::kN;
  const int64_t nv = n / V;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = tid; i < nv; i += step) {
    Vec16<T> x = reinterpret_cast<const Vec16<T>*>(a)[i];
    Vec16<T> y;
#pragma unroll
    for (int k = 0; k < V; ++k) y.v[k] = cvt<T>(unary_apply<C>(op, cvt<C>(x.v[k]), s));
    reinterpret_cast<Vec16<T>*>(out)[i] = y;
  }
  for (int64_t i = nv * V + tid; i < n; i += step) out[i] = cvt<T>(unary_apply<C>(op, cvt<C>(a[i]), s));
}

template <typename T>
__global__ void unary_strided(UnaryOp op, Geom<2> g, T* out, const T* a, acc_t<T> s, int64_t n) {
  pdl_start();
  using C = acc_t<T>;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[2];
    g.offsets(i, off);
    out[off[0]] = cvt<T>(unary_apply<C>(op, cvt<C>(a[off[1]]), s));
  }
}

// ---- binary ----
template <typename T>
__global__ void binary_flat(BinaryOp op, T* out, const T* a, const T* b, acc_t<T> alpha,
                            int64_t n) {
  pdl_start();
  using C = acc_t<T>;
  constexpr int V = Vec16<T>::kN;
  const int64_t nv = n / V;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = tid; i < nv; i += step) {
    Vec16<T> x = reinterpret_cast<const Vec16<T>*>(a)[i];
    Vec16<T> z = reinterpret_cast<const Vec16<T>*>(b)[i];
    Vec16<T> y;
#pragma unroll
    for (int k = 0; k < V; ++k)
      y.v[k] = cvt<T>(binary_apply<C>(op, cvt<C>(x.v[k]), cvt<C>(z.v[k]), alpha));
    reinterpret_cast<Vec16<T>*>(out)[i] = y;
  }
  for (int64_t i = nv * V + tid; i < n; i += step)
    out[i] = cvt<T>(binary_apply<C>(op, cvt<C>(a[i]), cvt<C>(b[i]), alpha));
}

template <typename T>
__global__ void binary_strided(BinaryOp op, Geom<3> g, T* out, const T* a, const T* b,
                               acc_t<T> alpha, int64_t n) {
  pdl_start();
  using C = acc_t<T>;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[3];
    g.offsets(i, off);
    out[off[0]] = cvt<T>(binary_apply<C>(op, cvt<C>(a[off[1]]), cvt<C>(b[off[2]]), alpha));
  }
}

// Integer counters (batch norm's num_batches_tracked): out = a + s, exactly.
__global__ void add_i64_kernel(int64_t* out, const int64_t* a, int64_t s, int64_t n) {
  pdl_start();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = a[i] + s;
}

}  // namespace

void unary(UnaryOp op, const Tensor& out, const Tensor& a, double scalar) {
  const int64_t n = out.numel();
  if (n == 0) return;
  if (op == UnaryOp::AddScalar && a.dtype() == DType::i64 && out.dtype() == DType::i64 &&
      out.is_contiguous() && a.is_contiguous()) {
    KILN_CHECK(scalar == double(int64_t(scalar)), "add (cuda): an i64 tensor takes an integral "
               "scalar, got ", scalar);
    launch(add_i64_kernel, grid_for(n), kBlock, 0, current_stream(),
           static_cast<int64_t*>(out.raw_data()), static_cast<const int64_t*>(a.raw_data()),
           int64_t(scalar), n);
    KILN_CUDA_CHECK_LAUNCH();
    return;
  }
  dispatch_device_float(a.dtype(), unary_name(op), [&]<typename T>() {
    using C = acc_t<T>;
    T* o = static_cast<T*>(out.raw_data());
    const T* x = static_cast<const T*>(a.raw_data());
    cudaStream_t stream = current_stream();
    if (dense_same_layout(out, a) && aligned16(o) && aligned16(x)) {
      const int64_t items = (n + Vec16<T>::kN - 1) / Vec16<T>::kN;
      launch(unary_flat<T>, grid_for(items), kBlock, 0, stream, op, o, x, C(scalar), n);
    } else {
      Geom<2> g = make_geom<2>(out.shape(), {&out.strides(), &a.strides()});
      launch(unary_strided<T>, grid_for(n), kBlock, 0, stream, op, g, o, x, C(scalar), n);
    }
    KILN_CUDA_CHECK_LAUNCH();
  });
}

void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b, double alpha) {
  const int64_t n = out.numel();
  if (n == 0) return;
  dispatch_device_float(a.dtype(), binary_name(op), [&]<typename T>() {
    using C = acc_t<T>;
    T* o = static_cast<T*>(out.raw_data());
    const T* x = static_cast<const T*>(a.raw_data());
    const T* y = static_cast<const T*>(b.raw_data());
    cudaStream_t stream = current_stream();
    if (dense_same_layout(out, a) && dense_same_layout(out, b) && aligned16(o) &&
        aligned16(x) && aligned16(y)) {
      const int64_t items = (n + Vec16<T>::kN - 1) / Vec16<T>::kN;
      launch(binary_flat<T>, grid_for(items), kBlock, 0, stream, op, o, x, y, C(alpha), n);
    } else {
      Geom<3> g = make_geom<3>(out.shape(), {&out.strides(), &a.strides(), &b.strides()});
      launch(binary_strided<T>, grid_for(n), kBlock, 0, stream, op, g, o, x, y, C(alpha), n);
    }
    KILN_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace kiln::cuda
