#pragma once
// The scalar formulas of the unary and binary families (core/kinds.h), written once for the CPU
// backend (ops/cpu/elementwise.cpp) and the CUDA kernels (cuda/kernels/elementwise.cuh, and any
// fused kernel that wants them). C is the compute type: float for f32/f16/bf16 data, double for
// f64. The `switch` makes the compiler flag a missing op. Host and device differ only where
// their libm's exp, erf, tanh ... round differently (the CUDA-vs-CPU tests allow for it).
#include <cmath>

#include "core/hostdevice.h"
#include "core/kinds.h"

namespace kiln::math {

// The standard normal density and GELU's tanh constants.
template <typename C>
KILN_HD C normal_pdf(C x) {
  using std::exp;
  return C(0.3989422804014327) * exp(C(-0.5) * x * x);  // 1/sqrt(2π) · exp(-x²/2)
}
inline constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2/π)
inline constexpr double kGeluCubic = 0.044715;

template <typename C>
KILN_HD C sigmoid(C x) {
  using std::exp;
  return C(1) / (C(1) + exp(-x));
}

template <typename C>
KILN_HD C unary_apply(UnaryOp op, C x, C s) {
  using std::erf;
  using std::exp;
  using std::log;
  using std::pow;
  using std::sqrt;
  using std::tanh;
  switch (op) {
    case UnaryOp::Neg: return -x;
    case UnaryOp::Exp: return exp(x);
    case UnaryOp::Log: return log(x);
    case UnaryOp::Sqrt: return sqrt(x);
    case UnaryOp::Relu: return x > C(0) ? x : C(0);
    case UnaryOp::Sigmoid: return sigmoid(x);
    case UnaryOp::Tanh: return tanh(x);
    case UnaryOp::PowScalar: return pow(x, s);
    case UnaryOp::AddScalar: return x + s;
    case UnaryOp::MulScalar: return x * s;
    case UnaryOp::RsubScalar: return s - x;
    case UnaryOp::RdivScalar: return s / x;
    case UnaryOp::GtScalar: return x > s ? C(1) : C(0);
    // x·Φ(x), Φ the standard normal CDF (PyTorch's approximate='none').
    case UnaryOp::Gelu: return C(0.5) * x * (C(1) + erf(x * C(0.7071067811865476)));
    // PyTorch's approximate='tanh'.
    case UnaryOp::GeluTanh:
      return C(0.5) * x *
             (C(1) + tanh(C(kSqrt2OverPi) * (x + C(kGeluCubic) * x * x * x)));
    case UnaryOp::Silu: return x * sigmoid(x);
  }
  return x;
}

template <typename C>
KILN_HD C binary_apply(BinaryOp op, C a, C b, C alpha) {
  using std::erf;
  using std::pow;
  using std::tanh;
  switch (op) {
    case BinaryOp::AddScaled: return a + alpha * b;
    case BinaryOp::Mul: return a * b;
    case BinaryOp::Div: return a / b;
    case BinaryOp::Pow: return pow(a, b);
    case BinaryOp::ReluBackward: return b > C(0) ? a : C(0);
    case BinaryOp::Eq: return a == b ? C(1) : C(0);
    // The backward ops: a is the output's gradient, b the forward's input x.
    case BinaryOp::GeluBackward:  // Φ(x) + x·φ(x)
      return a * (C(0.5) * (C(1) + erf(b * C(0.7071067811865476))) + b * normal_pdf(b));
    case BinaryOp::GeluTanhBackward: {
      const C inner = C(kSqrt2OverPi) * (b + C(kGeluCubic) * b * b * b);
      const C t = tanh(inner);
      const C dinner = C(kSqrt2OverPi) * (C(1) + C(3 * kGeluCubic) * b * b);
      return a * (C(0.5) * (C(1) + t) + C(0.5) * b * (C(1) - t * t) * dinner);
    }
    case BinaryOp::SiluBackward: {  // σ(x)·(1 + x·(1 - σ(x)))
      const C sg = sigmoid(b);
      return a * (sg * (C(1) + b * (C(1) - sg)));
    }
  }
  return a;
}

}  // namespace kiln::math
