// Batch norm on f16 NHWC activations, the forward passes (contract in cuda/kernels.h): the
// statistics finalized into scale and shift, then y = x·scale + shift (+ z) (ReLU), the two batch
// norms meeting at the residual add, and the ResNet stem's batch norm + ReLU + max pool. Shared
// helpers in bn_nhwc.cuh.
#include "cuda/kernels/bn_nhwc.cuh"

namespace kiln::cuda {
namespace {

// ---- forward ----

// BnStatsFinalize as raw pointers (null: undefined); sum == nullptr: nothing to finalize, the
// scale_shift is an input.
struct Finalize {
  float *mean = nullptr, *invstd = nullptr, *scale_shift = nullptr, *rm = nullptr, *rv = nullptr;
  const float *sum = nullptr, *sqsum = nullptr, *w = nullptr, *b = nullptr;
  int64_t* counter = nullptr;
  double n = 0, momentum = 0, eps = 0;
};

// One thread per channel, in double; thread 0 also counts.
__global__ void finalize_kernel(Finalize f, int64_t C) {
  pdl_start();
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t == 0 && f.counter != nullptr) ++*f.counter;
  for (int64_t c = t; c < C; c += int64_t(gridDim.x) * blockDim.x) {
    const double mu = double(f.sum[c]) / f.n;
    const double var = fmax(double(f.sqsum[c]) / f.n - mu * mu, 0.0);
    const double k = 1.0 / sqrt(var + f.eps);
    const double scale = (f.w != nullptr ? double(f.w[c]) : 1.0) * k;
    f.mean[c] = float(mu);
    f.invstd[c] = float(k);
    f.scale_shift[c] = float(scale);
    f.scale_shift[C + c] = float((f.b != nullptr ? double(f.b[c]) : 0.0) - mu * scale);
    if (f.rm != nullptr) {
      f.rm[c] = float((1.0 - f.momentum) * double(f.rm[c]) + f.momentum * mu);
      f.rv[c] = float((1.0 - f.momentum) * double(f.rv[c]) + f.momentum * var * f.n / (f.n - 1.0));
    }
  }
}

// The scale and shift of vector i's 8 channels.
__device__ inline void factors8(const float* ss, int64_t i, int64_t G, int64_t C, Vec8& sc,
                                Vec8& sh) {
  const int64_t c0 = (i % G) * kVec;
  sc = load8f(ss + c0);
  sh = load8f(ss + C + c0);
}

// NaN stays NaN through the ReLU (a comparison with NaN is false).
__device__ inline float relu_keep_nan(float v) { return v < 0.f ? 0.f : v; }

// A grid-stride loop over 16-byte vectors keeps each thread on one group of 8 channels when
// the stride is a multiple of G (vectors per row) — always for ResNet's channel counts — so the
// per-channel factors are loaded once, not per vector.
template <Activation kAct, bool kAdd>
__global__ void apply_kernel(uint4* __restrict__ y, const uint4* __restrict__ x,
                             const uint4* __restrict__ z, const float* __restrict__ ss,
                             uint8_t* __restrict__ mask, int64_t vecs, int64_t G, int64_t C) {
  pdl_start();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const bool fixed = stride % G == 0;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= vecs) return;
  Vec8 sc, sh;
  factors8(ss, i, G, C, sc, sh);
  for (; i < vecs; i += stride) {
    if (!fixed) factors8(ss, i, G, C, sc, sh);
    Vec8 v = load8(x, i);
    Vec8 r;
    if constexpr (kAdd) r = load8(z, i);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float a = fmaf(v.v[j], sc.v[j], sh.v[j]);
      if constexpr (kAdd) a += r.v[j];
      if constexpr (kAct == Activation::Relu) a = relu_keep_nan(a);
      if constexpr (kAct == Activation::Gelu) a = math::unary_apply(UnaryOp::Gelu, a, 0.f);
      v.v[j] = a;
    }
    store8(y, i, v);
    if constexpr (kAct == Activation::Relu && kAdd) {
      unsigned bits = 0;
#pragma unroll
      for (int j = 0; j < kVec; ++j) bits |= unsigned(v.v[j] > 0.f) << j;
      mask[i] = uint8_t(bits);
    }
  }
}

// ---- two batch norms meeting at the residual add ----

__global__ void dual_apply_kernel(uint4* __restrict__ y, const uint4* __restrict__ x,
                                  const float* __restrict__ ssx, const uint4* __restrict__ r,
                                  const float* __restrict__ ssr, uint8_t* __restrict__ mask,
                                  int64_t vecs, int64_t G, int64_t C) {
  pdl_start();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const bool fixed = stride % G == 0;  // as in apply_kernel
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= vecs) return;
  Vec8 a1, b1, a2, b2;
  auto load_factors = [&](int64_t v) {
    factors8(ssx, v, G, C, a1, b1);
    factors8(ssr, v, G, C, a2, b2);
  };
  load_factors(i);
  for (; i < vecs; i += stride) {
    if (!fixed) load_factors(i);
    Vec8 v = load8(x, i);
    const Vec8 u = load8(r, i);
    unsigned bits = 0;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float a = relu_keep_nan(fmaf(v.v[j], a1.v[j], b1.v[j]) + fmaf(u.v[j], a2.v[j], b2.v[j]));
      bits |= unsigned(a > 0.f) << j;
      v.v[j] = a;
    }
    store8(y, i, v);
    mask[i] = uint8_t(bits);
  }
}

// ---- batch norm + ReLU + 3x3/2 max pool (the ResNet stem) ----

// x's raw f16 bits at each of 8 channels' maxima (positions pos[j] 0-8 of the 3x3/2 window of
// output (oh, ow); channels c0..c0 + 7): what the backward's sums read instead of all of x
// (at_max in cuda/kernels.h). The loads hit the rows the kernel has just read (L1 / L2).
__device__ inline uint4 x_at_max(const uint4* __restrict__ x, int64_t n, int H, int W, int64_t C,
                                 int64_t c0, int oh, int ow, const unsigned (&pos)[kVec]) {
  const unsigned short* xh = reinterpret_cast<const unsigned short*>(x);
  unsigned w32[kVec / 2];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const int h = 2 * oh - 1 + int(pos[j]) / 3, w = 2 * ow - 1 + int(pos[j]) % 3;
    const unsigned b = xh[((n * H + h) * W + w) * C + c0 + j];
    w32[j / 2] = j % 2 ? w32[j / 2] | (b << 16) : b;
  }
  return make_uint4(w32[0], w32[1], w32[2], w32[3]);
}

// y = max_pool2d(relu(x·scale + shift), 3x3, stride 2, pad 1) and the window position (0-8) of
// each maximum, bit for bit what apply_kernel<true, false> followed by max_pool_fwd_nhwc give:
// each normalised value is rounded to f16 before the comparison, positions are visited in the
// same order with the same rule (first valid, then NaN over a number, then strictly greater).
// The normalised tensor itself is never written. Thread: one output pixel's 8 channels; grid
// (ceil(OH·OW·G / kBlock), N) keeps the index arithmetic in 32 bits; the 9 loads are issued
// before any is used. The kernel is bound by its instructions (72 normalise-round-compare steps
// per thread), not by memory: comparing f16 keys instead of floats and 3 blocks per SM (80
// registers) took it from 406 to 310 µs on the ResNet-50 stem at batch 256 (docs/lab/stem.md, v13).
__global__ void __launch_bounds__(kBlock, 3)
    relu_max_pool_k3s2_kernel(uint4* __restrict__ y, uint2* __restrict__ idx,
                              uint4* __restrict__ at_max, const uint4* __restrict__ x,
                              const float* __restrict__ scale_shift, int H, int W, int OH, int OW,
                              int G) {
  pdl_start();
  const int t = int(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= OH * OW * G) return;
  const int g = t % G, pix = t / G, ow = pix % OW, oh = pix / OW;
  const int64_t n = blockIdx.y, C = int64_t(G) * kVec;
  const Vec8 sc = load8f(scale_shift + g * kVec), sh = load8f(scale_shift + C + g * kVec);
  uint4 raw[9];
  bool valid[9];
#pragma unroll
  for (int k = 0; k < 9; ++k) {
    const int h = 2 * oh - 1 + k / 3, w = 2 * ow - 1 + k % 3;
    valid[k] = h >= 0 && h < H && w >= 0 && w < W;
    if (valid[k]) raw[k] = x[((n * H + h) * W + w) * G + g];
  }
  // The comparison runs on the f16 bits with the sign cleared: after the ReLU a value is +0,
  // -0 (kept, as relu_keep_nan keeps it), positive or NaN (one bit pattern once rounded to f16),
  // so this key orders them as max_pool_fwd_nhwc's float comparison does — ±0 tie, NaN above
  // every number, NaNs tie — and a strictly greater key takes over: first position wins ties.
  // (A NaN is stored as rounded; the unfused pool passes it through float and back, which may
  // change its sign or payload bits. Numbers are identical.)
  int key[kVec];
  unsigned bits[kVec], arg[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    key[j] = -1;  // below every key: the first valid position always takes over
    bits[j] = 0xfc00u;  // -inf, as max_pool_fwd_nhwc for a window without input (not reached)
    arg[j] = 0xffu;
  }
#pragma unroll
  for (int k = 0; k < 9; ++k) {
    if (!valid[k]) continue;
    const __half2* hv = reinterpret_cast<const __half2*>(&raw[k]);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float2 f2 = __half22float2(hv[j / 2]);
      const float a = relu_keep_nan(fmaf(j % 2 ? f2.y : f2.x, sc.v[j], sh.v[j]));
      const unsigned h = __half_as_ushort(__float2half_rn(a));
      const int kk = int(h & 0x7fffu);
      if (kk > key[j]) {
        key[j] = kk;
        bits[j] = h;
        arg[j] = unsigned(k);
      }
    }
  }
  uint4 out;
  uint2 packed{0u, 0u};
  unsigned* ow32 = reinterpret_cast<unsigned*>(&out);
#pragma unroll
  for (int j = 0; j < kVec / 2; ++j) ow32[j] = bits[2 * j] | (bits[2 * j + 1] << 16);
#pragma unroll
  for (int j = 0; j < kVec; ++j) (j < 4 ? packed.x : packed.y) |= arg[j] << (8 * (j % 4));
  const int64_t o = (n * OH + oh) * int64_t(OW) * G + int64_t(ow) * G + g;
  y[o] = out;
  idx[o] = packed;
  if (at_max != nullptr) at_max[o] = x_at_max(x, n, H, W, C, int64_t(g) * kVec, oh, ow, arg);
}

// The same output and positions from 8 × 8-output tiles (KILN_STEM_POOL_TILE, on): a block
// normalises its 17 × 17-pixel input tile once into shared memory — relu(x·scale + shift) rounded
// to f16, what the per-output kernel compares — and then compares each output's 9 stored values
// with the per-output kernel's rule, so the bits are the same. Each input value is normalised
// 289 / 256 = 1.13 times instead of 2.25, and the comparisons run on two channels at once: the
// key (f16 bits, sign cleared) of two channels as one u16x2 word, max.u16x2 against the best so
// far, and a lane that grew (strictly greater: the first position keeps a tie) takes the new bits
// and position. kGC channel vectors (8 channels each) per block: 8, 4, 2 or 1, the largest that
// divides C / 8. Grid (tiles across × tiles down, N, C / 8 / kGC).
constexpr int kPoolTile = 8, kPoolIn = 2 * kPoolTile + 1, kPoolThreads = 256;

// Lanes of a u16x2 word that are not zero, as 0xffff lanes. Each lane is at most 0x7fff, so adding
// 0x7fff sets its bit 15 exactly when it is not zero, and carries nothing into the next lane.
__device__ inline unsigned nonzero_lanes(unsigned d) {
  return (((d + 0x7fff7fffu) & 0x80008000u) >> 15) * 0xffffu;
}

// kRaw (KILN_STEM_POOL_RAW_TILE, on; with at_max and kGC ≤ 4): the input tile is also kept as it
// was read, and at_max takes x at each maximum from there instead of from global memory (8
// scattered 2-byte loads an output). The same bits either way.
template <int kGC, bool kRaw>
__global__ void __launch_bounds__(kPoolThreads)
    relu_max_pool_k3s2_tiled_kernel(uint4* __restrict__ y, uint2* __restrict__ idx,
                                    uint4* __restrict__ at_max, const uint4* __restrict__ x,
                                    const float* __restrict__ scale_shift, int H, int W, int OH,
                                    int OW, int G, int tiles_w) {
  pdl_start();
  static_assert(!kRaw || kGC <= 4, "two tiles of 8 channel vectors exceed 48 KB");
  __shared__ uint4 tile[kPoolIn * kPoolIn * kGC];
  __shared__ uint4 raw_tile[kRaw ? kPoolIn * kPoolIn * kGC : 1];
  const int tid = threadIdx.x;
  const int oh0 = int(blockIdx.x) / tiles_w * kPoolTile;
  const int ow0 = int(blockIdx.x) % tiles_w * kPoolTile;
  const int64_t n = blockIdx.y, C = int64_t(G) * kVec;
  const int g0 = int(blockIdx.z) * kGC;
  // A thread's channel vector is the same in both phases (kPoolThreads is a multiple of kGC).
  const int gl = tid % kGC;
  {
    const Vec8 sc = load8f(scale_shift + (g0 + gl) * kVec);
    const Vec8 sh = load8f(scale_shift + C + (g0 + gl) * kVec);
    constexpr int kCount = kPoolIn * kPoolIn * kGC;
    constexpr int kLoads = (kCount + kPoolThreads - 1) / kPoolThreads;
    uint4 raw[kLoads];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {  // every load issued before any value is used
      const int i = tid + l * kPoolThreads, p = i / kGC;
      const int h = 2 * oh0 - 1 + p / kPoolIn, w = 2 * ow0 - 1 + p % kPoolIn;
      raw[l] = make_uint4(0, 0, 0, 0);
      if (i < kCount && h >= 0 && h < H && w >= 0 && w < W)
        raw[l] = x[((n * H + h) * W + w) * G + g0 + gl];
    }
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int i = tid + l * kPoolThreads;
      if (i >= kCount) break;
      // Padding positions are normalised too (from zeros) but never compared: the second phase
      // skips positions outside the image as the per-output kernel does.
      if constexpr (kRaw) raw_tile[i] = raw[l];
      const __half2* hv = reinterpret_cast<const __half2*>(&raw[l]);
      uint4 out;
      unsigned* o32 = reinterpret_cast<unsigned*>(&out);
#pragma unroll
      for (int j = 0; j < kVec / 2; ++j) {
        const float2 f2 = __half22float2(hv[j]);
        const float a = relu_keep_nan(fmaf(f2.x, sc.v[2 * j], sh.v[2 * j]));
        const float b = relu_keep_nan(fmaf(f2.y, sc.v[2 * j + 1], sh.v[2 * j + 1]));
        o32[j] = unsigned(__half_as_ushort(__float2half_rn(a))) |
                 (unsigned(__half_as_ushort(__float2half_rn(b))) << 16);
      }
      tile[i] = out;
    }
  }
  __syncthreads();
  for (int o = tid; o < kPoolTile * kPoolTile * kGC; o += kPoolThreads) {
    const int q = o / kGC, toh = q / kPoolTile, tow = q % kPoolTile;
    const int oh = oh0 + toh, ow = ow0 + tow;
    if (oh >= OH || ow >= OW) continue;
    // The first position inside the image takes the values; then a strictly greater key.
    const int kh0 = oh == 0 ? 1 : 0, kw0 = ow == 0 ? 1 : 0;
    const bool row2 = 2 * oh + 1 < H, col2 = 2 * ow + 1 < W;  // window row / column 2 inside
    auto at = [&](int kh, int kw) {
      return tile[((2 * toh + kh) * kPoolIn + 2 * tow + kw) * kGC + gl];
    };
    const uint4 first = at(kh0, kw0);
    unsigned bits[4] = {first.x, first.y, first.z, first.w};
    unsigned key[4], arg[4];
    const unsigned k0 = unsigned(kh0 * 3 + kw0) * 0x00010001u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      key[j] = bits[j] & 0x7fff7fffu;
      arg[j] = k0;
    }
#pragma unroll
    for (int k = 0; k < 9; ++k) {
      const int kh = k / 3, kw = k % 3;
      if (kh < kh0 || kw < kw0 || k == kh0 * 3 + kw0) continue;  // before the first, or it
      if ((kh == 2 && !row2) || (kw == 2 && !col2)) continue;
      const uint4 v = at(kh, kw);
      const unsigned h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const unsigned kk = h[j] & 0x7fff7fffu;
        const unsigned m = __vmaxu2(kk, key[j]);
        const unsigned grew = nonzero_lanes(m ^ key[j]);
        key[j] = m;
        bits[j] = (h[j] & grew) | (bits[j] & ~grew);
        arg[j] = (unsigned(k) * 0x00010001u & grew) | (arg[j] & ~grew);
      }
    }
    const int64_t out = (n * OH + oh) * int64_t(OW) * G + int64_t(ow) * G + g0 + gl;
    y[out] = make_uint4(bits[0], bits[1], bits[2], bits[3]);
    // Positions 0-8, one byte a channel: bytes 0 and 2 of each word's two lanes.
    idx[out] =
        make_uint2(__byte_perm(arg[0], arg[1], 0x6420), __byte_perm(arg[2], arg[3], 0x6420));
    if constexpr (kRaw) {
      // Channel j's position k = kh·3 + kw is tile pixel (2·toh + kh, 2·tow + kw).
      const unsigned short* rt = reinterpret_cast<const unsigned short*>(raw_tile);
      unsigned w32[kVec / 2];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const int k = int((arg[j / 2] >> (16 * (j % 2))) & 0xffffu), kh = k / 3, kw = k - 3 * kh;
        const unsigned v = rt[(((2 * toh + kh) * kPoolIn + 2 * tow + kw) * kGC + gl) * kVec + j];
        w32[j / 2] = j % 2 ? w32[j / 2] | (v << 16) : v;
      }
      at_max[out] = make_uint4(w32[0], w32[1], w32[2], w32[3]);
    } else if (at_max != nullptr) {
      unsigned pos[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) pos[j] = (arg[j / 2] >> (16 * (j % 2))) & 0xffffu;
      at_max[out] = x_at_max(x, n, H, W, C, int64_t(g0 + gl) * kVec, oh, ow, pos);
    }
  }
}

// ---- host side ----

// f's pointers, checked against x's channels.
Finalize finalize_args(const BnStatsFinalize& f, const Tensor& x, const char* op) {
  const int64_t C = x.size(1);
  Finalize d;
  d.scale_shift =
      required(f32_ptr(f.scale_shift, 2 * C, x, op, "scale_shift"), op, "scale_shift");
  if (!f.sum.defined()) return d;
  KILN_CHECK(f.count > 1, op, " (cuda): needs more than one value per channel, got ", f.count);
  d.mean = required(f32_ptr(f.save_mean, C, x, op, "save_mean"), op, "save_mean");
  d.invstd = required(f32_ptr(f.save_invstd, C, x, op, "save_invstd"), op, "save_invstd");
  d.sum = required(f32_ptr(f.sum, C, x, op, "sum"), op, "sum");
  d.sqsum = required(f32_ptr(f.sqsum, C, x, op, "sqsum"), op, "sqsum");
  d.w = f32_ptr(f.weight, C, x, op, "weight");
  d.b = f32_ptr(f.bias, C, x, op, "bias");
  d.rm = f32_ptr(f.running_mean, C, x, op, "running_mean");
  d.rv = f32_ptr(f.running_var, C, x, op, "running_var");
  KILN_CHECK((d.rm == nullptr) == (d.rv == nullptr), op,
             " (cuda): running_mean and running_var must be given together");
  if (f.counter.defined()) {
    KILN_CHECK(f.counter.dtype() == DType::i64 && f.counter.numel() == 1 &&
                   f.counter.device() == x.device(),
               op, " (cuda): counter must be one i64 value on ", x.device(), ", got ",
               f.counter.desc());
    d.counter = static_cast<int64_t*>(f.counter.raw_data());
  }
  d.n = double(f.count);
  d.momentum = f.momentum;
  d.eps = f.eps;
  return d;
}

// f finalized (when it has statistics); its scale_shift is then the apply kernels' input.
// Finalizing inside the apply kernels, each block into shared memory, made them 11 µs slower
// per call (docs/lab/batch-norm.md): their 4 waves of blocks each paid the double-precision
// arithmetic's latency.
const float* finalized(const Finalize& f, int64_t C) {
  if (f.sum != nullptr) {
    launch(finalize_kernel, grid_for(C), kBlock, 0, current_stream(), f, C);
    KILN_CUDA_CHECK_LAUNCH();
  }
  return f.scale_shift;
}

}  // namespace

void bn_nhwc_finalize(const BnStatsFinalize& f) {
  const char* op = "bn_nhwc_finalize";
  KILN_CHECK(f.sum.defined() && f.sum.is_cuda() && f.sum.dim() == 1, op,
             " (cuda): sum must be a CUDA vector, got ", f.sum.defined() ? f.sum.desc() : "undefined");
  const int64_t C = f.sum.numel();
  // finalize_args checks the channel count against x's dimension 1: a (1, C) view of sum.
  const Finalize d = finalize_args(f, f.sum.reshape({1, C}), op);
  launch(finalize_kernel, grid_for(C), kBlock, 0, current_stream(), d, C);
  KILN_CUDA_CHECK_LAUNCH();
}

void bn_nhwc_apply(const Tensor& y, const Tensor& x, const Tensor& z, const BnStatsFinalize& f,
                   Activation act, const Tensor& mask) {
  const char* op = "bn_nhwc_apply";
  check_x(x, op);
  check_act(y, x, op, "y");
  if (z.defined()) check_act(z, x, op, "z");
  KILN_CHECK(!(act == Activation::Gelu && z.defined()), op,
             " (cuda): GELU with a residual is not a fused case");
  const bool relu = act == Activation::Relu;
  const int64_t C = x.size(1), G = C / kVec, vecs = x.numel() / kVec;
  uint8_t* mp = relu && z.defined() ? mask_ptr(mask, vecs, x, op) : nullptr;
  if (vecs == 0) return;
  const float* ss = finalized(finalize_args(f, x, op), C);
  const unsigned grid = grid_for(vecs);
  cudaStream_t s = current_stream();
  const uint4* zp = z.defined() ? vec_in(z) : nullptr;
  auto apply = [&](auto kernel) {
    launch(kernel, grid, kBlock, 0, s, vec_out(y), vec_in(x), zp, ss, mp, vecs, G, C);
  };
  if (relu && z.defined())
    apply(apply_kernel<Activation::Relu, true>);
  else if (relu)
    apply(apply_kernel<Activation::Relu, false>);
  else if (act == Activation::Gelu)
    apply(apply_kernel<Activation::Gelu, false>);
  else if (z.defined())
    apply(apply_kernel<Activation::None, true>);
  else
    apply(apply_kernel<Activation::None, false>);
  KILN_CUDA_CHECK_LAUNCH();
}

void bn_nhwc_dual_apply(const Tensor& y, const Tensor& x, const BnStatsFinalize& f_x,
                        const Tensor& r, const BnStatsFinalize& f_r, const Tensor& mask) {
  const char* op = "bn_nhwc_dual_apply";
  check_x(x, op);
  check_act(y, x, op, "y");
  check_act(r, x, op, "r");
  const int64_t C = x.size(1), G = C / kVec, vecs = x.numel() / kVec;
  uint8_t* mp = mask_ptr(mask, vecs, x, op);
  if (vecs == 0) return;
  const float* ssx = finalized(finalize_args(f_x, x, op), C);
  const float* ssr = finalized(finalize_args(f_r, x, op), C);
  launch(dual_apply_kernel, grid_for(vecs), kBlock, 0, current_stream(), vec_out(y), vec_in(x), ssx,
         vec_in(r), ssr, mp, vecs, G, C);
  KILN_CUDA_CHECK_LAUNCH();
}

namespace {
constinit RuntimeSwitch g_stem_pool_tile{&Switches::stem_pool_tile};  // KILN_STEM_POOL_TILE
}  // namespace

bool stem_pool_tile_enabled() { return g_stem_pool_tile.get(); }
void set_stem_pool_tile_enabled(bool on) { g_stem_pool_tile.set(on); }

namespace {
constinit RuntimeSwitch g_stem_pool_at_max{&Switches::stem_pool_at_max};  // KILN_STEM_POOL_AT_MAX
constinit RuntimeSwitch g_stem_pool_raw_tile{
    &Switches::stem_pool_raw_tile};  // KILN_STEM_POOL_RAW_TILE
}  // namespace

bool stem_pool_at_max_enabled() { return g_stem_pool_at_max.get(); }
void set_stem_pool_at_max_enabled(bool on) { g_stem_pool_at_max.set(on); }
bool stem_pool_raw_tile_enabled() { return g_stem_pool_raw_tile.get(); }
void set_stem_pool_raw_tile_enabled(bool on) { g_stem_pool_raw_tile.set(on); }

void bn_nhwc_relu_max_pool(const Tensor& y, const Tensor& indices, const Tensor& at_max,
                           const Tensor& x, const Tensor& scale_shift) {
  const char* op = "bn_nhwc_relu_max_pool";
  check_x(x, op);
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t OH = (H - 1) / 2 + 1, OW = (W - 1) / 2 + 1;  // 3x3, stride 2, pad 1
  const Shape out{N, C, OH, OW};
  check_pooled(y, DType::f16, out, x, op, "y");
  check_pooled(indices, DType::u8, out, x, op, "indices");
  if (at_max.defined()) check_pooled(at_max, DType::f16, out, x, op, "at_max");
  uint4* am = at_max.defined() ? vec_out(at_max) : nullptr;
  KILN_CHECK(N <= 65535 && OH * OW * (C / kVec) < (int64_t(1) << 31), op,
             " (cuda): x ", x.desc(), " is too large for this kernel");
  const float* ss = required(f32_ptr(scale_shift, 2 * C, x, op, "scale_shift"), op, "scale_shift");
  if (y.numel() == 0) return;
  const int G = int(C / kVec);
  if (stem_pool_tile_enabled()) {
    const int tiles_w = int((OW + kPoolTile - 1) / kPoolTile);
    const int tiles = tiles_w * int((OH + kPoolTile - 1) / kPoolTile);
    auto go = [&]<int kGC, bool kRaw = false>() {
      const dim3 grid{unsigned(tiles), unsigned(N), unsigned(G / kGC)};
      launch(relu_max_pool_k3s2_tiled_kernel<kGC, kRaw>, grid, kPoolThreads, 0, current_stream(),
             vec_out(y), static_cast<uint2*>(indices.raw_data()), am, vec_in(x), ss, int(H), int(W),
             int(OH), int(OW), G, tiles_w);
    };
    // With at_max, 4 channel vectors a block and the raw tile beside the normalised one.
    if (am != nullptr && g_stem_pool_raw_tile.get() && G % 4 == 0)
      go.template operator()<4, true>();
    else if (am != nullptr && g_stem_pool_raw_tile.get() && G % 2 == 0)
      go.template operator()<2, true>();
    else if (am != nullptr && g_stem_pool_raw_tile.get())
      go.template operator()<1, true>();
    else if (G % 8 == 0)
      go.template operator()<8>();
    else if (G % 4 == 0)
      go.template operator()<4>();
    else if (G % 2 == 0)
      go.template operator()<2>();
    else
      go.template operator()<1>();
  } else {
    const dim3 grid{grid_for(OH * OW * G), unsigned(N)};
    launch(relu_max_pool_k3s2_kernel, grid, kBlock, 0, current_stream(), vec_out(y),
           static_cast<uint2*>(indices.raw_data()), am, vec_in(x), ss, int(H), int(W), int(OH),
           int(OW), G);
  }
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda
