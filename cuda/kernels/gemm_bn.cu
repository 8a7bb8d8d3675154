// A 1x1 convolution's data gradient with the block tail's batch-norm backward in its epilogue
// (contract in cuda/kernels.h: bn_nhwc_backward_dgrad1x1).
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
// The GEMM: mma.sync m16n8k16 (f16 in, f32 accumulation), CTA tile 128 × 64 × 32, 8 warps as
// 4 (M) × 2 (N), each 32 × 32; operands staged by cp.async in 3 stages; ldmatrix from padded
// rows (no bank conflicts). A CTA walks M tiles blockIdx.y, blockIdx.y + gridDim.y, ... of its
// column tile blockIdx.x and keeps its columns' sums in registers; at the end its warps' sums are
// added in a fixed order into one partial row — bit-reproducible for a given shape and device.
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"

namespace kiln::cuda {
namespace {

constexpr int kBM = 128, kBN = 64, kBK = 32, kStages = 3;
constexpr int kThreads = 256;
constexpr int kPadA = kBK + 8, kPadB = kBN + 8;  // halves per smem row (16 B of padding)
constexpr int kStageHalves = kBM * kPadA + kBK * kPadB;

__device__ inline void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ inline void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ inline void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ inline void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ inline void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Stage s of the (kBM × kBK) tile of dy at rows m0.., columns k0.. and the (kBK × kBN) tile of w
// at rows k0.., columns n0..: 16-byte chunks, rows past M zero-filled.
__device__ inline void load_stage(__half* stage, const __half* __restrict__ dy,
                                  const __half* __restrict__ w, int64_t M, int K, int N,
                                  int64_t m0, int k0, int n0) {
  __half* sa = stage;
  __half* sb = stage + kBM * kPadA;
  const int t = threadIdx.x;
  // A: 128 rows × 4 chunks = 512 chunks, two per thread.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int chunk = t + i * kThreads, row = chunk >> 2, col = (chunk & 3) * 8;
    const int64_t m = m0 + row;
    const bool valid = m < M;
    cp_async16(sa + row * kPadA + col, dy + (valid ? m : 0) * K + k0 + col, valid);
  }
  // B: 32 rows × 8 chunks = 256 chunks, one per thread.
  {
    const int row = t >> 3, col = (t & 7) * 8;
    cp_async16(sb + row * kPadB + col, w + int64_t(k0 + row) * N + n0 + col, true);
  }
}

__global__ void __launch_bounds__(kThreads, 2)
dgrad1x1_bn_sums_kernel(__half* __restrict__ g, float* __restrict__ partial,
                        const __half* __restrict__ dy, const __half* __restrict__ w,
                        const __half* __restrict__ r, const uint8_t* __restrict__ mask,
                        const __half* __restrict__ x, const float* __restrict__ mean, int64_t M,
                        int K, int N) {
  __shared__ __align__(16) __half smem[kStages * kStageHalves];
  __shared__ float red[4][2][kBN];  // per M-warp row: Σg and Σg·(x - mean) per column
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp >> 1, wn = warp & 1;  // warp tile rows wm·32.., columns wn·32..
  const int n0 = blockIdx.x * kBN;
  const int64_t tiles = (M + kBM - 1) / kBM;
  const int ktiles = K / kBK;

  // This thread's 8 columns: wn·32 + ni·8 + 2·(lane % 4) + {0, 1}, ni = 0..3.
  float mu[4][2];
#pragma unroll
  for (int ni = 0; ni < 4; ++ni)
#pragma unroll
    for (int j = 0; j < 2; ++j) mu[ni][j] = mean[n0 + wn * 32 + ni * 8 + 2 * (lane & 3) + j];
  float s1[4][2] = {}, s2[4][2] = {};

  for (int64_t tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
    const int64_t m0 = tile * kBM;
    float acc[2][4][4] = {};
    // Prologue: the first kStages - 1 stages in flight.
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < ktiles) load_stage(smem + s * kStageHalves, dy, w, M, K, N, m0, s * kBK, n0);
      cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; ++kt) {
      cp_async_wait<kStages - 2>();
      __syncthreads();
      // Refill the stage consumed one step ago.
      const int next = kt + kStages - 1;
      if (next < ktiles)
        load_stage(smem + (next % kStages) * kStageHalves, dy, w, M, K, N, m0, next * kBK, n0);
      cp_async_commit();
      const __half* sa = smem + (kt % kStages) * kStageHalves;
      const __half* sb = sa + kBM * kPadA;
#pragma unroll
      for (int kk = 0; kk < kBK; kk += 16) {
        unsigned a[2][4], b[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
          ldmatrix_x4(a[mi], sa + (wm * 32 + mi * 16 + (lane & 15)) * kPadA + kk + (lane >> 4) * 8);
#pragma unroll
        for (int nj = 0; nj < 2; ++nj)  // n8 tiles 2·nj and 2·nj + 1
          ldmatrix_x4_trans(b[nj], sb + (kk + (lane & 15)) * kPadB + wn * 32 + nj * 16 +
                                       (lane >> 4) * 8);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
          for (int ni = 0; ni < 4; ++ni)
            mma16816(acc[mi][ni], a[mi], b[ni >> 1][(ni & 1) * 2], b[ni >> 1][(ni & 1) * 2 + 1]);
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the stages before the next tile refills them

    // Epilogue: rows wm·32 + mi·16 + lane/4 + 8·h, columns as above.
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t m = m0 + wm * 32 + mi * 16 + (lane >> 2) + 8 * h;
        if (m >= M) continue;
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          const int n = n0 + wn * 32 + ni * 8 + 2 * (lane & 3);
          const int64_t i = m * N + n;
          const float2 rv = __half22float2(*reinterpret_cast<const __half2*>(r + i));
          const float2 xv = __half22float2(*reinterpret_cast<const __half2*>(x + i));
          const unsigned bits = mask[i >> 3] >> (n & 7);
          // G rounded to f16 as cuDNN stores it, then masked: g is exactly what the unfused
          // sums kernel would read.
          const __half2 gh = __floats2half2_rn(acc[mi][ni][2 * h] + rv.x, acc[mi][ni][2 * h + 1] + rv.y);
          float2 gv = __half22float2(gh);
          if (!(bits & 1u)) gv.x = 0.f;
          if (!(bits & 2u)) gv.y = 0.f;
          *reinterpret_cast<__half2*>(g + i) = __floats2half2_rn(gv.x, gv.y);
          s1[ni][0] += gv.x;
          s1[ni][1] += gv.y;
          s2[ni][0] = fmaf(gv.x, xv.x - mu[ni][0], s2[ni][0]);
          s2[ni][1] = fmaf(gv.y, xv.y - mu[ni][1], s2[ni][1]);
        }
      }
  }

  // The 8 lanes of a column group (lane / 4) in a fixed shuffle tree, then the 4 M-warps in order.
#pragma unroll
  for (int ni = 0; ni < 4; ++ni)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        s1[ni][j] += __shfl_xor_sync(0xffffffffu, s1[ni][j], off);
        s2[ni][j] += __shfl_xor_sync(0xffffffffu, s2[ni][j], off);
      }
  if (lane < 4)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = wn * 32 + ni * 8 + 2 * lane + j;
        red[wm][0][col] = s1[ni][j];
        red[wm][1][col] = s2[ni][j];
      }
  __syncthreads();
  if (threadIdx.x < 2 * kBN) {
    const int t = threadIdx.x / kBN, col = threadIdx.x % kBN;
    const float v = ((red[0][t][col] + red[1][t][col]) + red[2][t][col]) + red[3][t][col];
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

}  // namespace

// Two CTAs per SM over the whole grid, at most one per M tile.
int dgrad1x1_bn_parts(int64_t M, int64_t C) {
  const int64_t tiles = (M + kBM - 1) / kBM, col_tiles = std::max<int64_t>(C / kBN, 1);
  const int64_t sms = context().props.multiProcessorCount;
  return int(std::clamp<int64_t>((2 * sms + col_tiles - 1) / col_tiles, 1,
                                 std::min<int64_t>(std::max<int64_t>(tiles, 1), 65535)));
}

bool dgrad1x1_bn_supported(const Tensor& dy, const Tensor& w, const Tensor& x) {
  if (!(dy.defined() && w.defined() && x.defined() && dy.is_cuda() && dy.dtype() == DType::f16 &&
        w.dtype() == DType::f16 && x.dtype() == DType::f16 && dy.dim() == 4 && w.dim() == 4 &&
        x.dim() == 4))
    return false;
  const int64_t K = dy.size(1), N = x.size(1);
  return w.size(0) == K && w.size(1) == N && w.size(2) == 1 && w.size(3) == 1 &&
         dy.size(0) == x.size(0) && dy.size(2) == x.size(2) && dy.size(3) == x.size(3) &&
         K % kBK == 0 && N % kBN == 0 && dy.is_contiguous(MemoryFormat::ChannelsLast) &&
         x.is_contiguous(MemoryFormat::ChannelsLast) &&
         (w.is_contiguous(MemoryFormat::ChannelsLast) || w.is_contiguous());
}

int dgrad1x1_bn_sums(const Tensor& g, const Tensor& partial, const Tensor& dy, const Tensor& w,
                     const Tensor& r, const Tensor& mask, const Tensor& x, const Tensor& mean) {
  const char* op = "dgrad1x1_bn_sums";
  KILN_CHECK(dgrad1x1_bn_supported(dy, w, x), op,
             " (cuda): needs f16 channels-last dy (N, K, H, W), w (K, C, 1, 1) and x (N, C, H, W) "
             "with K % 32 == 0 and C % 64 == 0, got dy ", dy.desc(), ", w ", w.desc(), ", x ",
             x.desc());
  const int64_t C = x.size(1), K = dy.size(1), M = x.numel() / C;
  check_nhwc_f16(g, x.shape(), x.device(), op, "g");
  check_nhwc_f16(r, x.shape(), x.device(), op, "r");
  KILN_CHECK(mask.defined() && mask.dtype() == DType::u8 && mask.is_contiguous() &&
                 mask.numel() == x.numel() / 8 && mask.device() == x.device(),
             op, " (cuda): mask must be a contiguous u8 tensor of ", x.numel() / 8, " elements, got ",
             mask.defined() ? mask.desc() : "undefined");
  KILN_CHECK(mean.defined() && mean.dtype() == DType::f32 && mean.numel() == C &&
                 mean.is_contiguous() && mean.device() == x.device(),
             op, " (cuda): mean must be f32 of ", C, " elements, got ",
             mean.defined() ? mean.desc() : "undefined");
  const int parts = dgrad1x1_bn_parts(M, C);
  KILN_CHECK(partial.defined() && partial.dtype() == DType::f32 && partial.is_contiguous() &&
                 partial.numel() >= int64_t(parts) * 2 * C && partial.device() == x.device(),
             op, " (cuda): partial must hold ", int64_t(parts) * 2 * C, " f32 values, got ",
             partial.defined() ? partial.desc() : "undefined");
  if (M == 0) return 0;
  const dim3 grid{unsigned(C / kBN), unsigned(parts)};
  auto h = [](const Tensor& t) { return static_cast<const __half*>(t.raw_data()); };
  dgrad1x1_bn_sums_kernel<<<grid, kThreads, 0, current_stream()>>>(
      static_cast<__half*>(g.raw_data()), static_cast<float*>(partial.raw_data()), h(dy), h(w),
      h(r), static_cast<const uint8_t*>(mask.raw_data()), h(x),
      static_cast<const float*>(mean.raw_data()), M, int(K), int(C));
  KILN_CUDA_CHECK_LAUNCH();
  return parts;
}

}  // namespace kiln::cuda
