// Elementwise ops with broadcasting: validation, forward, backward, device dispatch.
#include <cmath>

#include "ops/check.h"
#include "ops/ops.h"

namespace kiln {

namespace F {

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    KILN_CHECK(da == db || da == 1 || db == 1, op, ": shapes ", shape_str(a), " and ",
               shape_str(b), " cannot be broadcast together");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

namespace {

// Output for an elementwise op: the inputs' layout when they agree on a dense one (so NHWC
// stays NHWC), else contiguous.
Tensor elementwise_out(const Shape& shape, const Tensor& a, const Tensor* b) {
  MemoryFormat fmt = MemoryFormat::Contiguous;
  if (a.shape() == shape && a.suggest_memory_format() == MemoryFormat::ChannelsLast &&
      (!b || b->shape() != shape || b->suggest_memory_format() == MemoryFormat::ChannelsLast))
    fmt = MemoryFormat::ChannelsLast;
  return empty(shape, TensorOptions(a.dtype()).with_device(a.device()).with_memory_format(fmt));
}

Tensor run_unary(UnaryOp op, const Tensor& a, double s) {
  KILN_OP_SCOPE(unary_name(op), a);
  check_defined(a, unary_name(op));
  Tensor out = elementwise_out(a.shape(), a, nullptr);
  backend(a).unary(op, out, a, s);
  return out;
}

Tensor run_binary(BinaryOp op, const Tensor& a, const Tensor& b, double alpha) {
  KILN_OP_SCOPE(binary_name(op), a);
  const char* name = binary_name(op);
  check_same(a, b, name);
  Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  Tensor out = elementwise_out(shape, a, &b);
  Tensor ea = a.shape() == shape ? a.detach() : a.detach().expand(shape);
  Tensor eb = b.shape() == shape ? b.detach() : b.detach().expand(shape);
  backend(a).binary(op, out, ea, eb, alpha);
  return out;
}

// Backward of the binary family. Saves what each op needs.
class BinaryBackward final : public Node {
 public:
  BinaryBackward(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out, double alpha)
      : op_(op), alpha_(alpha) {
    if (op == BinaryOp::Mul || op == BinaryOp::Div || op == BinaryOp::Pow) {
      a_ = SavedTensor(a);
      b_ = SavedTensor(b);
    }
    if (op == BinaryOp::Pow) out_ = SavedTensor(out);
  }
  std::string name() const override { return std::string(binary_name(op_)) + "Backward"; }
  void release_saved() override {
    a_.release();
    b_.release();
    out_.release();
  }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    const Tensor& g = grads[0];
    const Shape& sa = input_meta_[0].shape;
    const Shape& sb = input_meta_[1].shape;
    Tensor ga, gb;
    switch (op_) {
      case BinaryOp::AddScaled:
        if (needs_input_grad(0)) ga = sum_to(g, sa);
        if (needs_input_grad(1)) gb = sum_to(alpha_ == 1.0 ? g : mul(g, alpha_), sb);
        break;
      case BinaryOp::Mul: {
        Tensor a = a_.get(*this), b = b_.get(*this);
        if (needs_input_grad(0)) ga = sum_to(mul(g, b), sa);
        if (needs_input_grad(1)) gb = sum_to(mul(g, a), sb);
        break;
      }
      case BinaryOp::Div: {
        Tensor a = a_.get(*this), b = b_.get(*this);
        Tensor g_over_b = div(g, b);
        if (needs_input_grad(0)) ga = sum_to(g_over_b, sa);
        if (needs_input_grad(1)) gb = sum_to(neg(mul(g_over_b, div(a, b))), sb);
        break;
      }
      case BinaryOp::Pow: {
        Tensor a = a_.get(*this), b = b_.get(*this), out = out_.get(*this);
        // d/da a^b = b a^(b-1) = b * out / a; d/db a^b = out * log(a)
        if (needs_input_grad(0)) ga = sum_to(mul(g, mul(b, pow(a, sub(b, ones_like(b))))), sa);
        if (needs_input_grad(1)) gb = sum_to(mul(g, mul(out, log(a))), sb);
        break;
      }
      case BinaryOp::ReluBackward:
      case BinaryOp::Eq:
      case BinaryOp::GeluBackward:
      case BinaryOp::GeluTanhBackward:
      case BinaryOp::SiluBackward:
        KILN_FAIL(binary_name(op_), " is not differentiable");
    }
    return {ga, gb};
  }

 private:
  BinaryOp op_;
  double alpha_;
  SavedTensor a_, b_, out_;
};

Tensor binary_op(BinaryOp op, const Tensor& a, const Tensor& b, double alpha) {
  Tensor out = run_binary(op, a, b, alpha);
  if (autograd::any_requires_grad({a, b})) {
    auto node = std::make_shared<BinaryBackward>(op, a, b, out, alpha);
    node->set_inputs({a, b});
    autograd::set_history(out, node);
  }
  return out;
}

// Backward of the unary family; saves the input or the output as its formula needs.
class UnaryBackward final : public Node {
 public:
  UnaryBackward(UnaryOp op, const Tensor& a, const Tensor& out, double s) : op_(op), s_(s) {
    switch (op) {
      case UnaryOp::Log: case UnaryOp::Relu: case UnaryOp::PowScalar: case UnaryOp::RdivScalar:
      case UnaryOp::Gelu: case UnaryOp::GeluTanh: case UnaryOp::Silu:
        saved_ = SavedTensor(a);
        break;
      case UnaryOp::Exp: case UnaryOp::Sqrt: case UnaryOp::Sigmoid: case UnaryOp::Tanh:
        saved_ = SavedTensor(out);
        break;
      default: break;
    }
  }
  std::string name() const override { return std::string(unary_name(op_)) + "Backward"; }
  void release_saved() override { saved_.release(); }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    const Tensor& g = grads[0];
    switch (op_) {
      case UnaryOp::Neg: return {neg(g)};
      case UnaryOp::AddScalar: return {g};
      case UnaryOp::MulScalar: return {mul(g, s_)};
      case UnaryOp::RsubScalar: return {neg(g)};
      case UnaryOp::RdivScalar: {  // d(s/a) = -s/a^2
        Tensor a = saved_.get(*this);
        return {mul(div(g, mul(a, a)), -s_)};
      }
      case UnaryOp::Exp: return {mul(g, saved_.get(*this))};
      case UnaryOp::Log: return {div(g, saved_.get(*this))};
      case UnaryOp::Sqrt: return {div(mul(g, 0.5), saved_.get(*this))};
      case UnaryOp::Relu: return {run_binary(BinaryOp::ReluBackward, g, saved_.get(*this), 1.0)};
      case UnaryOp::Sigmoid: {
        Tensor y = saved_.get(*this);
        return {mul(g, mul(y, rsub(y, 1.0)))};
      }
      case UnaryOp::Tanh: {
        Tensor y = saved_.get(*this);
        return {mul(g, rsub(mul(y, y), 1.0))};
      }
      case UnaryOp::PowScalar: {
        Tensor a = saved_.get(*this);
        return {mul(mul(g, pow(a, s_ - 1.0)), s_)};
      }
      case UnaryOp::Gelu:
        return {run_binary(BinaryOp::GeluBackward, g, saved_.get(*this), 1.0)};
      case UnaryOp::GeluTanh:
        return {run_binary(BinaryOp::GeluTanhBackward, g, saved_.get(*this), 1.0)};
      case UnaryOp::Silu:
        return {run_binary(BinaryOp::SiluBackward, g, saved_.get(*this), 1.0)};
      case UnaryOp::GtScalar: KILN_FAIL("gt is not differentiable");
    }
    return {Tensor()};
  }

 private:
  UnaryOp op_;
  double s_;
  SavedTensor saved_;
};

Tensor unary_op(UnaryOp op, const Tensor& a, double s = 0.0) {
  Tensor out = run_unary(op, a, s);
  if (autograd::any_requires_grad({a})) {
    auto node = std::make_shared<UnaryBackward>(op, a, out, s);
    node->set_inputs({a});
    autograd::set_history(out, node);
  }
  return out;
}

void inplace_binary(BinaryOp op, const Tensor& self, const Tensor& other, double alpha,
                    const char* name) {
  check_same(self, other, name);
  autograd::check_inplace(self, name);
  Shape shape = broadcast_shapes(self.shape(), other.shape(), name);
  KILN_CHECK(shape == self.shape(), name, ": cannot broadcast ", other.desc(), " into ",
             self.desc());
  Tensor o = other.shape() == shape ? other.detach() : other.detach().expand(shape);
  // Reading and writing the same element in place is safe; reading memory of self through
  // another layout (x.add_(x.t())) is not, so such an operand is snapshotted first.
  if (o.shares_storage(self) && (o.strides() != self.strides() || o.offset() != self.offset()))
    o = o.clone();
  self.bump_version();
  backend(self).binary(op, self, self, o, alpha);
}

void inplace_unary(UnaryOp op, const Tensor& self, double s, const char* name) {
  check_defined(self, name);
  autograd::check_inplace(self, name);
  self.bump_version();
  backend(self).unary(op, self, self, s);
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b, double alpha) {
  return binary_op(BinaryOp::AddScaled, a, b, alpha);
}
Tensor sub(const Tensor& a, const Tensor& b, double alpha) {
  return binary_op(BinaryOp::AddScaled, a, b, -alpha);
}
Tensor mul(const Tensor& a, const Tensor& b) { return binary_op(BinaryOp::Mul, a, b, 1.0); }
Tensor div(const Tensor& a, const Tensor& b) { return binary_op(BinaryOp::Div, a, b, 1.0); }
Tensor pow(const Tensor& a, const Tensor& e) { return binary_op(BinaryOp::Pow, a, e, 1.0); }
Tensor add(const Tensor& a, double b) { return unary_op(UnaryOp::AddScalar, a, b); }
Tensor mul(const Tensor& a, double b) { return unary_op(UnaryOp::MulScalar, a, b); }
Tensor rsub(const Tensor& a, double b) { return unary_op(UnaryOp::RsubScalar, a, b); }
Tensor rdiv(const Tensor& a, double b) { return unary_op(UnaryOp::RdivScalar, a, b); }
Tensor pow(const Tensor& a, double e) { return unary_op(UnaryOp::PowScalar, a, e); }
Tensor neg(const Tensor& a) { return unary_op(UnaryOp::Neg, a); }
Tensor exp(const Tensor& a) { return unary_op(UnaryOp::Exp, a); }
Tensor log(const Tensor& a) { return unary_op(UnaryOp::Log, a); }
Tensor sqrt(const Tensor& a) { return unary_op(UnaryOp::Sqrt, a); }
Tensor relu(const Tensor& a) { return unary_op(UnaryOp::Relu, a); }
Tensor sigmoid(const Tensor& a) { return unary_op(UnaryOp::Sigmoid, a); }
Tensor tanh(const Tensor& a) { return unary_op(UnaryOp::Tanh, a); }
Tensor gelu(const Tensor& a, GeluApproximate approximate) {
  return unary_op(approximate == GeluApproximate::Tanh ? UnaryOp::GeluTanh : UnaryOp::Gelu, a);
}
Tensor silu(const Tensor& a) { return unary_op(UnaryOp::Silu, a); }

Tensor eq(const Tensor& a, const Tensor& b) {
  // Integer tensors (labels, argmax indices) compare exactly in f64 up to 2^53.
  if (!is_floating(a.dtype()) && a.dtype() == b.dtype())
    return run_binary(BinaryOp::Eq, a.to(DType::f64), b.to(DType::f64), 1.0).to(DType::boolean);
  return run_binary(BinaryOp::Eq, a, b, 1.0).to(DType::boolean);
}
Tensor gt(const Tensor& a, double b) { return run_unary(UnaryOp::GtScalar, a, b).to(DType::boolean); }

void add_(const Tensor& self, const Tensor& other, double alpha) {
  inplace_binary(BinaryOp::AddScaled, self, other, alpha, "add_");
}
void mul_(const Tensor& self, const Tensor& other) {
  inplace_binary(BinaryOp::Mul, self, other, 1.0, "mul_");
}
void add_(const Tensor& self, double v) { inplace_unary(UnaryOp::AddScalar, self, v, "add_"); }
void mul_(const Tensor& self, double v) { inplace_unary(UnaryOp::MulScalar, self, v, "mul_"); }

Tensor sum_to(const Tensor& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  const size_t lead = g.shape().size() - shape.size();
  KILN_CHECK(g.shape().size() >= shape.size(), "sum_to: cannot reduce ", g.desc(), " to ",
             shape_str(shape));
  std::vector<int64_t> dims;
  for (size_t i = 0; i < g.shape().size(); ++i) {
    if (i < lead) {
      dims.push_back(int64_t(i));
    } else if (shape[i - lead] == 1 && g.shape()[i] != 1) {
      dims.push_back(int64_t(i));
    } else {
      KILN_CHECK(shape[i - lead] == g.shape()[i], "sum_to: cannot reduce ", g.desc(), " to ",
                 shape_str(shape));
    }
  }
  Tensor r = sum(g, dims, /*keepdim=*/true);
  return r.reshape(shape);
}

}  // namespace F
}  // namespace kiln
