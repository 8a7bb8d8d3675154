// The ResNet stem's convolution, 3 → 64 channels, 7x7, stride 2, padding 3, f16 NHWC, with the
// batch norm's statistics (Σy, Σy² per channel) in its epilogue — one kernel where cuDNN ran a
// channel pad of x (3 → 4), its image_first_layer kernel at ~1.2 TB/s and kiln a statistics pass
// over y (docs/lab/stem.md, the v12–v14 profiles: 75 + 410 + ~130 µs at batch 256).
//
// An implicit GEMM on mma.sync: M = output pixels, N = 64 channels, K = 7 rows × 8 columns × 4
// channels = 224 (the 8th column and the 4th channel are zero weights, so that each k8 chunk of
// A is 2 neighbouring input pixels × 4 channels: 16 contiguous bytes of the input patch in shared
// memory, which ldmatrix loads directly). A CTA (4 warps) takes 8 × 16 output pixels at a time:
// their 21 × 38-pixel input patch is loaded once (3 channels from global memory, padded to 4 in
// shared memory, zeros outside the image) and each warp computes 2 output rows × 64 channels
// from it with the whole weight tensor, which stays in shared memory for the CTA's life. CTAs are
// persistent (one wave), tile t going to CTA t mod grid, and each keeps its statistics in
// registers in a fixed order, so the per-CTA partial rows and their fixed-order sum make the
// statistics bit-reproducible for a shape and a device.
//
// Its weight gradient is the same GEMM turned around: dW (64 × 224) = dyᵀ · patches, summed
// over the output pixels. A CTA loads a tile's input patch (as above) and its 128 × 64 block
// of dy; warp w owns the 8 columns of kw = 2w, 2w + 1 for all 7 kernel rows and all 64 output
// channels (7 × 4 MMA tiles in registers), taking 16 output pixels per k16 step: A = dyᵀ through
// ldmatrix.trans of dy's rows, B = the same 16-byte patch chunks as the forward's A, through
// ldmatrix.trans. Each persistent CTA writes its 64 × 224 partial once; a second kernel adds the
// partials in a fixed order into dw's own layout (dropping the zero column and channel), written
// or added to.
#include <cuda_fp16.h>

#include <algorithm>

#include "core/switches.h"
#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/gemm_bn_wgmma.h"
#include "cuda/kernels/mma.cuh"
#include "cuda/kernels/stem_conv.cuh"

namespace kiln::cuda {
namespace {

using namespace stem;

constexpr int kPitchW = kK + 8;  // halves per weight row: conflict-free ldmatrix
constexpr int kSmemBytes = kCout * kPitchW * 2 + kPatch * 8 + 4 * kStage * 2;  // 52,464

__global__ void __launch_bounds__(kThreads, 3)
    stem_conv_stats_kernel(__half* __restrict__ y, float* __restrict__ partial,
                           const __half* __restrict__ x, const __half* __restrict__ w, StemGeom g) {
  pdl_start();
  extern __shared__ __align__(16) unsigned char smem[];
  __half* ws = reinterpret_cast<__half*>(smem);                         // [64][kPitchW]
  uint2* patch = reinterpret_cast<uint2*>(smem + kCout * kPitchW * 2);  // [21][38] × 4 halves
  __half* stage_all = reinterpret_cast<__half*>(smem + kCout * kPitchW * 2 + kPatch * 8);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  __half* stage = stage_all + warp * kStage;  // [32 pixels][64 channels], 16-byte chunks swizzled

  // The weight as B (k-contiguous rows per output channel): k = kh·32 + kw·4 + c.
  for (int i = tid; i < kCout * kK; i += kThreads) {
    const int n = i / kK, k = i % kK, kh = k >> 5, kw = (k >> 2) & 7, c = k & 3;
    __half v = __ushort_as_half(0);
    if (kw < 7 && c < 3) v = w[n * g.wn + c * g.wc + kh * g.wh + kw * g.ww];
    ws[n * kPitchW + k] = v;
  }

  // This thread's statistics: channels 8j + 2t + e (j < 8, e < 2) at index 2j + e.
  float s1[16], s2[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) s1[i] = s2[i] = 0.f;
  const int lj = lane >> 3, lr = lane & 7;  // ldmatrix: the matrix this lane addresses, its row

  for (int tile = blockIdx.x; tile < g.tiles; tile += gridDim.x) {
    const auto [n, oh0, ow0] = stem_tile(g, tile);
    __syncthreads();  // the previous tile's patch has been read (and the weights are in)
    load_patch(patch, x, g, n, oh0, ow0);
    __syncthreads();

    float acc[2][8][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[mi][j][q] = 0.f;
#pragma unroll
    for (int s = 0; s < 2 * kKh; ++s) {
      const int kh = s >> 1, kw0 = (s & 1) * 4 + 2 * (lj >> 1);
      unsigned a[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        // Row lr + 8·(lj & 1) of the m16 tile = output column; its pixels 2·col + kw0, + 1.
        const int row = 2 * (warp * 2 + mi) + kh, col = 2 * (lr + 8 * (lj & 1)) + kw0;
        ldmatrix_x4(a[mi], patch + row * kPatchW + col);
      }
#pragma unroll
      for (int nb = 0; nb < 4; ++nb) {
        unsigned b[4];
        ldmatrix_x4(b, ws + (nb * 16 + lr + 8 * (lj >> 1)) * kPitchW + 16 * s + 8 * (lj & 1));
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          mma16816(acc[mi][2 * nb], a[mi], b[0], b[1]);
          mma16816(acc[mi][2 * nb + 1], a[mi], b[2], b[3]);
        }
      }
    }

    store_tile([&](int mi, int j, int q) { return acc[mi][j][q]; }, s1, s2, stage, y, g, n, oh0,
               ow0);
  }

  write_partial_stats(s1, s2, reinterpret_cast<float*>(stage_all), partial);
}

// sum (=) and sqsum (=): the parts' partial rows added in order.
__global__ void stem_stats_finish_kernel(float* __restrict__ sum, float* __restrict__ sqsum,
                                         const float* __restrict__ partial, int parts) {
  pdl_start();
  const int which = threadIdx.x >> 6, c = threadIdx.x & 63;
  float v = 0.f;
  for (int p = 0; p < parts; ++p) v += partial[int64_t(p) * 2 * kCout + which * kCout + c];
  (which ? sqsum : sum)[c] = v;
}

// ---- the weight gradient ----

constexpr int kDyPitch = kCout + 8;  // halves per staged dy row: conflict-free ldmatrix.trans
constexpr int kWgSmemBytes = kPatch * 8 + kTileH * kTileW * kDyPitch * 2;  // 24,816

__global__ void __launch_bounds__(kThreads, 3)
    stem_wgrad_kernel(float* __restrict__ partial, const __half* __restrict__ dy,
                      const __half* __restrict__ x, StemGeom g) {
  pdl_start();
  extern __shared__ __align__(16) unsigned char smem[];
  uint2* patch = reinterpret_cast<uint2*>(smem);               // [21][38] × 4 halves
  __half* sdy = reinterpret_cast<__half*>(smem + kPatch * 8);  // [128 pixels][kDyPitch]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3, lj = lane >> 3, lr = lane & 7;
  const int kw0 = 2 * warp;  // this warp's kernel columns kw0, kw0 + 1

  // acc[mt][kh]: output channels 16·mt.., the 8 columns (kw0 + c / 4, channel c % 4) of row kh.
  float acc[4][kKh][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int kh = 0; kh < kKh; ++kh)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mt][kh][q] = 0.f;

  for (int tile = blockIdx.x; tile < g.tiles; tile += gridDim.x) {
    const auto [n, oh0, ow0] = stem_tile(g, tile);
    __syncthreads();  // the previous tile's patch and dy have been read
    // dy's 128 pixels × 128 bytes, 16 bytes per copy.
    for (int i = tid; i < kTileH * kTileW * 8; i += kThreads) {
      const int pix = i >> 3, chunk = i & 7;
      const int64_t src =
          ((int64_t(n) * g.OH + oh0 + (pix >> 4)) * g.OW + ow0 + (pix & 15)) * kCout + chunk * 8;
      cp_async16(sdy + pix * kDyPitch + chunk * 8, dy + src, true);
    }
    cp_async_commit();
    load_patch(patch, x, g, n, oh0, ow0);
    cp_async_wait_all();
    __syncthreads();

    // k16 step r: the 16 pixels of output row r of the tile.
#pragma unroll 1
    for (int r = 0; r < kTileH; ++r) {
      // A = dyᵀ: rows = channels, columns = the 16 pixels. B: rows = the same pixels (input
      // column 2·col + kw0 of input row 2r + kh), columns = (kw0 + c / 4, channel c % 4).
      unsigned a[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        ldmatrix_x4_trans(
            a[mt], sdy + (r * kTileW + lr + 8 * (lj >> 1)) * kDyPitch + mt * 16 + 8 * (lj & 1));
      }
#pragma unroll
      for (int kh = 0; kh + 1 < kKh; kh += 2) {
        unsigned b[4];
        const int row = 2 * r + kh + (lj >> 1), col = 2 * (lr + 8 * (lj & 1)) + kw0;
        ldmatrix_x4_trans(b, patch + row * kPatchW + col);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          mma16816(acc[mt][kh], a[mt], b[0], b[1]);
          mma16816(acc[mt][kh + 1], a[mt], b[2], b[3]);
        }
      }
      {
        unsigned b[2];
        const int row = 2 * r + kKh - 1, col = 2 * (lr + 8 * (lj & 1)) + kw0;
        ldmatrix_x2_trans(b, patch + row * kPatchW + col);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) mma16816(acc[mt][kKh - 1], a[mt], b[0], b[1]);
      }
    }
  }

  // This CTA's 64 × 224 partial, k = kh·32 + kw·4 + c as the forward's weight rows.
  float* out = partial + int64_t(blockIdx.x) * kCout * kK;
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int kh = 0; kh < kKh; ++kh)
#pragma unroll
      for (int q = 0; q < 4; ++q)
        out[(mt * 16 + gq + 8 * (q >> 1)) * kK + kh * 32 + 4 * kw0 + 2 * tq + (q & 1)] =
            acc[mt][kh][q];
}

// dw (64, 3, 7, 7; strides in g) (=, or += with accumulate) from the parts' partials, added in
// order; the zero column (kw 7) and channel (3) are dropped.
template <typename T>
__global__ void stem_wgrad_finish_kernel(T* __restrict__ dw, const float* __restrict__ partial,
                                         int parts, StemGeom g, bool accumulate) {
  pdl_start();
  const int i = int(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= kCout * 3 * kKh * kKh) return;
  const int n = i / (3 * kKh * kKh), c = (i / (kKh * kKh)) % 3, kh = (i / kKh) % kKh, kw = i % kKh;
  const int k = kh * 32 + kw * 4 + c;
  float v = 0.f;
  for (int p = 0; p < parts; ++p) v += partial[(int64_t(p) * kCout + n) * kK + k];
  T* d = dw + n * g.wn + c * g.wc + kh * g.wh + kw * g.ww;
  if (accumulate) v += float(*d);
  *d = T(v);
}

// One wave of `Kernel`'s CTAs, at most one per tile.
template <auto Kernel>
int stem_parts(int bytes, int tiles) {
  if (bytes > 48 * 1024) allow_smem_once<Kernel>(bytes, "stem_conv");
  const int64_t wave =
      int64_t(context().props.multiProcessorCount) *
      resident_blocks_per_sm(reinterpret_cast<const void*>(Kernel), kThreads, bytes);
  return int(std::clamp<int64_t>(wave, 1, tiles));
}

// The geometry both kernels take (w: the weight or its gradient, for its strides).
StemGeom stem_geom(const Tensor& x, const Tensor& w, int64_t OH, int64_t OW) {
  StemGeom g{};
  g.H = int(x.size(2));
  g.W = int(x.size(3));
  g.OH = int(OH);
  g.OW = int(OW);
  g.tiles_w = int(OW / kTileW);
  g.tiles_img = int((OH / kTileH) * g.tiles_w);
  g.tiles = int(x.size(0) * g.tiles_img);
  g.wn = w.stride(0);
  g.wc = w.stride(1);
  g.wh = w.stride(2);
  g.ww = w.stride(3);
  return g;
}

// Shapes, parameters and layouts (not the dtypes of w and y): x (N, 3, H, W) channels-last, w
// (64, 3, 7, 7), stride 2, padding 3, y (N, 64, OH, OW) channels-last with OH % 8 == 0 and
// OW % 16 == 0, all on x's CUDA device.
bool stem_shapes(const Tensor& y, const Tensor& x, const Tensor& w, const ConvParams& p) {
  if (!(x.defined() && w.defined() && y.defined() && x.is_cuda() && x.dim() == 4 && w.dim() == 4 &&
        y.dim() == 4 && w.device() == x.device() && y.device() == x.device()))
    return false;
  if (!(x.size(1) == 3 && w.size(0) == kCout && w.size(1) == 3 && w.size(2) == kKh &&
        w.size(3) == kKh && p.stride_h == 2 && p.stride_w == 2 && p.pad_h == 3 && p.pad_w == 3 &&
        p.dil_h == 1 && p.dil_w == 1 && p.groups == 1))
    return false;
  const int64_t N = x.size(0), H = x.size(2), W = x.size(3);
  const int64_t OH = (H - 1) / 2 + 1, OW = (W - 1) / 2 + 1;
  return y.size(0) == N && y.size(1) == kCout && y.size(2) == OH && y.size(3) == OW &&
         OH % kTileH == 0 && OW % kTileW == 0 && N * (OH / kTileH) * (OW / kTileW) < (1 << 30) &&
         x.is_contiguous(MemoryFormat::ChannelsLast) && y.is_contiguous(MemoryFormat::ChannelsLast);
}

constinit RuntimeSetting<int> g_stem_conv{&Switches::stem_conv};       // KILN_STEM_CONV
constinit RuntimeSetting<int> g_stem_wgmma{&Switches::stem_wgmma};     // KILN_STEM_WGMMA
constinit RuntimeSwitch g_stem_a_smem{&Switches::stem_a_smem};         // KILN_STEM_A_SMEM
constinit RuntimeSwitch g_wgrad_a_smem{&Switches::stem_wgrad_a_smem};  // KILN_STEM_WGRAD_A_SMEM

}  // namespace

int stem_conv_mode() { return g_stem_conv.get(); }
void set_stem_conv_mode(int mode) {
  KILN_CHECK(mode >= 0 && mode <= 2, "set_stem_conv_mode: mode ", mode, " is not 0, 1 or 2");
  g_stem_conv.set(mode);
}

int stem_wgmma_mode() { return dgrad1x1_bn_wgmma_available() ? g_stem_wgmma.get() : 0; }
void set_stem_wgmma_mode(int mode) {
  KILN_CHECK(mode >= 0 && mode <= 2, "set_stem_wgmma_mode: mode ", mode, " is not 0, 1 or 2");
  g_stem_wgmma.set(mode);
}

bool stem_a_smem_enabled() { return g_stem_a_smem.get(); }
void set_stem_a_smem_enabled(bool on) { g_stem_a_smem.set(on); }

bool stem_wgrad_a_smem_enabled() { return g_wgrad_a_smem.get(); }
void set_stem_wgrad_a_smem_enabled(bool on) { g_wgrad_a_smem.set(on); }

bool stem_conv_supported(const Tensor& y, const Tensor& x, const Tensor& w, const ConvParams& p) {
  return stem_shapes(y, x, w, p) && x.dtype() == DType::f16 && w.dtype() == DType::f16 &&
         y.dtype() == DType::f16;
}

bool stem_wgrad_supported(const Tensor& dw, const Tensor& dy, const Tensor& x,
                          const ConvParams& p) {
  return stem_shapes(dy, x, dw, p) && x.dtype() == DType::f16 && dy.dtype() == DType::f16 &&
         (dw.dtype() == DType::f16 || dw.dtype() == DType::f32);
}

void stem_conv_forward_stats(const Tensor& y, const Tensor& sum, const Tensor& sqsum,
                             const Tensor& x, const Tensor& w, const ConvParams& p) {
  KILN_CHECK(stem_conv_supported(y, x, w, p),
             "stem_conv_forward_stats (cuda): takes a 7x7/2 convolution (padding 3) of f16 "
             "channels-last x with 3 channels to 64, output rows a multiple of 8 and columns of "
             "16; got x ",
             x.desc(), ", w ", w.desc(), ", y ", y.desc());
  const char* op = "stem_conv_forward_stats";
  float* ps = f32_ptr(sum, kCout, x, op, "sum");
  float* pq = f32_ptr(sqsum, kCout, x, op, "sqsum");
  const StemGeom g = stem_geom(x, w, y.size(2), y.size(3));
  const bool wgmma = stem_wgmma_mode() >= 1;
  const bool a_smem = wgmma && stem_a_smem_enabled();
  const int parts = wgmma ? conv_wgmma_parts(g.tiles, a_smem)
                          : stem_parts<stem_conv_stats_kernel>(kSmemBytes, g.tiles);
  Tensor partial =
      empty({int64_t(parts) * 2 * kCout}, TensorOptions(DType::f32).with_device(x.device()));
  cudaStream_t s = current_stream();
  __half* yp = static_cast<__half*>(y.raw_data());
  float* pp = static_cast<float*>(partial.raw_data());
  const __half* xp = static_cast<const __half*>(x.raw_data());
  const __half* wp = static_cast<const __half*>(w.raw_data());
  if (wgmma) {
    conv_wgmma(yp, pp, xp, wp, g, parts, a_smem, s);
  } else {
    launch(stem_conv_stats_kernel, parts, kThreads, kSmemBytes, s, yp, pp, xp, wp, g);
    KILN_CUDA_CHECK_LAUNCH();
  }
  launch(stem_stats_finish_kernel, 1, 2 * kCout, 0, s, ps, pq, pp, parts);
  KILN_CUDA_CHECK_LAUNCH();
}

void stem_conv_backward_weight(const Tensor& dw, const Tensor& dy, const Tensor& x,
                               const ConvParams& p, bool accumulate) {
  KILN_CHECK(stem_wgrad_supported(dw, dy, x, p),
             "stem_conv_backward_weight (cuda): takes the weight gradient (f16 or f32) of a 7x7/2 "
             "convolution (padding 3) of f16 channels-last x with 3 channels to 64, output rows "
             "a multiple of 8 and columns of 16; got dw ",
             dw.desc(), ", dy ", dy.desc(), ", x ", x.desc());
  const StemGeom g = stem_geom(x, dw, dy.size(2), dy.size(3));
  const bool wgmma = stem_wgmma_mode() == 2;
  const bool a_smem = wgmma && stem_wgrad_a_smem_enabled();
  const int parts = wgmma ? wgrad_wgmma_parts(g.tiles, a_smem)
                          : stem_parts<stem_wgrad_kernel>(kWgSmemBytes, g.tiles);
  Tensor partial =
      empty({int64_t(parts) * kCout * kK}, TensorOptions(DType::f32).with_device(x.device()));
  cudaStream_t s = current_stream();
  float* pw = static_cast<float*>(partial.raw_data());
  const __half* dyp = static_cast<const __half*>(dy.raw_data());
  const __half* xp = static_cast<const __half*>(x.raw_data());
  if (wgmma) {
    wgrad_wgmma(pw, dyp, xp, g, parts, a_smem, s);
  } else {
    launch(stem_wgrad_kernel, parts, kThreads, kWgSmemBytes, s, pw, dyp, xp, g);
    KILN_CUDA_CHECK_LAUNCH();
  }
  const float* pp = pw;
  const unsigned blocks = unsigned((kCout * 3 * kKh * kKh + 255) / 256);
  if (dw.dtype() == DType::f16)
    launch(stem_wgrad_finish_kernel<__half>, blocks, 256, 0, s, static_cast<__half*>(dw.raw_data()),
           pp, parts, g, accumulate);
  else
    launch(stem_wgrad_finish_kernel<float>, blocks, 256, 0, s, static_cast<float*>(dw.raw_data()),
           pp, parts, g, accumulate);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda
