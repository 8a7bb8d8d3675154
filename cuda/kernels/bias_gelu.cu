// The exact GELU of a GEMM's output plus its bias (F::linear_gelu: a transformer MLP's first
// Linear and its activation), so that the GEMM runs without cuBLASLt's bias epilogue and the
// bias gradient needs no pass of its own:
//  - forward: out = gelu(y + b), one elementwise pass (16-byte accesses where the row width and
//    the pointers allow);
//  - backward: dy = dout·gelu'(y + b), and db = Σ_rows dy (of the rounded dy, as the weight
//    gradient GEMM reads it) from the same pass: each thread keeps its columns' sums over a
//    chunk of rows in registers and writes one f32 partial row per chunk; bias_gelu_db adds the
//    chunks in order. The chunking depends on (rows, cols, device) only, so db is
//    bit-reproducible (graph replay equals eager).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/elementwise_math.h"
#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"

namespace kiln::cuda {
namespace {

constexpr int kColThreads = 128;     // threads across a column slab of the backward
constexpr int kChunksPerSm = 4;      // row chunks × column slabs ≈ this many blocks per SM

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

__device__ __forceinline__ float gelu_f(float x) {
  return math::unary_apply(UnaryOp::Gelu, x, 0.0f);
}
__device__ __forceinline__ float gelu_grad_f(float g, float x) {
  return math::binary_apply(BinaryOp::GeluBackward, g, x, 1.0f);
}

// out = gelu(y + b) over rows × cols, V elements (one row's, from a column that is a multiple
// of V) per step of a grid-stride loop.
template <typename T, int V>
__global__ void bias_gelu_fwd(T* __restrict__ out, const T* __restrict__ y,
                              const T* __restrict__ b, int64_t rows, int64_t cols) {
  pdl_start();
  using P = Pack<T, V>;
  const int64_t packs = rows * cols / V;
  const int64_t per_row = cols / V;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < packs;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = (i % per_row) * V;
    const P yv = reinterpret_cast<const P*>(y)[i];
    const P bv = *reinterpret_cast<const P*>(b + c);
    P o;
#pragma unroll
    for (int j = 0; j < V; ++j)
      o.v[j] = cvt<T>(gelu_f(cvt<float>(yv.v[j]) + cvt<float>(bv.v[j])));
    reinterpret_cast<P*>(out)[i] = o;
  }
}

// dy = dout·gelu'(y + b) for rows [chunk·rows_per_chunk, ...) of the columns
// [(slab·kColThreads + thread)·V, ... + V); partial[chunk, col] = Σ of those rows' rounded dy
// (when partial is not null). Rows are loaded kRowUnroll at a time, so that each thread has
// several loads in flight.
constexpr int kRowUnroll = 4;

template <typename T, int V>
__global__ void bias_gelu_bwd(T* __restrict__ dy, float* __restrict__ partial,
                              const T* __restrict__ dout, const T* __restrict__ y,
                              const T* __restrict__ b, int64_t rows, int64_t cols,
                              int64_t rows_per_chunk) {
  pdl_start();
  using P = Pack<T, V>;
  const int64_t c = (int64_t(blockIdx.y) * kColThreads + threadIdx.x) * V;
  if (c >= cols) return;
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_chunk;
  const int64_t r1 = min(rows, r0 + rows_per_chunk);
  const P bv = *reinterpret_cast<const P*>(b + c);
  float bias[V], sum[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    bias[j] = cvt<float>(bv.v[j]);
    sum[j] = 0.0f;
  }
  auto rows_from = [&]<int U>(int64_t r) {
    P gv[U], yv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      gv[u] = *reinterpret_cast<const P*>(dout + (r + u) * cols + c);
      yv[u] = *reinterpret_cast<const P*>(y + (r + u) * cols + c);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      P o;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        o.v[j] = cvt<T>(gelu_grad_f(cvt<float>(gv[u].v[j]), cvt<float>(yv[u].v[j]) + bias[j]));
        sum[j] += cvt<float>(o.v[j]);
      }
      *reinterpret_cast<P*>(dy + (r + u) * cols + c) = o;
    }
  };
  int64_t r = r0;
  for (; r + kRowUnroll <= r1; r += kRowUnroll) rows_from.template operator()<kRowUnroll>(r);
  for (; r < r1; ++r) rows_from.template operator()<1>(r);
  if (partial) {
#pragma unroll
    for (int j = 0; j < V; ++j) partial[int64_t(blockIdx.x) * cols + c + j] = sum[j];
  }
}

// db[c] = Σ_k partial[k, c] over the chunks in order.
template <typename T>
__global__ void bias_gelu_db(T* db, const float* partial, int64_t chunks, int64_t cols) {
  pdl_start();
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
       c += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int64_t k = 0; k < chunks; ++k) s += partial[k * cols + c];
    db[c] = cvt<T>(s);
  }
}

bool aligned(const Tensor& t, int bytes) {
  return reinterpret_cast<uintptr_t>(t.raw_data()) % uintptr_t(bytes) == 0;
}

// Calls f.template operator()<T, V>() for f32, f16 or bf16 data with the widest V (16 bytes,
// else 1 element) that cols and every tensor's address allow.
template <typename F>
void dispatch_pack(DType t, int64_t cols, std::initializer_list<const Tensor*> ts, F&& f) {
  auto pick = [&]<typename T>() {
    constexpr int V = 16 / sizeof(T);
    bool wide = cols % V == 0;
    for (const Tensor* p : ts)
      if (p->defined()) wide = wide && aligned(*p, 16);
    if (wide) f.template operator()<T, V>(); else f.template operator()<T, 1>();
  };
  switch (t) {
    case DType::f32: return pick.template operator()<float>();
    case DType::f16: return pick.template operator()<__half>();
    case DType::bf16: return pick.template operator()<__nv_bfloat16>();
    default: KILN_FAIL("bias_gelu (cuda): dtype ", dtype_name(t), " is not f32, f16 or bf16");
  }
}

}  // namespace

void bias_gelu_forward(const Tensor& out, const Tensor& y, const Tensor& bias) {
  const int64_t rows = y.size(0), cols = y.size(1);
  if (out.numel() == 0) return;
  dispatch_pack(y.dtype(), cols, {&out, &y, &bias}, [&]<typename T, int V>() {
    launch(bias_gelu_fwd<T, V>, grid_for(rows * cols / V), kBlock, 0, current_stream(),
           static_cast<T*>(out.raw_data()), static_cast<const T*>(y.raw_data()),
           static_cast<const T*>(bias.raw_data()), rows, cols);
  });
}

void bias_gelu_backward(const Tensor& dy, const Tensor& dbias, const Tensor& dout,
                        const Tensor& y, const Tensor& bias) {
  const int64_t rows = y.size(0), cols = y.size(1);
  if (cols == 0) return;
  if (rows == 0) {
    if (dbias.defined()) dbias.zero_();
    return;
  }
  dispatch_pack(y.dtype(), cols, {&dy, &dout, &y, &bias}, [&]<typename T, int V>() {
    const int64_t slabs = (cols / V + kColThreads - 1) / kColThreads;
    const int64_t target = int64_t(context().props.multiProcessorCount) * kChunksPerSm;
    const int64_t chunks = std::clamp<int64_t>(target / slabs, 1, rows);
    const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
    const int64_t used = (rows + rows_per_chunk - 1) / rows_per_chunk;
    Tensor partial;
    if (dbias.defined())
      partial = empty({used, cols}, TensorOptions(DType::f32).with_device(y.device()));
    launch(bias_gelu_bwd<T, V>, dim3(unsigned(used), unsigned(slabs)), kColThreads, 0,
           current_stream(), static_cast<T*>(dy.raw_data()),
           partial.defined() ? static_cast<float*>(partial.raw_data()) : nullptr,
           static_cast<const T*>(dout.raw_data()), static_cast<const T*>(y.raw_data()),
           static_cast<const T*>(bias.raw_data()), rows, cols, rows_per_chunk);
    if (dbias.defined())
      launch(bias_gelu_db<T>, grid_for(cols), kBlock, 0, current_stream(),
             static_cast<T*>(dbias.raw_data()), static_cast<const float*>(partial.raw_data()),
             used, cols);
  });
}

}  // namespace kiln::cuda
