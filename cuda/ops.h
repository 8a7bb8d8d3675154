#pragma once
// The CUDA backend's entry points called by ops/*.cpp (the counterpart of ops/cpu/kernels.h).
// Inputs are validated by the caller, outputs are allocated by the caller with the right
// shape; each function writes every element of its outputs (`=`) unless it says `+=`, on the
// current device's compute stream, without synchronising the host. f32 and f16 data are
// supported (f16: f32 accumulation); batch-norm parameters and statistics are always f32.
#include "core/tensor.h"
#include "ops/kinds.h"

namespace kiln::cuda {

// ---- copies (cuda/copy.cpp) ----
// dst = src converted to dst's dtype; same shape (the caller expands src), any devices (at least
// one cuda), dtypes and strides. Device-to-host copies synchronise before returning.
void copy_tensor(const Tensor& dst, const Tensor& src);
// Every element of the cuda tensor dst (any strides) = value converted to dst's dtype.
void fill_tensor(const Tensor& dst, double value);

// ---- elementwise and reductions (cuda/kernels/elementwise.cu, reduce.cu) ----
void unary(UnaryOp op, const Tensor& out, const Tensor& a, double scalar);
// a and b already expanded to out's shape (zero strides where broadcast).
void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b, double alpha);
// x contiguous viewed as (rows, inner); out (rows) contiguous.
void reduce_rows(ReduceOp op, const Tensor& out, const Tensor& x, int64_t rows, int64_t inner);
// max over the inner dim of contiguous x (rows, inner): values and i64 indices (first max).
void max_rows(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t rows,
              int64_t inner);
// dx (rows, inner) = 0 except dx[r, indices[r]] = g[r].
void scatter_rows(const Tensor& dx, const Tensor& g, const Tensor& indices, int64_t rows,
                  int64_t inner);

// ---- matmul / linear on cuBLASLt (cuda/blas.cpp) ----
// out = op(a)·op(b) for 2-D contiguous a, b (op = transpose when the flag is set);
// batched when a, b, out are 3-D with the same batch size.
void matmul(const Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b);
// y (N, out) = x (N, in) · w (out, in)ᵀ + bias (bias in the epilogue; bias may be undefined).
void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias);
// dx = dy·w (when defined), dw = dyᵀ·x, db = Σ_n dy (BGRADB epilogue) (when defined).
void linear_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy,
                     const Tensor& x, const Tensor& w);

// ---- convolution on cuDNN (cuda/conv.cpp) ----
// Tensors are 4-D, NCHW or NHWC strided; bias (O) or undefined. The backward outputs are `=`,
// or `+=` with accumulate (cuDNN's beta = 1 when dx/dw is dense in the problem's layout; the
// output must not share memory with the inputs).
void conv2d_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias,
                    const ConvParams& p);
// The forward convolution (no bias) with the per-channel sum and sum of squares of y (f32, O
// values each, `=`) from the same cuDNN kernel (a GenStats epilogue, which sums the f32 results
// before their rounding to f16, and across thread blocks in no fixed order: not bit-
// reproducible). Returns false when that is not available — f16 channels-last only, backend API
// on, a plan found for the problem that beats the plain convolution plus a statistics pass
// (tuned on first sight, like conv2d_forward; ConvBackend::Force takes any plan that runs),
// KILN_CONV_STATS not 0 — and then y, sum and sqsum hold no result.
bool conv2d_forward_stats(const Tensor& y, const Tensor& sum, const Tensor& sqsum,
                          const Tensor& x, const Tensor& w, const ConvParams& p);
void conv2d_backward_data(const Tensor& dx, const Tensor& dy, const Tensor& w, const ConvParams& p,
                          bool accumulate = false);
void conv2d_backward_weight(const Tensor& dw, const Tensor& dy, const Tensor& x,
                            const ConvParams& p, bool accumulate = false);

// ---- pooling (cuda/kernels/pool.cu) ----
// Max pooling saves, per output, the window-local position i*kernel_w + j of the window's first
// maximal element (NaN counts as maximal): `indices` (N, C, OH, OW), any layout, of dtype
// max_pool2d_indices_dtype(p): u8 when the window has at most 255 positions, else i32. The
// value 255 (u8) or -1 (i32) marks a window that holds no input element (its y is -inf).
inline DType max_pool2d_indices_dtype(const PoolParams& p) {
  return p.kernel_h * p.kernel_w <= 255 ? DType::u8 : DType::i32;
}
// y (N, C, OH, OW) = window maxima, indices as above (both `=`).
void max_pool2d_forward(const Tensor& y, const Tensor& indices, const Tensor& x,
                        const PoolParams& p);
// dx (N, C, H, W) = dy routed to the saved positions, summed where windows overlap (`=`, dx
// fully written; a gather without atomics, so deterministic).
void max_pool2d_backward(const Tensor& dx, const Tensor& dy, const Tensor& indices,
                         const PoolParams& p);
void avg_pool2d_forward(const Tensor& y, const Tensor& x, const PoolParams& p);
void avg_pool2d_backward(const Tensor& dx, const Tensor& dy, const PoolParams& p);
// Adaptive average pooling with PyTorch's window rule (global average pooling when 1x1).
void adaptive_avg_pool2d_forward(const Tensor& y, const Tensor& x);
void adaptive_avg_pool2d_backward(const Tensor& dx, const Tensor& dy);

// ---- batch norm (cuda/batchnorm.cpp, cuda/kernels/batchnorm.cu) ----
// x, y: (N, C, H, W) or (N, C); weight, bias, running stats: f32 (C).
// Training: writes y, save_mean (C) and save_invstd (C) = 1/sqrt(var_biased + eps), and updates
// running_mean/var in place (when defined) with momentum and the unbiased variance.
void batch_norm_forward_training(const Tensor& y, const Tensor& save_mean,
                                 const Tensor& save_invstd, const Tensor& x, const Tensor& weight,
                                 const Tensor& bias, const Tensor& running_mean,
                                 const Tensor& running_var, double momentum, double eps);
void batch_norm_forward_eval(const Tensor& y, const Tensor& x, const Tensor& weight,
                             const Tensor& bias, const Tensor& running_mean,
                             const Tensor& running_var, double eps);
// Training-mode backward: dx (=), dweight and dbias (=) when defined.
void batch_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& weight,
                         const Tensor& save_mean, const Tensor& save_invstd);

// ---- fused batch norm + ReLU (+ residual add) on cuDNN (cuda/batchnorm.cpp) ----
// x, z, y: (N, C, H, W) f16 channels-last (NHWC) only — anything else is a kiln::Error naming
// the op. Forward: y = relu(bn(x)) or relu(bn(x) + z), with save_mean/save_invstd and the
// running stats as in batch_norm_forward_training. Returns the reserve space (u8, on x's
// device, possibly empty) that the matching backward needs: keep it alive with y.
Tensor batch_norm_relu_forward_training(const Tensor& y, const Tensor& save_mean,
                                        const Tensor& save_invstd, const Tensor& x,
                                        const Tensor& weight, const Tensor& bias,
                                        const Tensor& running_mean, const Tensor& running_var,
                                        double momentum, double eps);
Tensor batch_norm_add_relu_forward_training(const Tensor& y, const Tensor& save_mean,
                                            const Tensor& save_invstd, const Tensor& x,
                                            const Tensor& z, const Tensor& weight,
                                            const Tensor& bias, const Tensor& running_mean,
                                            const Tensor& running_var, double momentum,
                                            double eps);
// Backward through relu and bn (and the add): dx (=), dz (=, add variant), dweight and dbias
// (=) when defined. y is the forward's output, eps and reserve the forward's.
void batch_norm_relu_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                              const Tensor& dy, const Tensor& x, const Tensor& y,
                              const Tensor& weight, const Tensor& bias, const Tensor& save_mean,
                              const Tensor& save_invstd, const Tensor& reserve, double eps);
void batch_norm_add_relu_backward(const Tensor& dx, const Tensor& dz, const Tensor& dweight,
                                  const Tensor& dbias, const Tensor& dy, const Tensor& x,
                                  const Tensor& y, const Tensor& weight, const Tensor& bias,
                                  const Tensor& save_mean, const Tensor& save_invstd,
                                  const Tensor& reserve, double eps);

// ---- softmax and cross-entropy (cuda/kernels/softmax.cu) ----
// Over the last dim of contiguous (rows, cols).
void softmax_forward(const Tensor& y, const Tensor& x, bool log);
// dx = y*(dy - Σ dy*y) (softmax) or dy - exp(y)*Σ dy (log_softmax).
void softmax_backward(const Tensor& dx, const Tensor& dy, const Tensor& y, bool log);
// Fused softmax-cross-entropy over logits (N, C) and i64 targets (N): loss (f32 scalar, mean over
// N), grad (N, C) = (softmax - smoothed target) * grad_scale / N, and correct (i64 scalar) =
// number of rows whose argmax equals the target. grad has the logits' dtype or f32 (for 16-bit
// logits: unrounded, so a later loss scale is applied before the one rounding to 16 bits).
void cross_entropy_fused(const Tensor& loss, const Tensor& grad, const Tensor& correct,
                         const Tensor& logits, const Tensor& target, double label_smoothing,
                         double grad_scale);

}  // namespace kiln::cuda
