#pragma once
// The elementwise and reduction families, shared by the CPU and CUDA backends. Each backend
// implements one kernel per family with a `switch` over these enums (the compiler flags a
// missing case), so adding an op means adding a case in both places.
#include <cstdint>

namespace kiln {

enum class UnaryOp : uint8_t { Neg, Exp, Log, Sqrt, Relu, Sigmoid, Tanh, PowScalar, AddScalar,
                               MulScalar, RsubScalar, RdivScalar, GtScalar };
// a (op) b. AddScaled is a + alpha*b. ReluBackward(g, x) = x > 0 ? g : 0.
enum class BinaryOp : uint8_t { AddScaled, Mul, Div, Pow, ReluBackward, Eq };
enum class ReduceOp : uint8_t { Sum, Max };

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

}  // namespace kiln
