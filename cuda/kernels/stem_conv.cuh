#pragma once
// What the ResNet stem convolution's kernels share (cuda/kernels/stem_conv.cu, the mma.sync forward
// and the weight gradient; cuda/kernels/stem_conv_wgmma.cu, the forward on Hopper's wgmma): the
// tile geometry, the input patch's load, the forward's epilogue and its statistics' partial row.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::cuda::stem {

constexpr int kCout = 64, kKh = 7;
constexpr int kTileH = 8, kTileW = 16;     // output pixels per tile
constexpr int kThreads = 128;              // 4 warps, 2 output rows each
constexpr int kPatchH = 2 * kTileH + 5;    // 21 input rows: (8 − 1)·2 + 7
constexpr int kPatchW = 2 * kTileW + 6;    // 38 input columns: (16 − 1)·2 + 8
constexpr int kPatch = kPatchH * kPatchW;  // pixels of 4 halves (8 bytes)
constexpr int kK = kKh * 8 * 4;            // 224
constexpr int kStage = 32 * kCout;         // halves a warp stages per tile

struct StemGeom {
  int H, W, OH, OW;
  int tiles_w, tiles_img, tiles;
  int64_t wn, wc, wh, ww;  // the weight's strides, elements
};

// Output tile `tile` of g (row-major over images, then tile rows, then tile columns): its image n
// and its first output row and column.
struct StemTile {
  int n, oh0, ow0;
};
__device__ inline StemTile stem_tile(const StemGeom& g, int tile) {
  const int rem = tile % g.tiles_img;
  return {tile / g.tiles_img, (rem / g.tiles_w) * kTileH, (rem % g.tiles_w) * kTileW};
}

// The input patch of output tile (oh0, ow0) of image n into shared memory: rows 2·oh0 − 3..,
// columns 2·ow0 − 3.., 3 channels padded to 4, zeros outside the image. Every load of the thread
// is issued before its first store, so their latencies overlap (a loop of load-then-store
// waits for each in turn).
__device__ inline void load_patch(uint2* patch, const __half* __restrict__ x, const StemGeom& g,
                                  int n, int oh0, int ow0) {
  constexpr int kIters = (kPatch + kThreads - 1) / kThreads;
  const unsigned short* xs = reinterpret_cast<const unsigned short*>(x);
  const int ih0 = 2 * oh0 - 3, iw0 = 2 * ow0 - 3;
  unsigned lo[kIters], hi[kIters];
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int i = int(threadIdx.x) + it * kThreads;
    const int ih = ih0 + i / kPatchW, iw = iw0 + i % kPatchW;
    lo[it] = hi[it] = 0u;
    if (i < kPatch && ih >= 0 && ih < g.H && iw >= 0 && iw < g.W) {
      const unsigned short* p = xs + ((int64_t(n) * g.H + ih) * g.W + iw) * 3;
      lo[it] = unsigned(p[0]) | (unsigned(p[1]) << 16);
      hi[it] = unsigned(p[2]);
    }
  }
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int i = int(threadIdx.x) + it * kThreads;
    if (i < kPatch) patch[i] = uint2{lo[it], hi[it]};
  }
}

// The forward's epilogue for one tile: warp `warp`'s 2 output rows × 16 columns × 64 channels,
// acc(mi, j, q) the accumulator of m16 tile mi (output row 2·warp + mi), n8 tile j, fragment
// element q (mma.sync's C layout, which wgmma's D repeats per warp). Rounds to f16, adds the
// rounded values into this thread's statistics s1, s2 (channels 8j + 2·(lane % 4) + e at 2j + e),
// stages the warp's 32 pixels (pixel p = 16·mi + column; chunk j of 8 channels at j XOR p % 8:
// conflict-free) in `stage` (kStage halves), then writes them out 16 bytes per lane, each pixel's
// 128 bytes contiguous.
template <typename Acc>
__device__ inline void store_tile(const Acc& acc, float (&s1)[16], float (&s2)[16], __half* stage,
                                  __half* __restrict__ y, const StemGeom& g, int n, int oh0,
                                  int ow0) {
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int gq = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const __half2 v = __floats2half2_rn(acc(mi, j, 2 * h), acc(mi, j, 2 * h + 1));
        const float2 f = __half22float2(v);
        s1[2 * j] += f.x;
        s1[2 * j + 1] += f.y;
        s2[2 * j] += f.x * f.x;
        s2[2 * j + 1] += f.y * f.y;
        const int p = 16 * mi + gq + 8 * h;
        *reinterpret_cast<__half2*>(stage + p * kCout + ((j ^ (p & 7)) * 8) + 2 * tq) = v;
      }
  __syncwarp();
#pragma unroll
  for (int it = 0; it < 8; ++it) {
    const int idx = it * 32 + lane, p = idx >> 3, chunk = idx & 7;
    const int oh = oh0 + warp * 2 + (p >> 4), ow = ow0 + (p & 15);
    const uint4 v = *reinterpret_cast<const uint4*>(stage + p * kCout + ((chunk ^ (p & 7)) * 8));
    *reinterpret_cast<uint4*>(y + ((int64_t(n) * g.OH + oh) * g.OW + ow) * kCout + chunk * 8) = v;
  }
  __syncwarp();
}

// The forward's statistics after its last tile: the 8 lanes of each column pair added in a fixed
// order, then the 4 warps (through `red`, 4 × 2 × 64 floats of shared memory that no warp still
// reads), into this CTA's partial row (2, 64).
__device__ inline void write_partial_stats(float (&s1)[16], float (&s2)[16], float* red,
                                           float* __restrict__ partial) {
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int m = 4; m < 32; m <<= 1) {
      s1[i] += __shfl_xor_sync(0xffffffffu, s1[i], m);
      s2[i] += __shfl_xor_sync(0xffffffffu, s2[i], m);
    }
  __syncthreads();  // every warp is done with the patch and its staging
  if (gq == 0) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        red[(warp * 2 + 0) * kCout + 8 * j + 2 * tq + e] = s1[2 * j + e];
        red[(warp * 2 + 1) * kCout + 8 * j + 2 * tq + e] = s2[2 * j + e];
      }
  }
  __syncthreads();
  {
    const int which = tid >> 6, c = tid & 63;
    float v = 0.f;
    for (int wv = 0; wv < 4; ++wv) v += red[(wv * 2 + which) * kCout + c];
    partial[int64_t(blockIdx.x) * 2 * kCout + which * kCout + c] = v;
  }
}

// ---- the kernels on wgmma (cuda/kernels/stem_conv_wgmma.cu) ----

// Whether they can run is dgrad1x1_bn_wgmma_available() (cuda/kernels/gemm_bn_wgmma.h): the same
// sm_90a object library and the same device test.
// CTAs of its one wave for `tiles` tiles (at most one per tile); a_smem: the form with the patch
// from 16-byte copies (load_patch_wide) and A read from it by descriptor (KILN_STEM_A_SMEM), not
// from 2-byte loads and ldmatrix fragments.
int conv_wgmma_parts(int tiles, bool a_smem);
// y (=) and the CTAs' partial rows (parts, 2, 64) of the statistics, as the mma.sync forward's.
void conv_wgmma(__half* y, float* partial, const __half* x, const __half* w, const StemGeom& g,
                int parts, bool a_smem, cudaStream_t stream);
// The weight gradient's CTAs for `tiles` tiles, and its partials (parts, 64, kK) as the mma.sync
// kernel's; a_smem: A read from the patch by descriptor (KILN_STEM_WGRAD_A_SMEM), not loaded
// into registers by ldmatrix.trans.
int wgrad_wgmma_parts(int tiles, bool a_smem);
void wgrad_wgmma(float* partial, const __half* dy, const __half* x, const StemGeom& g, int parts,
                 bool a_smem, cudaStream_t stream);

}  // namespace kiln::cuda::stem
