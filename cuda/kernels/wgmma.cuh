#pragma once
// What kiln's Hopper kernels on wgmma and TMA share (cuda/kernels/gemm_bn_wgmma.cu,
// cuda/kernels/wgrad1x1_wgmma.cu): PTX wrappers for mbarriers, TMA loads and wgmma, the shared-
// memory descriptors of the 128-byte swizzle, and the host's tensor maps. Included only by
// sources built for sm_90a (KILN_WGMMA_SOURCES in CMakeLists.txt); the device wrappers exist in
// that pass only.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/tensor.h"
#include "cuda/check.h"
#include "cuda/kernels/gemm_bn_epilogue.cuh"

namespace kiln::cuda::sm90 {

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
// A box of a 3-D tensor map at (c0 innermost, c1, c2) into shared `dst`; its bytes arrive on
// `bar`.
__device__ inline void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                   uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
// 128 pixels × 64 channels of an NHWC tensor's im2col map into shared `dst`: the pixels from
// (w, h, n) on in the map's traversal order, each shifted by (dw, dh), channels c.. (zeros where
// the shifted pixel is padding or past the last image); its bytes arrive on `bar`.
__device__ inline void tma_load_im2col(uint32_t dst, const CUtensorMap* map, int c, int w, int h,
                                       int n, uint16_t dw, uint16_t dh, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes [%0], "
      "[%1, {%2, %3, %4, %5}], [%6], {%7, %8};\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c), "r"(w), "r"(h), "r"(n), "r"(bar), "h"(dw),
      "h"(dh)
      : "memory");
}
// Orders this thread's generic-proxy shared-memory accesses before later async-proxy (TMA)
// writes to the same bytes.
__device__ inline void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ inline void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// Pins the accumulators' last writes (their zeroing, say) before the next wgmma_fence(): without
// it the compiler may sink the zeroing past the fence, and ptxas then serialises the wgmmas by
// inserting its own arrive and wait (its warnings C7519 and C7517).
template <int N>
__device__ inline void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ inline void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ inline void wgmma_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
__device__ inline void wgmma_wait1() {
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
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
// Descriptor of an N-major operand (B read from w (K × C) as it lies, C contiguous) in the
// 128-byte swizzle: each 64-column box is 64 rows (k) of 128 bytes; leading byte offset >> 4 in
// bits 16-29 = 8,192 (from columns 0-63 to the box of columns 64-127), stride byte offset >> 4
// in 32-45 = 1,024 (from one 8-row group of k to the next), swizzle mode 1 (128 B).
__device__ inline uint64_t make_desc_nmajor(uint32_t addr) {
  uint64_t d = uint64_t((addr & 0x3FFFF) >> 4);
  d |= uint64_t(8192 >> 4) << 16;
  d |= uint64_t(1024 >> 4) << 32;
  d |= uint64_t(1) << 62;
  return d;
}
// A descriptor moved `bytes` (a multiple of 16) on within its tile: the start address field
// alone changes. Shared addresses lie below 2^18, so the field (address >> 4, 14 bits) cannot
// carry out of the low word, and the result equals make_desc of the moved address. Computed
// once per k-step and advanced per wgmma, a descriptor costs one add on the consumers' path
// instead of a mask, a shift and the ORs (ncu, v33).
__device__ inline uint64_t desc_advance(uint64_t d, uint32_t bytes) {
  return (d & 0xFFFFFFFF00000000ull) | uint32_t(uint32_t(d) + (bytes >> 4));
}
// D (64 × 128 f32, the warpgroup's fragments) += A (64 × 16) · B (16 × 128), both in shared
// memory: A K-major (kTransA 0) or M-major (1), B K-major (kTransB 0) or N-major (1).
template <int kTransA, int kTransB>
__device__ inline void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"  // scale-d: D += A·B (the accumulators start at zero)
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, "
      "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, "
      "%55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %66, %67;\n"
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
      : "l"(desc_a), "l"(desc_b), "n"(kTransA), "n"(kTransB));
}

// D (64 × 128 f32) += A (64 × 16, in registers: the warpgroup's fragments, each warp's 16 rows
// laid out as mma.sync's m16n8k16 A operand) · B (16 × 128 in shared memory, K-major (kTransB 0)
// or N-major (1)).
template <int kTransB>
__device__ inline void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4],
                                           uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, "
      "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, "
      "%55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n"
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
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTransB));
}
// Four 8 × 8 b16 matrices from shared memory (ldmatrix .x4): lanes 8i..8i+7 give matrix i's row
// addresses; r[i] is this lane's pair of matrix i (row lane / 4, columns 2·(lane % 4) + {0, 1}).
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// The same, each matrix transposed (ldmatrix .trans): r[i] is this lane's pair of matrix i's
// transpose, i.e. column lane / 4, rows 2·(lane % 4) + {0, 1} of the matrix as stored.
__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// relu(x·scale + shift) of one half2, bit for bit bn_relu8's.
__device__ inline uint32_t bn_relu2(uint32_t x, float2 sc, float2 sh) {
  const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&x));
  float a = fmaf(v.x, sc.x, sh.x), b = fmaf(v.y, sc.y, sh.y);
  a = a < 0.f ? 0.f : a;
  b = b < 0.f ? 0.f : b;
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// relu(x·scale + shift) of one half2 in half precision (KILN_PROLOGUE_F16: the factors rounded
// to f16, one fused multiply-add and ReLU, one rounding): not bn_relu8's bits.
__device__ inline uint32_t bn_relu2_f16(uint32_t x, __half2 sc, __half2 sh) {
  const __half2 h = __hfma2_relu(*reinterpret_cast<const __half2*>(&x), sc, sh);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The same with B 16 × 64: D 64 × 64 f32.
template <int kTransA, int kTransB>
__device__ inline void wgmma_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %34, "
      "%35;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "n"(kTransA), "n"(kTransB));
}

// The same with A in registers (this warp's 16 rows, as mma.sync's m16n8k16 A operand) and B
// 16 × 64 in shared memory (K-major, kTransB 0, or N-major, 1): D 64 × 64 f32.
template <int kTransB>
__device__ inline void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4],
                                          uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, "
      "%36, p, 1, 1, %37;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTransB));
}

// The prologue of kiln's wgmma kernels: relu(x·scale + shift) in place (bn_relu8) on one box of
// 64 channels × kRows rows in the 128-byte swizzle at generic address `box` (1,024-byte
// aligned), by kThreads threads (a multiple of 64) of which this is `t`. Row r's 16-byte chunk j
// holds channels 8·(j XOR r % 8).. + 7; thread t takes chunk t % 8 of rows t / 8, t / 8 +
// kThreads / 8, ..., which all share r % 8 and so the same 8 channels: bn_relu_channel(t) of the
// box, whose factors sc, sh the caller loads (ahead of time: they are off the box's path). All
// its chunks are read before any is written. The caller fences (fence_proxy_async) and signals
// the threads whose MMAs read the box.
__device__ inline int bn_relu_channel(int t) { return ((t & 7) ^ ((t >> 3) & 7)) << 3; }
template <int kRows, int kThreads>
__device__ inline void bn_relu_box(unsigned char* box, int t, const float (&sc)[8],
                                   const float (&sh)[8]) {
  static_assert(kThreads % 64 == 0 && (kRows * 8) % kThreads == 0, "whole rows per pass");
  constexpr int kPer = kRows * 8 / kThreads, kStep = kThreads / 8;
  uint4* p = reinterpret_cast<uint4*>(box + (t >> 3) * 128 + (t & 7) * 16);
  uint4 v[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) v[i] = p[i * kStep * 8];
#pragma unroll
  for (int i = 0; i < kPer; ++i) p[i * kStep * 8] = bn_relu8(v[i], sc, sh);
}
// The 8 factors of channels c..c + 7 from scale_shift (scale of channel c at c, shift at C + c).
__device__ inline void bn_relu_factors(const float* ss, int C, int c, float (&sc)[8],
                                       float (&sh)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(ss + c),
               b = *reinterpret_cast<const float4*>(ss + c + 4);
  const float4 d = *reinterpret_cast<const float4*>(ss + C + c),
               e = *reinterpret_cast<const float4*>(ss + C + c + 4);
  sc[0] = a.x, sc[1] = a.y, sc[2] = a.z, sc[3] = a.w, sc[4] = b.x, sc[5] = b.y, sc[6] = b.z,
  sc[7] = b.w;
  sh[0] = d.x, sh[1] = d.y, sh[2] = d.z, sh[3] = d.w, sh[4] = e.x, sh[5] = e.y, sh[6] = e.z,
  sh[7] = e.w;
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// cuTensorMapEncodeTiled through the runtime's driver entry point (kiln does not link libcuda:
// CUDA builds must start on machines without a driver).
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline EncodeTiled encode_tiled() {
  static EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                cudaEnableDefault, &q));
#else
    CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &q));
#endif
    KILN_CHECK(q == cudaDriverEntryPointSuccess && p, "kiln's wgmma kernels (cuda): the driver has "
               "no cuTensorMapEncodeTiled");
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

// `rows` × `cols` row-major (f16, or bytes with !f16) as a TMA map of box_rows × box_cols
// boxes, in the 128-byte swizzle or none; rows past the end read as zeros.
inline CUtensorMap tile_map(const void* p, bool f16, int64_t rows, int64_t cols, int box_rows,
                     int box_cols, bool swizzle) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * (f16 ? 2 : 1)};
  const cuuint32_t box[2] = {cuuint32_t(box_cols), cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult res = encode_tiled()(
      &m, f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8, 2,
      const_cast<void*>(p), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
      swizzle ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  KILN_CHECK(res == CUDA_SUCCESS, "kiln's wgmma kernels (cuda): cuTensorMapEncodeTiled failed (",
             int(res), ") for a ", rows, " x ", cols, f16 ? " f16" : " u8", " operand");
  return m;
}

// cuTensorMapEncodeIm2col, as encode_tiled.
using EncodeIm2col = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                  const cuuint64_t*, const cuuint64_t*, const int*, const int*,
                                  cuuint32_t, cuuint32_t, const cuuint32_t*, CUtensorMapInterleave,
                                  CUtensorMapSwizzle, CUtensorMapL2promotion,
                                  CUtensorMapFloatOOBfill);
inline EncodeIm2col encode_im2col() {
  static EncodeIm2col fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeIm2col", &p, 12000,
                                                cudaEnableDefault, &q));
#else
    CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeIm2col", &p, cudaEnableDefault, &q));
#endif
    KILN_CHECK(q == cudaDriverEntryPointSuccess && p, "kiln's wgmma kernels (cuda): the driver has "
               "no cuTensorMapEncodeIm2col");
    return reinterpret_cast<EncodeIm2col>(p);
  }();
  return fn;
}

// An f16 NHWC tensor (n, h, w, c) as the im2col map of a 3x3, stride-1, padding-1 convolution:
// each load is `pixels` output pixels (the traversal runs over w, then h, then n, one step per
// output pixel) × 64 channels in the 128-byte swizzle, the layout of tile_map's boxes; the
// corners −1 and −1 make each image's traversal start one pixel before its first row and column
// and end one before its last, so that a tap's offset (0–2) lands on the input pixel.
inline CUtensorMap im2col3x3_map(const void* p, int64_t n, int64_t h, int64_t w, int64_t c,
                                 int pixels = 128) {
  CUtensorMap m;
  const cuuint64_t dims[4] = {cuuint64_t(c), cuuint64_t(w), cuuint64_t(h), cuuint64_t(n)};
  const cuuint64_t strides[3] = {cuuint64_t(c) * 2, cuuint64_t(w * c) * 2,
                                 cuuint64_t(h * w * c) * 2};
  const int lower[2] = {-1, -1}, upper[2] = {-1, -1};
  const cuuint32_t elem[4] = {1, 1, 1, 1};
  const CUresult res = encode_im2col()(
      &m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, const_cast<void*>(p), dims, strides, lower, upper,
      64, cuuint32_t(pixels), elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  KILN_CHECK(res == CUDA_SUCCESS, "kiln's wgmma kernels (cuda): cuTensorMapEncodeIm2col failed (",
             int(res), ") for an f16 NHWC tensor of ", n, " x ", h, " x ", w, " x ", c);
  return m;
}

// A channels-last 3x3 weight (k, 3, 3, c) as one (k × c) matrix per tap: a 3-D map (c innermost,
// then the 9 taps, then k) of 64 (k) × 64 (c) boxes in the 128-byte swizzle, each box one tap's
// rows — the layout of tile_map's 64 × 64 boxes of a (k × c) matrix.
inline CUtensorMap tap_weight_map(const void* p, int64_t k, int64_t c) {
  CUtensorMap m;
  const cuuint64_t dims[3] = {cuuint64_t(c), 9, cuuint64_t(k)};
  const cuuint64_t strides[2] = {cuuint64_t(c) * 2, cuuint64_t(9 * c) * 2};
  const cuuint32_t box[3] = {64, 1, 64};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult res =
      encode_tiled()(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, const_cast<void*>(p), dims, strides,
                     box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                     CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  KILN_CHECK(res == CUDA_SUCCESS, "kiln's wgmma kernels (cuda): cuTensorMapEncodeTiled failed (",
             int(res), ") for a ", k, " x 3 x 3 x ", c, " f16 weight");
  return m;
}

// The prologue's factors (bn_relu_box): `op` throws unless scale_shift is a contiguous f32
// vector of 2·channels (scale, then shift) on x's device; `n` names the channel count (K, I).
inline void check_scale_shift(const Tensor& scale_shift, int64_t channels, const Tensor& x,
                              const char* op, const char* n) {
  KILN_CHECK(scale_shift.defined() && scale_shift.is_cuda() && scale_shift.dtype() == DType::f32 &&
                 scale_shift.is_contiguous() && scale_shift.numel() == 2 * channels &&
                 scale_shift.device() == x.device(),
             op, " (cuda): scale_shift must be a contiguous f32 (2·", n, " = ", 2 * channels,
             ") vector on x's device, got ",
             scale_shift.defined() ? scale_shift.desc() : std::string("undefined"));
}

}  // namespace kiln::cuda::sm90
