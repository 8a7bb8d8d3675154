#pragma once
// The CUDA backend's entry points called by ops/*.cpp (the counterpart of ops/cpu/kernels.h).
// Inputs are validated by the caller; each function writes every element of its output (`=`)
// on the current device's compute stream. f32 and f16 (f32 accumulation) are supported.
#include "core/tensor.h"
#include "ops/kinds.h"

namespace kiln::cuda {

void unary(UnaryOp op, const Tensor& out, const Tensor& a, double scalar);
void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b, double alpha);
void reduce_rows(ReduceOp op, const Tensor& out, const Tensor& x, int64_t rows, int64_t inner);

}  // namespace kiln::cuda
