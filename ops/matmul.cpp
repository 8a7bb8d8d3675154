// matmul (2-D, batched with broadcast batch dims, 1-D operands as in PyTorch) and linear.
// matmul reduces to one GEMM entry point (Backend::matmul) that takes contiguous operands plus
// a transpose flag, so a transposed view (the operands of the backward GEMMs) costs no copy;
// linear to Backend::linear_forward/backward (the bias in cuBLASLt's epilogue on CUDA).
#include "ops/check.h"
#include "ops/ops.h"

namespace kiln::F {
namespace {

Shape batch_of(const Tensor& t) { return Shape(t.shape().begin(), t.shape().end() - 2); }

Shape concat(Shape s, std::initializer_list<int64_t> tail) {
  s.insert(s.end(), tail);
  return s;
}

// A GEMM operand: contiguous storage and whether its last two dims are stored transposed.
struct Operand {
  Tensor t;
  bool trans = false;
};

Operand as_operand(const Tensor& x) {
  if (x.is_contiguous()) return {x, false};
  Tensor xt = x.transpose(-2, -1);
  if (xt.is_contiguous()) return {xt, true};
  return {x.contiguous(), false};
}

// out (n, m) = a (n, k) · b (k, m), or all 3-D with one batch size. a, b detached.
void gemm(const Tensor& out, const Tensor& a, const Tensor& b) {
  Operand oa = as_operand(a), ob = as_operand(b);
  backend(out).matmul(out, oa.t, oa.trans, ob.t, ob.trans);
}

// Forward GEMM without autograd; a, b at least 2-D and already validated.
Tensor matmul_raw(const Tensor& a_in, const Tensor& b_in) {
  Tensor a = a_in.detach(), b = b_in.detach();
  const int64_t n = a.size(-2), k = a.size(-1), m = b.size(-1);
  const Shape batch_b = batch_of(b);
  const Shape batch = broadcast_shapes(batch_of(a), batch_b, "matmul");
  const int64_t nb = shape_numel(batch);
  Tensor out = empty(concat(batch, {n, m}), TensorOptions(a.dtype()).with_device(a.device()));
  if (out.numel() == 0) return out;
  if (k == 0) {
    out.zero_();
    return out;
  }
  if (shape_numel(batch_b) == 1) {
    // b is one matrix: fold a's batch into its rows, one GEMM (the (N, T, in) x (in, out) case).
    while (b.dim() > 2) b = b.select(0, 0);
    Tensor a2 = a.dim() == 2 ? a : a.reshape({nb * n, k});
    gemm(out.view({nb * n, m}), a2, b);
    return out;
  }
  // Materialise broadcast batch dims; keep a 3-D operand as is so a transposed view stays free.
  auto as_batched = [&](const Tensor& t, int64_t r, int64_t c) {
    if (t.dim() == 3 && batch_of(t) == batch) return t;
    return t.expand(concat(batch, {r, c})).reshape({nb, r, c});
  };
  gemm(out.view({nb, n, m}), as_batched(a, n, k), as_batched(b, k, m));
  return out;
}

class MatmulBackward final : public Node {
 public:
  MatmulBackward(const Tensor& a, const Tensor& b) : a_(a), b_(b) {}
  std::string name() const override { return "MatmulBackward"; }
  void release_saved() override {
    a_.release();
    b_.release();
  }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    const Tensor& g = grads[0];  // (batch..., n, m)
    if (!g.defined()) return {Tensor(), Tensor()};
    Tensor a = a_.get(*this), b = b_.get(*this);
    Tensor ga, gb;
    if (needs_input_grad(0)) ga = sum_to(matmul(g, b.transpose(-2, -1)), a.shape());  // dC·Bᵀ
    if (needs_input_grad(1)) {
      if (shape_numel(batch_of(b)) == 1 && a.dim() > 2) {
        // One shared b: Σ_batch Aᵢᵀ·dCᵢ is a single GEMM over the folded rows.
        const int64_t k = a.size(-1), m = g.size(-1);
        gb = matmul(a.reshape({-1, k}).t(), g.reshape({-1, m})).reshape(b.shape());
      } else {
        gb = sum_to(matmul(a.transpose(-2, -1), g), b.shape());  // Aᵀ·dC
      }
    }
    return {ga, gb};
  }

 private:
  SavedTensor a_, b_;
};

// The tensor a Linear-like node writes parameter gradient i into: the engine's target when it is
// a leaf's .grad known to hold zeros (writing it is then adding to it, core/autograd.h), else a
// fresh tensor of `shape`. The backends' linear entries only write (`=`), so a target that holds
// a sum is declined and the engine adds as usual.
Tensor param_grad_out(const Node& node, size_t i, const Shape& shape, const TensorOptions& opts) {
  if (node.accumulate_target_zero(i)) {
    Tensor t = node.accumulate_target(i);
    if (t.dtype() == opts.dtype && t.is_contiguous()) return t;
  }
  return empty(shape, opts);
}

// The gradients to return: a written target is bumped (its storage changed) and returned as it
// is, which tells the engine it holds the sum.
void settle_param_grad(const Node& node, size_t i, const Tensor& g) {
  if (g.defined() && g.is_same(node.accumulate_target(i))) g.bump_version();
}

class LinearBackward final : public Node {
 public:
  LinearBackward(const Tensor& x, const Tensor& w) : x_(x), w_(w) {}
  std::string name() const override { return "LinearBackward"; }
  // dw and db may be written into a zeroed .grad (param_grad_out).
  bool can_accumulate_into(size_t i) const override { return i == 1 || i == 2; }
  void release_saved() override {
    x_.release();
    w_.release();
  }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    const Tensor& dy = grads[0];  // (N, out)
    if (!dy.defined()) return {Tensor(), Tensor(), Tensor()};
    Tensor x = x_.get(*this), w = w_.get(*this);
    // The backend always writes dw; dx and db only when asked for.
    const TensorOptions opts = TensorOptions(dy.dtype()).with_device(dy.device());
    Tensor dx, db;
    if (needs_input_grad(0)) dx = empty(x.shape(), opts);
    Tensor dw = needs_input_grad(1) ? param_grad_out(*this, 1, w.shape(), opts)
                                    : empty(w.shape(), opts);
    if (needs_input_grad(2)) db = param_grad_out(*this, 2, {w.size(0)}, opts);
    backend(dy).linear_backward(dx, dw, db, dy.contiguous(), x.contiguous(), w.contiguous());
    if (!needs_input_grad(1)) dw = Tensor();
    settle_param_grad(*this, 1, dw);
    settle_param_grad(*this, 2, db);
    return {dx, dw, db};
  }

 private:
  SavedTensor x_, w_;
};

// gelu(linear(x, w, b)) on a backend with the bias-GELU entries: y = x·wᵀ without bias is saved
// (the GELU's input less the bias); the backward gets dy and db from one pass
// (bias_gelu_backward), then dx and dw from linear_backward without a bias.
class LinearGeluBackward final : public Node {
 public:
  LinearGeluBackward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y)
      : x_(x), w_(w), b_(b), y_(y) {}
  std::string name() const override { return "LinearGeluBackward"; }
  bool can_accumulate_into(size_t i) const override { return i == 1 || i == 2; }
  void release_saved() override {
    x_.release();
    w_.release();
    b_.release();
    y_.release();
  }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor()};
    const Tensor dout = grads[0].contiguous();
    Tensor x = x_.get(*this), w = w_.get(*this), b = b_.get(*this), y = y_.get(*this);
    const TensorOptions opts = TensorOptions(dout.dtype()).with_device(dout.device());
    Tensor dy = empty(y.shape(), opts);
    Tensor db = needs_input_grad(2) ? param_grad_out(*this, 2, b.shape(), opts) : Tensor();
    const Backend& be = backend(dout);
    be.bias_gelu_backward(dy, db, dout, y, b);
    Tensor dx = needs_input_grad(0) ? empty(x.shape(), opts) : Tensor();
    Tensor dw = needs_input_grad(1) ? param_grad_out(*this, 1, w.shape(), opts)
                                    : empty(w.shape(), opts);  // the backend always writes dw
    be.linear_backward(dx, dw, Tensor(), dy, x, w);
    if (!needs_input_grad(1)) dw = Tensor();
    settle_param_grad(*this, 1, dw);
    settle_param_grad(*this, 2, db);
    return {dx, dw, db};
  }

 private:
  SavedTensor x_, w_, b_, y_;
};

void check_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const char* op) {
  check_same(x, weight, op);
  check_float(x, op);
  check_dim(x, 2, op, "x");
  check_dim(weight, 2, op, "weight");
  KILN_CHECK(x.size(1) == weight.size(1), op, ": x ", x.desc(), " has ", x.size(1),
             " features but weight ", weight.desc(), " expects ", weight.size(1));
  if (bias.defined()) {
    check_same(x, bias, op);
    KILN_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0), op, ": bias ", bias.desc(),
               " must be [", weight.size(0), "] for weight ", weight.desc());
  }
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  KILN_OP_SCOPE("matmul", a);
  const char* op = "matmul";
  check_same(a, b, op);
  check_float(a, op);
  KILN_CHECK(a.dim() >= 1 && b.dim() >= 1, "matmul: operands must be at least 1-D, got ",
             a.desc(), " and ", b.desc());
  const int64_t ka = a.size(-1), kb = b.dim() == 1 ? b.size(0) : b.size(-2);
  KILN_CHECK(ka == kb, "matmul: shapes ", a.shape_str(), " and ", b.shape_str(),
             " are not aligned (", ka, " != ", kb, ")");
  // 1-D operands as in PyTorch: a vector becomes a row (a) or a column (b), removed afterwards.
  if (a.dim() == 1 || b.dim() == 1) {
    const bool va = a.dim() == 1, vb = b.dim() == 1;
    Tensor r = matmul(va ? a.unsqueeze(0) : a, vb ? b.unsqueeze(-1) : b);
    if (vb) r = r.squeeze(-1);
    if (va) r = r.squeeze(vb ? -1 : -2);
    return r;
  }
  const Shape ba = batch_of(a), bb = batch_of(b);
  for (size_t i = 1; i <= std::min(ba.size(), bb.size()); ++i) {
    const int64_t da = ba[ba.size() - i], db = bb[bb.size() - i];
    KILN_CHECK(da == db || da == 1 || db == 1, "matmul: batch dims of ", a.shape_str(), " and ",
               b.shape_str(), " cannot be broadcast together");
  }
  Tensor out = matmul_raw(a, b);
  if (autograd::any_requires_grad({a, b})) {
    auto node = std::make_shared<MatmulBackward>(a, b);
    node->set_inputs({a, b});
    autograd::set_history(out, node);
  }
  return out;
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  KILN_OP_SCOPE("linear", x);
  check_linear(x, weight, bias, "linear");
  Tensor y = empty({x.size(0), weight.size(0)}, TensorOptions(x.dtype()).with_device(x.device()));
  backend(x).linear_forward(y, x.detach().contiguous(), weight.detach().contiguous(),
                            bias.defined() ? bias.detach().contiguous() : Tensor());
  if (autograd::any_requires_grad({x, weight, bias})) {
    auto node = std::make_shared<LinearBackward>(x, weight);
    node->set_inputs({x, weight, bias});
    autograd::set_history(y, node);
  }
  return y;
}

Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  KILN_OP_SCOPE("linear_gelu", x);
  check_linear(x, weight, bias, "linear_gelu");
  const Backend& be = backend(x);
  const bool fused = be.bias_gelu_forward && be.bias_gelu_backward && bias.defined() &&
                     supports(be, FastPath::BiasGelu, {&x, &weight, &bias});
  if (!fused) return gelu(linear(x, weight, bias));
  const TensorOptions opts = TensorOptions(x.dtype()).with_device(x.device());
  Tensor y = empty({x.size(0), weight.size(0)}, opts);
  be.linear_forward(y, x.detach().contiguous(), weight.detach().contiguous(), Tensor());
  Tensor b = bias.detach().contiguous();
  Tensor out = empty(y.shape(), opts);
  be.bias_gelu_forward(out, y, b);
  if (autograd::any_requires_grad({x, weight, bias})) {
    auto node = std::make_shared<LinearGeluBackward>(x, weight, bias, y);
    node->set_inputs({x, weight, bias});
    autograd::set_history(out, node);
  }
  return out;
}

}  // namespace kiln::F
