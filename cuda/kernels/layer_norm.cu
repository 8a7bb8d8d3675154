// Layer norm over the trailing `cols` elements of each row (transformers' LayerNorm): one warp
// per row for the forward and the data gradient, f32 statistics for f16/bf16/f32 data (f64 for
// f64). The parameter gradients are column sums over all rows, made in two fixed-order passes
// (partial sums per chunk of rows, then the chunks in order) so they are bit-reproducible:
// graph replay must equal eager execution.
#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"
#include "cuda/kernels/reduce.cuh"

namespace kiln::cuda {
namespace {

constexpr int kRowsPerBlock = kBlock / 32;
constexpr int kColTile = 32;     // columns per block of the parameter-gradient pass
constexpr int kRowLanes = 8;     // ... and threads along its rows
constexpr int64_t kRowChunk = 256;  // rows per partial sum of the parameter gradients

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

// dx = rstd·(gw - mean(gw) - x̂·mean(gw·x̂)), gw = dy·w.
template <typename T, typename P>
__global__ void ln_bwd_dx(T* dx, const T* dy, const T* x, const P* w, const P* mean,
                          const P* rstd, int64_t rows, int64_t cols) {
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
      dr[j] = cvt<T>(rs * (gw - sg - xh * sgx));
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

// dweight, dbias (=, or += when add) = Σ over chunks, in chunk order.
template <typename P>
__global__ void ln_bwd_params(P* dw, P* db, const P* partial, int64_t chunks, int64_t cols,
                              bool add) {
  pdl_start();
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= cols) return;
  P sw = 0, sb = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    sw += partial[c * 2 * cols + j];
    sb += partial[c * 2 * cols + cols + j];
  }
  if (dw) dw[j] = add ? dw[j] + sw : sw;
  if (db) db[j] = add ? db[j] + sb : sb;
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
    launch(ln_fwd<T, P>, warp_rows_grid(rows), kBlock, 0, current_stream(),
           static_cast<T*>(y.raw_data()), static_cast<P*>(mean.raw_data()),
           static_cast<P*>(rstd.raw_data()), static_cast<const T*>(x.raw_data()), w, b, rows,
           cols, eps);
  });
}

void layer_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& weight,
                         const Tensor& mean, const Tensor& rstd, int64_t rows, int64_t cols,
                         GradientMode mode) {
  dispatch_device_float(x.dtype(), "layer_norm_backward", [&]<typename T>() {
    using P = acc_t<T>;
    const cudaStream_t stream = current_stream();
    const P* w = param_ptr<P>(weight, cols, x, "layer_norm_backward", "weight");
    if (dx.defined() && rows > 0)
      launch(ln_bwd_dx<T, P>, warp_rows_grid(rows), kBlock, 0, stream,
             static_cast<T*>(dx.raw_data()), static_cast<const T*>(dy.raw_data()),
             static_cast<const T*>(x.raw_data()), w, static_cast<const P*>(mean.raw_data()),
             static_cast<const P*>(rstd.raw_data()), rows, cols);
    if (!dweight.defined() && !dbias.defined()) return;
    P* dw = const_cast<P*>(param_ptr<P>(dweight, cols, x, "layer_norm_backward", "dweight"));
    P* db = const_cast<P*>(param_ptr<P>(dbias, cols, x, "layer_norm_backward", "dbias"));
    const int64_t chunks = std::max<int64_t>(1, (rows + kRowChunk - 1) / kRowChunk);
    Tensor partial = empty({chunks * 2 * cols},
                           TensorOptions(std::is_same_v<P, double> ? DType::f64 : DType::f32)
                               .with_device(x.device()));
    P* pp = static_cast<P*>(partial.raw_data());
    if (rows == 0) {
      CUDA_CHECK(cudaMemsetAsync(pp, 0, size_t(partial.nbytes()), stream));
    } else {
      const dim3 grid(unsigned((cols + kColTile - 1) / kColTile), unsigned(chunks));
      launch(ln_bwd_partials<T, P>, grid, dim3(kColTile, kRowLanes), 0, stream, pp,
             static_cast<const T*>(dy.raw_data()), static_cast<const T*>(x.raw_data()),
             static_cast<const P*>(mean.raw_data()), static_cast<const P*>(rstd.raw_data()),
             rows, cols);
    }
    launch(ln_bwd_params<P>, unsigned((cols + kBlock - 1) / kBlock), kBlock, 0, stream, dw, db,
           static_cast<const P*>(pp), chunks, cols, mode == GradientMode::Accumulate);
  });
}

}  // namespace kiln::cuda
