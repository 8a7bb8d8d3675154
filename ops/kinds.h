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
