// Softmax / log-softmax over the last dim and the fused softmax-cross-entropy. One warp per row
// (rows are class vectors of up to a few thousand), f32 accumulation (f64 for f64 data).
//
// Cross-entropy reduces its per-row losses and hit flags with a second one-block kernel instead
// of float atomics: the summation order is then fixed, so the loss is bit-identical from run to
// run (graph replay must match eager execution bit for bit).
#include <limits>

#include "cuda/kernels/common.cuh"
#include "cuda/kernels/reduce.cuh"
#include "cuda/kernels.h"

namespace kiln::cuda {
namespace {

constexpr int kRowsPerBlock = kBlock / 32;

__device__ inline int64_t warp_row(int64_t& step) {
  step = int64_t(gridDim.x) * kRowsPerBlock;
  return int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
}

template <typename T>
__global__ void softmax_fwd(T* y, const T* x, int64_t rows, int64_t cols, bool log_out) {
  pdl_start();
  using C = acc_t<T>;
  const int lane = threadIdx.x % 32;
  int64_t step;
  for (int64_t r = warp_row(step); r < rows; r += step) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    C m = -std::numeric_limits<C>::infinity();
    for (int64_t i = lane; i < cols; i += 32) m = nan_max(m, cvt<C>(xr[i]));
    m = warp_max(m);
    C s = 0;
    for (int64_t i = lane; i < cols; i += 32) s += exp(cvt<C>(xr[i]) - m);
    s = warp_sum(s);
    if (log_out) {
      const C lse = m + log(s);
      for (int64_t i = lane; i < cols; i += 32) yr[i] = cvt<T>(cvt<C>(xr[i]) - lse);
    } else {
      const C inv = C(1) / s;
      for (int64_t i = lane; i < cols; i += 32) yr[i] = cvt<T>(exp(cvt<C>(xr[i]) - m) * inv);
    }
  }
}

template <typename T>
__global__ void softmax_bwd(T* dx, const T* dy, const T* y, int64_t rows, int64_t cols,
                            bool log_out) {
  pdl_start();
  using C = acc_t<T>;
  const int lane = threadIdx.x % 32;
  int64_t step;
  for (int64_t r = warp_row(step); r < rows; r += step) {
    const T* gr = dy + r * cols;
    const T* yr = y + r * cols;
    T* dr = dx + r * cols;
    C s = 0;  // Σ dy (log-softmax) or Σ dy·y (softmax)
    for (int64_t i = lane; i < cols; i += 32)
      s += log_out ? cvt<C>(gr[i]) : cvt<C>(gr[i]) * cvt<C>(yr[i]);
    s = warp_sum(s);
    for (int64_t i = lane; i < cols; i += 32) {
      const C g = cvt<C>(gr[i]), v = cvt<C>(yr[i]);
      dr[i] = cvt<T>(log_out ? g - exp(v) * s : v * (g - s));
    }
  }
}

// Per row: loss_r = -(1-ε)·logp[t] - (ε/C)·Σ_j logp[j]; hit_r = (first argmax == t);
// grad = (softmax - (1-ε)·onehot(t) - ε/C) · scale, with scale = grad_scale / N, written as G
// (T, or float for 16-bit logits so the loss scale can be applied before the one rounding).
template <typename T, typename G, typename I>
__global__ void cross_entropy_rows(float* row_loss, int* row_hit, G* grad, const T* logits,
                                   const I* target, int64_t rows, int64_t cols, double eps,
                                   double scale) {
  pdl_start();
  using C = acc_t<T>;
  const int lane = threadIdx.x % 32;
  int64_t step;
  for (int64_t r = warp_row(step); r < rows; r += step) {
    const T* xr = logits + r * cols;
    G* gr = grad + r * cols;
    const int64_t t = int64_t(target[r]);
    const bool valid = t >= 0 && t < cols;
    C m = -std::numeric_limits<C>::infinity();
    int64_t arg = std::numeric_limits<int64_t>::max();
    for (int64_t i = lane; i < cols; i += 32) {
      const C v = cvt<C>(xr[i]);
      if (arg_better(v, i, m, arg)) {
        m = v;
        arg = i;
      }
    }
    warp_argmax(m, arg);
    C s = 0, sx = 0;
    for (int64_t i = lane; i < cols; i += 32) {
      const C v = cvt<C>(xr[i]);
      s += exp(v - m);
      sx += v;
    }
    s = warp_sum(s);
    sx = warp_sum(sx);
    const C lse = m + log(s);
    const C on = C(1) - C(eps), off = C(eps) / C(cols);
    for (int64_t i = lane; i < cols; i += 32) {
      const C p = exp(cvt<C>(xr[i]) - lse);
      gr[i] = cvt<G>((p - off - (i == t ? on : C(0))) * C(scale));
    }
    if (lane == 0) {
      // An out-of-range target gives NaN rather than a read out of bounds.
      const C logp_t = valid ? cvt<C>(xr[t]) - lse : std::numeric_limits<C>::quiet_NaN();
      row_loss[r] = float(-on * logp_t - off * (sx - C(cols) * lse));
      row_hit[r] = valid && arg == t;
    }
  }
}

// One block: loss = Σ row_loss / N, correct = Σ row_hit, in a fixed order.
__global__ void cross_entropy_total(float* loss, int64_t* correct, const float* row_loss,
                                    const int* row_hit, int64_t rows) {
  pdl_start();
  __shared__ float sl[kBlock];
  __shared__ long long sc[kBlock];
  float l = 0;
  long long c = 0;
  for (int64_t i = threadIdx.x; i < rows; i += kBlock) {
    l += row_loss[i];
    c += row_hit[i];
  }
  sl[threadIdx.x] = l;
  sc[threadIdx.x] = c;
  __syncthreads();
  for (int w = kBlock / 2; w > 0; w >>= 1) {
    if (int(threadIdx.x) < w) {
      sl[threadIdx.x] += sl[threadIdx.x + w];
      sc[threadIdx.x] += sc[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *loss = sl[0] / float(rows);
    *correct = int64_t(sc[0]);
  }
}

void last_dim(const Tensor& x, int64_t& rows, int64_t& cols) {
  cols = x.dim() == 0 ? 1 : x.size(-1);
  rows = cols == 0 ? 0 : x.numel() / cols;
}

unsigned warp_rows_grid(int64_t rows) {
  return grid_for((rows + kRowsPerBlock - 1) / kRowsPerBlock * kBlock);
}

}  // namespace

void softmax_forward(const Tensor& y, const Tensor& x, bool log) {
  int64_t rows, cols;
  last_dim(x, rows, cols);
  if (rows == 0) return;
  dispatch_device_float(x.dtype(), log ? "log_softmax" : "softmax", [&]<typename T>() {
    launch(softmax_fwd<T>, warp_rows_grid(rows), kBlock, 0, current_stream(),
           static_cast<T*>(y.raw_data()), static_cast<const T*>(x.raw_data()), rows, cols, log);
    KILN_CUDA_CHECK_LAUNCH();
  });
}

void softmax_backward(const Tensor& dx, const Tensor& dy, const Tensor& y, bool log) {
  int64_t rows, cols;
  last_dim(y, rows, cols);
  if (rows == 0) return;
  dispatch_device_float(
      y.dtype(), log ? "log_softmax backward" : "softmax backward", [&]<typename T>() {
        launch(softmax_bwd<T>, warp_rows_grid(rows), kBlock, 0, current_stream(),
               static_cast<T*>(dx.raw_data()), static_cast<const T*>(dy.raw_data()),
               static_cast<const T*>(y.raw_data()), rows, cols, log);
        KILN_CUDA_CHECK_LAUNCH();
      });
}

void cross_entropy_fused(const Tensor& loss, const Tensor& grad, const Tensor& correct,
                         const Tensor& logits, const Tensor& target, double label_smoothing,
                         double grad_scale) {
  const int64_t rows = logits.size(0), cols = logits.size(1);
  KILN_CHECK(loss.dtype() == DType::f32 && correct.dtype() == DType::i64,
             "cross_entropy (cuda): loss must be f32 and correct i64, got ", loss.desc(), " and ",
             correct.desc());
  KILN_CHECK(target.dtype() == DType::i64 || target.dtype() == DType::i32,
             "cross_entropy (cuda): target must be i64 or i32, got ", target.desc());
  cudaStream_t stream = current_stream();
  if (rows == 0) {
    // Mean over an empty batch is NaN (as PyTorch); nothing is correct.
    CUDA_CHECK(cudaMemsetAsync(correct.raw_data(), 0, sizeof(int64_t), stream));
    const float nan = std::numeric_limits<float>::quiet_NaN();
    CUDA_CHECK(cudaMemcpyAsync(loss.raw_data(), &nan, sizeof(float), cudaMemcpyHostToDevice,
                               stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));  // &nan lives on this stack frame
    return;
  }
  // Scratch from the caching allocator; freed on return, reused only by later work on this
  // stream, so it is safe without a sync.
  Tensor row_loss = empty({rows}, TensorOptions(DType::f32).with_device(logits.device()));
  Tensor row_hit = empty({rows}, TensorOptions(DType::i32).with_device(logits.device()));
  const double scale = grad_scale / double(rows);  // rounded to the data's accumulation type
  const bool f32_grad = grad.dtype() == DType::f32;
  const bool half_logits = logits.dtype() == DType::f16 || logits.dtype() == DType::bf16;
  KILN_CHECK(
      grad.dtype() == logits.dtype() || (f32_grad && half_logits),
      "cross_entropy (cuda): grad must have the logits' dtype (or f32 for 16-bit logits), got ",
      grad.desc(), " for logits ", logits.desc());
  dispatch_device_float(logits.dtype(), "cross_entropy", [&]<typename T>() {
    auto rows_kernel = [&]<typename G, typename I>() {
      launch(cross_entropy_rows<T, G, I>, warp_rows_grid(rows), kBlock, 0, stream,
             static_cast<float*>(row_loss.raw_data()), static_cast<int*>(row_hit.raw_data()),
             static_cast<G*>(grad.raw_data()), static_cast<const T*>(logits.raw_data()),
             static_cast<const I*>(target.raw_data()), rows, cols, label_smoothing, scale);
      KILN_CUDA_CHECK_LAUNCH();
    };
    auto with_grad = [&]<typename G>() {
      if (target.dtype() == DType::i64)
        rows_kernel.template operator()<G, int64_t>();
      else
        rows_kernel.template operator()<G, int32_t>();
    };
    if (f32_grad)
      with_grad.template operator()<float>();
    else
      with_grad.template operator()<T>();
  });
  launch(cross_entropy_total, 1, kBlock, 0, stream, static_cast<float*>(loss.raw_data()),
         static_cast<int64_t*>(correct.raw_data()), static_cast<const float*>(row_loss.raw_data()),
         static_cast<const int*>(row_hit.raw_data()), rows);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda
