// Sync batch norm's local passes (entry points in cuda/kernels.h).
//
// Per-channel sums run in two kernels: blocks write partial sums (2, parts, C) over a fixed split
// of the rows, then one thread per output adds a channel's partials in order. The split depends
// only on the shape and the device, so the sums are bit-reproducible (a replayed CUDA graph
// matches eager execution) — no atomics.
//
// A dense x is walked either with channels innermost, as (N·S, C) row-major (NHWC, or no
// spatial dims): a block covers 32 channels × 8 rows per step, a warp reading 32 neighbouring
// channels; or with channels outer, as (N, C, S) (NCHW): a block per (channel, part) reading the
// channel's runs of S contiguous elements.
#include <algorithm>

#include "cuda/kernels/common.cuh"
#include "cuda/kernels/reduce.cuh"
#include "cuda/kernels.h"

namespace kiln::cuda {
namespace {

constexpr int kTile = 32;     // channels per block, channels-inner sums
constexpr int kTileRows = 8;  // rows per block step, channels-inner sums
constexpr int kMaxParts = 1024;
constexpr int kWarps = kBlock / 32;

struct Geometry {
  int64_t n = 0, c = 0, s = 1;  // x viewed as (N, C, S)
  bool inner = false;           // channels innermost in memory
};

Geometry geometry_of(const Tensor& x, const char* op) {
  KILN_CHECK(x.dtype() == DType::f32 || x.dtype() == DType::f16 || x.dtype() == DType::bf16, op,
             " (cuda): x must be f32, f16 or bf16, got ", x.desc());
  KILN_CHECK(x.dim() >= 2, op, " (cuda): x must be (N, C, ...), got ", x.desc());
  Geometry g;
  g.n = x.size(0);
  g.c = x.size(1);
  for (int64_t d = 2; d < x.dim(); ++d) g.s *= x.size(d);
  if (x.is_contiguous())
    g.inner = g.s == 1;
  else if (x.dim() == 4 && x.is_contiguous(MemoryFormat::ChannelsLast))
    g.inner = true;
  else
    KILN_FAIL(op, " (cuda): x must be dense (contiguous or channels-last), got ", x.desc());
  return g;
}

void check_like(const Tensor& t, const Tensor& x, const char* op, const char* what) {
  KILN_CHECK(
      t.defined() && t.dtype() == x.dtype() && t.device() == x.device() && dense_same_layout(t, x),
      op, " (cuda): ", what, " must match x ", x.desc(), " in dtype, device and layout, got ",
      t.defined() ? t.desc() : "undefined");
}

template <typename F>
void dispatch_data(DType t, F&& f) {
  switch (t) {
    case DType::f32:
      f.template operator()<float>();
      break;
    case DType::f16:
      f.template operator()<__half>();
      break;
    case DType::bf16:
      f.template operator()<__nv_bfloat16>();
      break;
    default:
      KILN_FAIL("sync_batch_norm (cuda): unsupported dtype ", dtype_name(t));
  }
}

// ---- per-channel sums ----

// Forward terms: (x, x²).
template <typename T>
struct StatTerms {
  const T* x;
  __device__ void channel(int64_t, float&, float&) const {}
  __device__ void add(int64_t o, float, float, float& s1, float& s2) const {
    const float v = cvt<float>(x[o]);
    s1 += v;
    s2 += v * v;
  }
};

// Backward terms: (dy, dy·x̂), x̂ = (x - mean)·invstd.
template <typename T>
struct GradTerms {
  const T* dy;
  const T* x;
  const float* mean;
  const float* invstd;
  __device__ void channel(int64_t c, float& m, float& k) const {
    m = mean[c];
    k = invstd[c];
  }
  __device__ void add(int64_t o, float m, float k, float& s1, float& s2) const {
    const float g = cvt<float>(dy[o]);
    s1 += g;
    s2 += g * (cvt<float>(x[o]) - m) * k;
  }
};

// Block (kTile, kTileRows); grid (ceil(C/kTile), parts). partial (2, parts, C).
template <typename Terms>
__global__ void sums_inner_kernel(Terms terms, float* __restrict__ partial, int64_t rows, int64_t C,
                                  int parts) {
  __shared__ float sh1[kTileRows][kTile + 1], sh2[kTileRows][kTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = int64_t(blockIdx.x) * kTile + tx;
  float s1 = 0.f, s2 = 0.f;
  if (c < C) {
    float m = 0.f, k = 1.f;
    terms.channel(c, m, k);
    for (int64_t r = int64_t(blockIdx.y) * kTileRows + ty; r < rows;
         r += int64_t(parts) * kTileRows)
      terms.add(r * C + c, m, k, s1, s2);
  }
  sh1[ty][tx] = s1;
  sh2[ty][tx] = s2;
  __syncthreads();
  if (ty == 0 && c < C) {
    for (int j = 1; j < kTileRows; ++j) {
      s1 += sh1[j][tx];
      s2 += sh2[j][tx];
    }
    partial[int64_t(blockIdx.y) * C + c] = s1;
    partial[(int64_t(parts) + blockIdx.y) * C + c] = s2;
  }
}

// Block kBlock; grid (C, parts). partial (2, parts, C).
template <typename Terms>
__global__ void sums_outer_kernel(Terms terms, float* __restrict__ partial, int64_t n, int64_t C,
                                  int64_t S, int parts) {
  __shared__ float sh1[kWarps], sh2[kWarps];
  const int64_t c = blockIdx.x;
  float m = 0.f, k = 1.f;
  terms.channel(c, m, k);
  float s1 = 0.f, s2 = 0.f;
  const int64_t total = n * S;
  for (int64_t i = int64_t(blockIdx.y) * kBlock + threadIdx.x; i < total;
       i += int64_t(parts) * kBlock) {
    const int64_t b = i / S;
    terms.add((b * C + c) * S + (i - b * S), m, k, s1, s2);
  }
  s1 = warp_sum(s1);
  s2 = warp_sum(s2);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    sh1[warp] = s1;
    sh2[warp] = s2;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    s1 = 0.f;
    s2 = 0.f;
    for (int j = 0; j < kWarps; ++j) {
      s1 += sh1[j];
      s2 += sh2[j];
    }
    partial[int64_t(blockIdx.y) * C + c] = s1;
    partial[(int64_t(parts) + blockIdx.y) * C + c] = s2;
  }
}

// out[j] (j < 2C) = Σ over parts of partial (2, parts, C), in part order; out[2C] = count when
// with_count.
__global__ void sums_finish_kernel(float* __restrict__ out, const float* __restrict__ partial,
                                   int64_t C, int parts, float count, bool with_count) {
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < 2 * C;
       j += int64_t(gridDim.x) * blockDim.x) {
    const int64_t half = j / C, c = j - half * C;
    const float* p = partial + half * parts * C + c;
    float s = 0.f;
    for (int q = 0; q < parts; ++q) s += p[int64_t(q) * C];
    out[j] = s;
  }
  if (with_count && blockIdx.x == 0 && threadIdx.x == 0) out[2 * C] = count;
}

template <typename Terms>
void channel_sums(float* out, const Geometry& g, Terms terms, bool with_count, Device dev) {
  const int64_t C = g.c, rows = g.n * g.s;
  const int64_t target = int64_t(context().props.multiProcessorCount) * 4;  // blocks in flight
  const int64_t tiles = (C + kTile - 1) / kTile;
  const int64_t per_part = g.inner ? kTileRows : kBlock;  // rows one part takes per step
  const int64_t useful = (rows + per_part - 1) / per_part;
  const int64_t blocks_per_part = g.inner ? tiles : C;
  const int parts = int(std::clamp<int64_t>((target + blocks_per_part - 1) / blocks_per_part, 1,
                                            std::clamp<int64_t>(useful, 1, kMaxParts)));
  Tensor partial = empty({2 * int64_t(parts) * C}, TensorOptions(DType::f32).with_device(dev));
  float* pp = static_cast<float*>(partial.raw_data());
  cudaStream_t s = current_stream();
  if (g.inner) {
    const dim3 grid{unsigned(tiles), unsigned(parts)}, block{kTile, kTileRows};
    sums_inner_kernel<<<grid, block, 0, s>>>(terms, pp, rows, C, parts);
  } else {
    const dim3 grid{unsigned(C), unsigned(parts)};
    sums_outer_kernel<<<grid, kBlock, 0, s>>>(terms, pp, g.n, C, g.s, parts);
  }
  KILN_CUDA_CHECK_LAUNCH();
  // partial goes back to the stream-ordered allocator after this call: the kernels below are
  // ordered after its last use on the same stream.
  sums_finish_kernel<<<grid_for(2 * C), kBlock, 0, s>>>(out, pp, C, parts, float(rows), with_count);
  KILN_CUDA_CHECK_LAUNCH();
}

// ---- per-channel statistics and elementwise passes ----

// mean, invstd and the running statistics from the global stats [Σx, Σx², n] (in double: the
// subtraction Σx²/n - mean² is where precision goes).
__global__ void stats_finish_kernel(float* __restrict__ mean, float* __restrict__ invstd,
                                    float* __restrict__ rm, float* __restrict__ rv,
                                    const float* __restrict__ stats, int64_t C, double momentum,
                                    double eps) {
  const double n = double(stats[2 * C]);
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < C;
       c += int64_t(gridDim.x) * blockDim.x) {
    const double mu = double(stats[c]) / n;
    const double var = fmax(double(stats[C + c]) / n - mu * mu, 0.0);
    mean[c] = float(mu);
    invstd[c] = float(1.0 / sqrt(var + eps));
    if (rm != nullptr) {
      rm[c] = float((1.0 - momentum) * double(rm[c]) + momentum * mu);
      rv[c] = float((1.0 - momentum) * double(rv[c]) + momentum * var * n / (n - 1.0));
    }
  }
}

// Channel of the element at memory offset i of a dense tensor.
__device__ inline int64_t channel_at(int64_t i, int64_t C, int64_t S, bool inner) {
  return inner ? i % C : (i / S) % C;
}

template <typename T>
__global__ void apply_kernel(T* __restrict__ y, const T* __restrict__ x,
                             const float* __restrict__ mean, const float* __restrict__ invstd,
                             const float* __restrict__ w, const float* __restrict__ b,
                             int64_t numel, int64_t C, int64_t S, bool inner) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = channel_at(i, C, S, inner);
    float v = (cvt<float>(x[i]) - mean[c]) * invstd[c];
    if (w != nullptr) v *= w[c];
    if (b != nullptr) v += b[c];
    y[i] = cvt<T>(v);
  }
}

template <typename T>
__global__ void dx_kernel(T* __restrict__ dx, const T* __restrict__ dy, const T* __restrict__ x,
                          const float* __restrict__ w, const float* __restrict__ mean,
                          const float* __restrict__ invstd, const float* __restrict__ sums,
                          const float* __restrict__ count, int64_t numel, int64_t C, int64_t S,
                          bool inner) {
  const float inv_n = 1.0f / count[0];
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = channel_at(i, C, S, inner);
    const float k = invstd[c];
    const float xhat = (cvt<float>(x[i]) - mean[c]) * k;
    const float v = cvt<float>(dy[i]) - sums[c] * inv_n - xhat * (sums[C + c] * inv_n);
    dx[i] = cvt<T>(v * k * (w != nullptr ? w[c] : 1.0f));
  }
}

}  // namespace

void sync_batch_norm_stats(const Tensor& stats, const Tensor& x) {
  const char* op = "sync_batch_norm_stats";
  const Geometry g = geometry_of(x, op);
  float* out = f32_ptr(stats, 2 * g.c + 1, x, op, "stats");
  KILN_CHECK(out != nullptr, op, " (cuda): stats is undefined");
  dispatch_data(x.dtype(), [&]<typename T>() {
    channel_sums(out, g, StatTerms<T>{static_cast<const T*>(x.raw_data())}, true, x.device());
  });
}

void sync_batch_norm_apply(const Tensor& y, const Tensor& save_mean, const Tensor& save_invstd,
                           const Tensor& x, const Tensor& weight, const Tensor& bias,
                           const Tensor& running_mean, const Tensor& running_var,
                           const Tensor& stats, double momentum, double eps) {
  const char* op = "sync_batch_norm_apply";
  const Geometry g = geometry_of(x, op);
  check_like(y, x, op, "y");
  const int64_t C = g.c;
  float* mean = f32_ptr(save_mean, C, x, op, "save_mean");
  float* invstd = f32_ptr(save_invstd, C, x, op, "save_invstd");
  const float* st = f32_ptr(stats, 2 * C + 1, x, op, "stats");
  KILN_CHECK(mean && invstd && st, op, " (cuda): save_mean, save_invstd and stats are required");
  const float* w = f32_ptr(weight, C, x, op, "weight");
  const float* b = f32_ptr(bias, C, x, op, "bias");
  float* rm = f32_ptr(running_mean, C, x, op, "running_mean");
  float* rv = f32_ptr(running_var, C, x, op, "running_var");
  KILN_CHECK((rm == nullptr) == (rv == nullptr), op,
             " (cuda): running_mean and running_var must be given together");
  cudaStream_t s = current_stream();
  stats_finish_kernel<<<grid_for(C), kBlock, 0, s>>>(mean, invstd, rm, rv, st, C, momentum, eps);
  KILN_CUDA_CHECK_LAUNCH();
  const int64_t numel = x.numel();
  dispatch_data(x.dtype(), [&]<typename T>() {
    apply_kernel<T><<<grid_for(numel), kBlock, 0, s>>>(static_cast<T*>(y.raw_data()),
                                                       static_cast<const T*>(x.raw_data()), mean,
                                                       invstd, w, b, numel, C, g.s, g.inner);
    KILN_CUDA_CHECK_LAUNCH();
  });
}

void sync_batch_norm_backward_sums(const Tensor& sums, const Tensor& dy, const Tensor& x,
                                   const Tensor& mean, const Tensor& invstd) {
  const char* op = "sync_batch_norm_backward_sums";
  const Geometry g = geometry_of(x, op);
  check_like(dy, x, op, "dy");
  float* out = f32_ptr(sums, 2 * g.c, x, op, "sums");
  const float* m = f32_ptr(mean, g.c, x, op, "mean");
  const float* k = f32_ptr(invstd, g.c, x, op, "invstd");
  KILN_CHECK(out && m && k, op, " (cuda): sums, mean and invstd are required");
  dispatch_data(x.dtype(), [&]<typename T>() {
    GradTerms<T> terms{static_cast<const T*>(dy.raw_data()), static_cast<const T*>(x.raw_data()), m,
                       k};
    channel_sums(out, g, terms, false, x.device());
  });
}

void sync_batch_norm_backward_dx(const Tensor& dx, const Tensor& dy, const Tensor& x,
                                 const Tensor& weight, const Tensor& mean, const Tensor& invstd,
                                 const Tensor& sums, const Tensor& count) {
  const char* op = "sync_batch_norm_backward_dx";
  const Geometry g = geometry_of(x, op);
  check_like(dy, x, op, "dy");
  check_like(dx, x, op, "dx");
  const int64_t C = g.c;
  const float* w = f32_ptr(weight, C, x, op, "weight");
  const float* m = f32_ptr(mean, C, x, op, "mean");
  const float* k = f32_ptr(invstd, C, x, op, "invstd");
  const float* s2 = f32_ptr(sums, 2 * C, x, op, "sums");
  const float* n = f32_ptr(count, 1, x, op, "count");
  KILN_CHECK(m && k && s2 && n, op, " (cuda): mean, invstd, sums and count are required");
  const int64_t numel = x.numel();
  dispatch_data(x.dtype(), [&]<typename T>() {
    dx_kernel<T><<<grid_for(numel), kBlock, 0, current_stream()>>>(
        static_cast<T*>(dx.raw_data()), static_cast<const T*>(dy.raw_data()),
        static_cast<const T*>(x.raw_data()), w, m, k, s2, n, numel, C, g.s, g.inner);
    KILN_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace kiln::cuda
