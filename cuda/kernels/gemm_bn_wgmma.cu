// The block tail's data-gradient GEMM with the batch-norm sums in its epilogue, on Hopper's
// wgmma and TMA (contract in cuda/kernels.h: dgrad1x1_bn_sums; the mma.sync kernel, which takes
// the tails this one does not (C not a multiple of 128, GPUs other than sm_90), is
// cuda/kernels/gemm_bn.cu, whose header explains what the epilogue computes).
//
// Measured (docs/lab/tail-gemm.md): in v15, for K 256/512, correct against the unfused composition
// and the CPU, compute-sanitizer clean, the step 0.13-0.16 ms faster than those seven tails on
// cuDNN's dgrad + kiln's two passes; in v17, with the TMA epilogue below, −0.22 ms more,
// and faster than the mma.sync kernel at K 64/128 too (−0.19 ms), so it takes every tail it fits.
// Its GEMM is the wgmma probe's v4 (docs/lab/tail-gemm.md, "The v14 remeasure round": the
// variants and their times; the probe's code was never committed), level with cuBLASLt on
// ResNet-50's four tail shapes (layer 3: 0.065 ms, layer 4: 0.053).
//
// Three forms since 2026-12-04 (docs/lab/norm-conv.md): the tail's (r added, the ReLU bits); a
// bottleneck's inner relu(bn2(y2)) before conv3 (no r, the ReLU mask recomputed from x); and a
// 1x1 convolution's forward with its output's statistics (conv1x1_forward_stats: y = x · wᵀ,
// Σy and Σy²). And 3x3 convolutions (stride 1, padding 1) with A from TMA's im2col loads: the
// forward with statistics (v23, kIm2col) and the data gradient with any of the epilogues (v24),
// on 256-row tiles where those fill the SMs (kTall).
//
// G (M × C) = dy (M × K) · w (K × C): A = dy, row-major (NHWC), K-major; B = w read as it lies,
// N-major, which wgmma transposes (kWDirect; KILN_TAIL_W_DIRECT=0: w transposed to wt (C × K)
// by a small kernel first, K-major, as before 2026-12-04 — the same bits). CTA: 3
// warpgroups. Warpgroup 0's first thread issues TMA loads of 128 × 64 boxes of dy and w into
// kStages slots in the 128-byte swizzle (the layout wgmma's descriptors name), each slot guarded
// by a "full" mbarrier (the bytes arrive on it) and an "empty" one (all 256 consumer threads
// arrive once their wgmma group on it has completed). Warpgroups 1 and 2 compute rows 0-63 and
// 64-127 of a 128 × 128 tile and run gemm_bn.cu's epilogue: add r, round to f16, mask with the
// ReLU bits, write g in 16-byte vectors, and keep Σg and Σg·(x − mean) of their 8 channels in
// registers. By default (kTmaEpi) r, x and the mask come into each warpgroup's shared buffer by
// TMA while its MMAs run and acc + r is formed there; with KILN_TAIL_TMA_EPI=0 the accumulators
// are staged in that buffer and r, x and the mask read from global memory after the MMAs.
//
// Persistent and bit-reproducible: the grid is parts × (C / 128) CTAs; CTA b owns column tile
// b % (C / 128) for good and the row tiles p, p + parts, ... (p = b / (C / 128)), so the producer
// runs into the next row tile while the consumers store this one, and at the end each CTA adds
// its 16 row sets' sums in a fixed order into its partial row: (parts, 2, C), a function of the
// shape and the device only.
#include <cuda.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <limits>

#include "core/switches.h"
#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/gemm_bn_epilogue.cuh"
#include "cuda/kernels/gemm_bn_wgmma.h"
#include "cuda/kernels/wgmma.cuh"

namespace kiln::cuda {
namespace {

using namespace sm90;

constexpr int kBM = 128, kBN = 128, kBK = 64;
constexpr int kStages = 4, kThreads = 384;
constexpr int kTile = kBM * kBK * 2;                  // bytes of one 128 × 64 box (A or B)
constexpr int kStageBytes = 2 * kTile;                // A and B
constexpr int kPitch = kBN + 4;                       // floats per staged accumulator row
constexpr int kStageOut = 64 * kPitch * 4;            // one consumer warpgroup's staging buffer
// With the TMA epilogue (kTmaEpi below) each consumer warpgroup's buffer holds, instead of its
// staged accumulators, its 64 rows of r and x (two 64 × 64 boxes each in the 128-byte swizzle)
// and of the ReLU mask (64 × 16 bytes): the same 33,792 bytes. r at offset 0, then x, then the
// mask.
constexpr int kEpiX = 2 * 64 * 64 * 2, kEpiMask = 2 * kEpiX;
constexpr int kEpiBytes = kEpiMask + 64 * 16;
static_assert(kEpiBytes == kStageOut, "the TMA epilogue's buffers replace the staging buffers");
static_assert(kStageOut % 1024 == 0, "each warpgroup's buffer must keep the swizzle's alignment");
// The mbarriers: full and empty per stage, and the TMA epilogue's two pairs.
// (kSlots: up to 2 · kStages slots of A alone with B resident.)
constexpr int kSmemBytes = kStages * kStageBytes + 2 * kStageOut + (2 * 2 * kStages + 4) * 8 + 1024;
// kTall: three stages of a 256 × 64 A box and a 128 × 64 B box.
constexpr int kSmemTall = 3 * (2 * kBM * kBK * 2 + kTile) + 2 * kStageOut + (2 * 3 + 4) * 8 + 1024;
static_assert(kSmemTall <= 227 * 1024, "tall tiles: within an SM's shared memory");
// kDual: three stages, and each consumer warpgroup's buffer 16 KB longer (u's rows).
constexpr int kSmemDual =
    3 * kStageBytes + 2 * (kStageOut + kEpiX) + (2 * 2 * kStages + 4) * 8 + 1024;
static_assert(kSmemDual <= 227 * 1024, "the dual form: within an SM's shared memory");
static_assert((kStageOut + kEpiX) % 1024 == 0 && kStageOut % 1024 == 0,
              "the dual form: u's boxes and the second warpgroup's buffer keep the swizzle's "
              "alignment");
static_assert(16 * 3 * kBN * 4 <= 2 * kStageOut, "three rows of 16 row sets' sums fit the buffers");
// With the prologue, the factors of up to 2,048 channels (scale, then shift) after the barriers.
constexpr int kSmemPrologue = kSmemBytes + 2 * 2048 * 4;
// kSplit: the bias of the CTA's 128 columns, as f32, in the same place.
constexpr int kSmemSplit = kSmemBytes + kBN * 4;

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

// kSplit's B: (w ; w2ᵀ) stacked along K, K = K1 + C2 — w (K1 × C) as it lies and w2 (C × C2),
// element (K1 + j, c) being w2 (c, j) — laid N-major (K × C) for kWDirect, else K-major (C × K).
__global__ void pack_split_b_kernel(__half* __restrict__ out, const __half* __restrict__ w,
                                    const __half* __restrict__ w2, int K1, int C, int C2,
                                    bool n_major) {
  pdl_start();
  const int64_t K = int64_t(K1) + C2, n = K * C;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t k = n_major ? i / C : i % K, c = n_major ? i % C : i / K;
    out[i] = k < K1 ? w[k * C + c] : w2[c * C2 + (k - K1)];
  }
}

// The pair view's operands (dgrad1x1_bn_sums_wgmma_pair64). out (2R × 2Cc) = in (R × Cc) twice
// on the diagonal, zeros elsewhere.
__global__ void block_diag2_kernel(__half* __restrict__ out, const __half* __restrict__ in, int R,
                                   int Cc) {
  pdl_start();
  const int64_t n = int64_t(4) * R * Cc;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / (2 * Cc), col = i % (2 * Cc);
    const bool diag = (row >= R) == (col >= Cc);
    out[i] = diag ? in[(row % R) * Cc + col % Cc] : __float2half(0.f);
  }
}
// out = each of in's `groups` segments of n values twice: (a, b) -> (a, a, b, b).
template <typename T>
__global__ void repeat2_kernel(T* __restrict__ out, const T* __restrict__ in, int n, int groups) {
  pdl_start();
  for (int i = int(blockIdx.x) * blockDim.x + threadIdx.x; i < 2 * n * groups;
       i += gridDim.x * blockDim.x)
    out[i] = in[(i / (2 * n)) * n + i % n];
}
// partial (parts, 2, 64) from the view's (parts_v, 2, 128): columns c and 64 + c added; rows
// from parts_v on zero.
__global__ void fold_pair_partial_kernel(float* __restrict__ out, const float* __restrict__ in,
                                         int parts, int parts_v) {
  pdl_start();
  for (int i = int(blockIdx.x) * blockDim.x + threadIdx.x; i < parts * 2 * 64;
       i += gridDim.x * blockDim.x) {
    const int qt = i / 64, c = i % 64;
    out[i] = qt < 2 * parts_v ? in[qt * 128 + c] + in[qt * 128 + 64 + c] : 0.f;
  }
}

// kSub2's rows. The data gradient of a stride-2 unpadded 1x1 convolution is zero but at the
// even (h, w) pixels of its input, and those pixels, taken in NHWC order, are the rows of the
// compact gradient (N, ⌈H/2⌉, ⌈W/2⌉, C) in its own order. So the even pixels of any run of rows
// are a run of the compact rows, starting at the number of even pixels before the run:
// sub2_rank(m). A pixel's compact row is its own rank.
__device__ __forceinline__ int sub2_rank(int m, int img_h, int img_w) {
  const int hw = img_h * img_w, n = m / hw, p = m - n * hw, h = p / img_w, w = p - h * img_w;
  const int hs = (img_h + 1) >> 1, ws = (img_w + 1) >> 1;
  return n * hs * ws + ((h + 1) >> 1) * ws + ((h & 1) != 0 ? 0 : (w + 1) >> 1);
}
// Row m's place among the compact rows from m0's rank on, or −1 at an odd h or w.
__device__ __forceinline__ int sub2_slot(int m, int q0, int img_h, int img_w) {
  const int hw = img_h * img_w, p = m % hw, h = p / img_w, w = p - h * img_w;
  return ((h | w) & 1) != 0 ? -1 : sub2_rank(m, img_h, img_w) - q0;
}

// kTmaEpi: r's, x's and the mask's rows of each tile come into shared memory by TMA (thread 32
// issues them while the tile's MMAs run, into the buffer the staging used), the accumulators
// add r there in their fragment layout, and the epilogue reads everything from shared memory —
// instead of staging the accumulators and reading r, x and the mask from global memory after the
// MMAs (latency-bound: ncu in docs/lab/tail-gemm.md, the v16 round). Same arithmetic in the
// same order: the results are bit-identical between the two.
//
// kResidual: r is added (else G is the GEMM alone); kBits: the ReLU mask is the forward's bitmask
// (a block tail relu(bn(x) + z)), else it is recomputed from x as x·scale + shift > 0 (a
// relu(bn(x)) whose output only the convolution reads), exactly as the unfused sums kernel's
// kMaskFromX does. kStats: a 1x1 convolution's forward with its output's statistics (the
// GEMM y = x · wᵀ, no residual, no mask; partial holds Σy and Σy² of y as rounded to f16, as
// kiln's statistics pass sums the stored tensor). Only the TMA epilogue takes the forms other
// than the tail's.
//
// kWDirect: B is read from w (K × C) as it lies, N-major, in two 64-column TMA boxes per stage,
// and wgmma transposes it (imm-trans-b) — instead of from wt = wᵀ (C × K), K-major, which a
// transpose kernel writes first. The same products in the same order: the same bits.
//
// kPipeline: each consumer warpgroup keeps one wgmma group in flight — k-step kt is issued before
// it waits for k-step kt − 1 and releases that slot — instead of waiting for every k-step before
// the next (KILN_WGMMA_PIPELINE=0). Written as a template flag: with a run-time flag the branch
// between an issue and its wait makes ptxas serialise the wgmma instructions (warning C7518).
// The same products in the same order: the same bits.
//
// kPrologue (with kStats only; K a multiple of 128): the convolution reads x = relu(bn(y)) — a
// bottleneck's conv3 reading bn2's output — from y and bn's scale and shift (scale_shift, K
// channels, copied into shared memory at the start), so that x is never written. A comes from
// registers: each consumer loads its 64 rows of a k-step's slot with ldmatrix, applies the
// factors there and issues wgmma's register-A form; two register sets alternate, so that one
// k-step's fragments are formed while the previous k-step's MMAs run. The values are bit for bit
// those the apply pass would have stored, so y and the statistics are the unfused path's bits.
// kF16 (KILN_PROLOGUE_F16=1, an experiment): the factors rounded to f16 and applied with one
// half-precision fused multiply-add and ReLU per pair (bn_relu2_f16) — about a seventh of the
// instructions, not the apply pass's bits.
//
// kIm2col (with kStats only): a 3x3 convolution, stride 1, padding 1 (implicit GEMM). dy is x's
// im2col map (im2col3x3_map: img_h × img_w images), K = 9 × x's channels, k-step kt is tap
// kt / (K / 9 / 64) (row-major over the 3 × 3 filter) at channels 64·(kt % (K / 9 / 64)); the
// producer asks TMA for the tile's 128 output pixels shifted by the tap, padding read as zeros.
// wt is w (C × 3 × 3 × K/9, channels-last) as a C × K matrix, K-major as it lies.
// With kWDirect instead of kStats, the same loads make a 3x3 convolution's data gradient
// (stride 1, padding 1) with any of the epilogues above: dy is the output gradient's im2col map,
// and since dx at a pixel takes dy at the pixel shifted by tap (r, s) through w's tap
// (2 − r, 2 − s), B for tap t is w's tap 8 − t (w: K/9 × 3 × 3 × C, channels-last), read N-major
// as it lies through a 3-D map (tap_weight_map), 64 rows of K at a time.
//
// kTall (with kIm2col; KILN_GEMM_TALL): 256 × 128 tiles, three stages. Each consumer warpgroup
// computes 128 rows as two 64-row halves against the same B (128 accumulators a thread, so the
// producer warpgroup gives registers up with setmaxnreg and the consumers take them), and runs
// the epilogue once per half through its 64-row buffer. Per k-step the shared memory moves
// 48 KB in and 96 KB out for 4.2 MFLOP, against 32 and 48 KB for 2.1 MFLOP with 128-row tiles.
// The same products in the same order: the same y and g bits (the statistics' partial rows
// group the rows differently). Off by default since v25 (KILN_GEMM_TALL=1 turns it on).
//
// b_resident (a run-time argument, KILN_GEMM_B_RESIDENT; the 1x1 forms with K ≤ 256): B, which
// is the same for every row tile of the CTA's column, is loaded once with its first tile into
// KT boxes at the end of the stages' memory, and the rest of that memory holds 8 − KT slots of
// A alone. A run-time select of B's box, no branch near the MMAs (v21: a run-time branch between
// a wgmma issue and its wait made ptxas serialise them, C7518); ptxas reports no C7518 here.
// The same products in the same order: the same bits.
//
// kSplit (with the TMA epilogue, no residual, a 1x1 w): the GEMM's A is two matrices side by
// side, dy (M × 64·ka) for k-steps below ka and x2 (M × (K − 64·ka), through map_r) for the rest,
// and B the matching (w1 ; w2ᵀ) stacked along K (packed by the host); bias2 (C f16) is added to
// the accumulators before they are rounded. The tail fold's data gradient of a bottleneck's a2,
// g · (a ⊙ w3) + a2 · (w3ᵀ·diag(b)·w3) + cᵀ·w3, is one GEMM this way, so its second term t is
// never written (docs/lab/norm-conv.md, v42).
//
// kSub2 (with the TMA epilogue, r and the mask bits): r is a stride-2 unpadded 1x1
// convolution's data gradient, compact — (N, ⌈H/2⌉, ⌈W/2⌉, C) for x's (N, H, W, C), img_h × img_w
// = H × W — and zero at the pixels it leaves out: a downsample block's shortcut, handed to the
// tail before it (ops/dgrad_sink.h, wants_dgrad_stride2). Thread 32 loads the 64 compact rows
// from the round's first even pixel on (sub2_rank) in place of r's 64; each accumulator row adds
// its pixel's compact row, or +0 at an odd h or w (as the dense r's zeros add), all rows read
// before any is written over. The same sums in the same order as with r scattered densely: the
// same bits, without the 3/4 of r that are zeros being written by the convolution and read here.
template <bool kTmaEpi, bool kResidual, bool kBits, bool kStats = false, bool kWDirect = false,
          bool kPipeline = true, bool kPrologue = false, bool kIm2col = false, bool kF16 = false,
          bool kTall = false, bool kDual = false, bool kSplit = false, bool kSub2 = false>
__global__ void __launch_bounds__(kThreads, 1) dgrad1x1_bn_sums_wgmma_kernel(
    __half* __restrict__ g, float* __restrict__ partial, const __grid_constant__ CUtensorMap map_dy,
    const __grid_constant__ CUtensorMap map_wt, const __grid_constant__ CUtensorMap map_r,
    const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_mask,
    const __grid_constant__ CUtensorMap map_u, const __half* __restrict__ r,
    const uint8_t* __restrict__ mask, const __half* __restrict__ x,
    const float* __restrict__ mean, const float* __restrict__ mean_u,
    const float* __restrict__ scale_shift, int64_t M, int C, int K, int parts, int img_h,
    int img_w, bool b_resident, int ka, const __half* __restrict__ bias2) {
  static_assert(kTmaEpi || (kResidual && kBits), "the global-memory epilogue is the tail's only");
  static_assert(!kStats || (kTmaEpi && !kResidual && !kBits), "statistics: the GEMM alone");
  static_assert(!(kStats && kWDirect), "the forward's w (C × K) is K-major already");
  static_assert(!kPrologue || kStats, "the prologue is the forward's");
  static_assert(!kIm2col || (!kPrologue && kTmaEpi && (kStats || kWDirect)),
                "the 3x3 convolution: the forward, or the data gradient with w read as it lies");
  static_assert(!kTall || (kIm2col && kPipeline), "tall tiles: the 3x3 GEMMs, pipelined");
  static_assert(!kDual || (kTmaEpi && kResidual && kBits && !kIm2col && !kPrologue),
                "the dual form: the 1x1 block tail's, with the TMA epilogue");
  static_assert(!kSplit || (kTmaEpi && !kResidual && !kStats && !kIm2col && !kTall && !kDual),
                "two A matrices: the 1x1 data gradient without a residual");
  static_assert(!kSub2 || (kTmaEpi && kResidual && kBits && !kIm2col && !kTall && !kDual),
                "the compact stride-2 residual: the 1x1 block tail's, with the TMA epilogue");
  // Rows per tile, stages, and the bytes of a stage's A box and of the whole stage. kDual: three
  // stages, whose freed 32 KB hold each consumer warpgroup's rows of u.
  constexpr int kTM = kTall ? 2 * kBM : kBM, kNS = kTall || kDual ? 3 : kStages;
  constexpr int kAB = kTM * kBK * 2, kSB = kAB + kTile;
  // The mbarrier pairs: one per slot, up to 2·kStages slots of A alone with B resident.
  constexpr int kSlots = kTall ? kNS : 2 * kStages;
  const int KT = K / kBK;
  // B resident (b_resident, K ≤ 256): this CTA's B, the same for all its tiles, is loaded once
  // into KT 16 KB boxes at the end of the stages' memory, and the rest of it holds ns = 8 − KT
  // slots of A alone (4 to 7; kDual's three stages: 6 − KT, K ≤ 192) — instead of kNS slots of
  // A and B, B loaded again per tile.
  const bool bres = !kTall && !kIm2col && b_resident && KT <= kNS;
  const int ns = bres ? 2 * kNS - KT : kNS;
  // A place in the ring of ns slots, k-step by k-step: the slot, and the parity of the round
  // through the ring, which is the phase its mbarriers are in. Each role walks the ring in
  // order, so it is advanced, never divided out: ns is known only at run time, and j % ns and
  // j / ns cost an integer division per k-step on the consumers' path (ncu, v32).
  struct Ring {
    int slot = 0;
    uint32_t round = 0;
  };
  auto advance = [ns](Ring& r) {
    if (++r.slot == ns) {
      r.slot = 0;
      r.round ^= 1u;
    }
  };
  pdl_start();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;  // the swizzle wants 1,024-byte alignment
  unsigned char* gbase = smem_raw + (base - raw);
  auto a_tile = [&](int s) { return base + uint32_t(bres ? s * kTile : s * kSB); };
  // B of k-step kt, loaded with slot s.
  auto b_tile = [&](int s, int kt) {
    return base + uint32_t(bres ? (ns + kt) * kTile : s * kSB + kAB);
  };
  const uint32_t out0 = uint32_t(kNS * kSB);  // the two staging buffers
  // kDual: each warpgroup's buffer holds u's 64 rows (two 64 × 64 boxes) after r, x and the mask.
  constexpr int kEpiStride = kDual ? kStageOut + kEpiX : kStageOut;
  const uint32_t bars = base + out0 + 2 * kEpiStride;
  auto full = [&](int s) { return bars + uint32_t(s * 8); };
  auto empty = [&](int s) { return bars + uint32_t((kSlots + s) * 8); };
  auto epi_full = [&](int c) { return bars + uint32_t((2 * kSlots + c) * 8); };
  auto epi_empty = [&](int c) { return bars + uint32_t((2 * kSlots + 2 + c) * 8); };
  auto epi_buf = [&](int c) { return base + out0 + uint32_t(c * kEpiStride); };
  const int tid = threadIdx.x, wg = tid >> 7;
  if (tid == 0) {
    for (int s = 0; s < kSlots; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), 256);
    }
    for (int c = 0; c < 2; ++c) {
      mbar_init(epi_full(c), 1);
      mbar_init(epi_empty(c), 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int col_tiles = C / kBN, n0 = (int(blockIdx.x) % col_tiles) * kBN;
  const int part = int(blockIdx.x) / col_tiles;
  const int64_t row_tiles = (M + kTM - 1) / kTM;

  if (wg == 0) {  // the producers: thread 0 the GEMM's operands, thread 32 the epilogue's
    if constexpr (kTall) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if constexpr (kTmaEpi) {
      if (tid == 32) {
        if constexpr (kStats) return;  // nothing to load for the statistics' epilogue
        int u = 0;  // this CTA's 64-row epilogue rounds so far (kTall: two a tile)
        for (int64_t tile = part; tile < row_tiles; tile += parts) {
          for (int half = 0; half < (kTall ? 2 : 1); ++half, ++u) {
            for (int c = 0; c < 2; ++c) {
              if (u > 0) mbar_wait(epi_empty(c), uint32_t((u - 1) & 1));  // round u-1 read
              constexpr int kBytes =
                  (kResidual ? kEpiX : 0) + kEpiX + (kBits ? 64 * 16 : 0) + (kDual ? kEpiX : 0);
              mbar_expect_tx(epi_full(c), uint32_t(kBytes));
              const int m0 = int(tile * kTM + c * (kTM / 2) + half * 64);
              const uint32_t e = epi_buf(c);
              [[maybe_unused]] const int rrow = kSub2 ? sub2_rank(m0, img_h, img_w) : m0;
              for (int h = 0; h < 2; ++h) {
                if constexpr (kResidual)
                  tma_load_2d(e + h * (kEpiX / 2), &map_r, n0 + h * 64, rrow, epi_full(c));
                tma_load_2d(e + kEpiX + h * (kEpiX / 2), &map_x, n0 + h * 64, m0, epi_full(c));
              }
              if constexpr (kBits) tma_load_2d(e + kEpiMask, &map_mask, n0 / 8, m0, epi_full(c));
              if constexpr (kDual)
                for (int h = 0; h < 2; ++h)
                  tma_load_2d(e + kStageOut + h * (kEpiX / 2), &map_u, n0 + h * 64, m0,
                              epi_full(c));
            }
          }
        }
        return;
      }
    }
    if (tid != 0) return;
    int j = 0;
    Ring put;
    [[maybe_unused]] const int cblocks = K / (9 * kBK);  // kIm2col: k-steps per tap
    for (int64_t tile = part; tile < row_tiles; tile += parts) {
      const int m0 = int(tile * kTM);
      // kIm2col: the tile's first output pixel (n, h, w); its tap (0, 0) input is (h − 1, w − 1).
      [[maybe_unused]] int pn = 0, ph = 0, pw = 0;
      if constexpr (kIm2col) {
        const int hw = img_h * img_w;
        pn = m0 / hw;
        ph = (m0 - pn * hw) / img_w;
        pw = m0 - pn * hw - ph * img_w;
      }
      for (int kt = 0; kt < KT; ++kt, ++j, advance(put)) {
        const int s = put.slot;
        if (j >= ns) mbar_wait(empty(s), put.round ^ 1u);  // the round before's MMAs are done
        const bool load_b = !bres || j < KT;  // B resident: with the first tile only
        mbar_expect_tx(full(s), uint32_t(load_b ? kSB : kAB));
        [[maybe_unused]] const int tap = kIm2col ? kt / cblocks : 0;
        [[maybe_unused]] const int ch = kIm2col ? (kt - tap * cblocks) * kBK : 0;
        if constexpr (kIm2col) {
          tma_load_im2col(a_tile(s), &map_dy, ch, pw - 1, ph - 1, pn, uint16_t(tap % 3),
                          uint16_t(tap / 3), full(s));
        } else if constexpr (kSplit) {  // dy's k-steps, then x2's (map_r)
          if (kt < ka)
            tma_load_2d(a_tile(s), &map_dy, kt * kBK, m0, full(s));
          else
            tma_load_2d(a_tile(s), &map_r, (kt - ka) * kBK, m0, full(s));
        } else {
          tma_load_2d(a_tile(s), &map_dy, kt * kBK, m0, full(s));
        }
        if constexpr (kWDirect && kIm2col) {  // the 3x3 data gradient: w's tap 8 − tap
          for (int h = 0; h < 2; ++h)
            tma_load_3d(b_tile(s, kt) + uint32_t(h * kTile / 2), &map_wt, n0 + h * 64, 8 - tap, ch,
                        full(s));
        } else if constexpr (kWDirect) {
          if (load_b)
            for (int h = 0; h < 2; ++h)
              tma_load_2d(b_tile(s, kt) + uint32_t(h * kTile / 2), &map_wt, n0 + h * 64, kt * kBK,
                          full(s));
        } else if (load_b) {
          tma_load_2d(b_tile(s, kt), &map_wt, kt * kBK, n0, full(s));
        }
      }
    }
    return;
  }

  // Consumers: warpgroup c computes rows c·64.. of each tile (kTall: c·128.., two halves).
  if constexpr (kTall) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int c = wg - 1, t = tid & 127, warp = t >> 5, lane = t & 31;
  float* sc = reinterpret_cast<float*>(gbase + out0 + c * kEpiStride);
  // The epilogue's thread layout: channel group cg (8 channels) of rows rr, rr + 8, ..., rr + 56.
  const int cg = t & 15, rr = t >> 4;
  const int c0 = n0 + cg * 8;
  float mu[8], s1[8] = {}, s2[8] = {};
  // kDual: Σg·(u − mean_u), the second batch norm's, whose input u meets x at the residual add.
  [[maybe_unused]] float mu_u[8], s3[8] = {};
#pragma unroll
  for (int q = 0; q < 8; ++q) mu[q] = kStats ? 0.f : mean[c0 + q];
  if constexpr (kDual) {
#pragma unroll
    for (int q = 0; q < 8; ++q) mu_u[q] = mean_u[c0 + q];
  }
  // The forward's scale and shift of these channels, for a mask recomputed from x.
  [[maybe_unused]] float scale[8], shift[8];
  if constexpr (!kBits && !kStats) {
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      scale[q] = scale_shift[c0 + q];
      shift[q] = scale_shift[C + c0 + q];
    }
  }

  // The prologue's factors, in shared memory after the barriers.
  [[maybe_unused]] const float* fss =
      reinterpret_cast<const float*>(gbase + out0 + 2 * kEpiStride + (2 * kSlots + 4) * 8);
  // kF16: K / 2 scale pairs, then K / 2 shift pairs, as half2.
  [[maybe_unused]] const __half2* fh = reinterpret_cast<const __half2*>(fss);
  if constexpr (kSplit) {  // b2 of columns n0.., read by the epilogue from shared memory
    if (t < kBN && c == 0) const_cast<float*>(fss)[t] = __half2float(bias2[n0 + t]);
    named_sync(3, 256);
  }
  if constexpr (kPrologue) {
    float* f = const_cast<float*>(fss);
    if constexpr (kF16) {
      __half2* h = reinterpret_cast<__half2*>(f);
      for (int i = tid - 128; i < K; i += 256) {
        const int which = i / (K / 2), ch = 2 * (i % (K / 2));
        h[i] = __floats2half2_rn(scale_shift[which * K + ch], scale_shift[which * K + ch + 1]);
      }
    } else {
      for (int i = tid - 128; i < 2 * K; i += 256) f[i] = scale_shift[i];
    }
    named_sync(3, 256);
  }

  int u = 0;  // this CTA's 64-row epilogue rounds so far (the TMA epilogue's phase)
  Ring got, done;  // the next slot to wait for full, and the next to release
  auto release = [&]() {
    mbar_arrive(empty(done.slot));
    advance(done);
  };
  // The epilogue of 64 rows from m0 on, whose accumulators are d.
  auto epilogue = [&](float (&d)[64], const int64_t m0) {
    // Fragment layout: register 4b + {0, 1} holds row 16·warp + lane / 4, columns
    // 8b + 2·(lane % 4) + {0, 1}; 4b + {2, 3} the row 8 below.
    const int r0 = warp * 16 + (lane >> 2);
    if constexpr (kTmaEpi) {
      // r, x and the mask of these rows are in. Over r, in its place: acc + r rounded to f16
      // (g before the mask; without r, acc rounded). Byte (row, col) of a 64-column box in the
      // 128-byte swizzle lies at row·128 + (16-byte chunk col / 8 XOR row % 8)·16 + (col % 8)·2;
      // r0 % 8 = lane / 4.
      if constexpr (kStats)
        named_sync(1 + c, 128);  // the previous tile's values have been read
      else
        mbar_wait(epi_full(c), uint32_t(u & 1));
      unsigned char* e = gbase + out0 + c * kEpiStride;
      if constexpr (kSub2) {
        // Rows r0 and r0 + 8 take compact rows j[0] and j[1] (−1: +0). Every row of r is read
        // into the accumulators before any row is written over.
        const int q0 = sub2_rank(int(m0), img_h, img_w);
        const int j[2] = {sub2_slot(int(m0) + r0, q0, img_h, img_w),
                          sub2_slot(int(m0) + r0 + 8, q0, img_h, img_w)};
#pragma unroll
        for (int b = 0; b < kBN / 8; ++b) {
          const int cb = (b / 8) * (kEpiX / 2) + (lane & 3) * 4;
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            float2 a = {0.f, 0.f};
            if (j[i] >= 0)
              a = __half22float2(*reinterpret_cast<const __half2*>(
                  e + j[i] * 128 + cb + (((b % 8) ^ (j[i] & 7)) * 16)));
            d[4 * b + 2 * i] += a.x;
            d[4 * b + 2 * i + 1] += a.y;
          }
        }
        named_sync(1 + c, 128);
      }
#pragma unroll
      for (int b = 0; b < kBN / 8; ++b) {
        const int off = (b / 8) * (kEpiX / 2) + (((b % 8) ^ (lane >> 2)) * 16) + (lane & 3) * 4;
        __half2* p0 = reinterpret_cast<__half2*>(e + r0 * 128 + off);
        __half2* p1 = reinterpret_cast<__half2*>(e + (r0 + 8) * 128 + off);
        if constexpr (kSub2) {  // r added above
          *p0 = __floats2half2_rn(d[4 * b], d[4 * b + 1]);
          *p1 = __floats2half2_rn(d[4 * b + 2], d[4 * b + 3]);
        } else if constexpr (kResidual) {
          const float2 a0 = __half22float2(*p0), a1 = __half22float2(*p1);
          *p0 = __floats2half2_rn(d[4 * b] + a0.x, d[4 * b + 1] + a0.y);
          *p1 = __floats2half2_rn(d[4 * b + 2] + a1.x, d[4 * b + 3] + a1.y);
        } else if constexpr (kSplit) {  // columns 8b + 2·(lane % 4) + {0, 1} of the tile
          const float2 bv = *reinterpret_cast<const float2*>(fss + 8 * b + 2 * (lane & 3));
          *p0 = __floats2half2_rn(d[4 * b] + bv.x, d[4 * b + 1] + bv.y);
          *p1 = __floats2half2_rn(d[4 * b + 2] + bv.x, d[4 * b + 3] + bv.y);
        } else {
          *p0 = __floats2half2_rn(d[4 * b], d[4 * b + 1]);
          *p1 = __floats2half2_rn(d[4 * b + 2], d[4 * b + 3]);
        }
      }
      named_sync(1 + c, 128);
      // Rows rr + 8·i (row % 8 = rr), channels c0..c0+7: 16-byte chunk cg % 8 of box cg / 8.
      const int chunk = (cg / 8) * (kEpiX / 2) + (((cg % 8) ^ rr) * 16);
      if constexpr (kStats) {
        // Statistics: every value kept, Σy and Σy·(y − 0). The eight rows' loads first (rows
        // past M read the buffer's stale bytes and are not used), so that their latencies
        // overlap: one after another, each sum waited for its row (ncu, v33).
        uint4 pv[8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
          pv[i] = *reinterpret_cast<const uint4*>(e + (rr + 8 * i) * 128 + chunk);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int64_t m = m0 + rr + 8 * i;
          if (m >= M) break;
          const uint4 gv = tail_epilogue8_rounded(pv[i], pv[i], 0xffu, mu, s1, s2);
          reinterpret_cast<uint4*>(g)[m * (C / 8) + c0 / 8] = gv;
        }
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int row = rr + 8 * i;
          const int64_t m = m0 + row;
          if (m >= M) break;
          const uint4 pv = *reinterpret_cast<const uint4*>(e + row * 128 + chunk);
          const uint4 xv = *reinterpret_cast<const uint4*>(e + kEpiX + row * 128 + chunk);
          unsigned bits;
          if constexpr (kBits)
            bits = e[kEpiMask + row * 16 + cg];
          else
            bits = relu_bits8(xv, scale, shift);
          const uint4 gv = tail_epilogue8_rounded(pv, xv, bits, mu, s1, s2);
          reinterpret_cast<uint4*>(g)[m * (C / 8) + c0 / 8] = gv;
          if constexpr (kDual)
            dual_sum8(gv, *reinterpret_cast<const uint4*>(e + kStageOut + row * 128 + chunk),
                      mu_u, s3);
        }
      }
      if constexpr (!kStats) {
        fence_proxy_async();  // the writes over r before the next tile's TMA into this buffer
        mbar_arrive(epi_empty(c));
      }
      ++u;
    } else if constexpr (kResidual && kBits) {
      // Stage the accumulators, then the epilogue reads r, x and the mask from global memory.
      named_sync(1 + c, 128);  // the buffer's previous tile has been read
#pragma unroll
      for (int b = 0; b < kBN / 8; ++b) {
        const int col = b * 8 + (lane & 3) * 2;
        *reinterpret_cast<float2*>(sc + r0 * kPitch + col) = float2{d[4 * b], d[4 * b + 1]};
        *reinterpret_cast<float2*>(sc + (r0 + 8) * kPitch + col) =
            float2{d[4 * b + 2], d[4 * b + 3]};
      }
      named_sync(1 + c, 128);

      // Rows rr + 8·i of this warpgroup's 64, channels c0..c0+7.
      tail_epilogue_rows<8, 8>(g, r, mask, x, M, C, m0, rr, c0, sc + rr * kPitch + cg * 8, kPitch,
                               mu, s1, s2);
    }
  };
  for (int64_t tile = part; tile < row_tiles; tile += parts) {
    const int64_t mt = tile * kTM + c * (kTM / 2);  // this warpgroup's first row
    float d[64];
    [[maybe_unused]] float d1[64];  // kTall: the rows 64 below
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.f;
    if constexpr (kTall) {
#pragma unroll
      for (int i = 0; i < 64; ++i) d1[i] = 0.f;
    }
    auto issue = [&](int kt) {
      const int s = got.slot;
      mbar_wait(full(s), got.round);
      advance(got);
      wgmma_fence();
      const uint64_t da0 = make_desc(a_tile(s) + uint32_t(c * (kTM / 2) * 128));
      const uint64_t db0 = kWDirect ? make_desc_nmajor(b_tile(s, kt)) : make_desc(b_tile(s, kt));
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        const uint64_t da = desc_advance(da0, uint32_t(kk * 32));
        // B's 16 rows of k: 32 bytes into each K-major row, or 16 rows of 128 bytes N-major.
        const uint64_t db = desc_advance(db0, uint32_t(kWDirect ? kk * 16 * 128 : kk * 32));
        wgmma_m64n128k16<0, kWDirect ? 1 : 0>(d, da, db);
        if constexpr (kTall) {
          const uint64_t da1 = desc_advance(da0, uint32_t(64 * 128 + kk * 32));
          wgmma_m64n128k16<0, kWDirect ? 1 : 0>(d1, da1, db);
        }
      }
      wgmma_commit();
    };
    if constexpr (kPrologue) {
      uint32_t a0[4][4], a1[4][4];
      // This warpgroup's 64 rows of k-step kt's slot s as wgmma's A fragments (each warp its 16
      // rows: ldmatrix matrices 0-3 are rows 0-7 / 8-15 of columns 0-7, then of columns 8-15 of
      // each 16-column step), relu(y·scale + shift) applied to each pair.
      auto form = [&](uint32_t (&a)[4][4], int s, int kt) {
        const int row = warp * 16 + (lane & 15);
        const uint32_t row_addr = a_tile(s) + uint32_t(c * 64 * 128 + row * 128);
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          const int chunk = kk * 2 + (lane >> 4);
          ldmatrix_x4(a[kk], row_addr + uint32_t((chunk ^ (row & 7)) << 4));
        }
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          const int ch = kt * kBK + kk * 16 + 2 * (lane & 3);
          if constexpr (kF16) {
            const __half2 s0 = fh[ch / 2], t0 = fh[K / 2 + ch / 2];
            const __half2 s8 = fh[ch / 2 + 4], t8 = fh[K / 2 + ch / 2 + 4];
            a[kk][0] = bn_relu2_f16(a[kk][0], s0, t0);
            a[kk][1] = bn_relu2_f16(a[kk][1], s0, t0);
            a[kk][2] = bn_relu2_f16(a[kk][2], s8, t8);
            a[kk][3] = bn_relu2_f16(a[kk][3], s8, t8);
          } else {
            const float2 s0 = *reinterpret_cast<const float2*>(fss + ch);
            const float2 t0 = *reinterpret_cast<const float2*>(fss + K + ch);
            const float2 s8 = *reinterpret_cast<const float2*>(fss + ch + 8);
            const float2 t8 = *reinterpret_cast<const float2*>(fss + K + ch + 8);
            a[kk][0] = bn_relu2(a[kk][0], s0, t0);
            a[kk][1] = bn_relu2(a[kk][1], s0, t0);
            a[kk][2] = bn_relu2(a[kk][2], s8, t8);
            a[kk][3] = bn_relu2(a[kk][3], s8, t8);
          }
        }
      };
      auto mma = [&](const uint32_t(&a)[4][4], int s, int kt) {
        wgmma_fence();  // the fragments were written by this thread
        const uint64_t db0 = make_desc(b_tile(s, kt));
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk)
          wgmma_m64n128k16_rs<0>(d, a[kk], desc_advance(db0, uint32_t(kk * 32)));
        wgmma_commit();
      };
      auto step = [&](uint32_t(&a)[4][4], int kt) {
        const int s = got.slot;
        mbar_wait(full(s), got.round);
        advance(got);
        form(a, s, kt);
        mma(a, s, kt);
      };
      // k-step kt's fragments are formed once k-step kt − 2's MMAs (the same registers) are
      // done; a slot is released once its MMAs are.
      step(a0, 0);
      step(a1, 1);
      wgmma_wait1();
      release();  // k-step 0's slot
      for (int kt = 2; kt < KT; kt += 2) {
        step(a0, kt);
        wgmma_wait1();
        release();  // k-step kt − 1's
        step(a1, kt + 1);
        wgmma_wait1();
        release();  // k-step kt's
      }
      wgmma_wait0();
      release();  // k-step KT − 1's
    } else if constexpr (kPipeline) {
      // One wgmma group in flight: k-step kt is issued before k-step kt - 1's slot is released.
      issue(0);
      for (int kt = 1; kt < KT; ++kt) {
        issue(kt);
        wgmma_wait1();
        release();  // k-step kt − 1's slot
      }
      wgmma_wait0();
      release();  // k-step KT − 1's
    } else {
      for (int kt = 0; kt < KT; ++kt) {
        issue(kt);
        wgmma_wait0();
        release();
      }
    }
    epilogue(d, mt);
    if constexpr (kTall) epilogue(d1, mt + 64);
  }

  // The 16 row sets (8 per warpgroup) of each channel, added in a fixed order into the CTA's
  // partial row; the staging buffers, now free, hold them.
  constexpr int kSums = kDual ? 3 : 2;
  named_sync(3, 256);  // both consumer warpgroups are done with their buffers
  float* red = reinterpret_cast<float*>(gbase + out0);  // [16 row sets][kSums][kBN]
  const int set = c * 8 + rr;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    red[(set * kSums + 0) * kBN + cg * 8 + q] = s1[q];
    red[(set * kSums + 1) * kBN + cg * 8 + q] = s2[q];
    if constexpr (kDual) red[(set * kSums + 2) * kBN + cg * 8 + q] = s3[q];
  }
  named_sync(3, 256);
  for (int ct = tid - 128; ct < kSums * kBN; ct += 256) {  // (sum, column)
    const int which = ct / kBN, col = ct % kBN;
    float v = 0.f;
    for (int s = 0; s < 16; ++s) v += red[(s * kSums + which) * kBN + col];
    partial[(int64_t(part) * kSums + which) * C + n0 + col] = v;
  }
#else
  __trap();  // built without sm_90a: dgrad1x1_bn_wgmma_available() is false, never launched
#endif
}

// The GEMM's operands: `rows` × K f16, 128 × 64 boxes in the 128-byte swizzle.
CUtensorMap kmajor_map(const void* p, int64_t rows, int64_t K) {
  return tile_map(p, true, rows, K, kBM, kBK, true);
}

constinit RuntimeSwitch g_tall{&Switches::gemm_tall};  // KILN_GEMM_TALL

// Whether a 3x3 GEMM of M rows and C columns takes 256-row tiles (kTall): with the switch on,
// where its tiles fill the SMs' rounds at least 90% (ResNet-50's layers 2 and 3 at batch 256, not
// layer 4: 49 tiles over 33 CTAs a column).
int tall_parts(int64_t M, int64_t C) {
  const int64_t col_tiles = std::max<int64_t>(C / kBN, 1), rows = (M + 2 * kBM - 1) / (2 * kBM);
  const int64_t sms = context().props.multiProcessorCount;
  return int(std::clamp<int64_t>(sms / col_tiles, 1, std::max<int64_t>(rows, 1)));
}
bool use_tall(int64_t M, int64_t C) {
  // The kernel's row coordinates are 32-bit: a 256-row tile past the last row must fit too.
  if (!g_tall.get() || M >= (int64_t(1) << 31) - 2 * kBM) return false;
  const int64_t rows = (M + 2 * kBM - 1) / (2 * kBM), parts = tall_parts(M, C);
  const int64_t rounds = (rows + parts - 1) / parts;
  return double(rows) >= 0.9 * double(parts * rounds);
}

constinit RuntimeSwitch g_tma_epi{&Switches::tail_tma_epi};  // KILN_TAIL_TMA_EPI
constinit RuntimeSwitch g_w_direct{&Switches::tail_w_direct};  // KILN_TAIL_W_DIRECT
constinit RuntimeSwitch g_pipeline{&Switches::wgmma_pipeline};  // KILN_WGMMA_PIPELINE
constinit RuntimeSwitch g_b_resident{&Switches::gemm_b_resident};  // KILN_GEMM_B_RESIDENT

}  // namespace

bool dgrad1x1_bn_wgmma_available() {
#if defined(KILN_WGMMA_SM90A)
  const cudaDeviceProp& p = context().props;
  return p.major == 9 && p.minor == 0;
#else
  return false;
#endif
}

bool dgrad1x1_bn_wgmma_shape(int64_t M, int64_t K, int64_t C) {
  // M: within TMA's 32-bit coordinates (a tile past the last row included).
  return M < (int64_t(1) << 31) - kBM && K >= kBK && K <= 2048 && K % kBK == 0 &&
         C % kBN == 0 && C / kBN <= 132;
}

bool dgrad1x1_bn_wgmma_takes_stride2(bool mask_bits) { return mask_bits && g_tma_epi.get(); }

int dgrad1x1_bn_wgmma_parts(int64_t M, int64_t C) {
  const int64_t col_tiles = std::max<int64_t>(C / kBN, 1), rows = (M + kBM - 1) / kBM;
  const int64_t sms = context().props.multiProcessorCount;
  return int(std::clamp<int64_t>(sms / col_tiles, 1, std::max<int64_t>(rows, 1)));
}

void dgrad1x1_bn_sums_wgmma(const Tensor& g, const Tensor& partial, const Tensor& dy,
                            const Tensor& w, const Tensor& r, const Tensor& mask, const Tensor& x,
                            const Tensor& mean, const Tensor& scale_shift, int parts,
                            const Tensor& u, const Tensor& mean_u, const Tensor& x2,
                            const Tensor& w2, const Tensor& b2) {
  const int64_t C = x.size(1), K1 = dy.size(1), M = x.numel() / C;
  cudaStream_t s = current_stream();
  const bool direct = g_w_direct.get();
  // kSplit: A is (dy | x2), K = K1 + C2 wide, and B (w ; w2ᵀ) packed into one matrix.
  const bool split = x2.defined();
  const int64_t K = split ? K1 + x2.size(1) : K1;
  Tensor wt;
  if (split) {
    KILN_CHECK(!r.defined() && !mask.defined() && !u.defined(),
               "dgrad1x1_bn_sums_wgmma: x2 · w2ᵀ is taken without r, the mask bits or u");
    wt = direct ? empty({K, C}, TensorOptions(DType::f16).with_device(x.device()))
                : empty({C, K}, TensorOptions(DType::f16).with_device(x.device()));
    launch(pack_split_b_kernel, grid_for(K * C), kBlock, 0, s,
           static_cast<__half*>(wt.raw_data()), static_cast<const __half*>(w.raw_data()),
           static_cast<const __half*>(w2.raw_data()), int(K1), int(C), int(K - K1), direct);
    KILN_CUDA_CHECK_LAUNCH();
  } else if (!direct) {
    // B: w (K × C) as it lies, N-major; or wt (C × K), the weight K-major, transposed first.
    wt = empty({C, K}, TensorOptions(DType::f16).with_device(x.device()));
    launch(transpose_kernel, dim3(unsigned((C + 31) / 32), unsigned((K + 31) / 32)), dim3(32, 8),
           0, s, static_cast<__half*>(wt.raw_data()), static_cast<const __half*>(w.raw_data()),
           int(K), int(C));
    KILN_CUDA_CHECK_LAUNCH();
  }
  const CUtensorMap map_dy = kmajor_map(dy.raw_data(), M, K1);
  const void* bp = split ? wt.raw_data() : w.raw_data();
  const CUtensorMap map_w = direct ? tile_map(bp, true, K, C, kBK, 64, true)
                                   : kmajor_map(wt.raw_data(), C, K);
  const bool residual = r.defined(), bits = mask.defined(), dual = u.defined();
  KILN_CHECK(!dual || (residual && bits && mean_u.defined()),
             "dgrad1x1_bn_sums_wgmma: the dual form takes r, the mask and mean_u");
  // r compact at x's even pixels (kSub2; dgrad1x1_bn_sums checked its shape): r's rows.
  const bool sub2 = residual && r.shape() != x.shape();
  KILN_CHECK(!sub2 || (dgrad1x1_bn_wgmma_takes_stride2(bits) && !dual && !split),
             "dgrad1x1_bn_sums_wgmma: a compact stride-2 r needs the TMA epilogue and the mask "
             "bits, without u or x2");
  // A mask recomputed from x, no residual, or the dual form: the TMA epilogue's forms only.
  const bool tma_epi = g_tma_epi.get() || !residual || !bits || dual;
  // The epilogue's operands per consumer warpgroup: 64 rows × 64 channels of r and x (twice),
  // 64 rows × 16 bytes (128 channels) of the mask. Unused without the TMA epilogue.
  CUtensorMap map_r{}, map_x{}, map_mask{}, map_u{};
  if (tma_epi) {
    if (residual) map_r = tile_map(r.raw_data(), true, r.numel() / C, C, 64, 64, true);
    map_x = tile_map(x.raw_data(), true, M, C, 64, 64, true);
    if (bits) map_mask = tile_map(mask.raw_data(), false, M, C / 8, 64, 16, false);
    if (dual) map_u = tile_map(u.raw_data(), true, M, C, 64, 64, true);
  }
  // kSplit: x2's k-steps through map_r (A's boxes), after dy's K1 / 64.
  if (split) map_r = kmajor_map(x2.raw_data(), M, K - K1);
  auto ptr = [](const Tensor& t) { return t.defined() ? t.raw_data() : nullptr; };
  const bool pipeline = g_pipeline.get();
  auto run = [&]<bool kTma, bool kResidual, bool kBits, bool kDirect, bool kDual = false,
                 bool kSplit = false, bool kSub2 = false>() {
    auto go = [&]<bool kPipeline>() {
      constexpr auto kernel = dgrad1x1_bn_sums_wgmma_kernel<kTma, kResidual, kBits, false, kDirect,
                                                            kPipeline, false, false, false, false,
                                                            kDual, kSplit, kSub2>;
      constexpr int kSmem = kDual ? kSmemDual : kSplit ? kSmemSplit : kSmemBytes;
      allow_smem_once<kernel>(kSmem, "dgrad1x1_bn_sums");
      const unsigned grid = unsigned(parts * (C / kBN));
      launch_whole_sm(
          kernel, grid, kThreads, kSmem, s, static_cast<__half*>(g.raw_data()),
          static_cast<float*>(partial.raw_data()), map_dy, map_w, map_r, map_x, map_mask, map_u,
          static_cast<const __half*>(ptr(r)), static_cast<const uint8_t*>(ptr(mask)),
          static_cast<const __half*>(x.raw_data()), static_cast<const float*>(mean.raw_data()),
          static_cast<const float*>(ptr(mean_u)), static_cast<const float*>(ptr(scale_shift)), M,
          int(C), int(K), parts, kSub2 ? int(x.size(2)) : 0, kSub2 ? int(x.size(3)) : 0,
          g_b_resident.get(), int(K1 / kBK),
          static_cast<const __half*>(ptr(b2)));
    };
    if (pipeline)
      go.template operator()<true>();
    else
      go.template operator()<false>();
  };
  auto pick = [&]<bool kDirect>() {
    if (split)
      run.template operator()<true, false, false, kDirect, false, true>();
    else if (dual)
      run.template operator()<true, true, true, kDirect, true>();
    else if (sub2)
      run.template operator()<true, true, true, kDirect, false, false, true>();
    else if (!tma_epi)
      run.template operator()<false, true, true, kDirect>();
    else if (residual && bits)
      run.template operator()<true, true, true, kDirect>();
    else if (bits)
      run.template operator()<true, false, true, kDirect>();
    else if (residual)
      run.template operator()<true, true, false, kDirect>();
    else
      run.template operator()<true, false, false, kDirect>();
  };
  if (direct)
    pick.template operator()<true>();
  else
    pick.template operator()<false>();
  KILN_CUDA_CHECK_LAUNCH();
}

void dgrad1x1_bn_sums_wgmma_pair64(const Tensor& g, const Tensor& partial, int parts,
                                   const Tensor& dy, const Tensor& w, const Tensor& r,
                                   const Tensor& x, const Tensor& mean, const Tensor& scale_shift,
                                   const Tensor& x2, const Tensor& w2, const Tensor& b2) {
  const int64_t M = x.numel() / 64, Mv = M / 2, K = dy.size(1);
  cudaStream_t s = current_stream();
  // (N, c, H, W) channels-last, M × c as it lies, read as (M/2) × 2c: rows 2i and 2i + 1 side by
  // side. A view, never a copy (g is written through it).
  auto pair_view = [&](const Tensor& t) {
    if (!t.defined()) return Tensor();
    const int64_t c = t.size(1);
    Tensor v = t.permute({0, 2, 3, 1}).reshape({Mv, 1, 1, 2 * c}).permute({0, 3, 1, 2});
    KILN_CHECK(v.raw_data() == t.raw_data(), "dgrad1x1_bn_sums_wgmma_pair64: ", t.desc(),
               " is not viewable as row pairs");
    return v;
  };
  const TensorOptions f16 = TensorOptions(DType::f16).with_device(x.device());
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
  Tensor wp = empty({2 * K, 128, 1, 1}, f16);
  launch(block_diag2_kernel, grid_for(4 * K * 64), kBlock, 0, s,
         static_cast<__half*>(wp.raw_data()), static_cast<const __half*>(w.raw_data()), int(K), 64);
  KILN_CUDA_CHECK_LAUNCH();
  Tensor mean2 = empty({128}, f32), ss2 = empty({256}, f32);
  launch(repeat2_kernel<float>, 1, kBlock, 0, s, static_cast<float*>(mean2.raw_data()),
         static_cast<const float*>(mean.raw_data()), 64, 1);
  launch(repeat2_kernel<float>, 1, kBlock, 0, s, static_cast<float*>(ss2.raw_data()),
         static_cast<const float*>(scale_shift.raw_data()), 64, 2);
  KILN_CUDA_CHECK_LAUNCH();
  Tensor w2p, b2p;
  if (x2.defined()) {
    const int64_t C2 = x2.size(1);
    w2p = empty({128, 2 * C2}, f16);
    launch(block_diag2_kernel, grid_for(4 * 64 * C2), kBlock, 0, s,
           static_cast<__half*>(w2p.raw_data()), static_cast<const __half*>(w2.raw_data()), 64,
           int(C2));
    b2p = empty({128}, f16);
    launch(repeat2_kernel<__half>, 1, kBlock, 0, s, static_cast<__half*>(b2p.raw_data()),
           static_cast<const __half*>(b2.raw_data()), 64, 1);
    KILN_CUDA_CHECK_LAUNCH();
  }
  const int parts_v = dgrad1x1_bn_wgmma_parts(Mv, 128);
  KILN_CHECK(parts_v <= parts, "dgrad1x1_bn_sums_wgmma_pair64: the view's ", parts_v,
             " parts exceed the caller's ", parts);
  Tensor partial_v = empty({int64_t(parts_v) * 2 * 128}, f32);
  dgrad1x1_bn_sums_wgmma(pair_view(g), partial_v, pair_view(dy), wp, pair_view(r), Tensor(),
                         pair_view(x), mean2, ss2, parts_v, Tensor(), Tensor(), pair_view(x2), w2p,
                         b2p);
  launch(fold_pair_partial_kernel, grid_for(int64_t(parts) * 2 * 64), kBlock, 0, s,
         static_cast<float*>(partial.raw_data()), static_cast<const float*>(partial_v.raw_data()),
         parts, parts_v);
  KILN_CUDA_CHECK_LAUNCH();
}

void conv1x1_stats_wgmma(const Tensor& y, const Tensor& partial, const Tensor& x, const Tensor& w,
                         int parts, const Tensor& scale_shift) {
  const int64_t C = y.size(1), K = x.size(1), M = x.numel() / K;
  // y = x · wᵀ: x (M × K) and w (C × K) are both K-major already.
  const CUtensorMap map_x = kmajor_map(x.raw_data(), M, K);
  const CUtensorMap map_w = kmajor_map(w.raw_data(), C, K);
  const CUtensorMap none{};
  const float* ss = scale_shift.defined() ? static_cast<const float*>(scale_shift.raw_data())
                                          : nullptr;
  auto go = [&]<bool kPipeline, bool kPrologue, bool kF16 = false>() {
    constexpr auto kernel = dgrad1x1_bn_sums_wgmma_kernel<true, false, false, true, false,
                                                          kPipeline, kPrologue, false, kF16>;
    constexpr int kSmem = kPrologue ? kSmemPrologue : kSmemBytes;
    allow_smem_once<kernel>(kSmem, "conv1x1_stats");
    launch_whole_sm(kernel, unsigned(parts * (C / kBN)), kThreads, kSmem, current_stream(),
                    static_cast<__half*>(y.raw_data()), static_cast<float*>(partial.raw_data()),
                    map_x, map_w, none, none, none, none, nullptr, nullptr, nullptr, nullptr,
                    nullptr, ss, M,
                    int(C), int(K), parts, 0, 0, g_b_resident.get(), 0, nullptr);
  };
  if (ss != nullptr && prologue_f16_enabled())
    go.template operator()<true, true, true>();
  else if (ss != nullptr)
    go.template operator()<true, true>();
  else if (g_pipeline.get())
    go.template operator()<true, false>();
  else
    go.template operator()<false, false>();
  KILN_CUDA_CHECK_LAUNCH();
}

constinit RuntimeSwitch g_conv1x1_stats{&Switches::conv1x1_stats};  // KILN_CONV1X1_STATS

bool conv1x1_stats_supported(const Tensor& y, const Tensor& x, const Tensor& w,
                             const ConvParams& p) {
  if (!g_conv1x1_stats.get() || !dgrad1x1_bn_wgmma_available()) return false;
  if (!(y.defined() && x.defined() && w.defined() && x.is_cuda() && x.dtype() == DType::f16 &&
        y.dtype() == DType::f16 && w.dtype() == DType::f16 && x.dim() == 4 && y.dim() == 4 &&
        w.dim() == 4))
    return false;
  const int64_t K = x.size(1), C = y.size(1);
  return p.groups == 1 && p.stride_h == 1 && p.stride_w == 1 && p.pad_h == 0 && p.pad_w == 0 &&
         p.dil_h == 1 && p.dil_w == 1 && w.size(0) == C && w.size(1) == K &&
         w.size(2) == 1 && w.size(3) == 1 && y.size(0) == x.size(0) && y.size(2) == x.size(2) &&
         y.size(3) == x.size(3) && x.numel() > 0 &&
         dgrad1x1_bn_wgmma_shape(x.numel() / K, K, C) &&
         x.is_contiguous(MemoryFormat::ChannelsLast) &&
         y.is_contiguous(MemoryFormat::ChannelsLast) &&
         (w.is_contiguous(MemoryFormat::ChannelsLast) || w.is_contiguous()) &&
         y.device() == x.device() && w.device() == x.device();
}

namespace {

// conv1x1_forward_stats and its prologue form: y and its statistics through the partial rows.
void conv1x1_stats(const Tensor& y, const Tensor& sum, const Tensor& sqsum, const Tensor& x,
                   const Tensor& w, const Tensor& scale_shift) {
  const int64_t C = y.size(1), M = x.numel() / x.size(1);
  const int parts = dgrad1x1_bn_wgmma_parts(M, C);
  Tensor partial =
      empty({int64_t(parts) * 2 * C}, TensorOptions(DType::f32).with_device(x.device()));
  conv1x1_stats_wgmma(y, partial, x, w, parts, scale_shift);
  bn_nhwc_stats_finish(sum, sqsum, partial, y, parts);
}

}  // namespace

void conv1x1_forward_stats(const Tensor& y, const Tensor& sum, const Tensor& sqsum,
                           const Tensor& x, const Tensor& w, const ConvParams& p) {
  KILN_CHECK(conv1x1_stats_supported(y, x, w, p), "conv1x1_forward_stats (cuda): needs an sm_90 "
             "GPU, f16 channels-last x (N, K, H, W) and y (N, C, H, W), w (C, K, 1, 1), stride 1, "
             "no padding, K a multiple of 64 up to 2,048 and C a multiple of 128, got x ",
             x.desc(), ", w ", w.desc(), ", y ", y.desc());
  conv1x1_stats(y, sum, sqsum, x, w, Tensor());
}

void conv1x1_bn_relu_forward_stats(const Tensor& y, const Tensor& sum, const Tensor& sqsum,
                                   const Tensor& x, const Tensor& scale_shift, const Tensor& w,
                                   const ConvParams& p) {
  const char* op = "conv1x1_bn_relu_forward_stats";
  KILN_CHECK(conv1x1_stats_supported(y, x, w, p), op, " (cuda): needs an sm_90 GPU, f16 "
             "channels-last x (N, K, H, W) and y (N, C, H, W), w (C, K, 1, 1), stride 1, no "
             "padding, K a multiple of 64 up to 2,048 and C a multiple of 128, got x ",
             x.desc(), ", w ", w.desc(), ", y ", y.desc());
  check_scale_shift(scale_shift, x.size(1), x, op, "K");
  KILN_CHECK(x.size(1) % 128 == 0, op, " (cuda): the prologue takes K a multiple of 128 (its "
             "k-steps in pairs), got x ", x.desc());
  conv1x1_stats(y, sum, sqsum, x, w, scale_shift);
}

constinit RuntimeSwitch g_conv3x3{&Switches::conv3x3};  // KILN_CONV3X3
// KILN_CONV3X3_ROWS (KILN_CONV3X3=1: no limit)
constinit RuntimeSetting<int> g_conv3x3_rows{&Switches::conv3x3_max_rows};

bool conv3x3_stats_supported(const Tensor& y, const Tensor& x, const Tensor& w,
                             const ConvParams& p) {
  if (!g_conv3x3.get() || !dgrad1x1_bn_wgmma_available()) return false;
  if (!(y.defined() && x.defined() && w.defined() && x.is_cuda() && x.dtype() == DType::f16 &&
        y.dtype() == DType::f16 && w.dtype() == DType::f16 && x.dim() == 4 && y.dim() == 4 &&
        w.dim() == 4))
    return false;
  const int64_t N = x.size(0), K = x.size(1), H = x.size(2), W = x.size(3), C = y.size(1);
  const int64_t M = N * H * W;
  // TMA's im2col coordinates: 32-bit, the channel count and the spatial sizes within its box
  // and traversal limits.
  return p.groups == 1 && p.stride_h == 1 && p.stride_w == 1 && p.pad_h == 1 && p.pad_w == 1 &&
         p.dil_h == 1 && p.dil_w == 1 && w.size(0) == C && w.size(1) == K && w.size(2) == 3 &&
         w.size(3) == 3 && y.size(0) == N && y.size(2) == H && y.size(3) == W && M > 0 &&
         M <= g_conv3x3_rows.get() && M < (int64_t(1) << 31) - kBM && K % kBK == 0 &&
         K <= 4096 && C % kBN == 0 && C / kBN <= 132 && H <= 65535 && W <= 65535 &&
         x.is_contiguous(MemoryFormat::ChannelsLast) &&
         y.is_contiguous(MemoryFormat::ChannelsLast) &&
         w.is_contiguous(MemoryFormat::ChannelsLast) && y.device() == x.device() &&
         w.device() == x.device();
}

void conv3x3_forward_stats(const Tensor& y, const Tensor& sum, const Tensor& sqsum,
                           const Tensor& x, const Tensor& w, const ConvParams& p) {
  KILN_CHECK(conv3x3_stats_supported(y, x, w, p), "conv3x3_forward_stats (cuda): needs an sm_90 "
             "GPU, KILN_CONV3X3 on, f16 channels-last x (N, K, H, W) and y (N, C, H, W), a "
             "channels-last w (C, K, 3, 3), stride 1, padding 1, K a multiple of 64 up to 4,096 "
             "and C a multiple of 128, got x ", x.desc(), ", w ", w.desc(), ", y ", y.desc());
  const int64_t N = x.size(0), Kc = x.size(1), H = x.size(2), W = x.size(3), C = y.size(1);
  const int64_t M = N * H * W, K = 9 * Kc;
  const bool tall = use_tall(M, C);
  const int parts = tall ? tall_parts(M, C) : dgrad1x1_bn_wgmma_parts(M, C);
  Tensor partial =
      empty({int64_t(parts) * 2 * C}, TensorOptions(DType::f32).with_device(x.device()));
  const CUtensorMap map_x = im2col3x3_map(x.raw_data(), N, H, W, Kc, tall ? 256 : 128);
  const CUtensorMap map_w = kmajor_map(w.raw_data(), C, K);  // (C, 3, 3, Kc) as it lies
  const CUtensorMap none{};
  if (tall) {
    constexpr auto kernel = dgrad1x1_bn_sums_wgmma_kernel<true, false, false, true, false, true,
                                                          false, true, false, true>;
    allow_smem_once<kernel>(kSmemTall, "conv3x3_stats");
    launch_whole_sm(kernel, unsigned(parts * (C / kBN)), kThreads, kSmemTall, current_stream(),
                    static_cast<__half*>(y.raw_data()), static_cast<float*>(partial.raw_data()),
                    map_x, map_w, none, none, none, none, nullptr, nullptr, nullptr, nullptr,
                    nullptr, nullptr, M,
                    int(C), int(K), parts, int(H), int(W), false, 0, nullptr);
    KILN_CUDA_CHECK_LAUNCH();
    bn_nhwc_stats_finish(sum, sqsum, partial, y, parts);
    return;
  }
  auto go = [&]<bool kPipeline>() {
    constexpr auto kernel =
        dgrad1x1_bn_sums_wgmma_kernel<true, false, false, true, false, kPipeline, false, true>;
    allow_smem_once<kernel>(kSmemBytes, "conv3x3_stats");
    launch_whole_sm(kernel, unsigned(parts * (C / kBN)), kThreads, kSmemBytes, current_stream(),
                    static_cast<__half*>(y.raw_data()), static_cast<float*>(partial.raw_data()),
                    map_x, map_w, none, none, none, none, nullptr, nullptr, nullptr, nullptr,
                    nullptr, nullptr, M,
                    int(C), int(K), parts, int(H), int(W), false, 0, nullptr);
  };
  if (g_pipeline.get())
    go.template operator()<true>();
  else
    go.template operator()<false>();
  KILN_CUDA_CHECK_LAUNCH();
  bn_nhwc_stats_finish(sum, sqsum, partial, y, parts);
}

constinit RuntimeSwitch g_dgrad3x3{&Switches::dgrad3x3};  // KILN_DGRAD3X3

bool dgrad3x3_bn_supported(const Tensor& dy, const Tensor& w, const Tensor& x) {
  if (!g_dgrad3x3.get() || !dgrad1x1_bn_wgmma_available()) return false;
  if (!(dy.defined() && w.defined() && x.defined() && dy.is_cuda() && dy.dtype() == DType::f16 &&
        w.dtype() == DType::f16 && x.dtype() == DType::f16 && dy.dim() == 4 && w.dim() == 4 &&
        x.dim() == 4))
    return false;
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), K = dy.size(1);
  const int64_t M = N * H * W;
  // As conv3x3_stats_supported, with dy in x's place: TMA's im2col coordinates are 32-bit.
  return w.size(0) == K && w.size(1) == C && w.size(2) == 3 && w.size(3) == 3 && dy.size(0) == N &&
         dy.size(2) == H && dy.size(3) == W && M > 0 && M < (int64_t(1) << 31) - kBM &&
         K % kBK == 0 && K <= 4096 && C % kBN == 0 && C / kBN <= 132 && H <= 65535 && W <= 65535 &&
         dy.is_contiguous(MemoryFormat::ChannelsLast) &&
         x.is_contiguous(MemoryFormat::ChannelsLast) &&
         w.is_contiguous(MemoryFormat::ChannelsLast) && dy.device() == x.device() &&
         w.device() == x.device();
}

void dgrad3x3_bn_sums_wgmma(const Tensor& g, const Tensor& partial, const Tensor& dy,
                            const Tensor& w, const Tensor& r, const Tensor& mask, const Tensor& x,
                            const Tensor& mean, const Tensor& scale_shift, int parts) {
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), Kc = dy.size(1);
  const int64_t M = N * H * W;
  const bool tall = use_tall(M, C);
  const CUtensorMap map_dy = im2col3x3_map(dy.raw_data(), N, H, W, Kc, tall ? 256 : 128);
  const CUtensorMap map_w = tap_weight_map(w.raw_data(), Kc, C);  // (Kc, 3, 3, C) as it lies
  const bool residual = r.defined(), bits = mask.defined();
  CUtensorMap map_r{}, map_mask{};
  if (residual) map_r = tile_map(r.raw_data(), true, M, C, 64, 64, true);
  const CUtensorMap map_x = tile_map(x.raw_data(), true, M, C, 64, 64, true);
  if (bits) map_mask = tile_map(mask.raw_data(), false, M, C / 8, 64, 16, false);
  auto ptr = [](const Tensor& t) { return t.defined() ? t.raw_data() : nullptr; };
  // One wgmma group in flight always (KILN_WGMMA_PIPELINE is the 1x1 kernels' A/B switch).
  auto run = [&]<bool kResidual, bool kBits>() {
    auto go = [&]<bool kTall>() {
      constexpr auto kernel = dgrad1x1_bn_sums_wgmma_kernel<true, kResidual, kBits, false, true,
                                                            true, false, true, false, kTall>;
      constexpr int kSmem = kTall ? kSmemTall : kSmemBytes;
      allow_smem_once<kernel>(kSmem, "dgrad3x3_bn_sums");
      launch_whole_sm(
          kernel, unsigned(parts * (C / kBN)), kThreads, kSmem, current_stream(),
          static_cast<__half*>(g.raw_data()), static_cast<float*>(partial.raw_data()), map_dy,
          map_w, map_r, map_x, map_mask, CUtensorMap{}, static_cast<const __half*>(ptr(r)),
          static_cast<const uint8_t*>(ptr(mask)), static_cast<const __half*>(x.raw_data()),
          static_cast<const float*>(mean.raw_data()), nullptr,
          static_cast<const float*>(ptr(scale_shift)), M, int(C), int(9 * Kc), parts, int(H),
          int(W), false, 0, nullptr);
    };
    if (tall)
      go.template operator()<true>();
    else
      go.template operator()<false>();
  };
  if (residual && bits)
    run.template operator()<true, true>();
  else if (bits)
    run.template operator()<false, true>();
  else if (residual)
    run.template operator()<true, false>();
  else
    run.template operator()<false, false>();
  KILN_CUDA_CHECK_LAUNCH();
}

int dgrad3x3_bn_parts(int64_t M, int64_t C) {
  return use_tall(M, C) ? tall_parts(M, C) : dgrad1x1_bn_wgmma_parts(M, C);
}

bool gemm_tall_enabled() { return g_tall.get(); }
void set_gemm_tall_enabled(bool on) { g_tall.set(on); }
bool dgrad3x3_enabled() { return g_dgrad3x3.get(); }
void set_dgrad3x3_enabled(bool on) { g_dgrad3x3.set(on); }
bool conv3x3_enabled() { return g_conv3x3.get(); }
void set_conv3x3_enabled(bool on) { g_conv3x3.set(on); }
int64_t conv3x3_max_rows() { return g_conv3x3_rows.get(); }
void set_conv3x3_max_rows(int64_t rows) {
  KILN_CHECK(rows >= 0, "set_conv3x3_max_rows: expected a row count >= 0, got ", rows);
  g_conv3x3_rows.set(int(std::min<int64_t>(rows, std::numeric_limits<int>::max())));
}
bool conv1x1_stats_enabled() { return g_conv1x1_stats.get(); }
bool tail_tma_epilogue_enabled() { return g_tma_epi.get(); }
bool tail_w_direct_enabled() { return g_w_direct.get(); }
void set_tail_w_direct_enabled(bool on) { g_w_direct.set(on); }
bool wgmma_pipeline_enabled() { return g_pipeline.get(); }
bool gemm_b_resident_enabled() { return g_b_resident.get(); }
void set_gemm_b_resident_enabled(bool on) { g_b_resident.set(on); }
void set_wgmma_pipeline_enabled(bool on) { g_pipeline.set(on); }
void set_tail_tma_epilogue_enabled(bool on) { g_tma_epi.set(on); }

}  // namespace kiln::cuda
