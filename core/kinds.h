#pragma once
// The op vocabulary shared by every layer: the elementwise and reduction families, and the
// geometry of convolutions and pooling after validation. Each backend implements one kernel
// per family with a `switch` over these enums (the compiler flags a missing case), so adding
// an op means adding a case in each backend.
#include <cstdint>

#include "core/dtype.h"

namespace kiln {

// Gelu is x·Φ(x), GeluTanh its tanh approximation, Silu x·sigmoid(x) (core/elementwise_math.h
// has every formula).
enum class UnaryOp : uint8_t { Neg, Exp, Log, Sqrt, Relu, Sigmoid, Tanh, PowScalar, AddScalar,
                               MulScalar, RsubScalar, RdivScalar, GtScalar, Gelu, GeluTanh, Silu };
// a (op) b. AddScaled is a + alpha*b. The *Backward ops take (g, x): ReluBackward(g, x) =
// x > 0 ? g : 0, GeluBackward(g, x) = g·gelu'(x), and so on.
enum class BinaryOp : uint8_t { AddScaled, Mul, Div, Pow, ReluBackward, Eq, GeluBackward,
                                GeluTanhBackward, SiluBackward };
// Reductions: the backends' reduce_rows computes Sum and Max; collectives (cuda/nccl.h) take
// all four (Avg needs a floating dtype).
enum class ReduceOp : uint8_t { Sum, Max, Min, Avg };

// Whether a backward writes a gradient (`=`) or adds into one (`+=`, autograd's
// accumulate-into: the gradient buffer already holds other edges' sum). AddToZeros: `+=` into a
// buffer known to hold zeros (a .grad zero_grad has just cleared): the result must be
// Accumulate's, value for value (the sign of a zero aside), but the backend need not read the
// buffer — it may write it as with Set wherever Set computes the same values (everything but
// cuDNN's weight gradient, whose beta = 1 plan may differ from its beta = 0 one).
enum class GradientMode : uint8_t { Set, Accumulate, AddToZeros };

// The activation a fused normalisation applies to its output: none, ReLU, or the exact GELU
// (x·Φ(x), UnaryOp::Gelu's formula).
enum class Activation : uint8_t { None, Relu, Gelu };

const char* unary_name(UnaryOp op);
const char* binary_name(BinaryOp op);

}  // namespace kiln

namespace kiln {

// Geometry of a 2-D convolution, after validation.
struct ConvParams {
  int64_t stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0, dil_h = 1, dil_w = 1, groups = 1;
};
// Geometry of a 2-D pooling window, after validation (stride already defaulted to the kernel).
struct PoolParams {
  int64_t kernel_h = 1, kernel_w = 1, stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
  int64_t dil_h = 1, dil_w = 1;
  bool count_include_pad = true;  // avg pooling only
};
// The dtype of max pooling's saved window positions (Backend::max_pool2d_forward): u8 when the
// window has at most 255 positions (255 marks an empty window), else i32 (-1 marks it).
inline DType max_pool2d_indices_dtype(const PoolParams& p) {
  return p.kernel_h * p.kernel_w <= 255 ? DType::u8 : DType::i32;
}

}  // namespace kiln
