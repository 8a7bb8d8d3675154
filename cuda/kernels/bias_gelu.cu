// The exact GELU of a GEMM's output plus its bias (F::linear_gelu: a transformer MLP's first
// Linear and its activation), so that the GEMM runs without cuBLASLt's bias epilogue and the
// bias gradient needs no pass of its own:
//  - forward: out = gelu(y + b), one elementwise pass (16-byte accesses where the row width and
//    the pointers allow);
//  - backward: dy = dout·gelu'(y + b), and db = Σ_rows dy (of the rounded dy, as the weight
//    gradient GEMM reads it) from the same pass: a block reads whole rows of a chunk (a column
//    slab of up to 512 16-byte packs), each thread keeps its columns' sums over the chunk's rows
//    in registers and writes them to an f32 partial row; bias_gelu_db adds the chunks in a fixed
//    order. The grid is one wave of resident blocks (a second, partial wave would leave most SMs
//    idle at the end), so the chunking depends on (rows, cols, device) only and db is
//    bit-reproducible (graph replay equals eager).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"

namespace kiln::cuda {
namespace {

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// The exact GELU, x·Φ(x), and its derivative Φ(x) + x·φ(x) in f32, with Φ the standard normal
// cdf and φ its density. These passes are bound by instruction issue, not by memory, unless the
// math is lean: with CUDA's erff the forward reached 60% of an H200's DRAM bandwidth at 80% SM
// throughput (docs/lab/transformer.md). Here
//   Φ(−|x|) = erfc(z)/2, z = |x|/√2, from the Chebyshev fit erfc(z) ≈ t·exp(P(t) − z²),
//   t = 1/(1 + z/2), P of degree 9 (Numerical Recipes §6.2: fractional error below 1.2e-7 for
//   every z ≥ 0, so the tails keep their relative accuracy),
// evaluated as t·2^(P(t)·log2e − x²·log2e/2 − 1) with log2e and the halving folded into P's
// coefficients, and φ(x) = 2^(−x²·log2e/2 − log2 √(2π)): one reciprocal, one or two exp2s (the
// hardware's approximations, denormals flushed) and a dozen FMAs. Relative error within 5e-6
// for |x| ≤ 9 (float rounding of the exponent; 1e-7 near 0), ±inf and NaN as with erff.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLog2Rsqrt2Pi = -1.32574806473615940f;  // log2(1/√(2π))

// t = 1/(1 + |x|/(2√2)).
__device__ __forceinline__ float erfc_fit_t(float x) {
  return rcp_approx(fmaf(fabsf(x), 0.35355339059327376f, 1.0f));
}
// P(t)·log2e − 1.
__device__ __forceinline__ float erfc_fit_exponent(float t) {
  float p = 0.17087277f * kLog2e;
  p = fmaf(p, t, -0.82215223f * kLog2e);
  p = fmaf(p, t, 1.48851587f * kLog2e);
  p = fmaf(p, t, -1.13520398f * kLog2e);
  p = fmaf(p, t, 0.27886807f * kLog2e);
  p = fmaf(p, t, -0.18628806f * kLog2e);
  p = fmaf(p, t, 0.09678418f * kLog2e);
  p = fmaf(p, t, 0.37409196f * kLog2e);
  p = fmaf(p, t, 1.00002368f * kLog2e);
  return fmaf(p, t, -1.26551223f * kLog2e - 1.0f);
}

__device__ __forceinline__ float gelu_f(float x) {
  const float t = erfc_fit_t(x);
  const float lower = t * ex2_approx(fmaf(x * (-0.5f * kLog2e), x, erfc_fit_exponent(t)));
  return x * (x < 0.0f ? lower : 1.0f - lower);
}
__device__ __forceinline__ float gelu_grad_f(float g, float x) {
  const float t = erfc_fit_t(x);
  const float q = x * x * (-0.5f * kLog2e);  // −x²·log2e/2
  const float lower = t * ex2_approx(q + erfc_fit_exponent(t));
  const float phi = ex2_approx(q + kLog2Rsqrt2Pi);
  return g * fmaf(x, phi, x < 0.0f ? lower : 1.0f - lower);
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
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t i0 = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  // The pack's column, advanced by the stride's remainder (no division per step).
  const int64_t step = stride % per_row;
  int64_t cp = i0 % per_row;
  for (int64_t i = i0; i < packs; i += stride) {
    const int64_t c = cp * V;
    cp += step;
    if (cp >= per_row) cp -= per_row;
    const P yv = reinterpret_cast<const P*>(y)[i];
    const P bv = *reinterpret_cast<const P*>(b + c);
    P o;
#pragma unroll
    for (int j = 0; j < V; ++j)
      o.v[j] = cvt<T>(gelu_f(cvt<float>(yv.v[j]) + cvt<float>(bv.v[j])));
    reinterpret_cast<P*>(out)[i] = o;
  }
}

// dy = dout·gelu'(y + b) over the rows [chunk·rows_per_chunk, ...) of one column slab: thread x
// of block (chunk, slab) owns columns (slab·blockDim.x + x)·V + [0, V) and walks the chunk's rows
// in order, U at a time, so that a block reads whole rows — up to kMaxLanes·V columns —
// contiguously, as an elementwise pass does; its column sums of the rounded dy go to
// partial[chunk, ...] (when partial is not null). No barrier: threads past the last column leave
// at once.
//
// On an H200 (ViT-B/16's mlp.0, 25,216 × 3,072 f16): the earlier layout — 8 warps on rows
// 8 apart of a 256-column slab, 64 registers — ran 169 µs at 57% of DRAM bandwidth, with 0.6
// eligible warps per scheduler (latency-bound). This one runs 128 µs (74%) with U = 1: 40
// registers, 4 blocks of 384 threads per SM. U = 2 runs 121 µs at 2 blocks per SM, but the
// whole step was no faster (docs/lab/transformer.md).
constexpr int kMaxLanes = 512;
constexpr int kRowsPerStep = 1;  // U

template <typename T, int V, int U>
__global__ void __launch_bounds__(kMaxLanes, U == 1 ? 3 : 2)
    bias_gelu_bwd(T* __restrict__ dy, float* __restrict__ partial, const T* __restrict__ dout,
                  const T* __restrict__ y, const T* __restrict__ b, int64_t rows, int64_t cols,
                  int64_t rows_per_chunk) {
  pdl_start();
  using P = Pack<T, V>;
  const int64_t c = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * V;
  if (c >= cols) return;
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_chunk;
  const int64_t r1 = min(rows, r0 + rows_per_chunk);
  const P bias = *reinterpret_cast<const P*>(b + c);  // kept packed: registers are short
  float sum[V];
#pragma unroll
  for (int j = 0; j < V; ++j) sum[j] = 0.0f;
  auto rows_from = [&]<int N>(int64_t r) {  // rows r, ..., r + N - 1
    P gv[N], yv[N];
#pragma unroll
    for (int u = 0; u < N; ++u) {
      const int64_t at = (r + u) * cols + c;
      gv[u] = *reinterpret_cast<const P*>(dout + at);
      yv[u] = *reinterpret_cast<const P*>(y + at);
    }
#pragma unroll
    for (int u = 0; u < N; ++u) {
      P o;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        o.v[j] = cvt<T>(gelu_grad_f(cvt<float>(gv[u].v[j]),
                                    cvt<float>(yv[u].v[j]) + cvt<float>(bias.v[j])));
        sum[j] += cvt<float>(o.v[j]);
      }
      *reinterpret_cast<P*>(dy + (r + u) * cols + c) = o;
    }
  };
  int64_t r = r0;
  for (; r + U - 1 < r1; r += U) rows_from.template operator()<U>(r);
  for (; r < r1; ++r) rows_from.template operator()<1>(r);
  if (partial)
#pragma unroll
    for (int j = 0; j < V; ++j) partial[int64_t(blockIdx.x) * cols + c + j] = sum[j];
}

// db[c] = Σ_k partial[k, c]: a block per kDbLanes columns; warp w adds chunks w, w + kDbWarps,
// ... in order, four loads in flight (one thread per column would wait on each in turn); the
// warps' sums are then added in warp order.
constexpr int kDbLanes = 32;
constexpr int kDbWarps = 32;

template <typename T>
__global__ void __launch_bounds__(kDbLanes * kDbWarps)
    bias_gelu_db(T* __restrict__ db, const float* __restrict__ partial, int64_t chunks,
                 int64_t cols) {
  pdl_start();
  __shared__ float sums[kDbWarps][kDbLanes];
  const int lane = threadIdx.x, warp = threadIdx.y;
  const int64_t c = int64_t(blockIdx.x) * kDbLanes + lane;
  float s = 0.0f;
  if (c < cols) {
    const float* p = partial + c;
    int64_t k = warp;
    for (; k + 3 * kDbWarps < chunks; k += 4 * kDbWarps) {
      const float a0 = p[k * cols], a1 = p[(k + kDbWarps) * cols];
      const float a2 = p[(k + 2 * kDbWarps) * cols], a3 = p[(k + 3 * kDbWarps) * cols];
      s += a0;
      s += a1;
      s += a2;
      s += a3;
    }
    for (; k < chunks; k += kDbWarps) s += p[k * cols];
  }
  sums[warp][lane] = s;
  __syncthreads();
  if (warp != 0 || c >= cols) return;
  float t = 0.0f;
#pragma unroll
  for (int w = 0; w < kDbWarps; ++w) t += sums[w][lane];
  db[c] = cvt<T>(t);
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
    constexpr auto kernel = bias_gelu_bwd<T, V, kRowsPerStep>;
    const int64_t per_row = cols / V;
    const int64_t lanes = std::min<int64_t>((per_row + 31) / 32 * 32, kMaxLanes);
    const int64_t slabs = (per_row + lanes - 1) / lanes;
    const int64_t resident =
        int64_t(context().props.multiProcessorCount) *
        resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), int(lanes), 0);
    const int64_t chunks = std::clamp<int64_t>(resident / slabs, 1, rows);
    const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
    const int64_t used = (rows + rows_per_chunk - 1) / rows_per_chunk;
    Tensor partial;
    if (dbias.defined())
      partial = empty({used, cols}, TensorOptions(DType::f32).with_device(y.device()));
    launch(kernel, dim3(unsigned(used), unsigned(slabs)), dim3(unsigned(lanes)), 0,
           current_stream(), static_cast<T*>(dy.raw_data()),
           partial.defined() ? static_cast<float*>(partial.raw_data()) : nullptr,
           static_cast<const T*>(dout.raw_data()), static_cast<const T*>(y.raw_data()),
           static_cast<const T*>(bias.raw_data()), rows, cols, rows_per_chunk);
    if (dbias.defined())
      launch(bias_gelu_db<T>, dim3(unsigned((cols + kDbLanes - 1) / kDbLanes)),
             dim3(kDbLanes, kDbWarps), 0, current_stream(),
             static_cast<T*>(dbias.raw_data()), static_cast<const float*>(partial.raw_data()),
             used, cols);
  });
}

}  // namespace kiln::cuda
