// The ResNet stem's convolution on Hopper's wgmma: the forward with statistics and the weight
// gradient (contracts in cuda/kernels.h: stem_conv_forward_stats, stem_conv_backward_weight).
// The same implicit GEMMs, tiles, patch and epilogues as the mma.sync kernels of
// cuda/kernels/stem_conv.cu (cuda/kernels/stem_conv.cuh has what they share); only the multiply
// differs. There each warp loaded both operands from shared memory by ldmatrix for every k16
// step, and mma.sync on sm_90 runs below wgmma's rate. Here a CTA's 4 warps are one warpgroup;
// one operand stays in registers, loaded by the same ldmatrix as before (wgmma's register A is
// mma.sync's m16n8k16 A, per warp), and the tensor cores read the other from shared memory
// through a descriptor, in the 128-byte swizzle.
//
// Forward: A = output pixels × K (the patch's 16-byte chunks), B = the weight (64 channels × K,
// K-major, K padded to 256 in four 64-column boxes). A k16 step is two wgmma m64n64k16, one per
// output row of each warp (warp w's 16 rows of wgmma mi are output row 2w + mi of the tile, as
// the m16 tile mi was); wgmma's accumulators repeat mma.sync's C layout per warp, so the epilogue
// is the same code.
//
// Weight gradient, turned around so that the patch is the A operand: dWᵀ (K × 64) =
// Σ patchesᵀ · dy. By default A is read from the patch by descriptor (below, v35); in the
// register form (KILN_STEM_WGRAD_A_SMEM=0) warp w's rows of m64 tile t are K = 64t + 16w.., kernel
// row kh = K / 32, columns kw0..kw0 + 3 (kw0 = 0 or 4), loaded by ldmatrix.trans of the patch's
// chunks (K 224-255 are past the kernel: any chunk, results dropped). B = the tile's dy, 128
// pixels × 64 channels (N-major), staged by cp.async in the swizzle. A k16 step (one output row
// of the tile, 16 pixels) is four wgmma m64n64k16. Each CTA writes its partial as the mma.sync
// kernel's, so the same finishing kernel adds them.
//
// The register forms keep one wgmma group in flight: step s's fragments are loaded while
// step s − 1 multiplies.
//
// The forward's A from shared memory (kASmem; the default since v34, KILN_STEM_A_SMEM=0 the
// register form): the patch arrives by 16-byte copies of its rows (load_patch_wide, 336 copies a
// tile where load_patch issues 2,394 2-byte loads), and at k16 step (kh, kw0) the
// A row of output pixel (row i, column c) is 16 contiguous halves of the patch (pixels 2c + kw0
// .. + 3 of patch row 2i + kh), and column c + 1's row starts 16 bytes on. So 8 consecutive
// columns of one output row are one no-swizzle core matrix, its K-neighbour is 16 bytes on (the
// two overlap: tools/bench/wgmma_desc_probe.cu found wgmma reads that exactly), and the same
// columns of the next output row are two patch rows (608 bytes) on. One descriptor (leading
// offset 16, stride 608) is then an m64 tile of 8 output rows × 8 columns: wgmma mi takes the
// tile's columns 8·mi.., where the register form's mi is an output row pair. The accumulators
// hold the same pixels in another order, which the epilogue's accessor undoes, so store_tile
// sums and writes them in the register form's order. No ldmatrix, no fragments: the 28
// wgmmas of a tile are issued in one group.
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/mma.cuh"
#include "cuda/kernels/stem_conv.cuh"
#include "cuda/kernels/wgmma.cuh"

namespace kiln::cuda::stem {
namespace {

using namespace sm90;

constexpr int kSteps = kK / 16;              // 14 k16 steps
constexpr int kBoxBytes = kCout * 128;       // 64 channels × 64 k of f16: 8 KB
constexpr int kWeightBytes = 4 * kBoxBytes;  // K padded to 256
constexpr int kSmemBytes = 1024 + kWeightBytes + kPatch * 8 + 4 * kStage * 2;  // 56,560
static_assert(kSteps * 16 == kK && kK <= 256, "the weight's K fits the four boxes");

// load_patch's patch from wider loads (the form with A from shared memory): each input row of
// the patch is one contiguous span of x, 38 pixels × 6 bytes, starting anywhere in a 16-byte
// chunk. So its 16-byte chunks are copied by cp.async into `raw` (kPatchH rows of kRawRow
// bytes; up to 16 chunks a row) and then unpacked in shared memory into the 8-byte pixels of the
// patch: 21 × 16 copies a tile where load_patch issues 3 loads for each of its 798 pixels. Only
// chunks inside x are copied whole; at x's two ends a chunk is copied 2 bytes at a time, those
// of the row's pixels only, so nothing outside x is read. Waits for every cp.async of the thread
// (a caller's pending copies too) and has one __syncthreads between the copy and the unpack;
// `raw` is free again when it returns. Puts the same values as load_patch in the patch.
constexpr int kRawRow = 256;                  // 16 chunks: 228 bytes + up to 14 of offset
constexpr int kRawBytes = kPatchH * kRawRow;  // 5,376
__device__ inline void load_patch_wide(uint2* patch, unsigned char* raw,
                                       const __half* __restrict__ x, const StemGeom& g, int n,
                                       int oh0, int ow0) {
  const int ih0 = 2 * oh0 - 3, iw0 = 2 * ow0 - 3;
  const int c0 = iw0 < 0 ? -iw0 : 0,
            c1 = g.W - iw0 < kPatchW ? g.W - iw0 : kPatchW;  // columns in x
  const uintptr_t xa = reinterpret_cast<uintptr_t>(x);
  const uintptr_t xend = xa + uintptr_t(int64_t(g.tiles / g.tiles_img) * g.H * g.W * 6);
  // Patch row r's column 0 (maybe before x: only columns c0..c1 − 1 are read), as an address.
  auto origin = [&](int r) {
    return xa + uintptr_t((int64_t(n) * g.H + ih0 + r) * g.W * 6 + int64_t(iw0) * 6);
  };
  constexpr int kSlots = kPatchH * 16;
#pragma unroll
  for (int it = 0; it < (kSlots + kThreads - 1) / kThreads; ++it) {
    const int slot = int(threadIdx.x) + it * kThreads, r = slot >> 4, k = slot & 15;
    const int ih = ih0 + r;
    if (slot >= kSlots || ih < 0 || ih >= g.H || c1 <= c0) continue;
    const uintptr_t first = origin(r) + uintptr_t(6 * c0), end = origin(r) + uintptr_t(6 * c1);
    const uintptr_t src = (first & ~uintptr_t(15)) + uintptr_t(16 * k);
    if (src >= end) continue;
    unsigned char* dst = raw + r * kRawRow + 16 * k;
    if (src >= xa && src + 16 <= xend) {
      cp_async16(dst, reinterpret_cast<const void*>(src), true);
    } else {  // a chunk past one of x's ends: the row's own bytes, 2 at a time
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const uintptr_t a = src + uintptr_t(2 * e);
        if (a >= first && a < end)
          reinterpret_cast<unsigned short*>(dst)[e] = *reinterpret_cast<const unsigned short*>(a);
      }
    }
  }
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  constexpr int kIters = (kPatch + kThreads - 1) / kThreads;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int i = int(threadIdx.x) + it * kThreads;
    if (i >= kPatch) break;
    const int r = i / kPatchW, c = i % kPatchW, ih = ih0 + r;
    uint2 v{0u, 0u};
    if (ih >= 0 && ih < g.H && c >= c0 && c < c1) {
      const uintptr_t first = origin(r) + uintptr_t(6 * c0);
      const unsigned short* p = reinterpret_cast<const unsigned short*>(
          raw + r * kRawRow + int(origin(r) + uintptr_t(6 * c) - (first & ~uintptr_t(15))));
      v = uint2{unsigned(p[0]) | (unsigned(p[1]) << 16), unsigned(p[2])};
    }
    patch[i] = v;
  }
}

static_assert(kRawBytes <= 4 * kStage * 2,
              "the forward stages the patch's raw rows in y's staging");

// No-swizzle descriptor of the forward's A at shared address `addr` (kASmem): leading byte
// offset 16 (the K-neighbouring core matrix, 2 pixels on), stride byte offset two patch rows
// (the next output row's core matrix), layout 0 (no swizzle) in bits 62-63.
constexpr uint32_t kARowPairBytes = 2 * kPatchW * 8;  // 608
static_assert(kARowPairBytes % 16 == 0 && (kPatchW * 8) % 16 == 0,
              "the A descriptor's offsets and starts are 16-byte multiples");
__device__ inline uint64_t make_desc_patch(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t(16 >> 4) << 16 |
         uint64_t(kARowPairBytes >> 4) << 32;
}

template <bool kASmem>
__global__ void __launch_bounds__(kThreads, 3)
    stem_conv_stats_wgmma_kernel(__half* __restrict__ y, float* __restrict__ partial,
                                 const __half* __restrict__ x, const __half* __restrict__ w,
                                 StemGeom g) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  pdl_start();
  extern __shared__ unsigned char smem_raw[];
  // The swizzle wants the weight's boxes 1,024-byte aligned.
  const uint32_t raw = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t pad = ((raw + 1023u) & ~1023u) - raw;
  unsigned char* wsm = smem_raw + pad;                          // 4 boxes [64][128 B]
  uint2* patch = reinterpret_cast<uint2*>(wsm + kWeightBytes);  // [21][38] × 4 halves
  __half* stage_all = reinterpret_cast<__half*>(wsm + kWeightBytes + kPatch * 8);
  const uint32_t w_addr = raw + pad, patch_addr = w_addr + kWeightBytes;
  const uint64_t w_desc = make_desc(w_addr);  // advanced per k-step (desc_advance)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  __half* stage = stage_all + warp * kStage;  // [32 pixels][64 channels], 16-byte chunks swizzled

  // The weight as B, K-major: channel n's k = kh·32 + kw·4 + c (zero for kw = 7, c = 3 and
  // k ≥ 224) at box k / 64, row n, 16-byte chunk (k % 64) / 8 XOR n % 8.
  for (int i = tid; i < kCout * 256; i += kThreads) {
    const int n = i >> 8, k = i & 255, kh = k >> 5, kw = (k >> 2) & 7, c = k & 3;
    __half v = __ushort_as_half(0);
    if (k < kK && kw < 7 && c < 3) v = w[n * g.wn + c * g.wc + kh * g.wh + kw * g.ww];
    *reinterpret_cast<__half*>(wsm + (k >> 6) * kBoxBytes + n * 128 +
                               ((((k & 63) >> 3) ^ (n & 7)) << 4) + (k & 7) * 2) = v;
  }
  fence_proxy_async();  // the weight's generic stores, before the tensor cores read it

  float s1[16], s2[16];  // this thread's statistics, as the mma.sync kernel's
#pragma unroll
  for (int i = 0; i < 16; ++i) s1[i] = s2[i] = 0.f;
  const int lj = lane >> 3, lr = lane & 7;  // ldmatrix: the matrix this lane addresses, its row

  for (int tile = blockIdx.x; tile < g.tiles; tile += gridDim.x) {
    const auto [n, oh0, ow0] = stem_tile(g, tile);
    __syncthreads();  // the previous tile's patch and staging have been read (the weight is in)
    if constexpr (kASmem) {  // its raw rows staged where the epilogue stages y
      load_patch_wide(patch, reinterpret_cast<unsigned char*>(stage_all), x, g, n, oh0, ow0);
      fence_proxy_async();  // the patch's stores, before the tensor cores read it
    } else {
      load_patch(patch, x, g, n, oh0, ow0);
    }
    __syncthreads();

    float d[2][32];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int i = 0; i < 32; ++i) d[mi][i] = 0.f;
    wgmma_fence_operands(d[0]);
    wgmma_fence_operands(d[1]);
    if constexpr (kASmem) {
      // wgmma mi: output rows 0-7 of the tile, columns 8·mi.. (warp w's accumulator rows
      // 16w + gq + 8h are output row 2w + h, column 8·mi + gq).
      const uint64_t a_desc = make_desc_patch(patch_addr);
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const int kh = s >> 1, kw0 = (s & 1) * 4;
        const uint64_t db = desc_advance(w_desc, uint32_t((s >> 2) * kBoxBytes + (s & 3) * 32));
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
          wgmma_m64n64k16<0, 0>(
              d[mi], desc_advance(a_desc, uint32_t((kh * kPatchW + 16 * mi + kw0) * 8)), db);
      }
      wgmma_commit();
      wgmma_wait0();
      // store_tile's (row 2w + r, column half h) is accumulator (mi = h, row half r).
      store_tile([&](int r, int j, int q) { return d[q >> 1][4 * j + 2 * r + (q & 1)]; }, s1, s2,
                 stage, y, g, n, oh0, ow0);
      continue;
    }
    uint32_t a[2][2][4];  // [step parity][mi]: the fragments of one step in flight, one loading
    auto load_a = [&](uint32_t(&fr)[2][4], int s) {
      const int kh = s >> 1, kw0 = (s & 1) * 4 + 2 * (lj >> 1);
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        // Row lr + 8·(lj & 1) of the warp's 16 = output column; its pixels 2·col + kw0, + 1.
        const int row = 2 * (warp * 2 + mi) + kh, col = 2 * (lr + 8 * (lj & 1)) + kw0;
        ldmatrix_x4(fr[mi], patch_addr + uint32_t((row * kPatchW + col) * 8));
      }
    };
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      load_a(a[s & 1], s);
      wgmma_fence();  // the fragments were written by this thread
      const uint64_t db = desc_advance(w_desc, uint32_t((s >> 2) * kBoxBytes + (s & 3) * 32));
      wgmma_m64n64k16_rs<0>(d[0], a[s & 1][0], db);
      wgmma_m64n64k16_rs<0>(d[1], a[s & 1][1], db);
      wgmma_commit();
      wgmma_wait1();  // step s − 1 is done: its fragments may be loaded over
    }
    wgmma_wait0();

    store_tile([&](int mi, int j, int q) { return d[mi][4 * j + q]; }, s1, s2, stage, y, g, n, oh0,
               ow0);
  }

  write_partial_stats(s1, s2, reinterpret_cast<float*>(stage_all), partial);
#else
  __trap();  // built without sm_90a: dgrad1x1_bn_wgmma_available() is false, never launched
#endif
}

constexpr int kDyBytes = kTileH * kTileW * 128;             // 128 pixels × 64 channels
constexpr int kWgSmemBytes = 1024 + kDyBytes + kPatch * 8;  // 23,792
constexpr int kMTiles = 4;                                  // K 0-255 in m64 tiles

// The weight gradient's A read from the patch by descriptor (kASmem; the default since v35,
// KILN_STEM_WGRAD_A_SMEM=0 the register form, A loaded by ldmatrix.trans): m64 tile p is kernel
// columns 2p, 2p + 1 of every kernel row: its M row 8·kh + 4·(kw − 2p) + c at output pixel j of
// output row r is patch halves ((2r + kh)·38 + 2j + kw)·4 + c, so 8 M rows (one kh) × 8 pixels
// are one MN-major core matrix of 128 contiguous bytes (M 16 bytes a pixel, pixels 16 bytes
// apart), the next 8 pixels 128 bytes on (leading offset) and the next kernel row one patch row
// (304 bytes) on (stride offset). kh = 7 is past the kernel (results dropped, as the register
// form's K 224-255): at r = 7 it reads one row past the patch, `kTailBytes` kept zero. The 32
// wgmmas of a tile are issued as one group: no ldmatrix, no fence waiting for it.
constexpr int kTailBytes = kPatchW * 8;  // 304
template <bool kASmem>
constexpr int wg_smem_bytes() {
  return kWgSmemBytes + (kASmem ? kTailBytes : 0);
}
static_assert(kTailBytes % 16 == 0, "the A descriptor's offsets are 16-byte multiples");

// MN-major no-swizzle descriptor of the weight gradient's A at shared address `addr`: leading
// byte offset 128 (the next 8 pixels: K), stride byte offset one patch row (the next kernel row:
// M), layout 0 (no swizzle).
__device__ inline uint64_t make_desc_patch_mn(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t(128 >> 4) << 16 |
         uint64_t(kTailBytes >> 4) << 32;
}

template <bool kASmem>
__global__ void __launch_bounds__(kThreads, 2)
    stem_wgrad_wgmma_kernel(float* __restrict__ partial, const __half* __restrict__ dy,
                            const __half* __restrict__ x, StemGeom g) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  pdl_start();
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t pad = ((raw + 1023u) & ~1023u) - raw;
  unsigned char* sdy = smem_raw + pad;                      // [128 pixels][128 B], swizzled
  uint2* patch = reinterpret_cast<uint2*>(sdy + kDyBytes);  // [21][38] × 4 halves
  const uint32_t dy_addr = raw + pad, patch_addr = dy_addr + kDyBytes;
  if constexpr (kASmem) {  // the zero row past the patch
    for (int i = int(threadIdx.x); i < kPatchW; i += kThreads) patch[kPatch + i] = uint2{0u, 0u};
  }
  const uint64_t dy_desc = make_desc_nmajor(dy_addr);  // advanced per k-step
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3, lj = lane >> 3, lr = lane & 7;

  // This warp's A rows in m64 tile t: K = 64t + 16w.., kernel row kh_t, columns kw0_t.. (K past
  // the kernel read row 6's chunks: any in-bounds chunk, dropped at the end).
  int a_off[kMTiles];  // the patch chunk of pixel (0, 0) for this lane, in 8-byte pixels
#pragma unroll
  for (int t = 0; t < kMTiles; ++t) {
    const int k0 = 64 * t + 16 * warp, kh = std::min(k0 >> 5, kKh - 1), kw0 = (k0 & 31) >> 2;
    // Matrix lj: pixels (columns) lr + 8·(lj >> 1), kernel columns kw0 + 2·(lj & 1), + 1.
    a_off[t] = kh * kPatchW + 2 * (lr + 8 * (lj >> 1)) + kw0 + 2 * (lj & 1);
  }

  float d[kMTiles][32];
#pragma unroll
  for (int t = 0; t < kMTiles; ++t)
#pragma unroll
    for (int i = 0; i < 32; ++i) d[t][i] = 0.f;

  for (int tile = blockIdx.x; tile < g.tiles; tile += gridDim.x) {
    const auto [n, oh0, ow0] = stem_tile(g, tile);
    __syncthreads();  // the previous tile's patch and dy have been read (its wgmmas waited for)
    // dy's 128 pixels × 128 bytes, 16 bytes per copy: pixel p's chunk c at c XOR p % 8.
    for (int i = tid; i < kTileH * kTileW * 8; i += kThreads) {
      const int pix = i >> 3, chunk = i & 7;
      const int64_t src =
          ((int64_t(n) * g.OH + oh0 + (pix >> 4)) * g.OW + ow0 + (pix & 15)) * kCout + chunk * 8;
      cp_async16(sdy + pix * 128 + ((chunk ^ (pix & 7)) << 4), dy + src, true);
    }
    cp_async_commit();
    load_patch(patch, x, g, n, oh0, ow0);
    cp_async_wait_all();
    fence_proxy_async();  // dy's copies (and the patch's stores), before the tensor cores
    __syncthreads();

    if constexpr (kASmem) {
      // wgmma p: kernel columns 2p, 2p + 1; step r's A starts at patch row 2r, pixel 2p.
      const uint64_t a_desc = make_desc_patch_mn(patch_addr);
      wgmma_fence();
#pragma unroll
      for (int r = 0; r < kTileH; ++r) {
        const uint64_t db = desc_advance(dy_desc, uint32_t(r * 16 * 128));
#pragma unroll
        for (int p = 0; p < kMTiles; ++p)
          wgmma_m64n64k16<1, 1>(d[p], desc_advance(a_desc, uint32_t(2 * r * kTailBytes + 16 * p)),
                                db);
      }
      wgmma_commit();
      wgmma_wait0();  // dy and the patch are read before the next tile's copies
    } else {
      uint32_t a[2][kMTiles][4];  // [step parity][t]
#pragma unroll
      for (int r = 0; r < kTileH; ++r) {  // k16 step r: the 16 pixels of output row r of the tile
#pragma unroll
        for (int t = 0; t < kMTiles; ++t)
          ldmatrix_x4_trans(a[r & 1][t], patch_addr + uint32_t((a_off[t] + 2 * r * kPatchW) * 8));
        wgmma_fence();  // the fragments were written by this thread
        const uint64_t db = desc_advance(dy_desc, uint32_t(r * 16 * 128));
#pragma unroll
        for (int t = 0; t < kMTiles; ++t) wgmma_m64n64k16_rs<1>(d[t], a[r & 1][t], db);
        wgmma_commit();
        wgmma_wait1();  // step r − 1 is done: its fragments may be loaded over
      }
      wgmma_wait0();  // dy is read before the next tile's copies
    }
  }

  // This CTA's 64 × 224 partial, k = kh·32 + kw·4 + c as the forward's weight rows: d[t][4j + q]
  // is K row 64t + 16w + gq + 8·(q / 2) (A from registers) or 64w + 32·(q / 2) + 8t + gq (A from
  // shared memory: kh = 2w + q / 2, kw = 2t + gq / 4, c = gq % 4), channel 8j + 2·tq + q % 2.
  float* out = partial + int64_t(blockIdx.x) * kCout * kK;
#pragma unroll
  for (int t = 0; t < kMTiles; ++t)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int k = kASmem ? 64 * warp + 32 * (q >> 1) + 8 * t + gq
                             : 64 * t + 16 * warp + gq + 8 * (q >> 1);
        if (k < kK) out[(8 * j + 2 * tq + (q & 1)) * kK + k] = d[t][4 * j + q];
      }
#else
  __trap();  // built without sm_90a: dgrad1x1_bn_wgmma_available() is false, never launched
#endif
}

// The forward's kernel (a_smem: the patch by 16-byte copies, A read from it), its shared memory
// allowed on this device.
const void* conv_kernel(bool a_smem) {
  const char* op = "stem_conv_forward_stats";
  allow_smem_once<stem_conv_stats_wgmma_kernel<false>>(kSmemBytes, op);
  allow_smem_once<stem_conv_stats_wgmma_kernel<true>>(kSmemBytes, op);
  return a_smem ? reinterpret_cast<const void*>(stem_conv_stats_wgmma_kernel<true>)
                : reinterpret_cast<const void*>(stem_conv_stats_wgmma_kernel<false>);
}
}  // namespace

int conv_wgmma_parts(int tiles, bool a_smem) {
  const int64_t wave = int64_t(context().props.multiProcessorCount) *
                       resident_blocks_per_sm(conv_kernel(a_smem), kThreads, kSmemBytes);
  return int(std::clamp<int64_t>(wave, 1, tiles));
}

void conv_wgmma(__half* y, float* partial, const __half* x, const __half* w, const StemGeom& g,
                int parts, bool a_smem, cudaStream_t stream) {
  if (a_smem)
    launch(stem_conv_stats_wgmma_kernel<true>, parts, kThreads, kSmemBytes, stream, y, partial, x,
           w, g);
  else
    launch(stem_conv_stats_wgmma_kernel<false>, parts, kThreads, kSmemBytes, stream, y, partial, x,
           w, g);
  KILN_CUDA_CHECK_LAUNCH();
}

namespace {
// The weight gradient's kernel (a_smem: A read from the patch), its shared memory allowed on this
// device.
const void* wgrad_kernel(bool a_smem) {
  const char* op = "stem_conv_backward_weight";
  allow_smem_once<stem_wgrad_wgmma_kernel<false>>(wg_smem_bytes<false>(), op);
  allow_smem_once<stem_wgrad_wgmma_kernel<true>>(wg_smem_bytes<true>(), op);
  return a_smem ? reinterpret_cast<const void*>(stem_wgrad_wgmma_kernel<true>)
                : reinterpret_cast<const void*>(stem_wgrad_wgmma_kernel<false>);
}
}  // namespace

int wgrad_wgmma_parts(int tiles, bool a_smem) {
  const int smem = a_smem ? wg_smem_bytes<true>() : wg_smem_bytes<false>();
  const int64_t wave = int64_t(context().props.multiProcessorCount) *
                       resident_blocks_per_sm(wgrad_kernel(a_smem), kThreads, smem);
  return int(std::clamp<int64_t>(wave, 1, tiles));
}

void wgrad_wgmma(float* partial, const __half* dy, const __half* x, const StemGeom& g, int parts,
                 bool a_smem, cudaStream_t stream) {
  if (a_smem)
    launch(stem_wgrad_wgmma_kernel<true>, parts, kThreads, wg_smem_bytes<true>(), stream, partial,
           dy, x, g);
  else
    launch(stem_wgrad_wgmma_kernel<false>, parts, kThreads, wg_smem_bytes<false>(), stream, partial,
           dy, x, g);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda::stem
