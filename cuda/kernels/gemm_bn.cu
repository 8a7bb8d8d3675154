// A 1x1 convolution's data gradient with the block tail's batch-norm backward in its epilogue
// (contract in cuda/kernels.h: bn_nhwc_backward_dgrad).
//
// In NHWC a stride-1 1x1 convolution is a GEMM: its data gradient is G (M × N) = dy (M × K) ·
// w (K × N), M = N·H·W pixels, K the convolution's output channels, N its input channels, w the
// KRSC weight read as K rows of N. In a ResNet the identity block's input x_b is the previous
// block's output relu(bn3(y3) + x_{b-1}); its gradient is this GEMM added onto the shortcut's
// gradient r. Unfused that is cuDNN's dgrad with beta = 1 (reads r, writes G), then kiln's sums
// kernel (reads G, y3 and the ReLU mask), then the apply kernel (reads them again, writes dz and
// dy3). Here the GEMM's epilogue adds r, rounds to f16, applies the ReLU bitmask, writes g (which
// is dz) and accumulates Σg and Σg·(y3 − mean) per channel; the apply then reads g and y3 and
// writes dy3 only: two passes over the activation fewer.
//
// The same GEMM without a residual and with the ReLU mask recomputed from x (a bottleneck's
// inner bn2 + ReLU, whose output only conv3 reads) runs on the wgmma kernel only
// (gemm_bn_wgmma.cu), as does the 1x1 forward with statistics (conv1x1_forward_stats).
//
// The GEMM: mma.sync m16n8k16 (f16 in, f32 accumulation), CTA tile 128 × 64 × K (K = 64 or
// 128: the layers where the activation, not the arithmetic, sets the time), 8 warps as 4 (M) × 2
// (N), each 32 × 32. A CTA keeps its column tile of w in shared memory and walks M tiles
// blockIdx.y, blockIdx.y + gridDim.y, ...; the next tile's rows of dy load (cp.async) while
// this one computes and writes. The accumulators go through shared memory so that the epilogue
// reads r and x and writes g in whole 16-byte vectors; each thread keeps the sums of its 8
// channels over all its rows, and at the end the CTA adds its threads' sums in a fixed order
// into one partial row — bit-reproducible for a given shape and device.
#include <cuda_fp16.h>

#include <algorithm>

#include "core/switches.h"
#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/gemm_bn_epilogue.cuh"
#include "cuda/kernels/gemm_bn_wgmma.h"
#include "cuda/kernels/mma.cuh"

namespace kiln::cuda {
namespace {

constexpr int kBM = 128, kBN = 64;
constexpr int kThreads = 256;
constexpr int kPadC = kBN + 4;  // floats per row of the staged accumulators

// Shared memory of the kernel for K: w's column tile, then two buffers each holding a tile of dy
// or, once it is consumed, the staged accumulators.
template <int K>
struct Smem {
  static constexpr int kPadA = K + 8, kPadB = kBN + 8;  // halves per row (16 B of padding)
  static constexpr size_t kB = size_t(K) * kPadB * 2;
  static constexpr size_t kBuf = std::max(size_t(kBM) * kPadA * 2, size_t(kBM) * kPadC * 4);
  static constexpr size_t kBytes = kB + 2 * kBuf;
};

// The (kBM × K) tile of dy at rows m0.. into sa; rows past M zero-filled.
template <int K>
__device__ inline void load_a(__half* sa, const __half* __restrict__ dy, int64_t M, int64_t m0) {
  constexpr int kChunks = K / 8;  // 16-byte chunks per row
#pragma unroll
  for (int i = 0; i < kBM * kChunks / kThreads; ++i) {
    const int chunk = threadIdx.x + i * kThreads, row = chunk / kChunks;
    const int col = (chunk % kChunks) * 8;
    const int64_t m = m0 + row;
    const bool valid = m < M;
    cp_async16(sa + row * Smem<K>::kPadA + col, dy + (valid ? m : 0) * K + col, valid);
  }
}

template <int K>
__global__ void __launch_bounds__(kThreads, 2)
dgrad1x1_bn_sums_kernel(__half* __restrict__ g, float* __restrict__ partial,
                        const __half* __restrict__ dy, const __half* __restrict__ w,
                        const __half* __restrict__ r, const uint8_t* __restrict__ mask,
                        const __half* __restrict__ x, const float* __restrict__ mean, int64_t M,
                        int N) {
  pdl_start();
  using S = Smem<K>;
  extern __shared__ __align__(16) unsigned char smem[];
  __half* sb = reinterpret_cast<__half*>(smem);
  auto buf = [&](int i) { return smem + S::kB + size_t(i) * S::kBuf; };
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp >> 1, wn = warp & 1;  // warp tile rows wm·32.., columns wn·32..
  const int n0 = blockIdx.x * kBN;
  const int64_t tiles = (M + kBM - 1) / kBM;

  // w's (K × kBN) column tile, and the first tile of dy.
#pragma unroll
  for (int i = 0; i < K * (kBN / 8) / kThreads; ++i) {
    const int chunk = threadIdx.x + i * kThreads, row = chunk / (kBN / 8);
    const int col = (chunk % (kBN / 8)) * 8;
    cp_async16(sb + row * S::kPadB + col, w + int64_t(row) * N + n0 + col, true);
  }
  int64_t tile = blockIdx.y;
  if (tile < tiles) load_a<K>(reinterpret_cast<__half*>(buf(0)), dy, M, tile * kBM);
  cp_async_commit();

  // The epilogue's thread layout: channel group cg (8 channels) of rows rr, rr + 32, ... .
  const int cg = threadIdx.x & 7, rr = threadIdx.x >> 3;
  const int c0 = n0 + cg * 8;
  float mu[8], s1[8] = {}, s2[8] = {};
#pragma unroll
  for (int j = 0; j < 8; ++j) mu[j] = mean[c0 + j];

  for (int cur = 0; tile < tiles; tile += gridDim.y, cur ^= 1) {
    const int64_t m0 = tile * kBM;
    cp_async_wait_all();
    __syncthreads();  // this tile's rows are in; the other buffer's last readers are done
    if (tile + gridDim.y < tiles)
      load_a<K>(reinterpret_cast<__half*>(buf(cur ^ 1)), dy, M, (tile + gridDim.y) * kBM);
    cp_async_commit();

    const __half* sa = reinterpret_cast<const __half*>(buf(cur));
    float acc[2][4][4] = {};
#pragma unroll
    for (int kk = 0; kk < K; kk += 16) {
      unsigned a[2][4], b[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
        ldmatrix_x4(a[mi], sa + (wm * 32 + mi * 16 + (lane & 15)) * S::kPadA + kk + (lane >> 4) * 8);
#pragma unroll
      for (int nj = 0; nj < 2; ++nj)  // n8 tiles 2·nj and 2·nj + 1
        ldmatrix_x4_trans(b[nj], sb + (kk + (lane & 15)) * S::kPadB + wn * 32 + nj * 16 +
                                     (lane >> 4) * 8);
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
          mma16816(acc[mi][ni], a[mi], b[ni >> 1][(ni & 1) * 2], b[ni >> 1][(ni & 1) * 2 + 1]);
    }
    __syncthreads();  // every warp is done with this tile's rows: the buffer takes the results
    float* sc = reinterpret_cast<float*>(buf(cur));
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = wm * 32 + mi * 16 + (lane >> 2) + 8 * h;
          const int col = wn * 32 + ni * 8 + 2 * (lane & 3);
          *reinterpret_cast<float2*>(sc + row * kPadC + col) =
              float2{acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]};
        }
    __syncthreads();

    // Rows rr + 32·j of the tile, channels c0..c0+7.
    tail_epilogue_rows<kBM / 32, 32>(g, r, mask, x, M, N, m0, rr, c0, sc + rr * kPadC + cg * 8,
                                     kPadC, mu, s1, s2);
  }
  cp_async_wait_all();

  // The 32 threads of a channel group, added in row order into the CTA's partial row.
  __syncthreads();
  float* red = reinterpret_cast<float*>(buf(0));  // [32 rows][2][kBN]
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    red[(rr * 2 + 0) * kBN + cg * 8 + j] = s1[j];
    red[(rr * 2 + 1) * kBN + cg * 8 + j] = s2[j];
  }
  __syncthreads();
  if (threadIdx.x < 2 * kBN) {
    const int t = threadIdx.x / kBN, col = threadIdx.x % kBN;
    float v = 0.f;
    for (int row = 0; row < 32; ++row) v += red[(row * 2 + t) * kBN + col];
    partial[(int64_t(blockIdx.y) * 2 + t) * N + n0 + col] = v;
  }
}

void check_nhwc_f16(const Tensor& t, const Shape& shape, const Device& dev, const char* op,
                    const char* what) {
  KILN_CHECK(t.defined() && t.dtype() == DType::f16 && t.shape() == shape && t.device() == dev &&
                 t.is_contiguous(MemoryFormat::ChannelsLast),
             op, " (cuda): ", what, " must be f16 channels-last ", shape_str(shape), " on ", dev,
             ", got ", t.defined() ? t.desc() : "undefined");
}

constinit RuntimeSetting<int> g_tail_gemm{&Switches::tail_gemm};  // KILN_TAIL_GEMM

// The wgmma kernel (gemm_bn_wgmma.cu) for K and C: wherever it fits in mode 2 (the default; with
// its TMA epilogue it beats the mma.sync kernel at K 64 and 128 too, docs/lab/tail-gemm.md), only
// where the mma.sync kernel does not go (K 256, 512) in mode 1 (KILN_TAIL_GEMM=mixed), never in
// mode 0 (KILN_TAIL_GEMM=mma).
bool use_wgmma(int64_t M, int64_t K, int64_t C) {
  const int mode = g_tail_gemm.get();
  if (mode == 0 || !dgrad1x1_bn_wgmma_shape(M, K, C) || !dgrad1x1_bn_wgmma_available())
    return false;
  return mode == 2 || K > 128;
}

constinit RuntimeSwitch g_dual_dgrad{&Switches::dual_dgrad};  // KILN_DUAL_DGRAD
}  // namespace

bool dual_dgrad_supported(const Tensor& dy1, const Tensor& w1, const Tensor& x) {
  // The wgmma kernel's dual form: the 1x1 tail's shapes on that kernel, and the switch.
  return g_dual_dgrad.get() && !dgrad_weight_3x3(w1) && dgrad1x1_bn_supported(dy1, w1, x, true) &&
         use_wgmma(x.numel() / x.size(1), dy1.size(1), x.size(1));
}
bool dual_dgrad_enabled() { return g_dual_dgrad.get(); }

namespace {
constinit RuntimeSwitch g_tail_fold_t{&Switches::tail_fold_t};  // KILN_TAIL_FOLD_T
}  // namespace

bool dgrad1x1_bn_linear_supported(const Tensor& dy1, const Tensor& w1, const Tensor& x,
                                  const Tensor& x2, const Tensor& w2, const Tensor& b2) {
  if (!g_tail_fold_t.get() || dgrad_weight_3x3(w1) || !dgrad1x1_bn_supported(dy1, w1, x, false))
    return false;
  if (!(x2.defined() && w2.defined() && b2.defined() && x2.dtype() == DType::f16 &&
        w2.dtype() == DType::f16 && b2.dtype() == DType::f16 && x2.dim() == 4))
    return false;
  const int64_t C = x.size(1), C2 = x2.size(1), K = dy1.size(1) + C2, M = x.numel() / C;
  return C2 > 0 && x2.size(0) == x.size(0) && x2.size(2) == x.size(2) &&
         x2.size(3) == x.size(3) && x2.is_contiguous(MemoryFormat::ChannelsLast) &&
         w2.dim() == 2 && w2.size(0) == C && w2.size(1) == C2 && w2.is_contiguous() &&
         b2.numel() == C && b2.is_contiguous() && x2.device() == x.device() &&
         w2.device() == x.device() && b2.device() == x.device() &&
         ((use_wgmma(M, K, C) && use_wgmma(M, dy1.size(1), C)) ||
          dgrad1x1_bn_pair64(dy1, w1, x, C2));
}
bool tail_fold_t_enabled() { return g_tail_fold_t.get(); }
void set_tail_fold_t_enabled(bool on) { g_tail_fold_t.set(on); }
void set_dual_dgrad_enabled(bool on) { g_dual_dgrad.set(on); }

bool dgrad1x1_bn_stride2_supported(const Tensor& x, const Tensor& mask) {
  if (!(x.defined() && mask.defined() && x.dim() == 4 && x.dtype() == DType::f16)) return false;
  const int64_t C = x.size(1), M = x.numel() / std::max<int64_t>(C, 1);
  // Any K the GEMM takes does (K = 64 is the smallest): the wgmma kernel in mode 2 for these rows.
  return g_tail_gemm.get() == 2 && use_wgmma(M, 64, C) && dgrad1x1_bn_wgmma_takes_stride2(true);
}

Shape stride2_grad_shape(const Tensor& x) {
  KILN_CHECK(x.dim() == 4, "stride2_grad_shape: x must be 4-D, got ", x.desc());
  return Shape{x.size(0), x.size(1), (x.size(2) + 1) / 2, (x.size(3) + 1) / 2};
}

bool dgrad_weight_3x3(const Tensor& w1) {
  return w1.defined() && w1.dim() == 4 && w1.size(2) == 3 && w1.size(3) == 3;
}

int tail_gemm_mode() { return g_tail_gemm.get(); }
void set_tail_gemm_mode(int mode) {
  KILN_CHECK(mode >= 0 && mode <= 2, "set_tail_gemm_mode: mode ", mode, " is not 0, 1 or 2");
  g_tail_gemm.set(mode);
}

// The wgmma kernel's parts; else two CTAs per SM over the whole grid, at most one per M tile.
int dgrad1x1_bn_parts(int64_t M, int64_t C, int64_t K) {
  if (use_wgmma(M, K, C)) return dgrad1x1_bn_wgmma_parts(M, C);
  const int64_t tiles = (M + kBM - 1) / kBM, col_tiles = std::max<int64_t>(C / kBN, 1);
  const int64_t sms = context().props.multiProcessorCount;
  return int(std::clamp<int64_t>((2 * sms + col_tiles - 1) / col_tiles, 1,
                                 std::min<int64_t>(std::max<int64_t>(tiles, 1), 65535)));
}

namespace {
constinit RuntimeSwitch g_pair64{&Switches::dgrad_pair64};  // KILN_DGRAD_PAIR64
}  // namespace

bool dgrad1x1_bn_pair64(const Tensor& dy, const Tensor& w, const Tensor& x, int64_t c2) {
  if (!g_pair64.get() || !dgrad1x1_bn_wgmma_available() || !dy.defined() || !w.defined() ||
      !x.defined() || x.dim() != 4 || x.size(1) != 64 || dy.dim() != 4 || w.dim() != 4 ||
      w.size(2) != 1 || w.size(3) != 1)
    return false;
  const int64_t M = x.numel() / 64, K = dy.size(1);
  return M > 0 && M % 2 == 0 && use_wgmma(M / 2, 2 * K, 128) &&
         use_wgmma(M / 2, 2 * K + 2 * c2, 128) && c2 % 32 == 0;
}
bool dgrad_pair64_enabled() { return g_pair64.get(); }
void set_dgrad_pair64_enabled(bool on) { g_pair64.set(on); }

bool dgrad1x1_bn_supported(const Tensor& dy, const Tensor& w, const Tensor& x, bool mask_bits) {
  if (!(dy.defined() && w.defined() && x.defined() && dy.is_cuda() && dy.dtype() == DType::f16 &&
        w.dtype() == DType::f16 && x.dtype() == DType::f16 && dy.dim() == 4 && w.dim() == 4 &&
        x.dim() == 4))
    return false;
  const int64_t K = dy.size(1), N = x.size(1);
  return w.size(0) == K && w.size(1) == N && w.size(2) == 1 && w.size(3) == 1 &&
         dy.size(0) == x.size(0) && dy.size(2) == x.size(2) && dy.size(3) == x.size(3) &&
         N > 0 &&
         (((K == 64 || K == 128) && N % kBN == 0 && mask_bits) ||
          use_wgmma(x.numel() / N, K, N) || (!mask_bits && dgrad1x1_bn_pair64(dy, w, x, 0))) &&
         dy.is_contiguous(MemoryFormat::ChannelsLast) &&
         x.is_contiguous(MemoryFormat::ChannelsLast) &&
         (w.is_contiguous(MemoryFormat::ChannelsLast) || w.is_contiguous());
}

int dgrad1x1_bn_sums(const Tensor& g, const Tensor& partial, const Tensor& dy, const Tensor& w,
                     const Tensor& r, const Tensor& mask, const Tensor& x, const Tensor& mean,
                     const Tensor& scale_shift, const Tensor& x2, const Tensor& w2,
                     const Tensor& b2) {
  const char* op = "dgrad1x1_bn_sums";
  if (x2.defined())
    KILN_CHECK(!r.defined() && !mask.defined() && dgrad1x1_bn_linear_supported(dy, w, x, x2, w2, b2),
               op, " (cuda): x2 · w2ᵀ + b2 needs KILN_TAIL_FOLD_T on, an sm_90 GPU, no r and no "
               "mask bits, a 1x1 w, x2 (N, C2, H, W) f16 channels-last at x's positions, w2 (C, "
               "C2) and b2 (C) f16 contiguous, and K + C2 a multiple of 64 up to 2,048, got dy ",
               dy.desc(), ", x ", x.desc(), ", x2 ", x2.desc(), ", w2 ",
               w2.defined() ? w2.desc() : "undefined", ", b2 ",
               b2.defined() ? b2.desc() : "undefined");
  const bool bits = mask.defined();
  // w (K, C, 3, 3): a 3x3 convolution's data gradient (stride 1, padding 1) on the wgmma kernel.
  const bool taps = dgrad_weight_3x3(w);
  if (taps) {
    KILN_CHECK(dgrad3x3_bn_supported(dy, w, x), op,
               " (cuda): a 3x3 w needs KILN_DGRAD3X3 on, an "
               "sm_90 GPU, f16 channels-last dy (N, K, H, W), w (K, C, 3, 3) and x (N, C, H, W) "
               "with K a multiple of 64 up to 4,096 and C a multiple of 128, got dy ",
               dy.desc(), ", w ", w.desc(), ", x ", x.desc());
  } else {
    KILN_CHECK(dgrad1x1_bn_supported(dy, w, x, bits), op,
               " (cuda): needs f16 channels-last dy (N, K, H, W), w (K, C, 1, 1) and x (N, C, H, "
               "W) with K 64 or 128 and C % 64 == 0 (on sm_90 also K a multiple of 64 up to "
               "2,048 and C % 128 == 0; a mask recomputed from x: those only), got dy ",
               dy.desc(), ", w ", w.desc(), ", x ", x.desc());
  }
  const int64_t C = x.size(1), K = dy.size(1), M = x.numel() / C;
  // C = 64 with the mask from x: kiln's GEMM on x's rows in pairs (dgrad1x1_bn_pair64).
  const bool pair =
      !taps && !bits && C == 64 && dgrad1x1_bn_pair64(dy, w, x, x2.defined() ? x2.size(1) : 0);
  const bool wgmma = taps || pair || use_wgmma(M, K, C);
  check_nhwc_f16(g, x.shape(), x.device(), op, "g");
  // r compact at x's even pixels, (N, C, ⌈H/2⌉, ⌈W/2⌉): a stride-2 1x1 convolution's data
  // gradient, zero at the other pixels. The wgmma kernel's tail form takes it as it is; every
  // other form gets it scattered into x's shape first.
  Tensor rd = r;
  if (r.defined() && r.shape() != x.shape() && r.shape() == stride2_grad_shape(x)) {
    check_nhwc_f16(r, r.shape(), x.device(), op, "r");
    if (taps || pair || !use_wgmma(M, K, C) || !dgrad1x1_bn_wgmma_takes_stride2(bits)) {
      rd = zeros_like(x);
      rd.slice(2, 0, x.size(2), 2).slice(3, 0, x.size(3), 2).copy_(r);
    }
  } else if (r.defined() || !wgmma) {
    // r may be left out on the wgmma kernel only (the mma.sync kernel always adds it).
    check_nhwc_f16(r, x.shape(), x.device(), op, "r");
  }
  if (bits) {
    KILN_CHECK(mask.dtype() == DType::u8 && mask.is_contiguous() &&
                   mask.numel() == x.numel() / 8 && mask.device() == x.device(),
               op, " (cuda): mask must be a contiguous u8 tensor of ", x.numel() / 8,
               " elements, got ", mask.desc());
  } else {
    KILN_CHECK(scale_shift.defined() && scale_shift.dtype() == DType::f32 &&
                   scale_shift.numel() == 2 * C && scale_shift.is_contiguous() &&
                   scale_shift.device() == x.device(),
               op, " (cuda): without a mask, scale_shift must be f32 of ", 2 * C,
               " elements (the ReLU mask is recomputed from x), got ",
               scale_shift.defined() ? scale_shift.desc() : "undefined");
  }
  KILN_CHECK(mean.defined() && mean.dtype() == DType::f32 && mean.numel() == C &&
                 mean.is_contiguous() && mean.device() == x.device(),
             op, " (cuda): mean must be f32 of ", C, " elements, got ",
             mean.defined() ? mean.desc() : "undefined");
  const int parts = taps ? dgrad3x3_bn_parts(M, C) : dgrad1x1_bn_parts(M, C, K);
  KILN_CHECK(partial.defined() && partial.dtype() == DType::f32 && partial.is_contiguous() &&
                 partial.numel() >= int64_t(parts) * 2 * C && partial.device() == x.device(),
             op, " (cuda): partial must hold ", int64_t(parts) * 2 * C, " f32 values, got ",
             partial.defined() ? partial.desc() : "undefined");
  if (M == 0) return 0;
  if (taps) {
    dgrad3x3_bn_sums_wgmma(g, partial, dy, w, rd, mask, x, mean, scale_shift, parts);
    return parts;
  }
  if (pair) {
    dgrad1x1_bn_sums_wgmma_pair64(g, partial, parts, dy, w, rd, x, mean, scale_shift, x2, w2, b2);
    return parts;
  }
  if (use_wgmma(M, K, C)) {
    dgrad1x1_bn_sums_wgmma(g, partial, dy, w, rd, mask, x, mean, scale_shift, parts, Tensor(),
                           Tensor(), x2, w2, b2);
    return parts;
  }
  const dim3 grid{unsigned(C / kBN), unsigned(parts)};
  auto h = [](const Tensor& t) { return static_cast<const __half*>(t.raw_data()); };
  auto run = [&]<int kK>() {
    constexpr auto kernel = dgrad1x1_bn_sums_kernel<kK>;
    allow_smem_once<kernel>(int(Smem<kK>::kBytes), op);
    launch(kernel, grid, kThreads, Smem<kK>::kBytes, current_stream(),
           static_cast<__half*>(g.raw_data()), static_cast<float*>(partial.raw_data()), h(dy), h(w),
           h(rd), static_cast<const uint8_t*>(mask.raw_data()), h(x),
           static_cast<const float*>(mean.raw_data()), M, int(C));
  };
  if (K == 64)
    run.template operator()<64>();
  else
    run.template operator()<128>();
  KILN_CUDA_CHECK_LAUNCH();
  return parts;
}

}  // namespace kiln::cuda
