#pragma once
// Device-side scalar formulas of the unary and binary families (core/kinds.h), shared by the
// elementwise kernels and any fused kernel that wants them. C is the compute type (float or
// double); the `switch` makes the compiler flag a missing op.
#include <cuda_runtime.h>

#include "core/kinds.h"

namespace kiln::cuda {

template <typename C>
__device__ inline C unary_apply(UnaryOp op, C x, C s) {
  switch (op) {
    case UnaryOp::Neg: return -x;
    case UnaryOp::Exp: return exp(x);
    case UnaryOp::Log: return log(x);
    case UnaryOp::Sqrt: return sqrt(x);
    case UnaryOp::Relu: return x > C(0) ? x : C(0);
    case UnaryOp::Sigmoid: return C(1) / (C(1) + exp(-x));
    case UnaryOp::Tanh: return tanh(x);
    case UnaryOp::PowScalar: return pow(x, s);
    case UnaryOp::AddScalar: return x + s;
    case UnaryOp::MulScalar: return x * s;
    case UnaryOp::RsubScalar: return s - x;
    case UnaryOp::RdivScalar: return s / x;
    case UnaryOp::GtScalar: return x > s ? C(1) : C(0);
  }
  return x;
}

template <typename C>
__device__ inline C binary_apply(BinaryOp op, C a, C b, C alpha) {
  switch (op) {
    case BinaryOp::AddScaled: return a + alpha * b;
    case BinaryOp::Mul: return a * b;
    case BinaryOp::Div: return a / b;
    case BinaryOp::Pow: return pow(a, b);
    case BinaryOp::ReluBackward: return b > C(0) ? a : C(0);
    case BinaryOp::Eq: return a == b ? C(1) : C(0);
  }
  return a;
}

}  // namespace kiln::cuda
