// Batch norm on f16 NHWC activations with known statistics (contract in cuda/kernels.h).
//
// Every pass moves 16-byte vectors: 8 neighbouring channels of one (n, h, w) row. The per-channel
// sums (the forward's statistics when the convolution did not produce them, and the backward's)
// run in two kernels: blocks write partial sums over a fixed split of the rows, then a finishing
// kernel adds them per channel in a fixed order — bit-reproducible, so a replayed CUDA graph
// matches eager execution.
#include <algorithm>
#include <utility>

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

// ---- forward ----

// BnStatsFinalize as raw pointers (null: undefined); sum == nullptr: nothing to finalize, the
// scale_shift is an input.
struct Finalize {
  float *mean = nullptr, *invstd = nullptr, *scale_shift = nullptr, *rm = nullptr, *rv = nullptr;
  const float *sum = nullptr, *sqsum = nullptr, *w = nullptr, *b = nullptr;
  int64_t* counter = nullptr;
  double n = 0, momentum = 0, eps = 0;
};

// One thread per channel, in double; thread 0 also counts.
__global__ void finalize_kernel(Finalize f, int64_t C) {
  pdl_start();
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t == 0 && f.counter != nullptr) ++*f.counter;
  for (int64_t c = t; c < C; c += int64_t(gridDim.x) * blockDim.x) {
    const double mu = double(f.sum[c]) / f.n;
    const double var = fmax(double(f.sqsum[c]) / f.n - mu * mu, 0.0);
    const double k = 1.0 / sqrt(var + f.eps);
    const double scale = (f.w != nullptr ? double(f.w[c]) : 1.0) * k;
    f.mean[c] = float(mu);
    f.invstd[c] = float(k);
    f.scale_shift[c] = float(scale);
    f.scale_shift[C + c] = float((f.b != nullptr ? double(f.b[c]) : 0.0) - mu * scale);
    if (f.rm != nullptr) {
      f.rm[c] = float((1.0 - f.momentum) * double(f.rm[c]) + f.momentum * mu);
      f.rv[c] = float((1.0 - f.momentum) * double(f.rv[c]) + f.momentum * var * f.n / (f.n - 1.0));
    }
  }
}

// The scale and shift of vector i's 8 channels.
__device__ inline void factors8(const float* ss, int64_t i, int64_t G, int64_t C, Vec8& sc,
                                Vec8& sh) {
  const int64_t c0 = (i % G) * kVec;
  sc = load8f(ss + c0);
  sh = load8f(ss + C + c0);
}

// NaN stays NaN through the ReLU (a comparison with NaN is false).
__device__ inline float relu_keep_nan(float v) { return v < 0.f ? 0.f : v; }

// A grid-stride loop over 16-byte vectors keeps each thread on one group of 8 channels when
// the stride is a multiple of G (vectors per row) — always for ResNet's channel counts — so the
// per-channel factors are loaded once, not per vector.
template <bool kRelu, bool kAdd>
__global__ void apply_kernel(uint4* __restrict__ y, const uint4* __restrict__ x,
                             const uint4* __restrict__ z, const float* __restrict__ ss,
                             uint8_t* __restrict__ mask, int64_t vecs, int64_t G, int64_t C) {
  pdl_start();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const bool fixed = stride % G == 0;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= vecs) return;
  Vec8 sc, sh;
  factors8(ss, i, G, C, sc, sh);
  for (; i < vecs; i += stride) {
    if (!fixed) factors8(ss, i, G, C, sc, sh);
    Vec8 v = load8(x, i);
    Vec8 r;
    if constexpr (kAdd) r = load8(z, i);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float a = fmaf(v.v[j], sc.v[j], sh.v[j]);
      if constexpr (kAdd) a += r.v[j];
      if constexpr (kRelu) a = relu_keep_nan(a);
      v.v[j] = a;
    }
    store8(y, i, v);
    if constexpr (kRelu && kAdd) {
      unsigned bits = 0;
#pragma unroll
      for (int j = 0; j < kVec; ++j) bits |= unsigned(v.v[j] > 0.f) << j;
      mask[i] = uint8_t(bits);
    }
  }
}

// ---- backward ----

// Where the ReLU mask comes from; kStatsOfX: no gradient at all, the sums kernel's terms are x
// itself (the forward statistics Σx and Σx²).
enum MaskMode : int { kNoMask = 0, kMaskFromX = 1, kMaskBits = 2, kStatsOfX = 3 };

// g = dy·mask for the 8 channels of vector i (x itself for kStatsOfX).
template <int kMode>
__device__ inline Vec8 masked_grad(const uint4* dy, const uint8_t* mask, const Vec8& xv,
                                   const Vec8& sc, const Vec8& sh, int64_t i) {
  if constexpr (kMode == kStatsOfX) return xv;
  Vec8 g = load8(dy, i);
  if constexpr (kMode == kMaskFromX) {
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
    if constexpr (kMode == kMaskFromX) {
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

unsigned finish_grid(int64_t C) { return unsigned((C + 31) / 32); }

// Per channel: dweight, dbias, and the coefficients of dx = A·g + B·x + C0.
__global__ void backward_finish_kernel(float* __restrict__ dweight, float* __restrict__ dbias,
                                       float* __restrict__ coef, const float* __restrict__ partial,
                                       const float* __restrict__ w, const float* __restrict__ mean,
                                       const float* __restrict__ invstd, int64_t C, int parts,
                                       double n, bool acc) {
  pdl_start();
  float sums[2];
  if (!finish_sums(partial, C, parts, sums)) return;
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const float s1 = sums[0], s2 = sums[1];
  const double k = double(invstd[c]);
  const double sum_gxhat = double(s2) * k;
  if (dweight != nullptr) dweight[c] = float(sum_gxhat) + (acc ? dweight[c] : 0.f);
  if (dbias != nullptr) dbias[c] = s1 + (acc ? dbias[c] : 0.f);
  const double a = (w != nullptr ? double(w[c]) : 1.0) * k;
  const double bcoef = -a * k * sum_gxhat / n;
  coef[c] = float(a);
  coef[C + c] = float(bcoef);
  coef[2 * C + c] = float(-a * double(s1) / n - bcoef * double(mean[c]));
}

// sum and sqsum (C) from the kStatsOfX partials.
__global__ void stats_finish_kernel(float* __restrict__ sum, float* __restrict__ sqsum,
                                    const float* __restrict__ partial, int64_t C, int parts) {
  pdl_start();
  float sums[2];
  if (!finish_sums(partial, C, parts, sums)) return;
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  sum[c] = sums[0];
  sqsum[c] = sums[1];
}

template <int kMode, bool kDz>
__global__ void backward_apply_kernel(uint4* __restrict__ dx, uint4* __restrict__ dz,
                                      const uint4* __restrict__ dy, const uint4* __restrict__ x,
                                      const uint8_t* __restrict__ y,
                                      const float* __restrict__ scale_shift,
                                      const float* __restrict__ coef, int64_t vecs, int64_t G,
                                      int64_t C) {
  pdl_start();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const bool fixed = stride % G == 0;  // as in apply_kernel
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= vecs) return;
  Vec8 sc{}, shf{}, a, b, c;
  auto load_factors = [&](int64_t v) {
    const int64_t c0 = (v % G) * kVec;
    if constexpr (kMode == kMaskFromX) {
      sc = load8f(scale_shift + c0);
      shf = load8f(scale_shift + C + c0);
    }
    a = load8f(coef + c0);
    b = load8f(coef + C + c0);
    c = load8f(coef + 2 * C + c0);
  };
  load_factors(i);
  for (; i < vecs; i += stride) {
    if (!fixed) load_factors(i);
    const Vec8 xv = load8(x, i);
    const Vec8 g = masked_grad<kMode>(dy, y, xv, sc, shf, i);
    if constexpr (kDz) store8(dz, i, g);
    Vec8 out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.v[j] = fmaf(a.v[j], g.v[j], fmaf(b.v[j], xv.v[j], c.v[j]));
    store8(dx, i, out);
  }
}


// ---- two batch norms meeting at the residual add ----

__global__ void dual_apply_kernel(uint4* __restrict__ y, const uint4* __restrict__ x,
                                  const float* __restrict__ ssx, const uint4* __restrict__ r,
                                  const float* __restrict__ ssr, uint8_t* __restrict__ mask,
                                  int64_t vecs, int64_t G, int64_t C) {
  pdl_start();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const bool fixed = stride % G == 0;  // as in apply_kernel
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= vecs) return;
  Vec8 a1, b1, a2, b2;
  auto load_factors = [&](int64_t v) {
    factors8(ssx, v, G, C, a1, b1);
    factors8(ssr, v, G, C, a2, b2);
  };
  load_factors(i);
  for (; i < vecs; i += stride) {
    if (!fixed) load_factors(i);
    Vec8 v = load8(x, i);
    const Vec8 u = load8(r, i);
    unsigned bits = 0;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float a = relu_keep_nan(fmaf(v.v[j], a1.v[j], b1.v[j]) + fmaf(u.v[j], a2.v[j], b2.v[j]));
      bits |= unsigned(a > 0.f) << j;
      v.v[j] = a;
    }
    store8(y, i, v);
    mask[i] = uint8_t(bits);
  }
}

// As backward_sums_kernel, with three sums per channel: Σg, Σg·(x - mean_x), Σg·(r - mean_r).
// partial (parts, 3, C).
__global__ void dual_sums_kernel(const uint4* __restrict__ dy, const uint8_t* __restrict__ mask,
                                 const uint4* __restrict__ x, const float* __restrict__ mean_x,
                                 const uint4* __restrict__ r, const float* __restrict__ mean_r,
                                 float* __restrict__ partial, int64_t rows, int64_t G, int64_t C,
                                 int parts) {
  pdl_start();
  __shared__ float sh_sums[kBlock * 3 * kVec];
  const int tx = threadIdx.x, ty = threadIdx.y, nx = blockDim.x, ny = blockDim.y;
  const int64_t gv = int64_t(blockIdx.x) * nx + tx;
  float s1[kVec] = {}, s2[kVec] = {}, s3[kVec] = {};
  if (gv < G) {
    const int64_t c0 = gv * kVec;
    const Vec8 mx = load8f(mean_x + c0), mr = load8f(mean_r + c0);
    const Vec8 none{};
    for (int64_t row = int64_t(blockIdx.y) * ny + ty; row < rows; row += int64_t(parts) * ny) {
      const int64_t i = row * G + gv;
      const Vec8 xv = load8(x, i), rv = load8(r, i);
      const Vec8 g = masked_grad<kMaskBits>(dy, mask, xv, none, none, i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        s1[j] += g.v[j];
        s2[j] = fmaf(g.v[j], xv.v[j] - mx.v[j], s2[j]);
        s3[j] = fmaf(g.v[j], rv.v[j] - mr.v[j], s3[j]);
      }
    }
  }
  const int width = nx * 3 * kVec;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    sh_sums[ty * width + tx * 3 * kVec + j] = s1[j];
    sh_sums[ty * width + tx * 3 * kVec + kVec + j] = s2[j];
    sh_sums[ty * width + tx * 3 * kVec + 2 * kVec + j] = s3[j];
  }
  __syncthreads();
  for (int col = ty * nx + tx; col < width; col += nx * ny) {
    float sum = 0.f;
    for (int row = 0; row < ny; ++row) sum += sh_sums[row * width + col];
    const int vx = col / (3 * kVec), k = col % (3 * kVec);
    const int64_t v = int64_t(blockIdx.x) * nx + vx;
    if (v < G) partial[(int64_t(blockIdx.y) * 3 + k / kVec) * C + v * kVec + (k % kVec)] = sum;
  }
}

// As backward_finish_kernel, for both sides; coef (6C): A, B, C0 for x then for r.
__global__ void dual_finish_kernel(float* __restrict__ dwx, float* __restrict__ dbx,
                                   float* __restrict__ dwr, float* __restrict__ dbr,
                                   float* __restrict__ coef, const float* __restrict__ partial,
                                   const float* __restrict__ wx, const float* __restrict__ mx,
                                   const float* __restrict__ kx, const float* __restrict__ wr,
                                   const float* __restrict__ mr, const float* __restrict__ kr,
                                   int64_t C, int parts, double n, bool acc) {
  pdl_start();
  float s[3];
  if (!finish_sums(partial, C, parts, s)) return;
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  auto side = [&](int t, const float* w, const float* m, const float* kk, float* dw, float* db,
                  float* out) {
    const double k = double(kk[c]);
    const double sum_gxhat = double(s[t]) * k;
    if (dw != nullptr) dw[c] = float(sum_gxhat) + (acc ? dw[c] : 0.f);
    if (db != nullptr) db[c] = s[0] + (acc ? db[c] : 0.f);
    const double a = (w != nullptr ? double(w[c]) : 1.0) * k;
    const double b = -a * k * sum_gxhat / n;
    out[c] = float(a);
    out[C + c] = float(b);
    out[2 * C + c] = float(-a * double(s[0]) / n - b * double(m[c]));
  };
  side(1, wx, mx, kx, dwx, dbx, coef);
  side(2, wr, mr, kr, dwr, dbr, coef + 3 * C);
}

__global__ void dual_backward_apply_kernel(uint4* __restrict__ dx, uint4* __restrict__ dr,
                                           const uint4* __restrict__ dy,
                                           const uint8_t* __restrict__ mask,
                                           const uint4* __restrict__ x,
                                           const uint4* __restrict__ r,
                                           const float* __restrict__ coef, int64_t vecs,
                                           int64_t G, int64_t C) {
  pdl_start();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const bool fixed = stride % G == 0;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= vecs) return;
  Vec8 a1, b1, c1, a2, b2, c2;
  auto load_factors = [&](int64_t v) {
    const int64_t c0 = (v % G) * kVec;
    a1 = load8f(coef + c0);
    b1 = load8f(coef + C + c0);
    c1 = load8f(coef + 2 * C + c0);
    a2 = load8f(coef + 3 * C + c0);
    b2 = load8f(coef + 4 * C + c0);
    c2 = load8f(coef + 5 * C + c0);
  };
  load_factors(i);
  const Vec8 none{};
  for (; i < vecs; i += stride) {
    if (!fixed) load_factors(i);
    const Vec8 xv = load8(x, i), rv = load8(r, i);
    const Vec8 g = masked_grad<kMaskBits>(dy, mask, xv, none, none, i);
    Vec8 ox, orr;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      ox.v[j] = fmaf(a1.v[j], g.v[j], fmaf(b1.v[j], xv.v[j], c1.v[j]));
      orr.v[j] = fmaf(a2.v[j], g.v[j], fmaf(b2.v[j], rv.v[j], c2.v[j]));
    }
    store8(dx, i, ox);
    store8(dr, i, orr);
  }
}

// ---- batch norm + ReLU + 3x3/2 max pool (the ResNet stem) ----

// y = max_pool2d(relu(x·scale + shift), 3x3, stride 2, pad 1) and the window position (0-8) of
// each maximum, bit for bit what apply_kernel<true, false> followed by max_pool_fwd_nhwc give:
// each normalised value is rounded to f16 before the comparison, positions are visited in the
// same order with the same rule (first valid, then NaN over a number, then strictly greater).
// The normalised tensor itself is never written. Thread: one output pixel's 8 channels; grid
// (ceil(OH·OW·G / kBlock), N) keeps the index arithmetic in 32 bits; the 9 loads are issued
// before any is used. The kernel is bound by its instructions (72 normalise-round-compare steps
// per thread), not by memory: comparing f16 keys instead of floats and 3 blocks per SM (80
// registers) took it from 406 to 310 µs on the ResNet-50 stem at batch 256 (docs/lab/stem.md, v13).
__global__ void __launch_bounds__(kBlock, 3)
    relu_max_pool_k3s2_kernel(uint4* __restrict__ y, uint2* __restrict__ idx,
                              const uint4* __restrict__ x, const float* __restrict__ scale_shift,
                              int H, int W, int OH, int OW, int G) {
  pdl_start();
  const int t = int(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= OH * OW * G) return;
  const int g = t % G, pix = t / G, ow = pix % OW, oh = pix / OW;
  const int64_t n = blockIdx.y, C = int64_t(G) * kVec;
  const Vec8 sc = load8f(scale_shift + g * kVec), sh = load8f(scale_shift + C + g * kVec);
  uint4 raw[9];
  bool valid[9];
#pragma unroll
  for (int k = 0; k < 9; ++k) {
    const int h = 2 * oh - 1 + k / 3, w = 2 * ow - 1 + k % 3;
    valid[k] = h >= 0 && h < H && w >= 0 && w < W;
    if (valid[k]) raw[k] = x[((n * H + h) * W + w) * G + g];
  }
  // The comparison runs on the f16 bits with the sign cleared: after the ReLU a value is +0,
  // -0 (kept, as relu_keep_nan keeps it), positive or NaN (one bit pattern once rounded to f16),
  // so this key orders them as max_pool_fwd_nhwc's float comparison does — ±0 tie, NaN above
  // every number, NaNs tie — and a strictly greater key takes over: first position wins ties.
  // (A NaN is stored as rounded; the unfused pool passes it through float and back, which may
  // change its sign or payload bits. Numbers are identical.)
  int key[kVec];
  unsigned bits[kVec], arg[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    key[j] = -1;  // below every key: the first valid position always takes over
    bits[j] = 0xfc00u;  // -inf, as max_pool_fwd_nhwc for a window without input (not reached)
    arg[j] = 0xffu;
  }
#pragma unroll
  for (int k = 0; k < 9; ++k) {
    if (!valid[k]) continue;
    const __half2* hv = reinterpret_cast<const __half2*>(&raw[k]);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float2 f2 = __half22float2(hv[j / 2]);
      const float a = relu_keep_nan(fmaf(j % 2 ? f2.y : f2.x, sc.v[j], sh.v[j]));
      const unsigned h = __half_as_ushort(__float2half_rn(a));
      const int kk = int(h & 0x7fffu);
      if (kk > key[j]) {
        key[j] = kk;
        bits[j] = h;
        arg[j] = unsigned(k);
      }
    }
  }
  uint4 out;
  uint2 packed{0u, 0u};
  unsigned* ow32 = reinterpret_cast<unsigned*>(&out);
#pragma unroll
  for (int j = 0; j < kVec / 2; ++j) ow32[j] = bits[2 * j] | (bits[2 * j + 1] << 16);
#pragma unroll
  for (int j = 0; j < kVec; ++j) (j < 4 ? packed.x : packed.y) |= arg[j] << (8 * (j % 4));
  const int64_t o = (n * OH + oh) * int64_t(OW) * G + int64_t(ow) * G + g;
  y[o] = out;
  idx[o] = packed;
}

// Its backward. The pool's gradient goes back to the 2x2 block of input pixels (2a..2a+1,
// 2b..2b+1) from the 4 windows (a..a+1, b..b+1) that cover it, added and rounded to f16 exactly
// as max_pool_bwd_nhwc_k3s2 does, then masked by the ReLU recomputed from x — the g the
// unfused backward_*_kernel<kMaskFromX> would read — without writing it: the sums and the apply
// kernel each rebuild it from dy and the indices (1/4 and 1/8 of x's bytes).
struct StemPoolGeom {
  int H, W, OH, OW, G, BH, BW;  // BH, BW: 2x2 blocks of input pixels per column, row
};

// Item i = ((n·BH + a)·BW + b)·G + gv: calls use(e, xv, g) for each input pixel of the block
// (e: the pixel's vector index, x there, the masked gradient there). The 4 windows' indices
// and gradients and the 4 pixels' x are loaded first, as raw vectors (all loads in flight),
// then each pixel is finished and handed over in turn. Registers bound these kernels: at 160
// per thread (every pixel's g and x kept as floats) they took 663 + 763 µs on the stem, more
// than the two unfused passes; streamed, with at most 128 (2 blocks per SM), 268 + 308 µs.
// Forcing 3 blocks per SM spills.
template <class Use>
__device__ inline void for_each_pool_relu_grad(const uint4* __restrict__ dy,
                                               const uint2* __restrict__ idx,
                                               const uint4* __restrict__ x, const Vec8& sc,
                                               const Vec8& sh, const StemPoolGeom& s, int i,
                                               Use&& use) {
  const int gv = i % s.G;
  int r = i / s.G;
  const int b = r % s.BW;
  r /= s.BW;
  const int a = r % s.BH;
  const int64_t n = r / s.BH;
  uint2 iv[4];
  uint4 d[4], xr[4];
  bool ok[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int oh = a + (q >> 1), ow = b + (q & 1);
    ok[q] = oh < s.OH && ow < s.OW;
    if (ok[q]) {
      const int64_t o = ((n * s.OH + oh) * s.OW + ow) * s.G + gv;
      iv[q] = idx[o];
      d[q] = dy[o];
    }
  }
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int h = 2 * a + (p >> 1), w = 2 * b + (p & 1);
    if (h < s.H && w < s.W) xr[p] = x[((n * s.H + h) * s.W + w) * s.G + gv];
  }
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int dh = p >> 1, dw = p & 1, h = 2 * a + dh, w = 2 * b + dw;
    if (h >= s.H || w >= s.W) continue;
    float acc[kVec] = {};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int qh = q >> 1, qw = q & 1;
      // window a+1 (b+1) starts at row 2a+1 (column 2b+1): it does not cover dh = 0 (dw = 0)
      if (!ok[q] || (qh && !dh) || (qw && !dw)) continue;
      const unsigned k = unsigned((qh ? 0 : dh + 1) * 3 + (qw ? 0 : dw + 1));
      const __half2* hv = reinterpret_cast<const __half2*>(&d[q]);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const unsigned pos = ((j < 4 ? iv[q].x : iv[q].y) >> (8 * (j % 4))) & 0xffu;
        const float2 f2 = __half22float2(hv[j / 2]);
        acc[j] += pos == k ? (j % 2 ? f2.y : f2.x) : 0.f;
      }
    }
    const int64_t e = ((n * s.H + h) * s.W + w) * s.G + gv;
    const Vec8 xv = load8(&xr[p], 0);
    Vec8 g;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float gj = __half2float(__float2half_rn(acc[j]));
      g.v[j] = fmaf(xv.v[j], sc.v[j], sh.v[j]) > 0.f ? gj : 0.f;
    }
    use(e, xv, g);
  }
}

// Σg and Σg·(x - mean) per channel over this block's items (grid-stride, a stride that is a
// multiple of G, so each thread keeps one channel vector): partial (parts, 2, C) as
// backward_sums_kernel's, the block's threads added in a fixed order.
__global__ void __launch_bounds__(kBlock, 2)
    pool_relu_sums_kernel(const uint4* __restrict__ dy, const uint2* __restrict__ idx,
                          const uint4* __restrict__ x, const float* __restrict__ mean,
                          const float* __restrict__ scale_shift, float* __restrict__ partial,
                          StemPoolGeom s, int items) {
  pdl_start();
  __shared__ float sh_sums[kBlock][2 * kVec];
  const int tid = threadIdx.x, gv = tid % s.G;
  const int64_t C = int64_t(s.G) * kVec;
  const Vec8 m = load8f(mean + gv * kVec), sc = load8f(scale_shift + gv * kVec),
             sh = load8f(scale_shift + C + gv * kVec);
  float s1[kVec] = {}, s2[kVec] = {};
  for (int i = int(blockIdx.x) * kBlock + tid; i < items; i += int(gridDim.x) * kBlock)
    for_each_pool_relu_grad(dy, idx, x, sc, sh, s, i,
                            [&](int64_t, const Vec8& xv, const Vec8& g) {
#pragma unroll
                              for (int j = 0; j < kVec; ++j) {
                                s1[j] += g.v[j];
                                s2[j] = fmaf(g.v[j], xv.v[j] - m.v[j], s2[j]);
                              }
                            });
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    sh_sums[tid][j] = s1[j];
    sh_sums[tid][kVec + j] = s2[j];
  }
  __syncthreads();
  for (int col = tid; col < 2 * C; col += kBlock) {
    const int k = int(col / C), c = int(col % C), v = c / kVec, j = c % kVec;
    float t = 0.f;
    for (int row = v; row < kBlock; row += s.G) t += sh_sums[row][k * kVec + j];
    partial[(int64_t(blockIdx.x) * 2 + k) * C + c] = t;
  }
}

// dx = A·g + B·x + C0 per channel (coef from backward_finish_kernel), for every input pixel.
__global__ void __launch_bounds__(kBlock, 2)
    pool_relu_apply_kernel(uint4* __restrict__ dx, const uint4* __restrict__ dy,
                           const uint2* __restrict__ idx, const uint4* __restrict__ x,
                           const float* __restrict__ scale_shift, const float* __restrict__ coef,
                           StemPoolGeom s, int items) {
  pdl_start();
  const int tid = threadIdx.x, gv = tid % s.G;
  const int64_t C = int64_t(s.G) * kVec;
  const Vec8 sc = load8f(scale_shift + gv * kVec), sh = load8f(scale_shift + C + gv * kVec);
  const Vec8 ca = load8f(coef + gv * kVec), cb = load8f(coef + C + gv * kVec),
             cc = load8f(coef + 2 * C + gv * kVec);
  for (int i = int(blockIdx.x) * kBlock + tid; i < items; i += int(gridDim.x) * kBlock)
    for_each_pool_relu_grad(dy, idx, x, sc, sh, s, i,
                            [&](int64_t e, const Vec8& xv, const Vec8& g) {
                              Vec8 out;
#pragma unroll
                              for (int j = 0; j < kVec; ++j)
                                out.v[j] = fmaf(ca.v[j], g.v[j], fmaf(cb.v[j], xv.v[j], cc.v[j]));
                              store8(dx, e, out);
                            });
}

// ---- host side ----

const uint4* vec_in(const Tensor& t) { return static_cast<const uint4*>(t.raw_data()); }
uint4* vec_out(const Tensor& t) { return static_cast<uint4*>(t.raw_data()); }

void check_act(const Tensor& t, const Tensor& x, const char* op, const char* what) {
  KILN_CHECK(t.defined() && t.dtype() == DType::f16 && t.shape() == x.shape() &&
                 t.device() == x.device() && t.is_contiguous(MemoryFormat::ChannelsLast),
             op, " (cuda): ", what, " must be f16 channels-last like x ", x.desc(), ", got ",
             t.defined() ? t.desc() : "undefined");
}

// Blocks of `kernel` (kBlock threads, no dynamic shared memory) resident on one SM of the
// current device. KILN_BN_SUMS_BLOCKS=N says N instead.
int resident_blocks(const void* kernel) {
  if (switches().bn_sums_blocks > 0) return switches().bn_sums_blocks;
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
SumsLaunch sums_launch(int64_t rows, int64_t G, const void* kernel) {
  const int tx = int(std::min<int64_t>(G, 32)), ty = kBlock / tx;
  const int64_t tiles = (G + tx - 1) / tx;
  const int64_t target = int64_t(context().props.multiProcessorCount) * resident_blocks(kernel);
  const int64_t useful = (rows + ty - 1) / ty;
  const int parts = int(std::clamp<int64_t>((target + tiles - 1) / tiles, 1,
                                            std::clamp<int64_t>(useful, 1, kMaxParts)));
  return {dim3{unsigned(tiles), unsigned(parts)}, dim3{unsigned(tx), unsigned(ty)}, parts};
}

// The ReLU bitmask: u8, one byte per 16-byte vector of x.
uint8_t* mask_ptr(const Tensor& m, int64_t vecs, const Tensor& x, const char* op) {
  KILN_CHECK(m.defined() && m.dtype() == DType::u8 && m.is_contiguous() && m.numel() == vecs &&
                 m.device() == x.device(),
             op, " (cuda): mask must be a contiguous u8 tensor of ", vecs, " elements on ",
             x.device(), ", got ", m.defined() ? m.desc() : "undefined");
  return static_cast<uint8_t*>(m.raw_data());
}

float* required(float* p, const char* op, const char* what) {
  KILN_CHECK(p != nullptr, op, " (cuda): ", what, " is required");
  return p;
}

void check_x(const Tensor& x, const char* op) {
  KILN_CHECK(bn_nhwc_supported(x), op,
             " (cuda): x must be f16, 4-D, channels-last, with channels a multiple of 8, got ",
             x.desc());
}

}  // namespace

bool bn_nhwc_supported(const Tensor& x) {
  return x.defined() && x.is_cuda() && x.dtype() == DType::f16 && x.dim() == 4 &&
         x.size(1) % kVec == 0 && x.size(1) > 0 && x.is_contiguous(MemoryFormat::ChannelsLast);
}

void bn_nhwc_stats(const Tensor& sum, const Tensor& sqsum, const Tensor& x) {
  const char* op = "bn_nhwc_stats";
  check_x(x, op);
  const int64_t C = x.size(1), G = C / kVec, rows = x.numel() / C;
  float* s = required(f32_ptr(sum, C, x, op, "sum"), op, "sum");
  float* q = required(f32_ptr(sqsum, C, x, op, "sqsum"), op, "sqsum");
  KILN_CHECK(rows > 0, op, " (cuda): x has no values, got ", x.desc());
  const SumsLaunch L =
      sums_launch(rows, G, reinterpret_cast<const void*>(backward_sums_kernel<kStatsOfX>));
  Tensor partial =
      empty({int64_t(L.parts) * 2 * C}, TensorOptions(DType::f32).with_device(x.device()));
  float* pp = static_cast<float*>(partial.raw_data());
  cudaStream_t st = current_stream();
  launch(backward_sums_kernel<kStatsOfX>, L.grid, L.block, 0, st, nullptr, vec_in(x), nullptr,
         nullptr, nullptr, pp, rows, G, C, L.parts);
  KILN_CUDA_CHECK_LAUNCH();
  launch(stats_finish_kernel, finish_grid(C), kFinishBlock, 0, st, s, q, pp, C, L.parts);
  KILN_CUDA_CHECK_LAUNCH();
}

namespace {

// f's pointers, checked against x's channels.
Finalize finalize_args(const BnStatsFinalize& f, const Tensor& x, const char* op) {
  const int64_t C = x.size(1);
  Finalize d;
  d.scale_shift =
      required(f32_ptr(f.scale_shift, 2 * C, x, op, "scale_shift"), op, "scale_shift");
  if (!f.sum.defined()) return d;
  KILN_CHECK(f.count > 1, op, " (cuda): needs more than one value per channel, got ", f.count);
  d.mean = required(f32_ptr(f.save_mean, C, x, op, "save_mean"), op, "save_mean");
  d.invstd = required(f32_ptr(f.save_invstd, C, x, op, "save_invstd"), op, "save_invstd");
  d.sum = required(f32_ptr(f.sum, C, x, op, "sum"), op, "sum");
  d.sqsum = required(f32_ptr(f.sqsum, C, x, op, "sqsum"), op, "sqsum");
  d.w = f32_ptr(f.weight, C, x, op, "weight");
  d.b = f32_ptr(f.bias, C, x, op, "bias");
  d.rm = f32_ptr(f.running_mean, C, x, op, "running_mean");
  d.rv = f32_ptr(f.running_var, C, x, op, "running_var");
  KILN_CHECK((d.rm == nullptr) == (d.rv == nullptr), op,
             " (cuda): running_mean and running_var must be given together");
  if (f.counter.defined()) {
    KILN_CHECK(f.counter.dtype() == DType::i64 && f.counter.numel() == 1 &&
                   f.counter.device() == x.device(),
               op, " (cuda): counter must be one i64 value on ", x.device(), ", got ",
               f.counter.desc());
    d.counter = static_cast<int64_t*>(f.counter.raw_data());
  }
  d.n = double(f.count);
  d.momentum = f.momentum;
  d.eps = f.eps;
  return d;
}

// f finalized (when it has statistics); its scale_shift is then the apply kernels' input.
// Finalizing inside the apply kernels, each block into shared memory, made them 11 µs slower
// per call (docs/lab/batch-norm.md): their 4 waves of blocks each paid the double-precision
// arithmetic's latency.
const float* finalized(const Finalize& f, int64_t C) {
  if (f.sum != nullptr) {
    launch(finalize_kernel, grid_for(C), kBlock, 0, current_stream(), f, C);
    KILN_CUDA_CHECK_LAUNCH();
  }
  return f.scale_shift;
}

}  // namespace

void bn_nhwc_finalize(const BnStatsFinalize& f) {
  const char* op = "bn_nhwc_finalize";
  KILN_CHECK(f.sum.defined() && f.sum.is_cuda() && f.sum.dim() == 1, op,
             " (cuda): sum must be a CUDA vector, got ", f.sum.defined() ? f.sum.desc() : "undefined");
  const int64_t C = f.sum.numel();
  // finalize_args checks the channel count against x's dimension 1: a (1, C) view of sum.
  const Finalize d = finalize_args(f, f.sum.reshape({1, C}), op);
  launch(finalize_kernel, grid_for(C), kBlock, 0, current_stream(), d, C);
  KILN_CUDA_CHECK_LAUNCH();
}

void bn_nhwc_apply(const Tensor& y, const Tensor& x, const Tensor& z, const BnStatsFinalize& f,
                   bool relu, const Tensor& mask) {
  const char* op = "bn_nhwc_apply";
  check_x(x, op);
  check_act(y, x, op, "y");
  if (z.defined()) check_act(z, x, op, "z");
  const int64_t C = x.size(1), G = C / kVec, vecs = x.numel() / kVec;
  uint8_t* mp = relu && z.defined() ? mask_ptr(mask, vecs, x, op) : nullptr;
  if (vecs == 0) return;
  const float* ss = finalized(finalize_args(f, x, op), C);
  const unsigned grid = grid_for(vecs);
  cudaStream_t s = current_stream();
  const uint4* zp = z.defined() ? vec_in(z) : nullptr;
  auto apply = [&](auto kernel) {
    launch(kernel, grid, kBlock, 0, s, vec_out(y), vec_in(x), zp, ss, mp, vecs, G, C);
  };
  if (relu && z.defined())
    apply(apply_kernel<true, true>);
  else if (relu)
    apply(apply_kernel<true, false>);
  else if (z.defined())
    apply(apply_kernel<false, true>);
  else
    apply(apply_kernel<false, false>);
  KILN_CUDA_CHECK_LAUNCH();
}

void bn_nhwc_backward(const Tensor& dx, const Tensor& dz, const Tensor& dweight,
                      const Tensor& dbias, const Tensor& dy, const Tensor& x, const Tensor& mask,
                      const Tensor& weight, const Tensor& save_mean, const Tensor& save_invstd,
                      const Tensor& scale_shift, bool relu, bool accumulate_params) {
  const char* op = "bn_nhwc_backward";
  check_x(x, op);
  check_act(dx, x, op, "dx");
  check_act(dy, x, op, "dy");
  if (dz.defined()) check_act(dz, x, op, "dz");
  const int64_t C = x.size(1), G = C / kVec, rows = x.numel() / C, vecs = x.numel() / kVec;
  const int mode = !relu ? kNoMask : (mask.defined() ? kMaskBits : kMaskFromX);
  const uint8_t* yp = mode == kMaskBits ? mask_ptr(mask, vecs, x, op) : nullptr;
  const float* mean = required(f32_ptr(save_mean, C, x, op, "save_mean"), op, "save_mean");
  const float* invstd =
      required(f32_ptr(save_invstd, C, x, op, "save_invstd"), op, "save_invstd");
  const float* ss = f32_ptr(scale_shift, 2 * C, x, op, "scale_shift");
  if (mode == kMaskFromX) required(const_cast<float*>(ss), op, "scale_shift");
  const float* w = f32_ptr(weight, C, x, op, "weight");
  float* dw = f32_ptr(dweight, C, x, op, "dweight");
  float* db = f32_ptr(dbias, C, x, op, "dbias");
  KILN_CHECK(rows > 1, op, " (cuda): needs more than one value per channel, got ", x.desc());

  const void* sums_kernel =
      mode == kNoMask      ? reinterpret_cast<const void*>(backward_sums_kernel<kNoMask>)
      : mode == kMaskFromX ? reinterpret_cast<const void*>(backward_sums_kernel<kMaskFromX>)
                           : reinterpret_cast<const void*>(backward_sums_kernel<kMaskBits>);
  const SumsLaunch L = sums_launch(rows, G, sums_kernel);
  const int parts = L.parts;
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
  Tensor partial = empty({int64_t(parts) * 2 * C}, f32);
  Tensor coef = empty({3 * C}, f32);
  float* pp = static_cast<float*>(partial.raw_data());
  float* cp = static_cast<float*>(coef.raw_data());
  cudaStream_t s = current_stream();
  const dim3 grid = L.grid, block = L.block;
  switch (mode) {
    case kNoMask:
      launch(backward_sums_kernel<kNoMask>, grid, block, 0, s, vec_in(dy), vec_in(x), yp, mean, ss,
             pp, rows, G, C, parts);
      break;
    case kMaskFromX:
      launch(backward_sums_kernel<kMaskFromX>, grid, block, 0, s, vec_in(dy), vec_in(x), yp, mean,
             ss, pp, rows, G, C, parts);
      break;
    default:
      launch(backward_sums_kernel<kMaskBits>, grid, block, 0, s, vec_in(dy), vec_in(x), yp, mean,
             ss, pp, rows, G, C, parts);
  }
  KILN_CUDA_CHECK_LAUNCH();
  launch(backward_finish_kernel, finish_grid(C), kFinishBlock, 0, s, dw, db, cp, pp, w, mean,
         invstd, C, parts, double(rows), accumulate_params);
  KILN_CUDA_CHECK_LAUNCH();
  const unsigned agrid = grid_for(vecs);
  uint4* dzp = dz.defined() ? vec_out(dz) : nullptr;
  auto run = [&]<int kMode>() {
    if (dzp)
      launch(backward_apply_kernel<kMode, true>, agrid, kBlock, 0, s, vec_out(dx), dzp, vec_in(dy),
             vec_in(x), yp, ss, cp, vecs, G, C);
    else
      launch(backward_apply_kernel<kMode, false>, agrid, kBlock, 0, s, vec_out(dx), dzp, vec_in(dy),
             vec_in(x), yp, ss, cp, vecs, G, C);
  };
  switch (mode) {
    case kNoMask:
      run.template operator()<kNoMask>();
      break;
    case kMaskFromX:
      run.template operator()<kMaskFromX>();
      break;
    default:
      run.template operator()<kMaskBits>();
      break;
  }
  KILN_CUDA_CHECK_LAUNCH();
}

void bn_nhwc_dual_apply(const Tensor& y, const Tensor& x, const BnStatsFinalize& f_x,
                        const Tensor& r, const BnStatsFinalize& f_r, const Tensor& mask) {
  const char* op = "bn_nhwc_dual_apply";
  check_x(x, op);
  check_act(y, x, op, "y");
  check_act(r, x, op, "r");
  const int64_t C = x.size(1), G = C / kVec, vecs = x.numel() / kVec;
  uint8_t* mp = mask_ptr(mask, vecs, x, op);
  if (vecs == 0) return;
  const float* ssx = finalized(finalize_args(f_x, x, op), C);
  const float* ssr = finalized(finalize_args(f_r, x, op), C);
  launch(dual_apply_kernel, grid_for(vecs), kBlock, 0, current_stream(), vec_out(y), vec_in(x), ssx,
         vec_in(r), ssr, mp, vecs, G, C);
  KILN_CUDA_CHECK_LAUNCH();
}

void bn_nhwc_dual_backward(const Tensor& dx, const Tensor& dr, const Tensor& dweight_x,
                           const Tensor& dbias_x, const Tensor& dweight_r, const Tensor& dbias_r,
                           const Tensor& dy, const Tensor& mask, const Tensor& x,
                           const Tensor& weight_x, const Tensor& mean_x, const Tensor& invstd_x,
                           const Tensor& r, const Tensor& weight_r, const Tensor& mean_r,
                           const Tensor& invstd_r, bool accumulate_params) {
  const char* op = "bn_nhwc_dual_backward";
  check_x(x, op);
  for (auto [t, what] : {std::pair{&dx, "dx"}, std::pair{&dr, "dr"}, std::pair{&dy, "dy"},
                         std::pair{&r, "r"}})
    check_act(*t, x, op, what);
  const int64_t C = x.size(1), G = C / kVec, rows = x.numel() / C, vecs = x.numel() / kVec;
  KILN_CHECK(rows > 1, op, " (cuda): needs more than one value per channel, got ", x.desc());
  const uint8_t* mp = mask_ptr(mask, vecs, x, op);
  const float* mx = required(f32_ptr(mean_x, C, x, op, "mean_x"), op, "mean_x");
  const float* kx = required(f32_ptr(invstd_x, C, x, op, "invstd_x"), op, "invstd_x");
  const float* mr = required(f32_ptr(mean_r, C, x, op, "mean_r"), op, "mean_r");
  const float* kr = required(f32_ptr(invstd_r, C, x, op, "invstd_r"), op, "invstd_r");
  const SumsLaunch L = sums_launch(rows, G, reinterpret_cast<const void*>(dual_sums_kernel));
  const int parts = L.parts;
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
  Tensor partial = empty({int64_t(parts) * 3 * C}, f32);
  Tensor coef = empty({6 * C}, f32);
  float* pp = static_cast<float*>(partial.raw_data());
  float* cp = static_cast<float*>(coef.raw_data());
  cudaStream_t s = current_stream();
  launch(dual_sums_kernel, L.grid, L.block, 0, s, vec_in(dy), mp, vec_in(x), mx, vec_in(r), mr, pp,
         rows, G, C, parts);
  KILN_CUDA_CHECK_LAUNCH();
  launch(dual_finish_kernel, finish_grid(C), kFinishBlock, 0, s,
         f32_ptr(dweight_x, C, x, op, "dweight_x"), f32_ptr(dbias_x, C, x, op, "dbias_x"),
         f32_ptr(dweight_r, C, x, op, "dweight_r"), f32_ptr(dbias_r, C, x, op, "dbias_r"), cp, pp,
         f32_ptr(weight_x, C, x, op, "weight_x"), mx, kx, f32_ptr(weight_r, C, x, op, "weight_r"),
         mr, kr, C, parts, double(rows), accumulate_params);
  KILN_CUDA_CHECK_LAUNCH();
  launch(dual_backward_apply_kernel, grid_for(vecs), kBlock, 0, s, vec_out(dx), vec_out(dr),
         vec_in(dy), mp, vec_in(x), vec_in(r), cp, vecs, G, C);
  KILN_CUDA_CHECK_LAUNCH();
}

void bn_nhwc_backward_dgrad1x1(const Tensor& dx, const Tensor& g, const Tensor& dweight,
                               const Tensor& dbias, const Tensor& dy1, const Tensor& w1,
                               const Tensor& r, const Tensor& mask, const Tensor& x,
                               const Tensor& weight, const Tensor& save_mean,
                               const Tensor& save_invstd, bool accumulate_params) {
  const char* op = "bn_nhwc_backward_dgrad1x1";
  check_x(x, op);
  check_act(dx, x, op, "dx");
  const int64_t C = x.size(1), G = C / kVec, rows = x.numel() / C, vecs = x.numel() / kVec;
  KILN_CHECK(rows > 1, op, " (cuda): needs more than one value per channel, got ", x.desc());
  const float* mean = required(f32_ptr(save_mean, C, x, op, "save_mean"), op, "save_mean");
  const float* invstd =
      required(f32_ptr(save_invstd, C, x, op, "save_invstd"), op, "save_invstd");
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
  const int parts = dgrad1x1_bn_parts(rows, C, dy1.size(1));
  Tensor partial = empty({int64_t(parts) * 2 * C}, f32);
  Tensor coef = empty({3 * C}, f32);
  dgrad1x1_bn_sums(g, partial, dy1, w1, r, mask, x, save_mean);
  float* cp = static_cast<float*>(coef.raw_data());
  cudaStream_t s = current_stream();
  launch(backward_finish_kernel, finish_grid(C), kFinishBlock, 0, s,
         f32_ptr(dweight, C, x, op, "dweight"), f32_ptr(dbias, C, x, op, "dbias"), cp,
         static_cast<const float*>(partial.raw_data()), f32_ptr(weight, C, x, op, "weight"), mean,
         invstd, C, parts, double(rows), accumulate_params);
  KILN_CUDA_CHECK_LAUNCH();
  launch(backward_apply_kernel<kNoMask, false>, grid_for(vecs), kBlock, 0, s, vec_out(dx), nullptr,
         vec_in(g), vec_in(x), nullptr, nullptr, cp, vecs, G, C);
  KILN_CUDA_CHECK_LAUNCH();
}

void bn_nhwc_relu_max_pool(const Tensor& y, const Tensor& indices, const Tensor& x,
                           const Tensor& scale_shift) {
  const char* op = "bn_nhwc_relu_max_pool";
  check_x(x, op);
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t OH = (H - 1) / 2 + 1, OW = (W - 1) / 2 + 1;  // 3x3, stride 2, pad 1
  const Shape out{N, C, OH, OW};
  KILN_CHECK(y.defined() && y.dtype() == DType::f16 && y.shape() == out &&
                 y.device() == x.device() && y.is_contiguous(MemoryFormat::ChannelsLast),
             op, " (cuda): y must be f16 channels-last ", shape_str(out), " for x ", x.desc(),
             ", got ", y.defined() ? y.desc() : "undefined");
  KILN_CHECK(indices.defined() && indices.dtype() == DType::u8 && indices.shape() == out &&
                 indices.device() == x.device() &&
                 indices.is_contiguous(MemoryFormat::ChannelsLast),
             op, " (cuda): indices must be u8 channels-last ", shape_str(out), ", got ",
             indices.defined() ? indices.desc() : "undefined");
  KILN_CHECK(N <= 65535 && OH * OW * (C / kVec) < (int64_t(1) << 31), op,
             " (cuda): x ", x.desc(), " is too large for this kernel");
  const float* ss = required(f32_ptr(scale_shift, 2 * C, x, op, "scale_shift"), op, "scale_shift");
  if (y.numel() == 0) return;
  const int G = int(C / kVec);
  const dim3 grid{grid_for(OH * OW * G), unsigned(N)};
  launch(relu_max_pool_k3s2_kernel, grid, kBlock, 0, current_stream(), vec_out(y),
         static_cast<uint2*>(indices.raw_data()), vec_in(x), ss, int(H), int(W), int(OH), int(OW),
         G);
  KILN_CUDA_CHECK_LAUNCH();
}

void bn_nhwc_relu_max_pool_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                                    const Tensor& dy, const Tensor& indices, const Tensor& x,
                                    const Tensor& weight, const Tensor& save_mean,
                                    const Tensor& save_invstd, const Tensor& scale_shift,
                                    bool accumulate_params) {
  const char* op = "bn_nhwc_relu_max_pool_backward";
  check_x(x, op);
  check_act(dx, x, op, "dx");
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t OH = (H - 1) / 2 + 1, OW = (W - 1) / 2 + 1, G = C / kVec;
  const Shape out{N, C, OH, OW};
  KILN_CHECK(dy.defined() && dy.dtype() == DType::f16 && dy.shape() == out &&
                 dy.device() == x.device() && dy.is_contiguous(MemoryFormat::ChannelsLast),
             op, " (cuda): dy must be f16 channels-last ", shape_str(out), ", got ",
             dy.defined() ? dy.desc() : "undefined");
  KILN_CHECK(indices.defined() && indices.dtype() == DType::u8 && indices.shape() == out &&
                 indices.device() == x.device() &&
                 indices.is_contiguous(MemoryFormat::ChannelsLast),
             op, " (cuda): indices must be u8 channels-last ", shape_str(out), ", got ",
             indices.defined() ? indices.desc() : "undefined");
  const int64_t BH = (H + 1) / 2, BW = (W + 1) / 2, items = N * BH * BW * G;
  if (kBlock % G != 0 || items >= (int64_t(1) << 31)) {
    // A channel count this layout does not keep per thread: the two passes it replaces.
    Tensor dact = empty_like(x);
    PoolParams p;
    p.kernel_h = p.kernel_w = 3;
    p.stride_h = p.stride_w = 2;
    p.pad_h = p.pad_w = 1;
    max_pool2d_backward(dact, dy, indices, p);
    bn_nhwc_backward(dx, Tensor(), dweight, dbias, dact, x, Tensor(), weight, save_mean,
                     save_invstd, scale_shift, /*relu=*/true, accumulate_params);
    return;
  }
  const int64_t rows = N * H * W;
  KILN_CHECK(rows > 1, op, " (cuda): needs more than one value per channel, got ", x.desc());
  const float* mean = required(f32_ptr(save_mean, C, x, op, "save_mean"), op, "save_mean");
  const float* invstd =
      required(f32_ptr(save_invstd, C, x, op, "save_invstd"), op, "save_invstd");
  const float* ss = required(f32_ptr(scale_shift, 2 * C, x, op, "scale_shift"), op, "scale_shift");
  const float* w = f32_ptr(weight, C, x, op, "weight");
  float* dw = f32_ptr(dweight, C, x, op, "dweight");
  float* db = f32_ptr(dbias, C, x, op, "dbias");
  const StemPoolGeom geom{int(H), int(W), int(OH), int(OW), int(G), int(BH), int(BW)};
  // One wave of resident blocks, as sums_launch.
  const int64_t resident = int64_t(context().props.multiProcessorCount) *
                           resident_blocks(reinterpret_cast<const void*>(pool_relu_sums_kernel));
  const int parts = int(std::min<int64_t>({kMaxParts, resident, (items + kBlock - 1) / kBlock}));
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
  Tensor partial = empty({int64_t(parts) * 2 * C}, f32);
  Tensor coef = empty({3 * C}, f32);
  float* pp = static_cast<float*>(partial.raw_data());
  float* cp = static_cast<float*>(coef.raw_data());
  const auto* ip = static_cast<const uint2*>(indices.raw_data());
  cudaStream_t s = current_stream();
  launch(pool_relu_sums_kernel, parts, kBlock, 0, s, vec_in(dy), ip, vec_in(x), mean, ss, pp, geom,
         int(items));
  KILN_CUDA_CHECK_LAUNCH();
  launch(backward_finish_kernel, finish_grid(C), kFinishBlock, 0, s, dw, db, cp, pp, w, mean,
         invstd, C, parts, double(rows), accumulate_params);
  KILN_CUDA_CHECK_LAUNCH();
  launch(pool_relu_apply_kernel, grid_for(items), kBlock, 0, s, vec_out(dx), vec_in(dy), ip,
         vec_in(x), ss, cp, geom, int(items));
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda
