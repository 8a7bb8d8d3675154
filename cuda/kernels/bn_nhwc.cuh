#pragma once
// Shared by the batch norm on f16 NHWC activations with known statistics (contract in
// cuda/kernels.h), whose passes live in three files: bn_nhwc_stats.cu (the forward statistics),
// bn_nhwc_apply.cu (finalize and the forward apply passes: plain, dual, ReLU + max pool) and
// bn_nhwc_backward.cu (the backward passes).
//
// Every pass moves 16-byte vectors: 8 neighbouring channels of one (n, h, w) row. The per-channel
// sums (the forward's statistics when the convolution did not produce them, and the backward's)
// run in two kernels: blocks write partial sums over a fixed split of the rows, then a finishing
// kernel adds them per channel in a fixed order — bit-reproducible, so a replayed CUDA graph
// matches eager execution. That sums kernel is defined here, as a template each file
// instantiates for the modes it launches.
//
// Everything here has internal linkage (an unnamed namespace): each file that includes it
// compiles and launches its own kernels, as when the family was one file.
#include <algorithm>
#include <cstdint>

#include "core/elementwise_math.h"
#include "core/switches.h"
#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"

namespace kiln::cuda {
namespace {

constexpr int kVec = 8;  // halves per 16-byte vector
constexpr int kMaxParts = 1024;

struct Vec8 {
  float v[kVec];
};

__device__ inline Vec8 load8(const uint4* p, int64_t i) {
  const uint4 u = p[i];
  const __half2* h = reinterpret_cast<const __half2*>(&u);
  Vec8 out;
#pragma unroll
  for (int j = 0; j < kVec / 2; ++j) {
    const float2 f = __half22float2(h[j]);
    out.v[2 * j] = f.x;
    out.v[2 * j + 1] = f.y;
  }
  return out;
}

__device__ inline void store8(uint4* p, int64_t i, const Vec8& v) {
  uint4 u;
  __half2* h = reinterpret_cast<__half2*>(&u);
#pragma unroll
  for (int j = 0; j < kVec / 2; ++j) h[j] = __floats2half2_rn(v.v[2 * j], v.v[2 * j + 1]);
  p[i] = u;
}

// 8 consecutive floats from a 16-byte aligned address.
__device__ inline Vec8 load8f(const float* p) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  return Vec8{{a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w}};
}

// ---- the per-channel sums ----

// Where the ReLU mask comes from; kStatsOfX: no gradient at all, the sums kernel's terms are x
// itself (the forward statistics Σx and Σx²); kGeluFromX: no mask, dy times GELU's derivative at
// x·scale + shift, recomputed from x.
enum MaskMode : int { kNoMask = 0, kMaskFromX = 1, kMaskBits = 2, kStatsOfX = 3, kGeluFromX = 4 };

// Whether a mode reads the forward's scale and shift (it recomputes the activation's input).
constexpr bool reads_scale_shift(int mode) { return mode == kMaskFromX || mode == kGeluFromX; }

// g = dy·mask for the 8 channels of vector i (x itself for kStatsOfX).
template <int kMode>
__device__ inline Vec8 masked_grad(const uint4* dy, const uint8_t* mask, const Vec8& xv,
                                   const Vec8& sc, const Vec8& sh, int64_t i) {
  if constexpr (kMode == kStatsOfX) return xv;
  Vec8 g = load8(dy, i);
  if constexpr (kMode == kGeluFromX) {
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      g.v[j] = math::binary_apply(BinaryOp::GeluBackward, g.v[j], fmaf(xv.v[j], sc.v[j], sh.v[j]),
                                  1.f);
  } else if constexpr (kMode == kMaskFromX) {
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      if (!(fmaf(xv.v[j], sc.v[j], sh.v[j]) > 0.f)) g.v[j] = 0.f;
  } else if constexpr (kMode == kMaskBits) {
    const unsigned bits = mask[i];
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      if (!((bits >> j) & 1u)) g.v[j] = 0.f;
  }
  return g;
}

// Block (tx, ty), tx·ty = kBlock, tx vectors of a row side by side; grid (tiles, parts).
// partial (parts, 2, C): Σg and Σg·(x - mean) over this part's rows; for kStatsOfX (g = x, no
// mean) Σx and Σx².
template <int kMode>
__global__ void backward_sums_kernel(const uint4* __restrict__ dy, const uint4* __restrict__ x,
                                     const uint8_t* __restrict__ y, const float* __restrict__ mean,
                                     const float* __restrict__ scale_shift,
                                     float* __restrict__ partial, int64_t rows, int64_t G,
                                     int64_t C, int parts) {
  pdl_start();
  __shared__ float sh_sums[kBlock * 2 * kVec];
  const int tx = threadIdx.x, ty = threadIdx.y, nx = blockDim.x, ny = blockDim.y;
  const int64_t gv = int64_t(blockIdx.x) * nx + tx;
  float s1[kVec] = {}, s2[kVec] = {};
  if (gv < G) {
    const int64_t c0 = gv * kVec;
    Vec8 m{};
    if constexpr (kMode != kStatsOfX) m = load8f(mean + c0);
    Vec8 sc{}, shf{};
    if constexpr (reads_scale_shift(kMode)) {
      sc = load8f(scale_shift + c0);
      shf = load8f(scale_shift + C + c0);
    }
    // Two rows per iteration: twice the loads in flight.
    const int64_t step = int64_t(parts) * ny;
    int64_t r = int64_t(blockIdx.y) * ny + ty;
    for (; r + step < rows; r += 2 * step) {
      const int64_t i0 = r * G + gv, i1 = (r + step) * G + gv;
      const Vec8 x0 = load8(x, i0), x1 = load8(x, i1);
      const Vec8 g0 = masked_grad<kMode>(dy, y, x0, sc, shf, i0);
      const Vec8 g1 = masked_grad<kMode>(dy, y, x1, sc, shf, i1);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        s1[j] += g0.v[j] + g1.v[j];
        s2[j] = fmaf(g0.v[j], x0.v[j] - m.v[j], fmaf(g1.v[j], x1.v[j] - m.v[j], s2[j]));
      }
    }
    if (r < rows) {
      const int64_t i = r * G + gv;
      const Vec8 xv = load8(x, i);
      const Vec8 g = masked_grad<kMode>(dy, y, xv, sc, shf, i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        s1[j] += g.v[j];
        s2[j] = fmaf(g.v[j], xv.v[j] - m.v[j], s2[j]);
      }
    }
  }
  // Column k of the block's (ny, nx·16) table: sums of one channel's term over the block's rows.
  const int width = nx * 2 * kVec;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    sh_sums[ty * width + tx * 2 * kVec + j] = s1[j];
    sh_sums[ty * width + tx * 2 * kVec + kVec + j] = s2[j];
  }
  __syncthreads();
  for (int col = ty * nx + tx; col < width; col += nx * ny) {
    float s = 0.f;
    for (int row = 0; row < ny; ++row) s += sh_sums[row * width + col];
    const int vx = col / (2 * kVec), k = col % (2 * kVec);
    const int64_t v = int64_t(blockIdx.x) * nx + vx;
    if (v < G) {
      const int64_t c = v * kVec + (k % kVec);
      partial[(int64_t(blockIdx.y) * 2 + k / kVec) * C + c] = s;
    }
  }
}

// The finishing kernels add the partial sums (parts, T, C) of the sums kernels. Block
// (32, kFinishRows), grid ceil(C / 32): thread (tx, ty) adds parts ty, ty + kFinishRows, ... of
// channel 32·blockIdx.x + tx (neighbouring threads read neighbouring channels), then the rows
// of the block are added in order — a fixed order, so bit-reproducible. The totals are valid in
// the threads with ty == 0 and a channel below C, for which finish_sums returns true. (Eight
// running sums per thread, taken in turn, made these kernels 3–4× slower: docs/lab/batch-norm.md.)
constexpr int kFinishRows = 8;
const dim3 kFinishBlock{32, kFinishRows};

template <int T>
__device__ bool finish_sums(const float* __restrict__ partial, int64_t C, int parts,
                            float (&s)[T]) {
  __shared__ float sh[kFinishRows][T][32];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = int64_t(blockIdx.x) * 32 + tx;
#pragma unroll
  for (int t = 0; t < T; ++t) s[t] = 0.f;
  if (c < C)
    for (int q = ty; q < parts; q += kFinishRows)
#pragma unroll
      for (int t = 0; t < T; ++t) s[t] += partial[(int64_t(q) * T + t) * C + c];
#pragma unroll
  for (int t = 0; t < T; ++t) sh[ty][t][tx] = s[t];
  __syncthreads();
  if (ty != 0 || c >= C) return false;
#pragma unroll
  for (int t = 0; t < T; ++t) {
    float a = 0.f;
    for (int r = 0; r < kFinishRows; ++r) a += sh[r][t][tx];
    s[t] = a;
  }
  return true;
}

inline unsigned finish_grid(int64_t C) { return unsigned((C + 31) / 32); }

// ---- host side ----

inline const uint4* vec_in(const Tensor& t) { return static_cast<const uint4*>(t.raw_data()); }
inline uint4* vec_out(const Tensor& t) { return static_cast<uint4*>(t.raw_data()); }

inline void check_act(const Tensor& t, const Tensor& x, const char* op, const char* what) {
  KILN_CHECK(t.defined() && t.dtype() == DType::f16 && t.shape() == x.shape() &&
                 t.device() == x.device() && t.is_contiguous(MemoryFormat::ChannelsLast),
             op, " (cuda): ", what, " must be f16 channels-last like x ", x.desc(), ", got ",
             t.defined() ? t.desc() : "undefined");
}

// A tensor of the stem pool's output shape `out` (y, its gradient, the positions, at_max):
// dtype `dt`, channels-last, on x's device.
inline void check_pooled(const Tensor& t, DType dt, const Shape& out, const Tensor& x,
                         const char* op, const char* what) {
  KILN_CHECK(t.defined() && t.dtype() == dt && t.shape() == out && t.device() == x.device() &&
                 t.is_contiguous(MemoryFormat::ChannelsLast),
             op, " (cuda): ", what, " must be ", dtype_name(dt), " channels-last ", shape_str(out),
             " for x ", x.desc(), ", got ", t.defined() ? t.desc() : "undefined");
}

// Blocks of `kernel` (kBlock threads, no dynamic shared memory) resident on one SM of the
// current device.
inline int resident_blocks(const void* kernel) {
  return resident_blocks_per_sm(kernel, kBlock, 0);
}

// Launch shape of the backward sums over (rows, G vectors): tx vectors of a row side by side per
// block row, ty rows, and as many parts (row splits) as the device holds blocks of `kernel` at
// once: one wave, so every resident block streams rows until the end and the finishing kernel
// adds as few partials as keep the memory busy (8 blocks per SM, 1,024 partials per channel at
// 64 channels, before v14). Depends only on the shape, the kernel and the device, which
// keeps the sums bit-reproducible.
struct SumsLaunch {
  dim3 grid, block;
  int parts;
};
inline SumsLaunch sums_launch(int64_t rows, int64_t G, const void* kernel) {
  const int tx = int(std::min<int64_t>(G, 32)), ty = kBlock / tx;
  const int64_t tiles = (G + tx - 1) / tx;
  const int64_t target = int64_t(context().props.multiProcessorCount) * resident_blocks(kernel);
  const int64_t useful = (rows + ty - 1) / ty;
  const int parts = int(std::clamp<int64_t>((target + tiles - 1) / tiles, 1,
                                            std::clamp<int64_t>(useful, 1, kMaxParts)));
  return {dim3{unsigned(tiles), unsigned(parts)}, dim3{unsigned(tx), unsigned(ty)}, parts};
}

// The ReLU bitmask: u8, one byte per 16-byte vector of x.
inline uint8_t* mask_ptr(const Tensor& m, int64_t vecs, const Tensor& x, const char* op) {
  KILN_CHECK(m.defined() && m.dtype() == DType::u8 && m.is_contiguous() && m.numel() == vecs &&
                 m.device() == x.device(),
             op, " (cuda): mask must be a contiguous u8 tensor of ", vecs, " elements on ",
             x.device(), ", got ", m.defined() ? m.desc() : "undefined");
  return static_cast<uint8_t*>(m.raw_data());
}

inline float* required(float* p, const char* op, const char* what) {
  KILN_CHECK(p != nullptr, op, " (cuda): ", what, " is required");
  return p;
}

inline void check_x(const Tensor& x, const char* op) {
  KILN_CHECK(bn_nhwc_supported(x), op,
             " (cuda): x must be f16, 4-D, channels-last, with channels a multiple of 8, got ",
             x.desc());
}

}  // namespace
}  // namespace kiln::cuda
