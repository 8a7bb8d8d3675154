// The weight gradient of a stride-1 1x1 convolution on Hopper's wgmma and TMA (contract in
// cuda/kernels.h: conv1x1_backward_weight): dw (O × I) = Σ_m dy[m][o] · x[m][i] over the
// M = N·H·W rows of two channels-last tensors. The reduction runs down the rows, so both operands
// are read as they lie with the channels contiguous, which wgmma takes transposed (A M-major,
// B N-major): no transpose pass. Launched without PDL (launch_whole_sm; docs/lab/norm-conv.md,
// v22).
//
// The kernel computes P (A × B) = Σ_m a[m][α] · b[m][β] for two row-major M × A and M × B f16
// tensors: a = dy and b = x, or, where O is not a multiple of 128 (ResNet-50's 64-channel conv1s),
// a = x and b = dy, P = dwᵀ. CTA tile 128 (α) × kBN (β, 128 or 64); a k-step is 64 rows. CTA:
// 3 warpgroups, as gemm_bn_wgmma.cu's. Warpgroup 0's first thread loads, per k-step, a's two
// 64 × 64 boxes (rows × α) and b's kBN / 64 boxes (rows × β) by TMA into one of kStages slots in
// the 128-byte swizzle, guarded by a "full" and an "empty" mbarrier per slot; warpgroup 1 and 2
// multiply α 0-63 and 64-127 of the tile, each keeping one wgmma group in flight.
//
// Split over the rows and bit-reproducible: the grid is parts × tiles CTAs; CTA b computes tile
// b % tiles over k-steps [KT·p / parts, KT·(p + 1) / parts) of part p = b / tiles (the tiles of one
// part run side by side and share their rows in L2), and writes its f32 tile into partial (parts,
// A, B). A finishing kernel adds the parts in order and writes dw (=, or += with accumulate).
// Rows past M come in as zeros from TMA and add nothing. parts depends on the shape and the
// device only.
#include <cuda.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "core/switches.h"
#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/gemm_bn_wgmma.h"
#include "cuda/kernels/wgmma.cuh"

namespace kiln::cuda {
namespace {

using namespace sm90;

constexpr int kBM = 128, kBK = 64, kThreads = 384;
constexpr int kBox = 64 * 64 * 2;  // one 64-row × 64-channel box, 8 KB
// Stage bytes and stages, about 192 KB of slots either way.
template <int kBN>
constexpr int kStageBytes = 2 * kBox + (kBN / 64) * kBox;
template <int kBN>
constexpr int kStages = (192 * 1024) / kStageBytes<kBN>;
template <int kBN>
constexpr int kSmemBytes = kStages<kBN> * kStageBytes<kBN> + 3 * kStages<kBN> * 8 + 1024;

// kPro: x is relu(bn(x)), bn's scale and shift (ss: scale of channel c at c, shift at C + c)
// applied to x's boxes in shared memory before the MMAs read them (bn_relu_box), bit for bit the
// values bn_nhwc_apply would have written; 1 where x is b, 2 where x is a. Warps 2 and 3 of
// warpgroup 0 transform each slot once it is in and arrive on its "ready" mbarrier, which the
// consumers then wait for instead of "full". kPro 3: x is a, taken into registers instead: each
// consumer loads its 64 channels × 16 rows per wgmma with ldmatrix .trans from the M-major slot,
// applies its two channels' factors there, and issues wgmma's register-A form; two register sets
// alternate, so each part's k-steps come in pairs (M a multiple of 128) and B (dy) takes
// 128-column tiles. kPro 4: kPro 3 with the factors in f16 (KILN_PROLOGUE_F16, bn_relu2_f16).
//
// kSumB (kPro 0 only): b's column sums Σ_m b[m][β] as well, by warps 2 and 3 of warpgroup 0 in
// the CTAs of α-tile 0 (one CTA per part and β-tile). They read each slot's b boxes once it is
// full, as the prologue's threads do (thread t takes chunk t % 8 of rows t / 8 + 8i: 8 fixed
// channels, bn_relu_channel), and arrive on its "empty" with the consumers (320 arrivals there),
// so the MMAs never wait for them. Each thread adds its rows in order; at the end each warp adds
// its four row groups per channel by shuffles, in order, and writes colsum (parts, 2, B): part,
// warp, channel. The tail fold's Σx (tail_fold.cu) comes from here instead of a pass over x.
//
// kGram (with kSumB, B = kBN: one β-tile): b's Gram bᵀb as well, by the consumers of the CTA of
// tile 0 in each part: b's boxes have a's layout (rows × channels, channels contiguous), so
// warpgroup c multiplies b's box c (where c·64 < kBN) by b into a second accumulator, in the same
// wgmma groups as its a · b. Written to gram (parts, B, B) as partial is; the tail fold's x Gram
// comes from here instead of a GEMM of its own.
template <int kBN, int kPro, bool kSumB = false, bool kGram = false>
__global__ void __launch_bounds__(kThreads, 1)
    wgrad1x1_wgmma_kernel(float* __restrict__ partial, const __grid_constant__ CUtensorMap map_a,
                          const __grid_constant__ CUtensorMap map_b, int64_t M, int A, int B,
                          int parts, const float* __restrict__ ss, bool pairs,
                          float* __restrict__ colsum, float* __restrict__ gram, bool sum_fence) {
  pdl_start();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int S = kStages<kBN>, kNd = kBN / 2;  // accumulator registers per thread
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;  // the swizzle wants 1,024-byte alignment
  auto a_slot = [&](int s) { return base + uint32_t(s * kStageBytes<kBN>); };
  auto b_slot = [&](int s) { return a_slot(s) + uint32_t(2 * kBox); };
  const uint32_t bars = base + uint32_t(S * kStageBytes<kBN>);
  auto full = [&](int s) { return bars + uint32_t(s * 8); };
  auto empty = [&](int s) { return bars + uint32_t((S + s) * 8); };
  auto ready = [&](int s) { return bars + uint32_t((2 * S + s) * 8); };
  const int tid = threadIdx.x, wg = tid >> 7;
  static_assert(!kSumB || kPro == 0, "b's column sums without a prologue only");
  static_assert(!kGram || kSumB, "b's Gram with its column sums only");
  const int b_tiles = B / kBN, tiles = (A / kBM) * b_tiles;
  const int tile = int(blockIdx.x) % tiles, part = int(blockIdx.x) / tiles;
  const bool sums = kSumB && tile < b_tiles;  // α-tile 0
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), sums ? 320 : 256);
      if constexpr (kPro == 1 || kPro == 2) mbar_init(ready(s), 64);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int a0 = (tile / b_tiles) * kBM, b0 = (tile % b_tiles) * kBN;
  static_assert(kPro < 3 || kBN == 128, "the register-A prologue takes 128-column tiles");
  const int64_t KT = (M + kBK - 1) / kBK;
  // pairs (KT even; always with kPro 3): whole pairs of k-steps per part, so that every form
  // adds the same rows into each partial and gives the same bits.
  const int64_t kt0 = pairs ? 2 * ((KT / 2) * part / parts) : KT * part / parts;
  const int64_t kt1 = pairs ? 2 * ((KT / 2) * (part + 1) / parts) : KT * (part + 1) / parts;
  const int n = int(kt1 - kt0);  // this CTA's k-steps

  unsigned char* gbase = smem_raw + (base - raw);
  if (wg == 0) {  // the producer, and with kPro the transform (warps 2 and 3)
    if constexpr (kPro == 1 || kPro == 2) {
      if (tid >= 64) {
        // x's boxes in each slot: b's kBN / 64 (kPro 1) or a's two (kPro 2), each 64 rows; the
        // tile's channels are fixed, so are each thread's factors.
        constexpr int kBoxes = kPro == 1 ? kBN / 64 : 2;
        const int t = tid - 64, ch = bn_relu_channel(t);
        const int x0 = kPro == 1 ? b0 : a0, C = kPro == 1 ? B : A;
        float sc[kBoxes][8], sh[kBoxes][8];
#pragma unroll
        for (int h = 0; h < kBoxes; ++h) bn_relu_factors(ss, C, x0 + h * 64 + ch, sc[h], sh[h]);
        for (int j = 0; j < n; ++j) {
          const int s = j % S;
          mbar_wait(full(s), uint32_t((j / S) & 1));
          unsigned char* x = gbase + ((kPro == 1 ? b_slot(s) : a_slot(s)) - base);
#pragma unroll
          for (int h = 0; h < kBoxes; ++h) bn_relu_box<64, 64>(x + h * kBox, t, sc[h], sh[h]);
          fence_proxy_async();  // before the MMAs read the slot through the async proxy
          mbar_arrive(ready(s));
        }
        return;
      }
    }
    if constexpr (kSumB) {
      if (tid >= 64) {
        if (!sums) return;
        constexpr int kBoxes = kBN / 64;
        const int t = tid - 64;
        float acc[kBoxes][8];
#pragma unroll
        for (int h = 0; h < kBoxes; ++h)
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[h][k] = 0.f;
        for (int j = 0; j < n; ++j) {
          const int s = j % S;
          mbar_wait(full(s), uint32_t((j / S) & 1));
          const unsigned char* x = gbase + (b_slot(s) - base);
#pragma unroll
          for (int h = 0; h < kBoxes; ++h) {
            const uint4* p =
                reinterpret_cast<const uint4*>(x + h * kBox + (t >> 3) * 128 + (t & 7) * 16);
#pragma unroll
            for (int i = 0; i < 8; ++i) {  // rows t / 8 + 8i, one 1,024-byte step apart
              const uint4 v = p[i * 64];
              const __half2* hv = reinterpret_cast<const __half2*>(&v);
#pragma unroll
              for (int k = 0; k < 4; ++k) {
                const float2 f = __half22float2(hv[k]);
                acc[h][2 * k] += f.x;
                acc[h][2 * k + 1] += f.y;
              }
            }
          }
          // The slot is next written by the producer's TMA, through the async proxy: these
          // reads went through the generic proxy, and release/acquire on the mbarrier orders
          // them only within it. Without this fence, Σx of the Gram form gave other bits in
          // about 2% of runs on two H100 boards of four (a row of x read out of turn);
          // whether the fence ends that is not known yet, as no such board has run with it
          // (docs/lab/norm-conv.md, "The determinism finding run"). KILN_WGRAD_SUM_FENCE=0
          // drops it, for that comparison.
          if (sum_fence) fence_proxy_async();
          mbar_arrive(empty(s));
        }
        // Lane l of w = t / 32 (0 or 1: the kernel's warps 2 and 3) holds the rows of group
        // g = 4·w + l / 8 in channels 8·((l % 8) XOR g)..; the lane of group g' with the same
        // channels is (l % 8 XOR g XOR g') % 8 + 8·(g' % 4). Each lane adds its warp's four
        // groups in order; lanes 0-7 write.
        const int lane = t & 31, w = t >> 5, g = (t >> 3) & 7;
        const int j8 = (lane & 7) ^ g;  // this lane's channel group
        float* out = colsum + (int64_t(part) * 2 + w) * B + b0;
#pragma unroll
        for (int h = 0; h < kBoxes; ++h)
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            float v = 0.f;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              const int gq = 4 * w + q;
              v += __shfl_sync(0xffffffffu, acc[h][k], ((j8 ^ gq) & 7) + 8 * q);
            }
            if (lane < 8) out[h * 64 + j8 * 8 + k] = v;
          }
        return;
      }
    }
    if (tid != 0) return;
    for (int j = 0; j < n; ++j) {
      const int s = j % S;
      if (j >= S) mbar_wait(empty(s), uint32_t((j / S - 1) & 1));
      mbar_expect_tx(full(s), uint32_t(kStageBytes<kBN>));
      const int m0 = int((kt0 + j) * kBK);
      for (int h = 0; h < 2; ++h)
        tma_load_2d(a_slot(s) + uint32_t(h * kBox), &map_a, a0 + h * 64, m0, full(s));
      for (int h = 0; h < kBN / 64; ++h)
        tma_load_2d(b_slot(s) + uint32_t(h * kBox), &map_b, b0 + h * 64, m0, full(s));
    }
    return;
  }

  // Consumers: warpgroup c computes α rows a0 + c·64 .. + 63 of the tile.
  const int c = wg - 1, t = tid & 127, warp = t >> 5, lane = t & 31;
  float d[kNd];
#pragma unroll
  for (int i = 0; i < kNd; ++i) d[i] = 0.f;
  wgmma_fence_operands(d);
  // kGram: tile 0 (B = kBN, so α-tile 0 and the only β-tile), warpgroups whose box of b exists.
  const bool gram_wg = kGram && tile == 0 && c * 64 < kBN;
  float dg[kNd];  // unused, and dropped by the compiler, without kGram
#pragma unroll
  for (int i = 0; i < kNd; ++i) dg[i] = 0.f;
  if constexpr (kGram) wgmma_fence_operands(dg);
  // kG: this warpgroup also multiplies for the Gram (unconditional inside, so that the compiler
  // keeps the wgmmas of a group back to back).
  auto issue = [&]<bool kG = false>(int j) {
    const int s = j % S;
    mbar_wait(kPro == 1 || kPro == 2 ? ready(s) : full(s), uint32_t((j / S) & 1));
    wgmma_fence();
    const uint64_t da0 = make_desc_nmajor(a_slot(s) + uint32_t(c * kBox));
    const uint64_t db0 = make_desc_nmajor(b_slot(s));
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      // 16 rows of the k-step: 16 rows of 128 bytes into each box, M- and N-major alike.
      const uint64_t da = desc_advance(da0, uint32_t(kk * 16 * 128));
      const uint64_t db = desc_advance(db0, uint32_t(kk * 16 * 128));
      if constexpr (kBN == 128)
        wgmma_m64n128k16<1, 1>(d, da, db);
      else
        wgmma_m64n64k16<1, 1>(d, da, db);
    }
    if constexpr (kG) {
      const uint64_t dg0 = make_desc_nmajor(b_slot(s) + uint32_t(c * kBox));
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        const uint64_t dga = desc_advance(dg0, uint32_t(kk * 16 * 128));
        const uint64_t db = desc_advance(db0, uint32_t(kk * 16 * 128));
        if constexpr (kBN == 128)
          wgmma_m64n128k16<1, 1>(dg, dga, db);
        else
          wgmma_m64n64k16<1, 1>(dg, dga, db);
      }
    }
    wgmma_commit();
  };
  if constexpr (kPro >= 3) {
    // This thread's two channels of x (fragment rows lane / 4 and lane / 4 + 8 of its warp).
    const int ch = a0 + c * 64 + warp * 16 + (lane >> 2);
    const float s_lo = ss[ch], t_lo = ss[A + ch], s_hi = ss[ch + 8], t_hi = ss[A + ch + 8];
    const float2 sl{s_lo, s_lo}, tl{t_lo, t_lo}, sh{s_hi, s_hi}, th{t_hi, t_hi};
    // kPro 4 (KILN_PROLOGUE_F16): the same factors in f16, bn_relu2_f16.
    const __half2 hsl = __float2half2_rn(s_lo), htl = __float2half2_rn(t_lo);
    const __half2 hsh = __float2half2_rn(s_hi), hth = __float2half2_rn(t_hi);
    uint32_t r0[4][4], r1[4][4];
    // A (64 channels × 16 rows per wgmma) from the slot's M-major box c: matrix q of each
    // ldmatrix is channels 8·(q % 2).. of rows 8·(q / 2).. of the 16-row step, transposed.
    auto form = [&](uint32_t (&a)[4][4], int s) {
      const int q = lane >> 3;
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        const int row = kk * 16 + (q >> 1) * 8 + (lane & 7), chunk = 2 * warp + (q & 1);
        ldmatrix_x4_trans(a[kk], a_slot(s) + uint32_t(c * kBox + row * 128 +
                                                      ((chunk ^ (row & 7)) << 4)));
        if constexpr (kPro == 4) {
          a[kk][0] = bn_relu2_f16(a[kk][0], hsl, htl);
          a[kk][1] = bn_relu2_f16(a[kk][1], hsh, hth);
          a[kk][2] = bn_relu2_f16(a[kk][2], hsl, htl);
          a[kk][3] = bn_relu2_f16(a[kk][3], hsh, hth);
        } else {
          a[kk][0] = bn_relu2(a[kk][0], sl, tl);
          a[kk][1] = bn_relu2(a[kk][1], sh, th);
          a[kk][2] = bn_relu2(a[kk][2], sl, tl);
          a[kk][3] = bn_relu2(a[kk][3], sh, th);
        }
      }
    };
    auto step = [&](uint32_t (&a)[4][4], int j) {
      const int s = j % S;
      mbar_wait(full(s), uint32_t((j / S) & 1));
      form(a, s);
      wgmma_fence();  // the fragments were written by this thread
      const uint64_t db0 = make_desc_nmajor(b_slot(s));
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk)
        wgmma_m64n128k16_rs<1>(d, a[kk], desc_advance(db0, uint32_t(kk * 16 * 128)));
      wgmma_commit();
    };
    if (n > 0) {
      step(r0, 0);
      step(r1, 1);
      wgmma_wait1();
      mbar_arrive(empty(0));
      for (int j = 2; j < n; j += 2) {
        step(r0, j);
        wgmma_wait1();
        mbar_arrive(empty((j - 1) % S));
        step(r1, j + 1);
        wgmma_wait1();
        mbar_arrive(empty(j % S));
      }
      wgmma_wait0();
      mbar_arrive(empty((n - 1) % S));
    }
  } else if (n > 0) {
    auto run = [&]<bool kG>() {
      issue.template operator()<kG>(0);
      for (int j = 1; j < n; ++j) {
        issue.template operator()<kG>(j);
        wgmma_wait1();
        mbar_arrive(empty((j - 1) % S));
      }
      wgmma_wait0();
      mbar_arrive(empty((n - 1) % S));
    };
    if (kGram && gram_wg)
      run.template operator()<kGram>();
    else
      run.template operator()<false>();
  }
  // Fragment layout: register 4q + {0, 1} holds row 16·warp + lane / 4, columns
  // 8q + 2·(lane % 4) + {0, 1}; 4q + {2, 3} the row 8 below.
  const int row = a0 + c * 64 + warp * 16 + (lane >> 2);
  float* out = partial + (int64_t(part) * A + row) * B + b0 + 2 * (lane & 3);
#pragma unroll
  for (int q = 0; q < kBN / 8; ++q) {
    *reinterpret_cast<float2*>(out + 8 * q) = float2{d[4 * q], d[4 * q + 1]};
    *reinterpret_cast<float2*>(out + int64_t(8) * B + 8 * q) = float2{d[4 * q + 2], d[4 * q + 3]};
  }
  if constexpr (kGram) {
    if (gram_wg) {  // b0 = 0: rows c·64 + ..., the same fragment layout
      const int grow = c * 64 + warp * 16 + (lane >> 2);
      float* gout = gram + (int64_t(part) * B + grow) * B + 2 * (lane & 3);
#pragma unroll
      for (int q = 0; q < kBN / 8; ++q) {
        *reinterpret_cast<float2*>(gout + 8 * q) = float2{dg[4 * q], dg[4 * q + 1]};
        *reinterpret_cast<float2*>(gout + int64_t(8) * B + 8 * q) =
            float2{dg[4 * q + 2], dg[4 * q + 3]};
      }
    }
  }
#else
  __trap();  // built without sm_90a: conv1x1_wgrad_supported() is false, never launched
#endif
}

// dw[o][i] (strides so, si) = Σ over parts, in order, of partial (parts, A, B) at (o, i), or at
// (i, o) when swapped; (+= the old value with accumulate). A block of 32 × 32 threads takes a
// 32 × 32 tile of (A, B), one element per thread (the parts' loads are what takes the time:
// up to 66 of them per element, so every element gets its own thread). Reads of partial run
// along B, and so do the writes of dw unswapped; swapped the sums go through a shared tile so
// that the writes run along A, dw's inner dimension — one 2-byte write per 1,024-byte row cost
// layer 4's conv1 19 µs before.
template <typename T>
__global__ void __launch_bounds__(1024)
    wgrad1x1_finish_kernel(T* __restrict__ dw, const float* __restrict__ partial, int parts,
                           int A, int B, bool swapped, int64_t so, int64_t si, bool accumulate) {
  pdl_start();
  __shared__ float tile[32][33];
  const int64_t n = int64_t(A) * B;
  const int a0 = int(blockIdx.y) * 32, b0 = int(blockIdx.x) * 32;
  const int tx = threadIdx.x, ty = threadIdx.y;
  {
    const int a = a0 + ty, b = b0 + tx;
    if (a < A && b < B) {
      const float* p = partial + int64_t(a) * B + b;
      float v = 0.f;
#pragma unroll 8
      for (int q = 0; q < parts; ++q) v += p[q * n];
      if (swapped) {
        tile[ty][tx] = v;
      } else {
        T* dst = dw + int64_t(a) * so + b * si;
        if (accumulate) v += float(*dst);
        *dst = T(v);
      }
    }
  }
  if (!swapped) return;
  __syncthreads();
  const int b = b0 + ty, a = a0 + tx;  // dw row o = b, its column i = a
  if (a >= A || b >= B) return;
  T* dst = dw + int64_t(b) * so + a * si;
  float v = tile[tx][ty];
  if (accumulate) v += float(*dst);
  *dst = T(v);
}

constinit RuntimeSwitch g_wgrad1x1{&Switches::wgrad1x1};  // KILN_WGRAD1X1
constinit RuntimeSwitch g_conv_prologue{&Switches::conv_prologue};  // KILN_CONV_PROLOGUE
constinit RuntimeSwitch g_prologue_f16{&Switches::prologue_f16};  // KILN_PROLOGUE_F16
constinit RuntimeSwitch g_wgrad_x_sum{&Switches::wgrad_x_sum};    // KILN_WGRAD_X_SUM
constinit RuntimeSwitch g_wgrad_x_gram{&Switches::wgrad_x_gram};  // KILN_WGRAD_X_GRAM
constinit RuntimeSwitch g_wgrad_sum_fence{&Switches::wgrad_sum_fence};  // KILN_WGRAD_SUM_FENCE

// x_sum[i] = Σ over parts, then over the two summing warps, in order, of colsum (parts, 2, B).
__global__ void wgrad1x1_colsum_finish_kernel(float* __restrict__ x_sum,
                                              const float* __restrict__ colsum, int rows, int B) {
  pdl_start();
  const int c = int(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= B) return;
  float v = 0.f;
#pragma unroll 8
  for (int r = 0; r < rows; ++r) v += colsum[int64_t(r) * B + c];
  x_sum[c] = v;
}

// dw (=, or += with accumulate) = dyᵀ · x, or dyᵀ · relu(x·scale + shift) with scale_shift
// defined; the shapes already checked. x_sum defined (f32, I values; no scale_shift, and x must
// be the kernel's b: conv1x1_wgrad_x_sum_supported): Σ over x's rows per channel too, from the
// same pass.
void wgrad1x1(const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& scale_shift,
              bool accumulate, const Tensor& x_sum = Tensor(), const Tensor& x_gram = Tensor()) {
  const int64_t O = dy.size(1), I = x.size(1), M = x.numel() / I;
  // The prologue from registers (kPro 3) where x can be A with dy in 128-column tiles and the
  // k-steps pair up. With KILN_CONV_PROLOGUE on, every weight gradient of such a shape takes
  // that orientation and row split, so that the fused op and its composition give the same bits;
  // with it off, dy is A wherever it can be (x as A was 1.05–1.26x slower on layers 1–2's shapes:
  // kiln-fusion-probe --wgrad1x1, docs/lab/norm-conv.md).
  const bool regs_shape =
      g_conv_prologue.get() && I % kBM == 0 && O % 128 == 0 && M % (2 * kBK) == 0;
  const bool regs = scale_shift.defined() && regs_shape;
  // A: the side that is a multiple of 128 (x's where the register form fits, else dy's where
  // both are).
  const bool swapped = regs_shape || O % kBM != 0;
  KILN_CHECK(!x_sum.defined() || (!swapped && !scale_shift.defined()),
             "conv1x1_backward_weight (cuda): x's column sums need x as the kernel's b");
  const Tensor& a = swapped ? x : dy;
  const Tensor& b = swapped ? dy : x;
  const int64_t A = swapped ? I : O, B = swapped ? O : I;
  const CUtensorMap map_a = tile_map(a.raw_data(), true, M, A, 64, 64, true);
  const CUtensorMap map_b = tile_map(b.raw_data(), true, M, B, 64, 64, true);
  const int bn = B % 128 == 0 ? 128 : 64;
  const int64_t tiles = (A / kBM) * (B / bn), KT = (M + kBK - 1) / kBK;
  const int64_t sms = context().props.multiProcessorCount;
  const bool pairs = g_conv_prologue.get() && KT % 2 == 0;
  const int parts = int(std::clamp<int64_t>(sms / tiles, 1, pairs ? KT / 2 : KT));
  Tensor partial =
      empty({int64_t(parts) * A * B}, TensorOptions(DType::f32).with_device(x.device()));
  cudaStream_t s = current_stream();
  const float* ss =
      scale_shift.defined() ? static_cast<const float*>(scale_shift.raw_data()) : nullptr;
  Tensor colsum;
  if (x_sum.defined())
    colsum = empty({int64_t(parts) * 2 * B}, TensorOptions(DType::f32).with_device(x.device()));
  float* cs = colsum.defined() ? static_cast<float*>(colsum.raw_data()) : nullptr;
  KILN_CHECK(!x_gram.defined() || (x_sum.defined() && B == bn),
             "conv1x1_backward_weight (cuda): x's Gram needs its column sums and one β-tile");
  Tensor gram_partial;
  if (x_gram.defined())
    gram_partial =
        empty({int64_t(parts) * B * B}, TensorOptions(DType::f32).with_device(x.device()));
  float* gp = gram_partial.defined() ? static_cast<float*>(gram_partial.raw_data()) : nullptr;
  auto go = [&]<int kBN, int kPro, bool kSumB = false, bool kGram = false>() {
    constexpr auto kernel = wgrad1x1_wgmma_kernel<kBN, kPro, kSumB, kGram>;
    allow_smem_once<kernel>(kSmemBytes<kBN>, "conv1x1_backward_weight");
    launch_whole_sm(kernel, unsigned(parts * tiles), kThreads, kSmemBytes<kBN>, s,
                    static_cast<float*>(partial.raw_data()), map_a, map_b, M, int(A), int(B),
                    parts, ss, pairs, cs, gp, g_wgrad_sum_fence.get());
  };
  auto pick = [&]<int kPro>() {
    if (bn == 128)
      go.template operator()<128, kPro>();
    else
      go.template operator()<64, kPro>();
  };
  if (gp != nullptr && bn == 128)
    go.template operator()<128, 0, true, true>();
  else if (gp != nullptr)
    go.template operator()<64, 0, true, true>();
  else if (cs != nullptr && bn == 128)
    go.template operator()<128, 0, true>();
  else if (cs != nullptr)
    go.template operator()<64, 0, true>();
  else if (ss == nullptr)
    pick.template operator()<0>();
  else if (regs && prologue_f16_enabled())
    go.template operator()<128, 4>();
  else if (regs)
    go.template operator()<128, 3>();
  else if (swapped)
    pick.template operator()<2>();
  else
    pick.template operator()<1>();
  KILN_CUDA_CHECK_LAUNCH();
  const dim3 blocks(unsigned((B + 31) / 32), unsigned((A + 31) / 32));
  const float* pp = static_cast<const float*>(partial.raw_data());
  const dim3 threads(32, 32);
  if (dw.dtype() == DType::f16)
    launch(wgrad1x1_finish_kernel<__half>, blocks, threads, 0, s,
           static_cast<__half*>(dw.raw_data()), pp, parts, int(A), int(B), swapped, dw.stride(0),
           dw.stride(1), accumulate);
  else
    launch(wgrad1x1_finish_kernel<float>, blocks, threads, 0, s,
           static_cast<float*>(dw.raw_data()), pp, parts, int(A), int(B), swapped, dw.stride(0),
           dw.stride(1), accumulate);
  KILN_CUDA_CHECK_LAUNCH();
  if (cs != nullptr) {
    launch(wgrad1x1_colsum_finish_kernel, unsigned((B + 127) / 128), 128u, 0, s,
           static_cast<float*>(x_sum.raw_data()), static_cast<const float*>(cs), 2 * parts,
           int(B));
    KILN_CUDA_CHECK_LAUNCH();
  }
  if (gp != nullptr) {
    const dim3 gblocks(unsigned((B + 31) / 32), unsigned((B + 31) / 32));
    launch(wgrad1x1_finish_kernel<float>, gblocks, threads, 0, s,
           static_cast<float*>(x_gram.raw_data()), static_cast<const float*>(gp), parts, int(B),
           int(B), false, int64_t(B), int64_t(1), false);
    KILN_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

namespace {
// conv1x1_wgrad_supported's conditions on dy, x and p (dw then needs O × I × 1 × 1 on x's device).
bool wgrad_operands_fit(const Tensor& dy, const Tensor& x, const ConvParams& p) {
  if (!g_wgrad1x1.get() || !dgrad1x1_bn_wgmma_available()) return false;
  if (!(dy.defined() && x.defined() && x.is_cuda() && dy.dim() == 4 && x.dim() == 4 &&
        x.dtype() == DType::f16 && dy.dtype() == DType::f16))
    return false;
  const int64_t O = dy.size(1), I = x.size(1), M = x.numel() / std::max<int64_t>(I, 1);
  const bool fits = (O % kBM == 0 && I % 64 == 0) || (I % kBM == 0 && O % 64 == 0);
  return p.groups == 1 && p.stride_h == 1 && p.stride_w == 1 && p.pad_h == 0 && p.pad_w == 0 &&
         p.dil_h == 1 && p.dil_w == 1 && fits && O <= 4096 && I <= 4096 && M > 0 &&
         M < (int64_t(1) << 31) - kBK && dy.size(0) == x.size(0) && dy.size(2) == x.size(2) &&
         dy.size(3) == x.size(3) && x.is_contiguous(MemoryFormat::ChannelsLast) &&
         dy.is_contiguous(MemoryFormat::ChannelsLast) && dy.device() == x.device();
}
}  // namespace

bool conv1x1_wgrad_supported(const Tensor& dw, const Tensor& dy, const Tensor& x,
                             const ConvParams& p) {
  return wgrad_operands_fit(dy, x, p) && dw.defined() && dw.dim() == 4 &&
         (dw.dtype() == DType::f16 || dw.dtype() == DType::f32) && dw.size(0) == dy.size(1) &&
         dw.size(1) == x.size(1) && dw.size(2) == 1 && dw.size(3) == 1 &&
         dw.device() == x.device();
}

bool conv1x1_wgrad_f32_supported(const Tensor& dy, const Tensor& x) {
  return wgrad_operands_fit(dy, x, ConvParams{});
}

void conv1x1_backward_weight(const Tensor& dw, const Tensor& dy, const Tensor& x,
                             const ConvParams& p, bool accumulate) {
  KILN_CHECK(conv1x1_wgrad_supported(dw, dy, x, p),
             "conv1x1_backward_weight (cuda): needs an sm_90 GPU, f16 channels-last dy (N, O, H, "
             "W) and x (N, I, H, W), dw (O, I, 1, 1) f16 or f32, stride 1, no padding, and O a "
             "multiple of 128 with I of 64 (or the other way round); got dw ",
             dw.desc(), ", dy ", dy.desc(), ", x ", x.desc());
  wgrad1x1(dw, dy, x, Tensor(), accumulate);
}

bool conv1x1_wgrad_x_sum_supported(const Tensor& dw, const Tensor& dy, const Tensor& x) {
  if (!g_wgrad_x_sum.get() || !conv1x1_wgrad_supported(dw, dy, x, ConvParams{})) return false;
  const int64_t O = dy.size(1), I = x.size(1), M = x.numel() / I;
  // wgrad1x1's orientation: x is b unless O is not a multiple of 128 or the register prologue's
  // shape takes x as a.
  const bool regs_shape =
      g_conv_prologue.get() && I % kBM == 0 && O % 128 == 0 && M % (2 * kBK) == 0;
  return O % kBM == 0 && !regs_shape;
}

bool conv1x1_wgrad_x_gram_supported(const Tensor& dw, const Tensor& dy, const Tensor& x) {
  if (!g_wgrad_x_gram.get() || !conv1x1_wgrad_x_sum_supported(dw, dy, x)) return false;
  const int64_t I = x.size(1);
  return I == 64 || I == 128;  // one β-tile: B = the kernel's tile width
}

void conv1x1_backward_weight_x_sum(const Tensor& dw, const Tensor& x_sum, const Tensor& dy,
                                   const Tensor& x, const Tensor& x_gram) {
  KILN_CHECK(conv1x1_wgrad_x_sum_supported(dw, dy, x),
             "conv1x1_backward_weight_x_sum (cuda): needs what conv1x1_backward_weight takes with "
             "O a multiple of 128 (and KILN_CONV_PROLOGUE off where I is too); got dw ",
             dw.desc(), ", dy ", dy.desc(), ", x ", x.desc());
  KILN_CHECK(x_sum.defined() && x_sum.dtype() == DType::f32 && x_sum.is_contiguous() &&
                 x_sum.numel() == x.size(1) && x_sum.device() == x.device(),
             "conv1x1_backward_weight_x_sum (cuda): x_sum must be ", x.size(1),
             " contiguous f32 values on x's device, got ",
             x_sum.defined() ? x_sum.desc() : "undefined");
  if (x_gram.defined()) {
    const int64_t I = x.size(1);
    KILN_CHECK(conv1x1_wgrad_x_gram_supported(dw, dy, x) && x_gram.dtype() == DType::f32 &&
                   x_gram.is_contiguous() && x_gram.numel() == I * I &&
                   x_gram.device() == x.device(),
               "conv1x1_backward_weight_x_sum (cuda): x_gram needs x of 64 or 128 channels and ",
               I * I, " contiguous f32 values on x's device, got ", x_gram.desc(), " for x ",
               x.desc());
  }
  wgrad1x1(dw, dy, x, Tensor(), false, x_sum, x_gram);
}

bool conv1x1_wgrad_x_sum_enabled() { return g_wgrad_x_sum.get(); }
bool conv1x1_wgrad_x_gram_enabled() { return g_wgrad_x_gram.get(); }
void set_conv1x1_wgrad_x_gram_enabled(bool on) { g_wgrad_x_gram.set(on); }
void set_conv1x1_wgrad_x_sum_enabled(bool on) { g_wgrad_x_sum.set(on); }

void conv1x1_bn_relu_backward_weight(const Tensor& dw, const Tensor& dy, const Tensor& x,
                                     const Tensor& scale_shift, const ConvParams& p,
                                     bool accumulate) {
  KILN_CHECK(conv1x1_wgrad_supported(dw, dy, x, p),
             "conv1x1_bn_relu_backward_weight (cuda): needs an sm_90 GPU, f16 channels-last dy "
             "(N, O, H, W) and x (N, I, H, W), dw (O, I, 1, 1) f16 or f32, stride 1, no padding, "
             "and O a multiple of 128 with I of 64 (or the other way round); got dw ",
             dw.desc(), ", dy ", dy.desc(), ", x ", x.desc());
  check_scale_shift(scale_shift, x.size(1), x, "conv1x1_bn_relu_backward_weight", "I");
  wgrad1x1(dw, dy, x, scale_shift, accumulate);
}


bool conv1x1_bn_relu_supported(const Tensor& x, const Tensor& w) {
  if (!g_conv_prologue.get() || !g_wgrad1x1.get() || !conv1x1_stats_enabled() ||
      !dgrad1x1_bn_wgmma_available())
    return false;
  if (!(x.defined() && w.defined() && x.is_cuda() && x.dtype() == DType::f16 && x.dim() == 4 &&
        w.dtype() == DType::f16 && w.dim() == 4 && w.device() == x.device() &&
        x.is_contiguous(MemoryFormat::ChannelsLast) &&
        (w.is_contiguous() || w.is_contiguous(MemoryFormat::ChannelsLast))))
    return false;
  const int64_t C = x.size(1), O = w.size(0), M = x.numel() / std::max<int64_t>(C, 1);
  // The forward's shapes (dgrad1x1_bn_wgmma_shape with K = C); the weight gradient's (O a
  // multiple of 128, C of 64, both up to 4,096) follow from them.
  return w.size(1) == C && w.size(2) == 1 && w.size(3) == 1 && M > 0 && O <= 4096 &&
         C % 128 == 0 && dgrad1x1_bn_wgmma_shape(M, C, O);
}

bool conv1x1_bn_relu_enabled() { return g_conv_prologue.get(); }
bool prologue_f16_enabled() { return g_prologue_f16.get(); }
void set_prologue_f16_enabled(bool on) { g_prologue_f16.set(on); }
void set_conv1x1_bn_relu_enabled(bool on) { g_conv_prologue.set(on); }

bool conv1x1_wgrad_enabled() { return g_wgrad1x1.get(); }
void set_conv1x1_wgrad_enabled(bool on) { g_wgrad1x1.set(on); }

}  // namespace kiln::cuda
