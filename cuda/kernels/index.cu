// Gathers and selections: embedding lookup and its backward, where.
//
// The embedding backward adds each index's gradient row into its weight row in index order, as
// the CPU kernel does, so the sums are bit-reproducible (graph replay equals eager): a thread
// owns one column and walks all indices. That is parallel over the embedding width only — fine
// for the position tables of vision transformers, slow for a large vocabulary with many tokens
// (a sorted, segmented pass would be the next step there).
#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"

namespace kiln::cuda {
namespace {

template <typename T>
__global__ void embedding_fwd(T* out, const T* w, const int64_t* idx, int64_t n, int64_t d,
                              int64_t rows) {
  pdl_start();
  const int64_t total = n * d, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += step) {
    const int64_t i = e / d, j = e - i * d, r = idx[i];
    out[e] = r >= 0 && r < rows ? w[r * d + j] : T{};  // out of range: a zero row
  }
}

template <typename T>
__global__ void embedding_bwd(T* dw, const T* g, const int64_t* idx, int64_t n, int64_t d,
                              int64_t rows, bool add) {
  pdl_start();
  using C = acc_t<T>;
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= d) return;
  if (!add)
    for (int64_t r = 0; r < rows; ++r) dw[r * d + j] = cvt<T>(C(0));
  for (int64_t i = 0; i < n; ++i) {
    if (idx[i] < 0 || idx[i] >= rows) continue;  // the forward gave it a zero row
    T* p = dw + idx[i] * d + j;
    *p = cvt<T>(cvt<C>(*p) + cvt<C>(g[i * d + j]));
  }
}

template <typename T>
__global__ void where_kernel(T* out, const bool* cond, const T* a, const T* b, int64_t n) {
  pdl_start();
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step)
    out[i] = cond[i] ? a[i] : b[i];
}

}  // namespace

void embedding_forward(const Tensor& out, const Tensor& weight, const Tensor& indices) {
  const int64_t n = indices.numel(), d = weight.size(1);
  if (n * d == 0) return;
  dispatch_device_all(weight.dtype(), [&]<typename T>() {
    launch(embedding_fwd<T>, grid_for(n * d), kBlock, 0, current_stream(),
           static_cast<T*>(out.raw_data()), static_cast<const T*>(weight.raw_data()),
           static_cast<const int64_t*>(indices.raw_data()), n, d, weight.size(0));
  });
}

void embedding_backward(const Tensor& dweight, const Tensor& dout, const Tensor& indices,
                        GradientMode mode) {
  const int64_t n = indices.numel(), d = dweight.size(1), rows = dweight.size(0);
  if (d == 0) return;
  dispatch_device_float(dweight.dtype(), "embedding_backward", [&]<typename T>() {
    launch(embedding_bwd<T>, unsigned((d + kBlock - 1) / kBlock), kBlock, 0, current_stream(),
           static_cast<T*>(dweight.raw_data()), static_cast<const T*>(dout.raw_data()),
           static_cast<const int64_t*>(indices.raw_data()), n, d, rows,
           mode == GradientMode::Accumulate);
  });
}

void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  const int64_t n = out.numel();
  if (n == 0) return;
  dispatch_device_all(out.dtype(), [&]<typename T>() {
    launch(where_kernel<T>, grid_for(n), kBlock, 0, current_stream(),
           static_cast<T*>(out.raw_data()), static_cast<const bool*>(cond.raw_data()),
           static_cast<const T*>(a.raw_data()), static_cast<const T*>(b.raw_data()), n);
  });
}

}  // namespace kiln::cuda
