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
