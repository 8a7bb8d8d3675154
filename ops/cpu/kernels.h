#pragma once
// CPU kernels (the reference backend). Inputs are already validated by ops/*.cpp; each kernel
// writes every element of `out` (`=`), which the caller allocated with the right shape.
// f32 and f64 compute; OpenMP splits large loops over the cores.
#include "core/tensor.h"
#include "ops/kinds.h"

namespace kiln::cpu {

// out = op(a, scalar). a and out have the same shape; any strides.
void unary(UnaryOp op, const Tensor& out, const Tensor& a, double scalar);
// out = a (op) b. a and b already broadcast (expanded) to out's shape; any strides.
void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b, double alpha);
// out[i] = reduce over the trailing `inner` elements of row i of contiguous x viewed (rows, inner).
void reduce_rows(ReduceOp op, const Tensor& out, const Tensor& x, int64_t rows, int64_t inner);

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
// Padding is -inf: a window with no valid element yields -inf and passes no gradient.
void max_pool2d_forward(const Tensor& y, const Tensor& x, const PoolParams& p);
// Routes each dy to the first maximal element of its window (recomputed from x).
void max_pool2d_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const PoolParams& p);
void avg_pool2d_forward(const Tensor& y, const Tensor& x, const PoolParams& p);
void avg_pool2d_backward(const Tensor& dx, const Tensor& dy, const PoolParams& p);
// Window of output i over an input of n: [floor(i*n/o), ceil((i+1)*n/o)).
void adaptive_avg_pool2d_forward(const Tensor& y, const Tensor& x);
void adaptive_avg_pool2d_backward(const Tensor& dx, const Tensor& dy);
}  // namespace kiln::cpu
