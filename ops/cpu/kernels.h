#pragma once
// CPU kernels (the reference backend), internal to ops/cpu/: ops/cpu/backend.cpp puts them in
// the CPU table, whose entries' contracts core/backend.h states. The notes below add only what
// is particular to the CPU: f32 and f64 compute (statistics accumulated in double), any input
// strides, OpenMP over large loops.
#include "core/tensor.h"
#include "core/kinds.h"

namespace kiln::cpu {

// out = op(a, scalar). a and out have the same shape; any strides.
void unary(UnaryOp op, const Tensor& out, const Tensor& a, double scalar);
// out = a (op) b. a and b already broadcast (expanded) to out's shape; any strides.
void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b, double alpha);
// out[i] = reduce over the trailing `inner` elements of row i of contiguous x viewed (rows, inner).
void reduce_rows(ReduceOp op, const Tensor& out, const Tensor& x, int64_t rows, int64_t inner);
void reduce_cols(const Tensor& out, const Tensor& x, int64_t outer, int64_t cols);

}  // namespace kiln::cpu

// ---- max / argmax (ops/cpu/max.cpp) ----
namespace kiln::cpu {

// x contiguous (rows, inner), inner > 0: values (rows) = max of each row, indices (rows, i64) =
// position of the first maximal element (a NaN counts as maximal). Both contiguous, `=`.
void max_rows(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t rows,
              int64_t inner);
// dx contiguous (rows, inner) = 0 except dx[r, indices[r]] = g[r]; g (rows), indices (rows, i64)
// contiguous. `=`: dx is fully written.
void scatter_rows(const Tensor& dx, const Tensor& g, const Tensor& indices, int64_t rows,
                  int64_t inner);

}  // namespace kiln::cpu

// ---- matmul (ops/cpu/matmul.cpp) ----
namespace kiln::cpu {

// out = op(a)·op(b) on Eigen's GEMM (op = transpose when the flag is set). a, b and out are
// contiguous and either all 2-D or all 3-D with the same batch size; a stores op(a)'s matrix
// transposed when trans_a is set (likewise b). out (..., n, m) is written (`=`). OpenMP: over
// the products, and over fixed 128 × 256 tiles of the output of those with n·k·m ≥ 2^21, each
// tile one single-threaded Eigen GEMM: the same bits on any thread count.
void matmul(const Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b);

// The cache sizes in bytes (L1, L2, L3) Eigen's GEMMs block for, which set the order of their
// sums: Eigen's fixed defaults, never the CPU's (EIGEN_NO_CPUID, CMakeLists.txt), so a portable
// build gives the same bits on every x86-64 CPU. `queried` is what Eigen asked the CPU for (-1:
// nothing, as it must be). `threads`: the threads Eigen would split one GEMM over (1: never, as
// it must be: EIGEN_DONT_PARALLELIZE, CMakeLists.txt).
struct GemmCacheSizes {
  int64_t l1, l2, l3, queried_l1;
  int threads;
};
GemmCacheSizes gemm_cache_sizes();

}  // namespace kiln::cpu

// ---- batch norm (ops/cpu/batch_norm.cpp) ----
// x, y, dy, dx: (N, C, ...) dense, row-major or channels-last (each may differ); params and
// statistics (C) of x's dtype, any stride; weight/bias/running stats may be undefined
// (weight = 1, bias = 0). Statistics are accumulated in double.
namespace kiln::cpu {
// y (=), save_mean (=), save_invstd (=) = 1/sqrt(var_biased + eps); running_mean/var updated in
// place when defined: r = (1-momentum)*r + momentum*stat (unbiased variance). N·spatial > 1.
void batch_norm_forward_training(const Tensor& y, const Tensor& save_mean,
                                 const Tensor& save_invstd, const Tensor& x, const Tensor& weight,
                                 const Tensor& bias, const Tensor& running_mean,
                                 const Tensor& running_var, double momentum, double eps);
// y (=) = (x - running_mean) / sqrt(running_var + eps) * weight + bias.
void batch_norm_forward_eval(const Tensor& y, const Tensor& x, const Tensor& weight,
                             const Tensor& bias, const Tensor& running_mean,
                             const Tensor& running_var, double eps);
// Training-mode backward with the batch statistics of the forward: dx (=) when defined,
// dweight (=) = Σ dy·x̂ and dbias (=) = Σ dy when defined.
void batch_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& weight,
                         const Tensor& save_mean, const Tensor& save_invstd);
}  // namespace kiln::cpu

// ---- sync_batch_norm (ops/cpu/sync_batch_norm.cpp) ----
// The local halves of F::sync_batch_norm; the op all-reduces `stats` and `sums` in between.
// x, y, dy, dx: (N, C, ...) any strides; per-channel tensors of x's dtype, any stride; weight
// and bias may be undefined (1 and 0). Sums are accumulated in double.
namespace kiln::cpu {
// stats (2C+1) = [Σx per channel, Σx² per channel, N·spatial] (=).
void sync_batch_norm_stats(const Tensor& stats, const Tensor& x);
// From the global `stats`: mean = Σx/n, var = Σx²/n - mean² (biased, clamped at 0),
// save_mean (=), save_invstd (=) = 1/sqrt(var + eps), y (=) = (x - mean)·invstd·weight + bias;
// running stats (when defined) r = (1-momentum)·r + momentum·stat (variance unbiased: n/(n-1)).
void sync_batch_norm_apply(const Tensor& y, const Tensor& save_mean, const Tensor& save_invstd,
                           const Tensor& x, const Tensor& weight, const Tensor& bias,
                           const Tensor& running_mean, const Tensor& running_var,
                           const Tensor& stats, double momentum, double eps);
// sums (2C) = [Σdy, Σdy·x̂] per channel (=), x̂ = (x - mean)·invstd.
void sync_batch_norm_backward_sums(const Tensor& sums, const Tensor& dy, const Tensor& x,
                                   const Tensor& mean, const Tensor& invstd);
// dx (=) = weight·invstd·(dy - Σdy/n - x̂·Σdy·x̂/n) with the global `sums` and n = count[0].
void sync_batch_norm_backward_dx(const Tensor& dx, const Tensor& dy, const Tensor& x,
                                 const Tensor& weight, const Tensor& mean, const Tensor& invstd,
                                 const Tensor& sums, const Tensor& count);
}  // namespace kiln::cpu

// ---- softmax (ops/cpu/softmax.cpp) ----
// Over the last dim of contiguous (rows, cols) tensors; outputs (=).
namespace kiln::cpu {
// y = softmax(x) or log_softmax(x) (max subtracted first: stable for large logits).
void softmax_forward(const Tensor& y, const Tensor& x, int64_t rows, int64_t cols, bool log);
// dx = y*(dy - Σ dy*y) (softmax) or dy - exp(y)*Σ dy (log_softmax; y = log-probabilities).
void softmax_backward(const Tensor& dx, const Tensor& dy, const Tensor& y, int64_t rows,
                      int64_t cols, bool log);
// Backend::cross_entropy; loss of logits' dtype; target i64 or i32.
void cross_entropy_forward(const Tensor& loss, const Tensor& grad, const Tensor& correct,
                           const Tensor& logits, const Tensor& target, double label_smoothing,
                           double grad_scale);
}  // namespace kiln::cpu

// ---- conv2d (ops/cpu/conv2d.cpp) ----
// im2col + Eigen GEMM per image, OpenMP over images. Inputs any strides (made contiguous NCHW
// internally); outputs any dense layout. x (N, C, H, W), w (O, C/groups, kH, kW), bias (O) or
// undefined, y/dy (N, O, H', W'). All three write `=`.
namespace kiln::cpu {
void conv2d_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias,
                    const ConvParams& p);
void conv2d_backward_data(const Tensor& dx, const Tensor& dy, const Tensor& w, const ConvParams& p);
void conv2d_backward_weight(const Tensor& dw, const Tensor& dy, const Tensor& x,
                            const ConvParams& p);
}  // namespace kiln::cpu

// ---- pooling (ops/cpu/pool.cpp) ----
// x/dx (N, C, H, W), y/dy (N, C, H', W'); any strides in, any dense layout out; all write `=`.
namespace kiln::cpu {
// Backend::max_pool2d_forward/backward: saved window-local indices, as on CUDA.
void max_pool2d_forward(const Tensor& y, const Tensor& indices, const Tensor& x,
                        const PoolParams& p);
void max_pool2d_backward(const Tensor& dx, const Tensor& dy, const Tensor& indices,
                         const PoolParams& p);
void avg_pool2d_forward(const Tensor& y, const Tensor& x, const PoolParams& p);
void avg_pool2d_backward(const Tensor& dx, const Tensor& dy, const PoolParams& p);
// Window of output i over an input of n: [floor(i*n/o), ceil((i+1)*n/o)).
void adaptive_avg_pool2d_forward(const Tensor& y, const Tensor& x);
void adaptive_avg_pool2d_backward(const Tensor& dx, const Tensor& dy);
}  // namespace kiln::cpu

// ---- layer norm (ops/cpu/layer_norm.cpp), dropout (ops/cpu/random.cpp), embedding and where
// (ops/cpu/index.cpp): the table's contracts; parameters and statistics in x's dtype (f32 or
// f64), statistics accumulated in double ----
namespace kiln::cpu {
void layer_norm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                        const Tensor& weight, const Tensor& bias, int64_t rows, int64_t cols,
                        double eps);
void layer_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& weight,
                         const Tensor& mean, const Tensor& rstd, int64_t rows, int64_t cols,
                         GradientMode mode, GradientMode dx_mode);
void philox_advance(const Tensor& base, const Tensor& offset, int64_t n);
void dropout(const Tensor& out, const Tensor& in, double p, uint64_t seed, const Tensor& base);
void embedding_forward(const Tensor& out, const Tensor& weight, const Tensor& indices);
void embedding_backward(const Tensor& dweight, const Tensor& dout, const Tensor& indices,
                        GradientMode mode);
void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b);
}  // namespace kiln::cpu
