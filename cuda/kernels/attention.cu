// Fused scaled-dot-product attention (FlashAttention-2's scheme, Dao 2023) on mma.sync
// m16n8k16 tensor cores, f16 or bf16 in, f32 accumulation, head_dim 64 or 128.
//
// Forward: a block of 4 warps takes 64 query rows of one (batch, head), each warp 16 of them,
// and walks the key tiles of 64: S = Q·Kᵀ in registers, the online softmax (running row max and
// sum), O += P·V with P reused from S's registers as the next MMA's A operand. The L×L scores
// never leave registers; out and each row's log-sum-exp are written once.
//
// Backward, deterministic (every output element is summed by one thread in a fixed order, no
// float atomics): delta_i = Σ_d dO·O per row; then one kernel per key tile (a warp owns 16 keys)
// walks the query tiles for dK and dV (S and dP recomputed transposed: Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ),
// and one kernel per query tile walks the key tiles for dQ. Recomputing S and dP in both costs
// two more GEMMs than FlashAttention-2's atomics, in exchange for bit-reproducible gradients
// (graph replay must equal eager execution).
//
// Fragment layouts and the ldmatrix addressing follow cuda/kernels/mma.cuh. Shared-memory rows
// are padded by 8 elements (16 bytes) so that ldmatrix's eight 16-byte row reads hit eight
// different bank groups.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/mma.cuh"

namespace kiln::cuda {
namespace {

constexpr int kTile = 64;      // query and key rows per tile
constexpr int kWarps = 4;      // 16 rows each
constexpr int kThreads = 32 * kWarps;
constexpr float kLog2e = 1.4426950408889634f;

struct AttnArgs {
  const void *q, *k, *v, *o, *dout;
  void *out, *dq, *dk, *dv;
  float *lse, *delta;
  int64_t qs[3], ks[3], vs[3], os[3], dos[3], dqs[3], dks[3], dvs[3];  // batch, head, row strides
  int64_t heads, lq, lk;
  float scale;   // softmax scale
  bool causal;   // key j is seen by query i when j <= i + (lk - lq)
};

// ---- element-type pieces ----
template <typename T>
__device__ inline unsigned pack2(float a, float b);
template <>
__device__ inline unsigned pack2<__half>(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}
template <>
__device__ inline unsigned pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}

template <typename T>
__device__ inline void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);
template <>
__device__ inline void mma<__half>(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                   unsigned b1) {
  mma16816(c, a, b0, b1);
}
template <>
__device__ inline void mma<__nv_bfloat16>(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- tiles in shared memory ----
template <int D>
struct Smem {
  static constexpr int kLd = D + 8;  // padded row, in elements
};

// Rows [r0, r0 + 64) of a (rows, D) matrix with row stride `ld` (elements) into s (64 × kLd),
// zero-filled past `rows`. All threads of the block take part; the caller commits and waits.
template <typename T, int D>
__device__ inline void load_tile(T* s, const T* g, int64_t ld, int64_t r0, int64_t rows) {
  constexpr int kChunks = kTile * D / 8;  // 16-byte pieces
  for (int c = threadIdx.x; c < kChunks; c += kThreads) {
    const int r = c / (D / 8), col = (c % (D / 8)) * 8;
    const bool valid = r0 + r < rows;
    cp_async16(s + r * Smem<D>::kLd + col, g + (valid ? (r0 + r) * ld + col : 0), valid);
  }
}

// A fragment (16 rows × 16 k) of a row-major tile in shared memory, rows from `row0`, k from k0.
template <int D>
__device__ inline void load_a(unsigned (&a)[4], const void* s, int row0, int k0) {
  const int lane = threadIdx.x % 32;
  const int r = row0 + (lane % 8) + ((lane >> 3) & 1) * 8, c = k0 + (lane >> 4) * 8;
  ldmatrix_x4(a, static_cast<const char*>(s) + (r * Smem<D>::kLd + c) * 2);
}
// B fragments of two n-tiles (16 n × 16 k) where the tile stores n as rows and k as columns
// (Kᵀ from K): b[0], b[1] for n-tile n0, b[2], b[3] for n0 + 8.
template <int D>
__device__ inline void load_b_nk(unsigned (&b)[4], const void* s, int n0, int k0) {
  const int lane = threadIdx.x % 32;
  const int r = n0 + (lane % 8) + (lane >> 4) * 8, c = k0 + ((lane >> 3) & 1) * 8;
  ldmatrix_x4(b, static_cast<const char*>(s) + (r * Smem<D>::kLd + c) * 2);
}
// B fragments of two n-tiles where the tile stores k as rows and n as columns (V for P·V).
template <int D>
__device__ inline void load_b_kn(unsigned (&b)[4], const void* s, int k0, int n0) {
  const int lane = threadIdx.x % 32;
  const int r = k0 + (lane % 8) + ((lane >> 3) & 1) * 8, c = n0 + (lane >> 4) * 8;
  ldmatrix_x4_trans(b, static_cast<const char*>(s) + (r * Smem<D>::kLd + c) * 2);
}

// C fragments of two adjacent n-tiles (16 × 16) as the A fragment of the next MMA.
template <typename T>
__device__ inline void c_to_a(unsigned (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack2<T>(c0[0], c0[1]);
  a[1] = pack2<T>(c0[2], c0[3]);
  a[2] = pack2<T>(c1[0], c1[1]);
  a[3] = pack2<T>(c1[2], c1[3]);
}

__device__ inline float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ inline float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// ---- forward ----
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attn_fwd(AttnArgs a) {
  pdl_start();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kLd = Smem<D>::kLd;
  T* sq = reinterpret_cast<T*>(smem_raw);
  // K and V tiles, double-buffered: buffer i's K at kv + 2i tiles, its V one tile further.
  T* kv = sq + kTile * kLd;
  auto kbuf = [&](int64_t i) { return kv + (2 * (i & 1)) * kTile * kLd; };
  auto vbuf = [&](int64_t i) { return kv + (2 * (i & 1) + 1) * kTile * kLd; };
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t b = blockIdx.y / a.heads, h = blockIdx.y % a.heads, q0 = int64_t(blockIdx.x) * kTile;
  const T* Q = static_cast<const T*>(a.q) + b * a.qs[0] + h * a.qs[1];
  const T* K = static_cast<const T*>(a.k) + b * a.ks[0] + h * a.ks[1];
  const T* V = static_cast<const T*>(a.v) + b * a.vs[0] + h * a.vs[1];
  const int64_t off = a.lk - a.lq;
  const float sl2 = a.scale * kLog2e;  // scores in log2 units

  load_tile<T, D>(sq, Q, a.qs[2], q0, a.lq);
  load_tile<T, D>(kbuf(0), K, a.ks[2], 0, a.lk);
  load_tile<T, D>(vbuf(0), V, a.vs[2], 0, a.lk);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  unsigned qf[D / 16][4];
#pragma unroll
  for (int k = 0; k < D / 16; ++k) load_a<D>(qf[k], sq, warp * 16, k * 16);

  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int64_t row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  // Keys past the block's last row are masked for every row when causal.
  const int64_t kend = a.causal ? min(a.lk, q0 + kTile + off) : a.lk;
  for (int64_t k0 = 0, it = 0; k0 < kend; k0 += kTile, ++it) {
    // This tile's loads have landed (the prologue's, or the previous iteration's prefetch), and
    // every warp is done with the buffer the next prefetch overwrites (the tile before this).
    cp_async_wait_all();
    __syncthreads();
    if (k0 + kTile < kend) {  // prefetch the next tile while this one is computed
      load_tile<T, D>(kbuf(it + 1), K, a.ks[2], k0 + kTile, a.lk);
      load_tile<T, D>(vbuf(it + 1), V, a.vs[2], k0 + kTile, a.lk);
      cp_async_commit();
    }
    const T* sk = kbuf(it);
    const T* sv = vbuf(it);
    float s[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int k = 0; k < D / 16; ++k)
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        unsigned kb[4];
        load_b_nk<D>(kb, sk, np * 16, k * 16);
        mma<T>(s[2 * np], qf[k], kb[0], kb[1]);
        mma<T>(s[2 * np + 1], qf[k], kb[2], kb[3]);
      }
    // Scale and mask; the running max and sum.
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t col = k0 + n * 8 + 2 * t + (e & 1), r = row[e >> 1];
        const bool masked = col >= a.lk || (a.causal && col > r + off);
        s[n][e] = masked ? -INFINITY : s[n][e] * sl2;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
      }
    float corr[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = quad_max(mx[i]);
      // A row that has seen only masked keys so far keeps max -inf: nothing to rescale.
      corr[i] = mx[i] == -INFINITY ? 1.f : exp2f(m[i] - mx[i]);
      m[i] = mx[i];
      l[i] *= corr[i];
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= corr[0];
      o[n][1] *= corr[0];
      o[n][2] *= corr[1];
      o[n][3] *= corr[1];
    }
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float mi = m[e >> 1];
        s[n][e] = mi == -INFINITY ? 0.f : exp2f(s[n][e] - mi);
        l[e >> 1] += s[n][e];
      }
    // O += P·V, P (16 × 64) from s's registers.
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      unsigned pa[4];
      c_to_a<T>(pa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        unsigned vb[4];
        load_b_kn<D>(vb, sv, kk * 16, dn * 16);
        mma<T>(o[2 * dn], pa, vb[0], vb[1]);
        mma<T>(o[2 * dn + 1], pa, vb[2], vb[3]);
      }
    }
  }
  T* O = static_cast<T*>(a.out) + b * a.os[0] + h * a.os[1];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float li = quad_sum(l[i]);
    const float inv = li > 0.f ? 1.f / li : 0.f;
    if (row[i] >= a.lq) continue;
    T* orow = O + row[i] * a.os[2];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<unsigned*>(orow + n * 8 + 2 * t) =
          pack2<T>(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
    if (t == 0)  // natural-log units: log Σ exp(scale·s)
      a.lse[(b * a.heads + h) * a.lq + row[i]] = (m[i] + log2f(li)) / kLog2e;
  }
}

// ---- backward ----
// delta[row] = Σ_d dO[row, d]·O[row, d], one warp per row.
template <typename T, int D>
__global__ void attn_bwd_delta(AttnArgs a) {
  pdl_start();
  const int64_t rows = int64_t(gridDim.y) * a.lq;  // (batch·heads) × lq
  const int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t bh = blockIdx.y, b = bh / a.heads, h = bh % a.heads;
  if (r >= a.lq) return;
  (void)rows;
  const T* O = static_cast<const T*>(a.o) + b * a.os[0] + h * a.os[1] + r * a.os[2];
  const T* G = static_cast<const T*>(a.dout) + b * a.dos[0] + h * a.dos[1] + r * a.dos[2];
  float s = 0.f;
  for (int d = lane; d < D; d += 32) s += float(O[d]) * float(G[d]);
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
  if (lane == 0) a.delta[bh * a.lq + r] = s;
}

// dK and dV of one key tile: each warp owns 16 keys and walks the query tiles.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attn_bwd_dkdv(AttnArgs a) {
  pdl_start();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kLd = Smem<D>::kLd;
  T* sk = reinterpret_cast<T*>(smem_raw);
  T* sv = sk + kTile * kLd;
  T* sq = sv + kTile * kLd;
  T* sg = sq + kTile * kLd;  // dO
  float* slse = reinterpret_cast<float*>(sg + kTile * kLd);
  float* sdelta = slse + kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t bh = blockIdx.y, b = bh / a.heads, h = bh % a.heads;
  const int64_t k0 = int64_t(blockIdx.x) * kTile, off = a.lk - a.lq;
  const T* Q = static_cast<const T*>(a.q) + b * a.qs[0] + h * a.qs[1];
  const T* K = static_cast<const T*>(a.k) + b * a.ks[0] + h * a.ks[1];
  const T* V = static_cast<const T*>(a.v) + b * a.vs[0] + h * a.vs[1];
  const T* G = static_cast<const T*>(a.dout) + b * a.dos[0] + h * a.dos[1];
  const float* lse = a.lse + bh * a.lq;
  const float* delta = a.delta + bh * a.lq;
  const float sl2 = a.scale * kLog2e;

  load_tile<T, D>(sk, K, a.ks[2], k0, a.lk);
  load_tile<T, D>(sv, V, a.vs[2], k0, a.lk);
  cp_async_commit();
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;
  const int64_t key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
  // Causal: query i sees key j when i >= j - off; the tile's first key needs i >= k0 - off.
  const int64_t first = (k0 - off) / kTile * kTile;
  const int64_t qstart = a.causal && first > 0 ? first : 0;
  for (int64_t q0 = qstart; q0 < a.lq; q0 += kTile) {
    __syncthreads();
    load_tile<T, D>(sq, Q, a.qs[2], q0, a.lq);
    load_tile<T, D>(sg, G, a.dos[2], q0, a.lq);
    for (int i = threadIdx.x; i < kTile; i += kThreads) {
      const bool valid = q0 + i < a.lq;
      slse[i] = valid ? lse[q0 + i] * kLog2e : INFINITY;  // a padding row's P is 0
      sdelta[i] = valid ? delta[q0 + i] : 0.f;
    }
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for the warp's 16 keys × the tile's 64 queries.
    float st[8][4], dpt[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      unsigned ka[4], va[4];
      load_a<D>(ka, sk, warp * 16, k * 16);
      load_a<D>(va, sv, warp * 16, k * 16);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        unsigned qb[4], gb[4];
        load_b_nk<D>(qb, sq, np * 16, k * 16);
        load_b_nk<D>(gb, sg, np * 16, k * 16);
        mma<T>(st[2 * np], ka, qb[0], qb[1]);
        mma<T>(st[2 * np + 1], ka, qb[2], qb[3]);
        mma<T>(dpt[2 * np], va, gb[0], gb[1]);
        mma<T>(dpt[2 * np + 1], va, gb[2], gb[3]);
      }
    }
    // Pᵀ = exp(scale·Sᵀ - lse[query]) and dSᵀ = Pᵀ·(dPᵀ - delta[query]).
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = n * 8 + 2 * t + (e & 1);
        const int64_t j = key[e >> 1];
        const bool masked = j >= a.lk || (a.causal && j > q0 + qi + off);
        const float p = masked ? 0.f : exp2f(st[n][e] * sl2 - slse[qi]);
        st[n][e] = p;
        dpt[n][e] = p * (dpt[n][e] - sdelta[qi]);
      }
    // dV += Pᵀ·dO and dK += dSᵀ·Q (k = the tile's queries).
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      unsigned pa[4], sa[4];
      c_to_a<T>(pa, st[2 * kk], st[2 * kk + 1]);
      c_to_a<T>(sa, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        unsigned gb[4], qb[4];
        load_b_kn<D>(gb, sg, kk * 16, dn * 16);
        load_b_kn<D>(qb, sq, kk * 16, dn * 16);
        mma<T>(dv[2 * dn], pa, gb[0], gb[1]);
        mma<T>(dv[2 * dn + 1], pa, gb[2], gb[3]);
        mma<T>(dk[2 * dn], sa, qb[0], qb[1]);
        mma<T>(dk[2 * dn + 1], sa, qb[2], qb[3]);
      }
    }
  }
  cp_async_wait_all();  // a tile range with no query tile still committed the K, V load
  T* dK = static_cast<T*>(a.dk) + b * a.dks[0] + h * a.dks[1];
  T* dV = static_cast<T*>(a.dv) + b * a.dvs[0] + h * a.dvs[1];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (key[i] >= a.lk) continue;
    T* krow = dK + key[i] * a.dks[2];
    T* vrow = dV + key[i] * a.dvs[2];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<unsigned*>(krow + n * 8 + 2 * t) =
          pack2<T>(dk[n][2 * i] * a.scale, dk[n][2 * i + 1] * a.scale);
      *reinterpret_cast<unsigned*>(vrow + n * 8 + 2 * t) = pack2<T>(dv[n][2 * i], dv[n][2 * i + 1]);
    }
  }
}

// dQ of one query tile: each warp owns 16 queries and walks the key tiles.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attn_bwd_dq(AttnArgs a) {
  pdl_start();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kLd = Smem<D>::kLd;
  T* sq = reinterpret_cast<T*>(smem_raw);
  T* sg = sq + kTile * kLd;
  T* kv = sg + kTile * kLd;  // K and V tiles, double-buffered as in the forward
  auto kbuf = [&](int64_t i) { return kv + (2 * (i & 1)) * kTile * kLd; };
  auto vbuf = [&](int64_t i) { return kv + (2 * (i & 1) + 1) * kTile * kLd; };
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t bh = blockIdx.y, b = bh / a.heads, h = bh % a.heads;
  const int64_t q0 = int64_t(blockIdx.x) * kTile, off = a.lk - a.lq;
  const T* Q = static_cast<const T*>(a.q) + b * a.qs[0] + h * a.qs[1];
  const T* K = static_cast<const T*>(a.k) + b * a.ks[0] + h * a.ks[1];
  const T* V = static_cast<const T*>(a.v) + b * a.vs[0] + h * a.vs[1];
  const T* G = static_cast<const T*>(a.dout) + b * a.dos[0] + h * a.dos[1];
  const float sl2 = a.scale * kLog2e;

  load_tile<T, D>(sq, Q, a.qs[2], q0, a.lq);
  load_tile<T, D>(sg, G, a.dos[2], q0, a.lq);
  load_tile<T, D>(kbuf(0), K, a.ks[2], 0, a.lk);
  load_tile<T, D>(vbuf(0), V, a.vs[2], 0, a.lk);
  cp_async_commit();
  const int64_t row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  float lse2[2], dl[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const bool valid = row[i] < a.lq;
    lse2[i] = valid ? a.lse[bh * a.lq + row[i]] * kLog2e : INFINITY;
    dl[i] = valid ? a.delta[bh * a.lq + row[i]] : 0.f;
  }
  float dq[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;
  const int64_t kend = a.causal ? min(a.lk, q0 + kTile + off) : a.lk;
  for (int64_t k0 = 0, it = 0; k0 < kend; k0 += kTile, ++it) {
    cp_async_wait_all();  // as in the forward: this tile landed, the other buffer is free
    __syncthreads();
    if (k0 + kTile < kend) {
      load_tile<T, D>(kbuf(it + 1), K, a.ks[2], k0 + kTile, a.lk);
      load_tile<T, D>(vbuf(it + 1), V, a.vs[2], k0 + kTile, a.lk);
      cp_async_commit();
    }
    const T* sk = kbuf(it);
    const T* sv = vbuf(it);
    float s[8][4], dp[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      unsigned qa[4], ga[4];
      load_a<D>(qa, sq, warp * 16, k * 16);
      load_a<D>(ga, sg, warp * 16, k * 16);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        unsigned kb[4], vb[4];
        load_b_nk<D>(kb, sk, np * 16, k * 16);
        load_b_nk<D>(vb, sv, np * 16, k * 16);
        mma<T>(s[2 * np], qa, kb[0], kb[1]);
        mma<T>(s[2 * np + 1], qa, kb[2], kb[3]);
        mma<T>(dp[2 * np], ga, vb[0], vb[1]);
        mma<T>(dp[2 * np + 1], ga, vb[2], vb[3]);
      }
    }
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t col = k0 + n * 8 + 2 * t + (e & 1), r = row[e >> 1];
        const bool masked = col >= a.lk || (a.causal && col > r + off);
        const float p = masked ? 0.f : exp2f(s[n][e] * sl2 - lse2[e >> 1]);
        dp[n][e] = p * (dp[n][e] - dl[e >> 1]);  // dS
      }
    // dQ += dS·K (k = the tile's keys).
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      unsigned sa[4];
      c_to_a<T>(sa, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        unsigned kb[4];
        load_b_kn<D>(kb, sk, kk * 16, dn * 16);
        mma<T>(dq[2 * dn], sa, kb[0], kb[1]);
        mma<T>(dq[2 * dn + 1], sa, kb[2], kb[3]);
      }
    }
  }
  cp_async_wait_all();
  T* dQ = static_cast<T*>(a.dq) + b * a.dqs[0] + h * a.dqs[1];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (row[i] >= a.lq) continue;
    T* qrow = dQ + row[i] * a.dqs[2];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<unsigned*>(qrow + n * 8 + 2 * t) =
          pack2<T>(dq[n][2 * i] * a.scale, dq[n][2 * i + 1] * a.scale);
  }
}

void strides_of(int64_t (&s)[3], const Tensor& t) {
  s[0] = t.stride(0);
  s[1] = t.stride(1);
  s[2] = t.stride(2);
}

AttnArgs args_of(const Tensor& q, const Tensor& k, const Tensor& v, double scale, bool causal) {
  AttnArgs a{};
  a.q = q.raw_data();
  a.k = k.raw_data();
  a.v = v.raw_data();
  strides_of(a.qs, q);
  strides_of(a.ks, k);
  strides_of(a.vs, v);
  a.heads = q.size(1);
  a.lq = q.size(2);
  a.lk = k.size(2);
  a.scale = float(scale);
  a.causal = causal;
  return a;
}

template <typename F>
void dispatch_attention(const Tensor& q, const char* op, F&& f) {
  auto by_dim = [&]<typename T>() {
    if (q.size(3) == 64) return f.template operator()<T, 64>();
    if (q.size(3) == 128) return f.template operator()<T, 128>();
    KILN_FAIL(op, " (cuda): head_dim ", q.size(3), " is not supported (64 or 128)");
  };
  if (q.dtype() == DType::f16) return by_dim.template operator()<__half>();
  if (q.dtype() == DType::bf16) return by_dim.template operator()<__nv_bfloat16>();
  KILN_FAIL(op, " (cuda): dtype ", dtype_name(q.dtype()), " is not supported (f16 or bf16)");
}

bool aligned16(const Tensor& t) {
  return (reinterpret_cast<uintptr_t>(t.raw_data()) & 15) == 0 && t.stride(0) % 8 == 0 &&
         t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0 && t.stride(3) == 1;
}

}  // namespace

bool attention_supported(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (!(q.is_cuda() && q.dim() == 4 && (q.dtype() == DType::f16 || q.dtype() == DType::bf16) &&
        (q.size(3) == 64 || q.size(3) == 128) && q.size(2) > 0 && k.size(2) > 0))
    return false;
  if (context().props.major < 8) return false;  // mma.sync m16n8k16 with bf16: sm_80+
  return aligned16(q) && aligned16(k) && aligned16(v);
}

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                       const Tensor& v, double scale, bool causal) {
  KILN_CHECK(attention_supported(q, k, v) && aligned16(out) && lse.is_contiguous() &&
                 lse.dtype() == DType::f32,
             "attention_forward (cuda): unsupported operands ", q.desc(), ", ", k.desc(), ", ",
             v.desc(), " -> ", out.desc());
  AttnArgs a = args_of(q, k, v, scale, causal);
  a.out = out.raw_data();
  strides_of(a.os, out);
  a.lse = static_cast<float*>(lse.raw_data());
  dispatch_attention(q, "attention_forward", [&]<typename T, int D>() {
    const int smem = 5 * kTile * Smem<D>::kLd * int(sizeof(T));  // Q, K and V twice
    allow_smem_once<attn_fwd<T, D>>(smem, "attention_forward");
    const dim3 grid(unsigned((a.lq + kTile - 1) / kTile), unsigned(q.size(0) * q.size(1)));
    launch(attn_fwd<T, D>, grid, kThreads, size_t(smem), current_stream(), a);
  });
}

void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                        const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, double scale, bool causal) {
  KILN_CHECK(attention_supported(q, k, v) && aligned16(dout) && aligned16(out) &&
                 aligned16(dq) && aligned16(dk) && aligned16(dv),
             "attention_backward (cuda): unsupported operands ", q.desc(), ", dout ",
             dout.desc());
  AttnArgs a = args_of(q, k, v, scale, causal);
  a.o = out.raw_data();
  a.dout = dout.raw_data();
  a.dq = dq.raw_data();
  a.dk = dk.raw_data();
  a.dv = dv.raw_data();
  strides_of(a.os, out);
  strides_of(a.dos, dout);
  strides_of(a.dqs, dq);
  strides_of(a.dks, dk);
  strides_of(a.dvs, dv);
  a.lse = static_cast<float*>(lse.raw_data());
  Tensor delta = empty({q.size(0) * q.size(1) * a.lq}, TensorOptions(DType::f32).with_device(q.device()));
  a.delta = static_cast<float*>(delta.raw_data());
  const unsigned bh = unsigned(q.size(0) * q.size(1));
  const cudaStream_t stream = current_stream();
  dispatch_attention(q, "attention_backward", [&]<typename T, int D>() {
    launch(attn_bwd_delta<T, D>, dim3(unsigned((a.lq + kWarps - 1) / kWarps), bh), kThreads, 0,
           stream, a);
    const int smem_kv = 4 * kTile * Smem<D>::kLd * int(sizeof(T)) + 2 * kTile * int(sizeof(float));
    allow_smem_once<attn_bwd_dkdv<T, D>>(smem_kv, "attention_backward");
    launch(attn_bwd_dkdv<T, D>, dim3(unsigned((a.lk + kTile - 1) / kTile), bh), kThreads,
           size_t(smem_kv), stream, a);
    const int smem_q = 6 * kTile * Smem<D>::kLd * int(sizeof(T));  // Q, dO, K and V twice
    allow_smem_once<attn_bwd_dq<T, D>>(smem_q, "attention_backward");
    launch(attn_bwd_dq<T, D>, dim3(unsigned((a.lq + kTile - 1) / kTile), bh), kThreads,
           size_t(smem_q), stream, a);
  });
}

}  // namespace kiln::cuda
