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
// the batch for many small matrices, else inside Eigen's GEMM.
void matmul(const Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b);

}  // namespace kiln::cpu
