// Elementwise unary and binary kernels: a vectorised flat path for dense operands that share
// one layout (16-byte loads and stores), and a strided path that also serves broadcasting
// (zero strides). No __restrict__: in-place ops pass out == a.
// The flat path takes the per-element function as a type: the op read at run time (one kernel
// for every op, a branch per element), or, for the GELU family in f32/f16/bf16 (the transformer
// MLP's widest tensors), the op fixed at compile time: the same formula (math::unary_apply /
// binary_apply with a constant op), so the same bits, as straight-line code with two vectors in
// flight per thread.
#include "core/switches.h"
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

// Per-element functions of the flat kernels. C is the compute type.
template <typename C>
struct AnyUnary {
  UnaryOp op;
  C s;
  __device__ C operator()(C x) const { return unary_apply<C>(op, x, s); }
};
template <UnaryOp kOp, typename C>
struct FixedUnary {
  C s;
  __device__ C operator()(C x) const { return unary_apply<C>(kOp, x, s); }
};
template <typename C>
struct AnyBinary {
  BinaryOp op;
  C alpha;
  __device__ C operator()(C a, C b) const { return binary_apply<C>(op, a, b, alpha); }
};
template <BinaryOp kOp, typename C>
struct FixedBinary {
  C alpha;
  __device__ C operator()(C a, C b) const { return binary_apply<C>(kOp, a, b, alpha); }
};

// Vectors per thread per step of the flat kernels: 1 for the run-time op (its switch per element
// is already more code than one vector wants), 2 for a fixed op (both loads issued before the
// math, for more bytes in flight).
template <typename Fn>
inline constexpr int kUnrollOf = 2;
template <typename C>
inline constexpr int kUnrollOf<AnyUnary<C>> = 1;
template <typename C>
inline constexpr int kUnrollOf<AnyBinary<C>> = 1;

// Grid for a flat kernel over n elements: one thread per kUnrollOf<Fn> vectors.
template <typename T, typename Fn>
unsigned flat_grid(int64_t n) {
  constexpr int64_t per_thread = int64_t(Vec16<T>::kN) * kUnrollOf<Fn>;
  return grid_for((n + per_thread - 1) / per_thread);
}

// ---- unary ----
// A thread's step takes vectors i + u·step, u < kUnrollOf<Fn>, all loaded before any is
// computed; the last n % V elements go one per thread.
template <typename T, typename Fn>
__global__ void unary_flat(Fn fn, T* out, const T* a, int64_t n) {
  pdl_start();
  using C = acc_t<T>;
  constexpr int V = Vec16<T>::kN;
  constexpr int U = kUnrollOf<Fn>;
  const int64_t nv = n / V;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  const Vec16<T>* av = reinterpret_cast<const Vec16<T>*>(a);
  Vec16<T>* ov = reinterpret_cast<Vec16<T>*>(out);
  for (int64_t i = tid; i < nv; i += step * U) {
    Vec16<T> x[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + u * step < nv) x[u] = av[i + u * step];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i + u * step >= nv) break;
      Vec16<T> y;
#pragma unroll
      for (int k = 0; k < V; ++k) y.v[k] = cvt<T>(fn(cvt<C>(x[u].v[k])));
      ov[i + u * step] = y;
    }
  }
  for (int64_t i = nv * V + tid; i < n; i += step) out[i] = cvt<T>(fn(cvt<C>(a[i])));
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
template <typename T, typename Fn>
__global__ void binary_flat(Fn fn, T* out, const T* a, const T* b, int64_t n) {
  pdl_start();
  using C = acc_t<T>;
  constexpr int V = Vec16<T>::kN;
  constexpr int U = kUnrollOf<Fn>;
  const int64_t nv = n / V;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  const Vec16<T>* av = reinterpret_cast<const Vec16<T>*>(a);
  const Vec16<T>* bv = reinterpret_cast<const Vec16<T>*>(b);
  Vec16<T>* ov = reinterpret_cast<Vec16<T>*>(out);
  for (int64_t i = tid; i < nv; i += step * U) {
    Vec16<T> x[U], z[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + u * step < nv) {
        x[u] = av[i + u * step];
        z[u] = bv[i + u * step];
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i + u * step >= nv) break;
      Vec16<T> y;
#pragma unroll
      for (int k = 0; k < V; ++k) y.v[k] = cvt<T>(fn(cvt<C>(x[u].v[k]), cvt<C>(z[u].v[k])));
      ov[i + u * step] = y;
    }
  }
  for (int64_t i = nv * V + tid; i < n; i += step) out[i] = cvt<T>(fn(cvt<C>(a[i]), cvt<C>(b[i])));
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
      auto run = [&](auto fn) {
        using Fn = decltype(fn);
        launch(unary_flat<T, Fn>, flat_grid<T, Fn>(n), kBlock, 0, stream, fn, o, x, n);
      };
      if constexpr (std::is_same_v<T, double>) {
        run(AnyUnary<C>{op, C(scalar)});
      } else if (!switches().row_kernels) {  // KILN_ROW_KERNELS=0: the run-time-op kernel
        run(AnyUnary<C>{op, C(scalar)});
      } else {
        switch (op) {
          case UnaryOp::Gelu: run(FixedUnary<UnaryOp::Gelu, C>{C(scalar)}); break;
          case UnaryOp::GeluTanh: run(FixedUnary<UnaryOp::GeluTanh, C>{C(scalar)}); break;
          default: run(AnyUnary<C>{op, C(scalar)}); break;
        }
      }
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
      auto run = [&](auto fn) {
        using Fn = decltype(fn);
        launch(binary_flat<T, Fn>, flat_grid<T, Fn>(n), kBlock, 0, stream, fn, o, x, y, n);
      };
      if constexpr (std::is_same_v<T, double>) {
        run(AnyBinary<C>{op, C(alpha)});
      } else if (!switches().row_kernels) {
        run(AnyBinary<C>{op, C(alpha)});
      } else {
        switch (op) {
          case BinaryOp::GeluBackward:
            run(FixedBinary<BinaryOp::GeluBackward, C>{C(alpha)});
            break;
          case BinaryOp::GeluTanhBackward:
            run(FixedBinary<BinaryOp::GeluTanhBackward, C>{C(alpha)});
            break;
          default: run(AnyBinary<C>{op, C(alpha)}); break;
        }
      }
    } else {
      Geom<3> g = make_geom<3>(out.shape(), {&out.strides(), &a.strides(), &b.strides()});
      launch(binary_strided<T>, grid_for(n), kBlock, 0, stream, op, g, o, x, y, C(alpha), n);
    }
    KILN_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace kiln::cuda
