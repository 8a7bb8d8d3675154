// The block tail's data-gradient GEMM with the batch-norm sums in its epilogue, on Hopper's
// wgmma and TMA (contract in cuda/kernels.h: dgrad1x1_bn_sums; the mma.sync kernel for K 64 and
// 128 is cuda/kernels/gemm_bn.cu, whose header explains what the epilogue computes).
//
// Measured in session 14 (NOTES.md): correct against the unfused composition and the CPU,
// compute-sanitizer clean, and the step 0.13-0.16 ms faster than with KILN_TAIL_GEMM=mma (the
// seven K 256/512 tails back on cuDNN's dgrad + kiln's two passes). Its GEMM is
// tools/probes/wgmma_gemm.cu's v4 on branch wip/wgmma, level with cuBLASLt on ResNet-50's four
// tail shapes (layer 3: 0.065 ms, layer 4: 0.053).
//
// G (M × C) = dy (M × K) · w (K × C): A = dy, row-major (NHWC); B = w transposed to wt (C × K)
// by a small kernel first, so that both operands are K-major for wgmma's descriptors. CTA: 3
// warpgroups. Warpgroup 0's first thread issues TMA loads of 128 × 64 boxes of dy and wt into
// kStages slots in the 128-byte swizzle (the layout wgmma's descriptors name), each slot guarded
// by a "full" mbarrier (the bytes arrive on it) and an "empty" one (all 256 consumer threads
// arrive once their wgmma group on it has completed). Warpgroups 1 and 2 compute rows 0-63 and
// 64-127 of a 128 × 128 tile, stage their f32 accumulators in their own shared buffer, and run
// gemm_bn.cu's epilogue on it: add r, round to f16, mask with the ReLU bits, write g in 16-byte
// vectors, and keep Σg and Σg·(x − mean) of their 8 channels in registers.
//
// Persistent and bit-reproducible: the grid is parts × (C / 128) CTAs; CTA b owns column tile
// b % (C / 128) for good and the row tiles p, p + parts, ... (p = b / (C / 128)), so the producer
// runs into the next row tile while the consumers store this one, and at the end each CTA adds
// its 16 row sets' sums in a fixed order into its partial row: (parts, 2, C), a function of the
// shape and the device only.
#include <cuda.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <mutex>

#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/gemm_bn_epilogue.cuh"
#include "cuda/kernels/gemm_bn_wgmma.h"

namespace kiln::cuda {
namespace {

constexpr int kBM = 128, kBN = 128, kBK = 64;
constexpr int kStages = 4, kThreads = 384;
constexpr int kTile = kBM * kBK * 2;                  // bytes of one 128 × 64 box (A or B)
constexpr int kStageBytes = 2 * kTile;                // A and B
constexpr int kPitch = kBN + 4;                       // floats per staged accumulator row
constexpr int kStageOut = 64 * kPitch * 4;            // one consumer warpgroup's staging buffer
constexpr int kSmemBytes = kStages * kStageBytes + 2 * kStageOut + 2 * kStages * 8 + 1024;
constexpr int kMaxDevices = 64;

// ---- PTX wrappers (sm_90a; only its device pass sees them) ----
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ inline void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ inline void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ inline void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ inline void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// A box of a 2-D tensor map at (c0 innermost, c1) into shared `dst`; its bytes arrive on `bar`.
__device__ inline void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                   uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ inline void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ inline void wgmma_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// Descriptor of a K-major operand in the 128-byte swizzle at shared address `addr`: start >> 4
// in bits 0-13, leading byte offset 16-29 (unused with this swizzle: 1), stride byte offset >> 4
// in 32-45 (1,024: 8 rows of 128 B), swizzle mode 1 (128 B) in 62-63.
__device__ inline uint64_t make_desc(uint32_t addr) {
  uint64_t d = uint64_t((addr & 0x3FFFF) >> 4);
  d |= uint64_t(1) << 16;
  d |= uint64_t(1024 >> 4) << 32;
  d |= uint64_t(1) << 62;
  return d;
}
// D (64 × 128 f32, the warpgroup's fragments) += A (64 × 16) · B (16 × 128), both K-major in
// shared memory.
__device__ inline void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"  // scale-d: D += A·B (the accumulators start at zero)
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, "
      "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, "
      "%55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
        "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
        "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),
        "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b));
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// wt (C × K) = w (K × C) transposed, through a 32 × 33 shared tile.
__global__ void transpose_kernel(__half* __restrict__ wt, const __half* __restrict__ w, int K,
                                 int C) {
  pdl_start();
  __shared__ __half tile[32][33];
  const int k0 = blockIdx.y * 32, c0 = blockIdx.x * 32;
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const int k = k0 + i, c = c0 + threadIdx.x;
    if (k < K && c < C) tile[i][threadIdx.x] = w[int64_t(k) * C + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const int c = c0 + i, k = k0 + threadIdx.x;
    if (c < C && k < K) wt[int64_t(c) * K + k] = tile[threadIdx.x][i];
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    dgrad1x1_bn_sums_wgmma_kernel(__half* __restrict__ g, float* __restrict__ partial,
                                  const __grid_constant__ CUtensorMap map_dy,
                                  const __grid_constant__ CUtensorMap map_wt,
                                  const __half* __restrict__ r, const uint8_t* __restrict__ mask,
                                  const __half* __restrict__ x, const float* __restrict__ mean,
                                  int64_t M, int C, int K, int parts) {
  pdl_start();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;  // the swizzle wants 1,024-byte alignment
  unsigned char* gbase = smem_raw + (base - raw);
  auto a_tile = [&](int s) { return base + uint32_t(s * kStageBytes); };
  auto b_tile = [&](int s) { return base + uint32_t(s * kStageBytes + kTile); };
  const uint32_t out0 = uint32_t(kStages * kStageBytes);  // the two staging buffers
  const uint32_t bars = base + out0 + 2 * kStageOut;
  auto full = [&](int s) { return bars + uint32_t(s * 8); };
  auto empty = [&](int s) { return bars + uint32_t((kStages + s) * 8); };
  const int tid = threadIdx.x, wg = tid >> 7;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int col_tiles = C / kBN, n0 = (int(blockIdx.x) % col_tiles) * kBN;
  const int part = int(blockIdx.x) / col_tiles, KT = K / kBK;
  const int64_t row_tiles = (M + kBM - 1) / kBM;

  if (wg == 0) {  // the producer: one thread issues every load
    if (tid != 0) return;
    int j = 0;
    for (int64_t tile = part; tile < row_tiles; tile += parts) {
      const int m0 = int(tile * kBM);
      for (int kt = 0; kt < KT; ++kt, ++j) {
        const int s = j % kStages;
        if (j >= kStages) mbar_wait(empty(s), uint32_t((j / kStages - 1) & 1));
        mbar_expect_tx(full(s), uint32_t(kStageBytes));
        tma_load_2d(a_tile(s), &map_dy, kt * kBK, m0, full(s));
        tma_load_2d(b_tile(s), &map_wt, kt * kBK, n0, full(s));
      }
    }
    return;
  }

  // Consumers: warpgroup c computes rows c·64.. of each tile.
  const int c = wg - 1, t = tid & 127, warp = t >> 5, lane = t & 31;
  float* sc = reinterpret_cast<float*>(gbase + out0 + c * kStageOut);
  // The epilogue's thread layout: channel group cg (8 channels) of rows rr, rr + 8, ..., rr + 56.
  const int cg = t & 15, rr = t >> 4;
  const int c0 = n0 + cg * 8;
  float mu[8], s1[8] = {}, s2[8] = {};
#pragma unroll
  for (int q = 0; q < 8; ++q) mu[q] = mean[c0 + q];

  int j = 0;
  for (int64_t tile = part; tile < row_tiles; tile += parts) {
    const int64_t m0 = tile * kBM + c * 64;
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.f;
    for (int kt = 0; kt < KT; ++kt, ++j) {
      const int s = j % kStages;
      mbar_wait(full(s), uint32_t((j / kStages) & 1));
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        const uint64_t da = make_desc(a_tile(s) + uint32_t(c * 64 * 128 + kk * 32));
        const uint64_t db = make_desc(b_tile(s) + uint32_t(kk * 32));
        wgmma_m64n128k16(d, da, db);
      }
      wgmma_commit();
      wgmma_wait0();
      mbar_arrive(empty(s));
    }
    // Stage the accumulators (fragment layout: register 4b + {0, 1} holds row 16·warp + lane / 4,
    // columns 8b + 2·(lane % 4) + {0, 1}; 4b + {2, 3} the row 8 below).
    named_sync(1 + c, 128);  // the buffer's previous tile has been read
    const int r0 = warp * 16 + (lane >> 2);
#pragma unroll
    for (int b = 0; b < kBN / 8; ++b) {
      const int col = b * 8 + (lane & 3) * 2;
      *reinterpret_cast<float2*>(sc + r0 * kPitch + col) = float2{d[4 * b], d[4 * b + 1]};
      *reinterpret_cast<float2*>(sc + (r0 + 8) * kPitch + col) =
          float2{d[4 * b + 2], d[4 * b + 3]};
    }
    named_sync(1 + c, 128);

    // Rows rr + 8·i of this warpgroup's 64, channels c0..c0+7.
    tail_epilogue_rows<8, 8>(g, r, mask, x, M, C, m0, rr, c0, sc + rr * kPitch + cg * 8, kPitch, mu,
                             s1, s2);
  }

  // The 16 row sets (8 per warpgroup) of each channel, added in a fixed order into the CTA's
  // partial row; the staging buffers, now free, hold them.
  named_sync(3, 256);  // both consumer warpgroups are done with their buffers
  float* red = reinterpret_cast<float*>(gbase + out0);  // [16 row sets][2][kBN]
  const int set = c * 8 + rr;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    red[(set * 2 + 0) * kBN + cg * 8 + q] = s1[q];
    red[(set * 2 + 1) * kBN + cg * 8 + q] = s2[q];
  }
  named_sync(3, 256);
  const int ct = tid - 128;  // 0..255: (sum, column)
  {
    const int which = ct / kBN, col = ct % kBN;
    float v = 0.f;
    for (int s = 0; s < 16; ++s) v += red[(s * 2 + which) * kBN + col];
    partial[(int64_t(part) * 2 + which) * C + n0 + col] = v;
  }
#else
  __trap();  // built without sm_90a: dgrad1x1_bn_wgmma_available() is false, never launched
#endif
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (kiln does not link libcuda:
// CUDA builds must start on machines without a driver).
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiled encode_tiled() {
  static EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                cudaEnableDefault, &q));
#else
    CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &q));
#endif
    KILN_CHECK(q == cudaDriverEntryPointSuccess && p, "dgrad1x1_bn_sums (cuda): the driver has no "
               "cuTensorMapEncodeTiled");
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

// `rows` × K f16 row-major as a TMA map of 128 × 64 boxes in the 128-byte swizzle; rows past
// the end read as zeros.
CUtensorMap kmajor_map(const void* p, int64_t rows, int64_t K) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {cuuint64_t(K), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(K) * 2};
  const cuuint32_t box[2] = {cuuint32_t(kBK), cuuint32_t(kBM)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult res = encode_tiled()(
      &m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, const_cast<void*>(p), dims, strides, box, elem,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  KILN_CHECK(res == CUDA_SUCCESS, "dgrad1x1_bn_sums (cuda): cuTensorMapEncodeTiled failed (",
             int(res), ") for a ", rows, " x ", K, " f16 operand");
  return m;
}

}  // namespace

bool dgrad1x1_bn_wgmma_available() {
#if defined(KILN_WGMMA_SM90A)
  const cudaDeviceProp& p = context().props;
  return p.major == 9 && p.minor == 0;
#else
  return false;
#endif
}

bool dgrad1x1_bn_wgmma_shape(int64_t K, int64_t C) {
  return K >= kBK && K <= 512 && K % kBK == 0 && C % kBN == 0 && C / kBN <= 132;
}

int dgrad1x1_bn_wgmma_parts(int64_t M, int64_t C) {
  const int64_t col_tiles = std::max<int64_t>(C / kBN, 1), rows = (M + kBM - 1) / kBM;
  const int64_t sms = context().props.multiProcessorCount;
  return int(std::clamp<int64_t>(sms / col_tiles, 1, std::max<int64_t>(rows, 1)));
}

void dgrad1x1_bn_sums_wgmma(const Tensor& g, const Tensor& partial, const Tensor& dy,
                            const Tensor& w, const Tensor& r, const Tensor& mask, const Tensor& x,
                            const Tensor& mean, int parts) {
  const int64_t C = x.size(1), K = dy.size(1), M = x.numel() / C;
  cudaStream_t s = current_stream();
  // wt (C × K): the weight K-major for wgmma's B.
  Tensor wt = empty({C, K}, TensorOptions(DType::f16).with_device(x.device()));
  launch(transpose_kernel, dim3(unsigned((C + 31) / 32), unsigned((K + 31) / 32)), dim3(32, 8), 0,
         s, static_cast<__half*>(wt.raw_data()), static_cast<const __half*>(w.raw_data()), int(K),
         int(C));
  KILN_CUDA_CHECK_LAUNCH();
  const CUtensorMap map_dy = kmajor_map(dy.raw_data(), M, K);
  const CUtensorMap map_wt = kmajor_map(wt.raw_data(), C, K);
  auto kernel = dgrad1x1_bn_sums_wgmma_kernel;
  static std::array<std::once_flag, kMaxDevices> sized;
  const int dev = current_device();
  KILN_CHECK(dev >= 0 && dev < kMaxDevices, "dgrad1x1_bn_sums (cuda): device ", dev,
             " out of range");
  std::call_once(sized[size_t(dev)], [&] {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kSmemBytes));
  });
  const unsigned grid = unsigned(parts * (C / kBN));
  launch(kernel, grid, kThreads, kSmemBytes, s, static_cast<__half*>(g.raw_data()),
         static_cast<float*>(partial.raw_data()), map_dy, map_wt,
         static_cast<const __half*>(r.raw_data()), static_cast<const uint8_t*>(mask.raw_data()),
         static_cast<const __half*>(x.raw_data()), static_cast<const float*>(mean.raw_data()), M,
         int(C), int(K), parts);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda
