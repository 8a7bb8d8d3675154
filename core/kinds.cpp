#include "core/kinds.h"

namespace kiln {

const char* unary_name(UnaryOp op) {
  switch (op) {
    case UnaryOp::Neg: return "neg";
    case UnaryOp::Exp: return "exp";
    case UnaryOp::Log: return "log";
    case UnaryOp::Sqrt: return "sqrt";
    case UnaryOp::Relu: return "relu";
    case UnaryOp::Sigmoid: return "sigmoid";
    case UnaryOp::Tanh: return "tanh";
    case UnaryOp::PowScalar: return "pow";
    case UnaryOp::AddScalar: return "add";
    case UnaryOp::MulScalar: return "mul";
    case UnaryOp::RsubScalar: return "rsub";
    case UnaryOp::RdivScalar: return "rdiv";
    case UnaryOp::GtScalar: return "gt";
    case UnaryOp::Gelu: return "gelu";
    case UnaryOp::GeluTanh: return "gelu_tanh";
    case UnaryOp::Silu: return "silu";
  }
  return "?";
}

const char* binary_name(BinaryOp op) {
  switch (op) {
    case BinaryOp::AddScaled: return "add";
    case BinaryOp::Mul: return "mul";
    case BinaryOp::Div: return "div";
    case BinaryOp::Pow: return "pow";
    case BinaryOp::ReluBackward: return "relu_backward";
    case BinaryOp::Eq: return "eq";
    case BinaryOp::GeluBackward: return "gelu_backward";
    case BinaryOp::GeluTanhBackward: return "gelu_tanh_backward";
    case BinaryOp::SiluBackward: return "silu_backward";
  }
  return "?";
}

}  // namespace kiln
