// Batch norm on f16 NHWC activations, the backward passes (contract in cuda/kernels.h): the
// sums of the gradient (kernels in bn_nhwc.cuh for one batch norm), the finishing kernels that
// turn them into dweight, dbias and dx's coefficients, and the apply passes that write dx — for
// one batch norm (+ ReLU, + residual), for two meeting at the residual add, and for the ResNet
// stem's batch norm + ReLU + max pool.
#include <algorithm>
#include <utility>

#include "cuda/kernels/bn_nhwc.cuh"
#include "cuda/kernels/gemm_bn_wgmma.h"

namespace kiln::cuda {
namespace {

// ---- backward ----

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
    if constexpr (reads_scale_shift(kMode)) {
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

// kMode: kMaskBits (g = dy masked by the forward's bits) or kNoMask (dy is g already: the dual
// form's GEMM wrote it masked). kX false: dr alone (x's gradient goes to conv3 as factors, the
// tail fold: dx and x are not touched).
template <int kMode, bool kX>
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
    Vec8 xv = none;
    if constexpr (kX) xv = load8(x, i);
    const Vec8 rv = load8(r, i);
    const Vec8 g = masked_grad<kMode>(dy, mask, xv, none, none, i);
    Vec8 ox, orr;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      ox.v[j] = fmaf(a1.v[j], g.v[j], fmaf(b1.v[j], xv.v[j], c1.v[j]));
      orr.v[j] = fmaf(a2.v[j], g.v[j], fmaf(b2.v[j], rv.v[j], c2.v[j]));
    }
    if constexpr (kX) store8(dx, i, ox);
    store8(dr, i, orr);
  }
}

// ---- batch norm + ReLU + 3x3/2 max pool (the ResNet stem) ----

// The backward of relu_max_pool_k3s2_kernel (bn_nhwc_apply.cu). The pool's gradient goes back to the 2x2 block of input pixels (2a..2a+1,
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

}  // namespace

void bn_nhwc_backward(const Tensor& dx, const Tensor& dz, const Tensor& dweight,
                      const Tensor& dbias, const Tensor& dy, const Tensor& x, const Tensor& mask,
                      const Tensor& weight, const Tensor& save_mean, const Tensor& save_invstd,
                      const Tensor& scale_shift, Activation act, bool accumulate_params) {
  const char* op = "bn_nhwc_backward";
  check_x(x, op);
  check_act(dx, x, op, "dx");
  check_act(dy, x, op, "dy");
  if (dz.defined()) check_act(dz, x, op, "dz");
  const int64_t C = x.size(1), G = C / kVec, rows = x.numel() / C, vecs = x.numel() / kVec;
  const int mode = act == Activation::Gelu   ? kGeluFromX
                   : act == Activation::None ? kNoMask
                   : mask.defined()          ? kMaskBits
                                             : kMaskFromX;
  const uint8_t* yp = mode == kMaskBits ? mask_ptr(mask, vecs, x, op) : nullptr;
  const float* mean = required(f32_ptr(save_mean, C, x, op, "save_mean"), op, "save_mean");
  const float* invstd =
      required(f32_ptr(save_invstd, C, x, op, "save_invstd"), op, "save_invstd");
  const float* ss = f32_ptr(scale_shift, 2 * C, x, op, "scale_shift");
  if (reads_scale_shift(mode)) required(const_cast<float*>(ss), op, "scale_shift");
  const float* w = f32_ptr(weight, C, x, op, "weight");
  float* dw = f32_ptr(dweight, C, x, op, "dweight");
  float* db = f32_ptr(dbias, C, x, op, "dbias");
  KILN_CHECK(rows > 1, op, " (cuda): needs more than one value per channel, got ", x.desc());

  const void* sums_kernel =
      mode == kNoMask      ? reinterpret_cast<const void*>(backward_sums_kernel<kNoMask>)
      : mode == kMaskFromX ? reinterpret_cast<const void*>(backward_sums_kernel<kMaskFromX>)
      : mode == kGeluFromX ? reinterpret_cast<const void*>(backward_sums_kernel<kGeluFromX>)
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
    case kGeluFromX:
      launch(backward_sums_kernel<kGeluFromX>, grid, block, 0, s, vec_in(dy), vec_in(x), yp, mean,
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
    case kGeluFromX:
      run.template operator()<kGeluFromX>();
      break;
    default:
      run.template operator()<kMaskBits>();
      break;
  }
  KILN_CUDA_CHECK_LAUNCH();
}

namespace {

// The dual backward after its sums (partial (parts, 3, C)): both sides' finish, then the apply
// pass reading dy (kMode: kMaskBits, masked here by mp) or g (kNoMask: masked already). With
// coef_out (6C) the factors go there; with dx undefined the pass writes dr alone.
template <int kMode>
void dual_finish_apply(const char* op, const Tensor& dx, const Tensor& dr, const Tensor& dweight_x,
                       const Tensor& dbias_x, const Tensor& dweight_r, const Tensor& dbias_r,
                       const Tensor& dy, const uint8_t* mp, const Tensor& x,
                       const Tensor& weight_x, const float* mx, const float* kx, const Tensor& r,
                       const Tensor& weight_r, const float* mr, const float* kr,
                       const float* pp, int parts, bool accumulate_params,
                       const Tensor& coef_out = Tensor()) {
  const int64_t C = x.size(1), G = C / kVec, rows = x.numel() / C, vecs = x.numel() / kVec;
  Tensor coef = coef_out.defined()
                    ? coef_out
                    : empty({6 * C}, TensorOptions(DType::f32).with_device(x.device()));
  float* cp = static_cast<float*>(coef.raw_data());
  cudaStream_t s = current_stream();
  launch(dual_finish_kernel, finish_grid(C), kFinishBlock, 0, s,
         f32_ptr(dweight_x, C, x, op, "dweight_x"), f32_ptr(dbias_x, C, x, op, "dbias_x"),
         f32_ptr(dweight_r, C, x, op, "dweight_r"), f32_ptr(dbias_r, C, x, op, "dbias_r"), cp, pp,
         f32_ptr(weight_x, C, x, op, "weight_x"), mx, kx, f32_ptr(weight_r, C, x, op, "weight_r"),
         mr, kr, C, parts, double(rows), accumulate_params);
  KILN_CUDA_CHECK_LAUNCH();
  if (dx.defined())
    launch(dual_backward_apply_kernel<kMode, true>, grid_for(vecs), kBlock, 0, s, vec_out(dx),
           vec_out(dr), vec_in(dy), mp, vec_in(x), vec_in(r), cp, vecs, G, C);
  else if (dr.defined())
    launch(dual_backward_apply_kernel<kMode, false>, grid_for(vecs), kBlock, 0, s, nullptr,
           vec_out(dr), vec_in(dy), mp, nullptr, vec_in(r), cp, vecs, G, C);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace

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
  float* pp = static_cast<float*>(partial.raw_data());
  launch(dual_sums_kernel, L.grid, L.block, 0, current_stream(), vec_in(dy), mp, vec_in(x), mx,
         vec_in(r), mr, pp, rows, G, C, parts);
  KILN_CUDA_CHECK_LAUNCH();
  dual_finish_apply<kMaskBits>(op, dx, dr, dweight_x, dbias_x, dweight_r, dbias_r, dy, mp, x,
                               weight_x, mx, kx, r, weight_r, mr, kr, pp, parts,
                               accumulate_params);
}

namespace {
// bn_nhwc_dual_backward_dgrad and its _coef form: the GEMM writes g (g_out where given), then
// the finish and the apply (dx and dr, or dr alone with coef_out).
void dual_backward_dgrad_impl(const char* op, const Tensor& dx, const Tensor& g_out,
                              const Tensor& coef_out, const Tensor& dr, const Tensor& dweight_x,
                              const Tensor& dbias_x, const Tensor& dweight_r,
                              const Tensor& dbias_r, const Tensor& dy1, const Tensor& w1,
                              const Tensor& dy_rest, const Tensor& mask, const Tensor& x,
                              const Tensor& weight_x, const Tensor& mean_x,
                              const Tensor& invstd_x, const Tensor& r, const Tensor& weight_r,
                              const Tensor& mean_r, const Tensor& invstd_r,
                              bool accumulate_params) {
  check_x(x, op);
  if (dx.defined()) check_act(dx, x, op, "dx");
  if (g_out.defined()) check_act(g_out, x, op, "g");
  check_act(r, x, op, "r");
  // dr undefined: r's side is folded too (coef_out given), and nothing is applied.
  if (dr.defined() || !coef_out.defined()) check_act(dr, x, op, "dr");
  if (dy_rest.defined()) check_act(dy_rest, x, op, "dy_rest");
  KILN_CHECK(dual_dgrad_supported(dy1, w1, x), op,
             " (cuda): needs KILN_DUAL_DGRAD on, an sm_90 GPU, f16 channels-last dy1 (N, K, H, W), "
             "w1 (K, C, 1, 1) and x (N, C, H, W) with K a multiple of 64 up to 2,048 and C of 128, "
             "got dy1 ",
             dy1.desc(), ", w1 ", w1.desc(), ", x ", x.desc());
  const int64_t C = x.size(1), rows = x.numel() / C, vecs = x.numel() / kVec;
  KILN_CHECK(rows > 1, op, " (cuda): needs more than one value per channel, got ", x.desc());
  if (coef_out.defined())
    KILN_CHECK(coef_out.dtype() == DType::f32 && coef_out.is_contiguous() &&
                   coef_out.numel() == 6 * C && coef_out.device() == x.device(),
               op, " (cuda): coef must be f32, contiguous, 6·C = ", 6 * C,
               " values on x's device, got ", coef_out.desc());
  mask_ptr(mask, vecs, x, op);  // checked here; the GEMM reads it by TMA
  const float* mx = required(f32_ptr(mean_x, C, x, op, "mean_x"), op, "mean_x");
  const float* kx = required(f32_ptr(invstd_x, C, x, op, "invstd_x"), op, "invstd_x");
  const float* mr = required(f32_ptr(mean_r, C, x, op, "mean_r"), op, "mean_r");
  const float* kr = required(f32_ptr(invstd_r, C, x, op, "invstd_r"), op, "invstd_r");
  const int parts = dgrad1x1_bn_wgmma_parts(rows, C);
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
  Tensor partial = empty({int64_t(parts) * 3 * C}, f32);
  Tensor g = g_out.defined() ? g_out : empty_like(x);  // masked, for the apply pass
  // The tail form's kernel always adds a residual: zeros when nothing else reached dy.
  const Tensor rest = dy_rest.defined() ? dy_rest : zeros_like(x);
  dgrad1x1_bn_sums_wgmma(g, partial, dy1, w1, rest, mask, x, mean_x, Tensor(), parts, r, mean_r);
  dual_finish_apply<kNoMask>(op, dx, dr, dweight_x, dbias_x, dweight_r, dbias_r, g, nullptr, x,
                             weight_x, mx, kx, r, weight_r, mr, kr,
                             static_cast<const float*>(partial.raw_data()), parts,
                             accumulate_params, coef_out);
}
}  // namespace

void bn_nhwc_dual_backward_dgrad(const Tensor& dx, const Tensor& dr, const Tensor& dweight_x,
                                 const Tensor& dbias_x, const Tensor& dweight_r,
                                 const Tensor& dbias_r, const Tensor& dy1, const Tensor& w1,
                                 const Tensor& dy_rest, const Tensor& mask, const Tensor& x,
                                 const Tensor& weight_x, const Tensor& mean_x,
                                 const Tensor& invstd_x, const Tensor& r, const Tensor& weight_r,
                                 const Tensor& mean_r, const Tensor& invstd_r,
                                 bool accumulate_params) {
  const char* op = "bn_nhwc_dual_backward_dgrad";
  check_x(x, op);
  check_act(dx, x, op, "dx");
  dual_backward_dgrad_impl(op, dx, Tensor(), Tensor(), dr, dweight_x,
                           dbias_x, dweight_r, dbias_r, dy1, w1, dy_rest, mask, x, weight_x,
                           mean_x, invstd_x, r, weight_r, mean_r, invstd_r, accumulate_params);
}

void bn_nhwc_dual_backward_dgrad_coef(const Tensor& coef, const Tensor& g, const Tensor& dr,
                                      const Tensor& dweight_x, const Tensor& dbias_x,
                                      const Tensor& dweight_r, const Tensor& dbias_r,
                                      const Tensor& dy1, const Tensor& w1, const Tensor& dy_rest,
                                      const Tensor& mask, const Tensor& x, const Tensor& weight_x,
                                      const Tensor& mean_x, const Tensor& invstd_x,
                                      const Tensor& r, const Tensor& weight_r,
                                      const Tensor& mean_r, const Tensor& invstd_r,
                                      bool accumulate_params) {
  const char* op = "bn_nhwc_dual_backward_dgrad_coef";
  KILN_CHECK(coef.defined() && g.defined(), op, " (cuda): coef and g must be defined");
  dual_backward_dgrad_impl(op, Tensor(), g, coef, dr, dweight_x, dbias_x, dweight_r, dbias_r, dy1,
                           w1, dy_rest, mask, x, weight_x, mean_x, invstd_x, r, weight_r, mean_r,
                           invstd_r, accumulate_params);
}

void bn_nhwc_backward_dgrad(const Tensor& dx, const Tensor& g, const Tensor& dweight,
                            const Tensor& dbias, const Tensor& dy1, const Tensor& w1,
                            const Tensor& r, const Tensor& mask, const Tensor& x,
                            const Tensor& weight, const Tensor& save_mean,
                            const Tensor& save_invstd, bool accumulate_params,
                            const Tensor& scale_shift, const Tensor& coef_out, const Tensor& x2,
                            const Tensor& w2, const Tensor& b2) {
  const char* op = "bn_nhwc_backward_dgrad";
  check_x(x, op);
  if (!coef_out.defined()) check_act(dx, x, op, "dx");
  const int64_t C = x.size(1), G = C / kVec, rows = x.numel() / C, vecs = x.numel() / kVec;
  KILN_CHECK(rows > 1, op, " (cuda): needs more than one value per channel, got ", x.desc());
  const float* mean = required(f32_ptr(save_mean, C, x, op, "save_mean"), op, "save_mean");
  const float* invstd =
      required(f32_ptr(save_invstd, C, x, op, "save_invstd"), op, "save_invstd");
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
  // w1 (K, C, 3, 3): a 3x3 convolution's data gradient, on the 3x3 GEMM's partial rows.
  const int parts =
      dgrad_weight_3x3(w1) ? dgrad3x3_bn_parts(rows, C) : dgrad1x1_bn_parts(rows, C, dy1.size(1));
  Tensor partial = empty({int64_t(parts) * 2 * C}, f32);
  if (coef_out.defined())
    KILN_CHECK(coef_out.dtype() == DType::f32 && coef_out.is_contiguous() &&
                   coef_out.numel() == 3 * C && coef_out.device() == x.device(),
               op, " (cuda): coef_out must be f32, contiguous, 3·C = ", 3 * C,
               " values on x's device, got ", coef_out.desc());
  Tensor coef = coef_out.defined() ? coef_out : empty({3 * C}, f32);
  dgrad1x1_bn_sums(g, partial, dy1, w1, r, mask, x, save_mean, scale_shift, x2, w2, b2);
  float* cp = static_cast<float*>(coef.raw_data());
  cudaStream_t s = current_stream();
  launch(backward_finish_kernel, finish_grid(C), kFinishBlock, 0, s,
         f32_ptr(dweight, C, x, op, "dweight"), f32_ptr(dbias, C, x, op, "dbias"), cp,
         static_cast<const float*>(partial.raw_data()), f32_ptr(weight, C, x, op, "weight"), mean,
         invstd, C, parts, double(rows), accumulate_params);
  KILN_CUDA_CHECK_LAUNCH();
  if (coef_out.defined()) return;  // dx = coef · (g, x, 1) is the caller's to form
  launch(backward_apply_kernel<kNoMask, false>, grid_for(vecs), kBlock, 0, s, vec_out(dx), nullptr,
         vec_in(g), vec_in(x), nullptr, nullptr, cp, vecs, G, C);
  KILN_CUDA_CHECK_LAUNCH();
}

namespace {
// Whether the stem pool's backward runs its own kernels on x (kBlock a multiple of x's channel
// vectors, the 2x2 blocks' items in 32 bits), else the composition's passes.
bool pool_backward_fused(const Tensor& x) {
  const int64_t G = x.size(1) / kVec;
  const int64_t items = x.size(0) * ((x.size(2) + 1) / 2) * ((x.size(3) + 1) / 2) * G;
  return G > 0 && kBlock % G == 0 && items < (int64_t(1) << 31);
}
}  // namespace

bool relu_max_pool_backward_uses_at_max(const Tensor& x) {
  return stem_pool_at_max_enabled() && x.dim() == 4 && pool_backward_fused(x);
}

void bn_nhwc_relu_max_pool_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                                    const Tensor& dy, const Tensor& indices, const Tensor& at_max,
                                    const Tensor& x, const Tensor& weight, const Tensor& save_mean,
                                    const Tensor& save_invstd, const Tensor& scale_shift,
                                    bool accumulate_params) {
  const char* op = "bn_nhwc_relu_max_pool_backward";
  check_x(x, op);
  check_act(dx, x, op, "dx");
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t OH = (H - 1) / 2 + 1, OW = (W - 1) / 2 + 1, G = C / kVec;
  const Shape out{N, C, OH, OW};
  check_pooled(dy, DType::f16, out, x, op, "dy");
  check_pooled(indices, DType::u8, out, x, op, "indices");
  if (at_max.defined()) check_pooled(at_max, DType::f16, out, x, op, "at_max");
  const int64_t BH = (H + 1) / 2, BW = (W + 1) / 2, items = N * BH * BW * G;
  if (!pool_backward_fused(x)) {
    // A channel count this layout does not keep per thread: the two passes it replaces.
    Tensor dact = empty_like(x);
    PoolParams p;
    p.kernel_h = p.kernel_w = 3;
    p.stride_h = p.stride_w = 2;
    p.pad_h = p.pad_w = 1;
    max_pool2d_backward(dact, dy, indices, p);
    bn_nhwc_backward(dx, Tensor(), dweight, dbias, dact, x, Tensor(), weight, save_mean,
                     save_invstd, scale_shift, Activation::Relu, accumulate_params);
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
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
  const auto* ip = static_cast<const uint2*>(indices.raw_data());
  cudaStream_t s = current_stream();
  Tensor partial;
  int parts = 0;
  if (at_max.defined()) {
    // The sums over the pool's outputs: the generic sums kernel on (dy, at_max), whose rows are
    // the outputs' pixels; the finishing kernel still divides by x's pixel count.
    const SumsLaunch L = sums_launch(
        N * OH * OW, G, reinterpret_cast<const void*>(backward_sums_kernel<kMaskFromX>));
    parts = L.parts;
    partial = empty({int64_t(parts) * 2 * C}, f32);
    launch(backward_sums_kernel<kMaskFromX>, L.grid, L.block, 0, s, vec_in(dy), vec_in(at_max),
           nullptr, mean, ss, static_cast<float*>(partial.raw_data()), N * OH * OW, G, C, parts);
  } else {
    // One wave of resident blocks, as sums_launch.
    const int64_t resident = int64_t(context().props.multiProcessorCount) *
                             resident_blocks(reinterpret_cast<const void*>(pool_relu_sums_kernel));
    parts = int(std::min<int64_t>({kMaxParts, resident, (items + kBlock - 1) / kBlock}));
    partial = empty({int64_t(parts) * 2 * C}, f32);
    launch(pool_relu_sums_kernel, parts, kBlock, 0, s, vec_in(dy), ip, vec_in(x), mean, ss,
           static_cast<float*>(partial.raw_data()), geom, int(items));
  }
  KILN_CUDA_CHECK_LAUNCH();
  Tensor coef = empty({3 * C}, f32);
  const float* pp = static_cast<const float*>(partial.raw_data());
  float* cp = static_cast<float*>(coef.raw_data());
  launch(backward_finish_kernel, finish_grid(C), kFinishBlock, 0, s, dw, db, cp, pp, w, mean,
         invstd, C, parts, double(rows), accumulate_params);
  KILN_CUDA_CHECK_LAUNCH();
  launch(pool_relu_apply_kernel, grid_for(items), kBlock, 0, s, vec_out(dx), vec_in(dy), ip,
         vec_in(x), ss, cp, geom, int(items));
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda
