// Layer norm over the trailing `cols` elements of each row (transformers' LayerNorm), f32
// statistics for f16/bf16/f32 data (f64 for f64). Two paths, chosen per call by
// use_register_rows():
//  - register rows (f32/f16/bf16, cols a multiple of a 16-byte vector and at most 1024, x and y
//    or x and dy 16-byte aligned): one warp per row, the row read once into registers with
//    16-byte loads. The backward is one kernel for dx and the parameter gradients: each warp
//    keeps its columns' Σ dy·x̂ and Σ dy over its rows in registers, the block adds its warps'
//    sums in warp order and writes one partial row; ln_bwd_params adds the blocks' rows.
//  - generic (any cols, f64, unaligned): one warp per row re-reading the row from memory for each
//    pass; the parameter gradients are partial sums per chunk of rows (ln_bwd_partials), then the
//    same ln_bwd_params.
// Every sum runs in an order fixed by (rows, cols, dtype, device) alone, so the parameter
// gradients are bit-reproducible (graph replay must equal eager execution) and do not depend on
// whether dx is asked for: the path is chosen without looking at dx (a dx the register kernel
// cannot store to gets ln_bwd_dx).
#include <initializer_list>
#include <limits>

#include "core/switches.h"
#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/reduce.cuh"

namespace kiln::cuda {
namespace {

constexpr int kRowsPerBlock = kBlock / 32;
constexpr int kColTile = 32;            // columns per block of the parameter-gradient passes
constexpr int kRowLanes = 8;            // ... and threads along the rows of ln_bwd_partials
constexpr int kPartialLanes = 32;       // ... and along the partial rows of ln_bwd_params
constexpr int64_t kRowChunk = 256;      // rows per partial sum of the generic parameter gradients
constexpr int kRegisterMaxCols = 1024;  // the widest row the register path holds
constexpr int kBwdBlocksPerSm = 4;      // at most, for ln_bwd_rows: a partial row per block

unsigned warp_rows_grid(int64_t rows) {
  return grid_for((rows + kRowsPerBlock - 1) / kRowsPerBlock, 1);
}

// P is the parameters' and statistics' type: float, or double for double data.
template <typename T, typename P>
__global__ void ln_fwd(T* y, P* mean, P* rstd, const T* x, const P* w, const P* b, int64_t rows,
                       int64_t cols, double eps) {
  pdl_start();
  using C = acc_t<T>;
  const int lane = threadIdx.x % 32;
  const int64_t step = int64_t(gridDim.x) * kRowsPerBlock;
  for (int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32; r < rows; r += step) {
    const T* xr = x + r * cols;
    C s = 0;
    for (int64_t j = lane; j < cols; j += 32) s += cvt<C>(xr[j]);
    const C mu = warp_sum(s) / C(cols);
    C v = 0;  // the second pass: no cancellation for rows far from zero
    for (int64_t j = lane; j < cols; j += 32) {
      const C d = cvt<C>(xr[j]) - mu;
      v += d * d;
    }
    const C rs = C(1) / sqrt(warp_sum(v) / C(cols) + C(eps));
    if (lane == 0) {
      mean[r] = P(mu);
      rstd[r] = P(rs);
    }
    T* yr = y + r * cols;
    for (int64_t j = lane; j < cols; j += 32) {
      const C xh = (cvt<C>(xr[j]) - mu) * rs;
      yr[j] = cvt<T>(xh * (w ? C(w[j]) : C(1)) + (b ? C(b[j]) : C(0)));
    }
  }
}

// dx = rstd·(gw - mean(gw) - x̂·mean(gw·x̂)), gw = dy·w; with add, dx += that value rounded to
// T first (what adding a separate gradient tensor gives, bit for bit: __fadd_rn is never
// contracted with the product into an FMA, which would skip the rounding for f32).
template <typename T>
__device__ __forceinline__ T add_rounded(T prev, T v) {
  return cvt<T>(__fadd_rn(cvt<float>(prev), cvt<float>(v)));
}
__device__ __forceinline__ double add_rounded(double prev, double v) { return __dadd_rn(prev, v); }
template <typename T, typename C>
__device__ __forceinline__ T dx_out(const T* at, C v, bool add) {
  return add ? add_rounded(*at, cvt<T>(v)) : cvt<T>(v);
}

template <typename T, typename P>
__global__ void ln_bwd_dx(T* dx, const T* dy, const T* x, const P* w, const P* mean,
                          const P* rstd, int64_t rows, int64_t cols, bool add) {
  pdl_start();
  using C = acc_t<T>;
  const int lane = threadIdx.x % 32;
  const int64_t step = int64_t(gridDim.x) * kRowsPerBlock;
  for (int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32; r < rows; r += step) {
    const T* xr = x + r * cols;
    const T* gr = dy + r * cols;
    const C mu = C(mean[r]), rs = C(rstd[r]);
    C sg = 0, sgx = 0;
    for (int64_t j = lane; j < cols; j += 32) {
      const C gw = cvt<C>(gr[j]) * (w ? C(w[j]) : C(1));
      sg += gw;
      sgx += gw * (cvt<C>(xr[j]) - mu) * rs;
    }
    sg = warp_sum(sg) / C(cols);
    sgx = warp_sum(sgx) / C(cols);
    T* dr = dx + r * cols;
    for (int64_t j = lane; j < cols; j += 32) {
      const C gw = cvt<C>(gr[j]) * (w ? C(w[j]) : C(1));
      const C xh = (cvt<C>(xr[j]) - mu) * rs;
      dr[j] = dx_out(dr + j, rs * (gw - sg - xh * sgx), add);
    }
  }
}

// partial[chunk][col] = Σ over the chunk's rows of dy·x̂ (first half) and dy (second half).
// Grid (column tiles, row chunks), block (kColTile, kRowLanes): thread (x, y) sums column x of
// the tile over rows y, y + kRowLanes, ... of the chunk, so a warp reads 32 adjacent columns of
// one row; the kRowLanes partial sums are then added in y order (a fixed order).
template <typename T, typename P>
__global__ void ln_bwd_partials(P* partial, const T* dy, const T* x, const P* mean,
                                const P* rstd, int64_t rows, int64_t cols) {
  pdl_start();
  using C = acc_t<T>;
  __shared__ C sw_s[kRowLanes][kColTile], sb_s[kRowLanes][kColTile];
  const int64_t j = int64_t(blockIdx.x) * kColTile + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * kRowChunk;
  const int64_t r1 = r0 + kRowChunk < rows ? r0 + kRowChunk : rows;
  C sw = 0, sb = 0;
  if (j < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) {
      const C g = cvt<C>(dy[r * cols + j]);
      sw += g * (cvt<C>(x[r * cols + j]) - C(mean[r])) * C(rstd[r]);
      sb += g;
    }
  sw_s[threadIdx.y][threadIdx.x] = sw;
  sb_s[threadIdx.y][threadIdx.x] = sb;
  __syncthreads();
  if (threadIdx.y != 0 || j >= cols) return;
  for (int y = 1; y < kRowLanes; ++y) {
    sw += sw_s[y][threadIdx.x];
    sb += sb_s[y][threadIdx.x];
  }
  const int64_t chunk = blockIdx.y;
  partial[chunk * 2 * cols + j] = P(sw);
  partial[chunk * 2 * cols + cols + j] = P(sb);
}

// dweight, dbias (=, or += when add) = Σ over the `chunks` partial rows (from ln_bwd_partials
// or ln_bwd_rows). Grid (column tiles), block (kColTile, kPartialLanes): thread (x, y) sums
// column x of the tile over partial rows y, y + kPartialLanes, ...; the kPartialLanes sums are
// then added in y order (a fixed order).
template <typename P>
__global__ void ln_bwd_params(P* dw, P* db, const P* partial, int64_t chunks, int64_t cols,
                              bool add) {
  pdl_start();
  __shared__ P sw_s[kPartialLanes][kColTile], sb_s[kPartialLanes][kColTile];
  const int64_t j = int64_t(blockIdx.x) * kColTile + threadIdx.x;
  P sw = 0, sb = 0;
  if (j < cols)
    for (int64_t c = threadIdx.y; c < chunks; c += kPartialLanes) {
      sw += partial[c * 2 * cols + j];
      sb += partial[c * 2 * cols + cols + j];
    }
  sw_s[threadIdx.y][threadIdx.x] = sw;
  sb_s[threadIdx.y][threadIdx.x] = sb;
  __syncthreads();
  if (threadIdx.y != 0 || j >= cols) return;
  for (int y = 1; y < kPartialLanes; ++y) {
    sw += sw_s[y][threadIdx.x];
    sb += sb_s[y][threadIdx.x];
  }
  if (dw) dw[j] = add ? dw[j] + sw : sw;
  if (db) db[j] = add ? db[j] + sb : sb;
}

// ---- register rows ----
// A row is cols / E vectors of 16 bytes (E = 16 / sizeof(T)); lane l of the row's warp holds
// vectors l, l + 32, ..., l + 32·(NV - 1), those that exist: one k is 512 contiguous bytes for
// the warp. The weight (and bias) sit in shared memory as f32, 1 (0) when undefined.
template <typename T>
struct alignas(16) RowVec {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};
template <typename T>
inline constexpr int kMaxVecsPerLane = kRegisterMaxCols / (32 * RowVec<T>::kN);

// E consecutive f32 of 16-byte aligned shared memory.
template <int E>
__device__ inline void load_f32(const float* p, float (&out)[E]) {
  static_assert(E % 4 == 0);
#pragma unroll
  for (int q = 0; q < E / 4; ++q) {
    const float4 f = reinterpret_cast<const float4*>(p)[q];
    out[4 * q] = f.x;
    out[4 * q + 1] = f.y;
    out[4 * q + 2] = f.z;
    out[4 * q + 3] = f.w;
  }
}

// Dynamic shared memory of the register-row kernels, float4 for its alignment.
extern __shared__ float4 ln_smem[];

// (rows, cols) -> y (rows, cols), mean and rstd (rows); the generic ln_fwd's math. Shared
// memory: 2·cols floats.
template <typename T, int NV>
__global__ void __launch_bounds__(kBlock)
    ln_fwd_rows(T* y, float* mean, float* rstd, const T* x, const float* w, const float* b,
                int64_t rows, int cols, float eps) {
  pdl_start();
  constexpr int E = RowVec<T>::kN;
  float* w_s = reinterpret_cast<float*>(ln_smem);
  float* b_s = w_s + cols;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    w_s[j] = w ? w[j] : 1.f;
    b_s[j] = b ? b[j] : 0.f;
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, nvec = cols / E;
  const int64_t step = int64_t(gridDim.x) * kRowsPerBlock;
  for (int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32; r < rows; r += step) {
    const RowVec<T>* xr = reinterpret_cast<const RowVec<T>*>(x + r * cols);
    RowVec<T> xv[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k)
      if (lane + 32 * k < nvec) xv[k] = xr[lane + 32 * k];
    float s = 0;
#pragma unroll
    for (int k = 0; k < NV; ++k)
      if (lane + 32 * k < nvec)
#pragma unroll
        for (int e = 0; e < E; ++e) s += cvt<float>(xv[k].v[e]);
    const float mu = warp_sum(s) / float(cols);
    float v = 0;  // the second pass, from registers: no cancellation for rows far from zero
#pragma unroll
    for (int k = 0; k < NV; ++k)
      if (lane + 32 * k < nvec)
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const float d = cvt<float>(xv[k].v[e]) - mu;
          v += d * d;
        }
    const float rs = 1.f / sqrtf(warp_sum(v) / float(cols) + eps);
    if (lane == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
    RowVec<T>* yr = reinterpret_cast<RowVec<T>*>(y + r * cols);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int vi = lane + 32 * k;
      if (vi >= nvec) continue;
      float wv[E], bv[E];
      load_f32(w_s + vi * E, wv);
      load_f32(b_s + vi * E, bv);
      RowVec<T> o;
#pragma unroll
      for (int e = 0; e < E; ++e)
        o.v[e] = cvt<T>((cvt<float>(xv[k].v[e]) - mu) * rs * wv[e] + bv[e]);
      yr[vi] = o;
    }
  }
}

// dx (rows, cols) when dx is not null, as ln_bwd_dx (Add: added to, its old values read with x
// and dy); partial[block] (2·cols) = the block's
// Σ dy·x̂ (first half) and Σ dy (second half) per column when partial is not null. Warp g of
// the grid takes rows g, g + warps, ... and sums its columns over them in that order; the block
// then adds its warps' sums in warp order. The sums do not depend on dx being written.
// Shared memory: 3·cols floats (the weight, then the block's sums).
template <typename T, int NV, bool Add>
__global__ void __launch_bounds__(kBlock, 2)
    ln_bwd_rows(T* dx, float* partial, const T* dy, const T* x, const float* w, const float* mean,
                const float* rstd, int64_t rows, int cols) {
  pdl_start();
  constexpr int E = RowVec<T>::kN;
  float* w_s = reinterpret_cast<float*>(ln_smem);
  float* sum_s = w_s + cols;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) w_s[j] = w ? w[j] : 1.f;
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nvec = cols / E;
  float sw[NV][E], sb[NV][E];
#pragma unroll
  for (int k = 0; k < NV; ++k)
#pragma unroll
    for (int e = 0; e < E; ++e) sw[k][e] = sb[k][e] = 0.f;
  const int64_t step = int64_t(gridDim.x) * kRowsPerBlock;
  for (int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + warp; r < rows; r += step) {
    const RowVec<T>* xr = reinterpret_cast<const RowVec<T>*>(x + r * cols);
    const RowVec<T>* gr = reinterpret_cast<const RowVec<T>*>(dy + r * cols);
    RowVec<T>* dr = dx ? reinterpret_cast<RowVec<T>*>(dx + r * cols) : nullptr;
    RowVec<T> xv[NV], gv[NV], pv[Add ? NV : 1];
#pragma unroll
    for (int k = 0; k < NV; ++k)
      if (lane + 32 * k < nvec) {
        xv[k] = xr[lane + 32 * k];
        gv[k] = gr[lane + 32 * k];
        if constexpr (Add) pv[k] = dr[lane + 32 * k];
      }
    const float mu = mean[r], rs = rstd[r];
    if (dx) {  // dx = rstd·(gw - mean(gw) - x̂·mean(gw·x̂)), gw = dy·w
      float sg = 0, sgx = 0;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int vi = lane + 32 * k;
        if (vi >= nvec) continue;
        float wv[E];
        load_f32(w_s + vi * E, wv);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const float gw = cvt<float>(gv[k].v[e]) * wv[e];
          sg += gw;
          sgx += gw * ((cvt<float>(xv[k].v[e]) - mu) * rs);
        }
      }
      sg = warp_sum(sg) / float(cols);
      sgx = warp_sum(sgx) / float(cols);
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int vi = lane + 32 * k;
        if (vi >= nvec) continue;
        float wv[E];
        load_f32(w_s + vi * E, wv);
        RowVec<T> o;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const float gw = cvt<float>(gv[k].v[e]) * wv[e];
          const float xh = (cvt<float>(xv[k].v[e]) - mu) * rs;
          o.v[e] = cvt<T>(rs * (gw - sg - xh * sgx));
          if constexpr (Add) o.v[e] = add_rounded(pv[k].v[e], o.v[e]);
        }
        dr[vi] = o;
      }
    }
    if (partial)
#pragma unroll
      for (int k = 0; k < NV; ++k)
        if (lane + 32 * k < nvec)
#pragma unroll
          for (int e = 0; e < E; ++e) {
            const float g = cvt<float>(gv[k].v[e]);
            // fmaf spelled out: the same rounding whatever the compiler does with the dx code
            sw[k][e] = fmaf(g, (cvt<float>(xv[k].v[e]) - mu) * rs, sw[k][e]);
            sb[k][e] += g;
          }
  }
  if (!partial) return;  // the same for the whole grid
  for (int wi = 0; wi < kRowsPerBlock; ++wi) {
    if (warp == wi)
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int vi = lane + 32 * k;
        if (vi >= nvec) continue;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          float* cw = sum_s + vi * E + e;
          *cw = wi == 0 ? sw[k][e] : *cw + sw[k][e];
          cw[cols] = wi == 0 ? sb[k][e] : cw[cols] + sb[k][e];
        }
      }
    __syncthreads();
  }
  float* out = partial + int64_t(blockIdx.x) * 2 * cols;
  for (int j = threadIdx.x; j < 2 * cols; j += blockDim.x) out[j] = sum_s[j];
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The register path takes the rows when T is f32/f16/bf16, a row is whole 16-byte vectors and
// at most kRegisterMaxCols, and the tensors' data start 16-byte aligned (rows are contiguous).
template <typename T>
bool use_register_rows(int64_t cols, std::initializer_list<const Tensor*> tensors) {
  if constexpr (std::is_same_v<T, double>) {
    return false;
  } else {
    if (!switches().row_kernels) return false;  // KILN_ROW_KERNELS=0: the generic kernels
    if (cols % RowVec<T>::kN != 0 || cols > kRegisterMaxCols) return false;
    for (const Tensor* t : tensors)
      if (t->defined() && !aligned16(t->raw_data())) return false;
    return true;
  }
}

// Calls f.template operator()<NV>() with NV = the vectors per lane for cols (1..kMaxVecsPerLane).
template <typename T, typename F>
void dispatch_vecs_per_lane(int64_t cols, F&& f) {
  const int nv = int((cols / RowVec<T>::kN + 31) / 32);
  [&]<int... I>(std::integer_sequence<int, I...>) {
    ((nv == I + 1 ? (f.template operator()<I + 1>(), 0) : 0), ...);
  }(std::make_integer_sequence<int, kMaxVecsPerLane<T>>{});
}

// A grid of the register-row kernel `kernel` for `rows`: one wave of the blocks that fit on the
// device at once, at most max_per_sm on each SM, fewer when fewer rows (each block loads the
// weight once). A function of (rows, kernel, smem, max_per_sm, device) only.
unsigned register_rows_grid(const void* kernel, int smem, int64_t rows,
                            int max_per_sm = std::numeric_limits<int>::max()) {
  const int per_sm = std::min(resident_blocks_per_sm(kernel, kBlock, smem), max_per_sm);
  const int64_t cap = int64_t(per_sm) * context().props.multiProcessorCount;
  return unsigned(std::clamp<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, 1, cap));
}

// dweight, dbias (= or += by mode) from `chunks` partial rows of 2·cols.
template <typename P>
void sum_partials(P* dw, P* db, const P* partial, int64_t chunks, int64_t cols, GradientMode mode,
                  cudaStream_t stream) {
  launch(ln_bwd_params<P>, unsigned((cols + kColTile - 1) / kColTile),
         dim3(kColTile, kPartialLanes), 0, stream, dw, db, partial, chunks, cols,
         mode == GradientMode::Accumulate);
}

template <typename P>
const P* param_ptr(const Tensor& t, int64_t cols, const Tensor& x, const char* op,
                   const char* what) {
  if (!t.defined()) return nullptr;
  KILN_CHECK(t.is_contiguous() && t.numel() == cols && t.device() == x.device() &&
                 t.dtype() == (std::is_same_v<P, double> ? DType::f64 : DType::f32),
             op, " (cuda): ", what, " must be a contiguous ",
             std::is_same_v<P, double> ? "f64" : "f32", " tensor of ", cols, " elements on ",
             x.device(), ", got ", t.desc());
  return static_cast<const P*>(t.raw_data());
}

}  // namespace

void layer_norm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                        const Tensor& weight, const Tensor& bias, int64_t rows, int64_t cols,
                        double eps) {
  if (rows == 0) return;
  dispatch_device_float(x.dtype(), "layer_norm", [&]<typename T>() {
    using P = acc_t<T>;
    const P* w = param_ptr<P>(weight, cols, x, "layer_norm", "weight");
    const P* b = param_ptr<P>(bias, cols, x, "layer_norm", "bias");
    T* yp = static_cast<T*>(y.raw_data());
    P* mp = static_cast<P*>(mean.raw_data());
    P* rp = static_cast<P*>(rstd.raw_data());
    const T* xp = static_cast<const T*>(x.raw_data());
    if constexpr (!std::is_same_v<T, double>) {
      if (use_register_rows<T>(cols, {&x, &y})) {
        dispatch_vecs_per_lane<T>(cols, [&]<int NV>() {
          constexpr auto kernel = ln_fwd_rows<T, NV>;
          const int smem = int(2 * cols * sizeof(float));
          const unsigned grid =
              register_rows_grid(reinterpret_cast<const void*>(kernel), smem, rows);
          launch(kernel, grid, kBlock, size_t(smem), current_stream(), yp, mp, rp, xp, w, b, rows,
                 int(cols), float(eps));
        });
        return;
      }
    }
    launch(ln_fwd<T, P>, warp_rows_grid(rows), kBlock, 0, current_stream(), yp, mp, rp, xp, w, b,
           rows, cols, eps);
  });
}

void layer_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& weight,
                         const Tensor& mean, const Tensor& rstd, int64_t rows, int64_t cols,
                         GradientMode mode, GradientMode dx_mode) {
  const bool dx_add = dx_mode != GradientMode::Set;
  dispatch_device_float(x.dtype(), "layer_norm_backward", [&]<typename T>() {
    using P = acc_t<T>;
    const cudaStream_t stream = current_stream();
    const P* w = param_ptr<P>(weight, cols, x, "layer_norm_backward", "weight");
    const bool params = dweight.defined() || dbias.defined();
    P* dw = const_cast<P*>(param_ptr<P>(dweight, cols, x, "layer_norm_backward", "dweight"));
    P* db = const_cast<P*>(param_ptr<P>(dbias, cols, x, "layer_norm_backward", "dbias"));
    const T* xp = static_cast<const T*>(x.raw_data());
    const T* gp = static_cast<const T*>(dy.raw_data());
    const P* mp = static_cast<const P*>(mean.raw_data());
    const P* rp = static_cast<const P*>(rstd.raw_data());
    const TensorOptions popts =
        TensorOptions(std::is_same_v<P, double> ? DType::f64 : DType::f32).with_device(x.device());
    // The path is chosen on x and dy alone, so the parameter gradients take the same sums
    // whether or not dx is asked for; an unaligned dx (never one from ops/layer_norm.cpp) gets
    // the generic ln_bwd_dx.
    bool dx_done = !dx.defined() || rows == 0, params_done = false;
    if constexpr (!std::is_same_v<T, double>) {
      if (rows > 0 && use_register_rows<T>(cols, {&x, &dy})) {
        T* dxp = !dx_done && aligned16(dx.raw_data()) ? static_cast<T*>(dx.raw_data()) : nullptr;
        if (dxp || params)
          dispatch_vecs_per_lane<T>(cols, [&]<int NV>() {
            // The grid (and so the order of the parameter sums) is the writing kernel's, also
            // when dx is added to.
            constexpr auto write = ln_bwd_rows<T, NV, false>;
            const auto kernel = dxp && dx_add ? ln_bwd_rows<T, NV, true> : write;
            const int smem = int(3 * cols * sizeof(float));
            const unsigned grid = register_rows_grid(reinterpret_cast<const void*>(write), smem,
                                                     rows, kBwdBlocksPerSm);
            Tensor partial = params ? empty({int64_t(grid) * 2 * cols}, popts) : Tensor();
            float* pp = params ? static_cast<float*>(partial.raw_data()) : nullptr;
            launch(kernel, grid, kBlock, size_t(smem), stream, dxp, pp, gp, xp, w, mp, rp, rows,
                   int(cols));
            if (params) sum_partials<P>(dw, db, pp, grid, cols, mode, stream);
          });
        if (dxp) dx_done = true;
        if (params) params_done = true;
      }
    }
    if (!dx_done)
      launch(ln_bwd_dx<T, P>, warp_rows_grid(rows), kBlock, 0, stream,
             static_cast<T*>(dx.raw_data()), gp, xp, w, mp, rp, rows, cols, dx_add);
    if (!params || params_done) return;
    const int64_t chunks = std::max<int64_t>(1, (rows + kRowChunk - 1) / kRowChunk);
    Tensor partial = empty({chunks * 2 * cols}, popts);
    P* pp = static_cast<P*>(partial.raw_data());
    if (rows == 0) {
      CUDA_CHECK(cudaMemsetAsync(pp, 0, size_t(partial.nbytes()), stream));
    } else {
      const dim3 grid(unsigned((cols + kColTile - 1) / kColTile), unsigned(chunks));
      launch(ln_bwd_partials<T, P>, grid, dim3(kColTile, kRowLanes), 0, stream, pp, gp, xp, mp,
             rp, rows, cols);
    }
    sum_partials<P>(dw, db, pp, chunks, cols, mode, stream);
  });
}

}  // namespace kiln::cuda
