// scaled_dot_product_attention: softmax(scale·q·kᵀ [+ causal mask])·v over (B, H, L, D).
// Where the backend supports it (FastPath::Attention, no dropout) one fused kernel each way that
// never materialises the L×L scores, saving only out and the rows' log-sum-exp; otherwise the
// composition of matmul, masked_fill, softmax, dropout and matmul, which defines the result (and
// is the CPU path and the tests' oracle).
#include <cmath>

#include "ops/check.h"
#include "ops/ops.h"

namespace kiln::F {
namespace {

class AttentionBackward final : public Node {
 public:
  AttentionBackward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                    const Tensor& lse, double scale, bool causal)
      : q_(q), k_(k), v_(v), out_(out), lse_(lse), scale_(scale), causal_(causal) {}
  std::string name() const override { return "ScaledDotProductAttentionBackward"; }
  void release_saved() override {
    for (SavedTensor* s : {&q_, &k_, &v_, &out_, &lse_}) s->release();
  }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    Tensor dout = grads[0];
    if (!dout.defined()) return {Tensor(), Tensor(), Tensor()};
    const Tensor q = q_.get(*this), k = k_.get(*this), v = v_.get(*this);
    if (dout.dtype() != q.dtype()) dout = dout.to(q.dtype());
    if (dout.stride(-1) != 1) dout = dout.contiguous();
    auto like = [](const Tensor& t) {
      return empty(t.shape(), TensorOptions(t.dtype()).with_device(t.device()));
    };
    Tensor dq = like(q), dk = like(k), dv = like(v);
    backend(q).attention->backward(dq, dk, dv, dout, q, k, v, out_.get(*this), lse_.get(*this),
                                   scale_, causal_);
    return {needs_input_grad(0) ? dq : Tensor(), needs_input_grad(1) ? dk : Tensor(),
            needs_input_grad(2) ? dv : Tensor()};
  }

 private:
  SavedTensor q_, k_, v_, out_, lse_;
  double scale_;
  bool causal_;
};

// Backward of packed_attention's fused path: dq, dk, dv written straight into one gradient of
// the packed qkv (B, L, 3, H, D) (the kernel takes strided outputs), so no per-part gradient is
// scattered into a zero tensor and summed.
class PackedAttentionBackward final : public Node {
 public:
  PackedAttentionBackward(const Tensor& qkv, const Tensor& out, const Tensor& lse, double scale,
                          bool causal)
      : qkv_(qkv), out_(out), lse_(lse), scale_(scale), causal_(causal) {}
  std::string name() const override { return "PackedAttentionBackward"; }
  void release_saved() override {
    for (SavedTensor* s : {&qkv_, &out_, &lse_}) s->release();
  }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    Tensor dout = grads[0];  // (B, L, H, D)
    if (!dout.defined()) return {Tensor()};
    const Tensor qkv = qkv_.get(*this);
    if (dout.dtype() != qkv.dtype()) dout = dout.to(qkv.dtype());
    if (dout.stride(-1) != 1) dout = dout.contiguous();
    Tensor dqkv = empty(qkv.shape(), TensorOptions(qkv.dtype()).with_device(qkv.device()));
    auto part = [](const Tensor& t, int64_t i) { return t.select(2, i).transpose(1, 2); };
    NoGradGuard ng;
    backend(qkv).attention->backward(part(dqkv, 0), part(dqkv, 1), part(dqkv, 2),
                                     dout.transpose(1, 2), part(qkv, 0), part(qkv, 1),
                                     part(qkv, 2), out_.get(*this).transpose(1, 2),
                                     lse_.get(*this), scale_, causal_);
    return {dqkv};
  }

 private:
  SavedTensor qkv_, out_, lse_;
  double scale_;
  bool causal_;
};

// The composition: the definition of the op.
Tensor attention_composed(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                          double dropout_p, double scale) {
  Tensor s = mul(matmul(q, k.transpose(-2, -1)), scale);  // (B, H, Lq, Lk)
  if (causal) {
    const int64_t lq = q.size(-2), lk = k.size(-2);
    // Query i sees keys j <= i + (Lk - Lq): the last query sees every key.
    Tensor above = empty({lq, lk}, TensorOptions(DType::boolean));
    bool* m = above.data<bool>();
    for (int64_t i = 0; i < lq; ++i)
      for (int64_t j = 0; j < lk; ++j) m[i * lk + j] = j > i + (lk - lq);
    s = masked_fill(s, above.to(q.device()), -INFINITY);
  }
  Tensor p = softmax(s, -1);
  if (dropout_p > 0) p = dropout(p, dropout_p, true);
  return matmul(p, v);
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                    double dropout_p, std::optional<double> scale) {
  const char* op = "scaled_dot_product_attention";
  check_same(q, k, op);
  check_same(q, v, op);
  check_float(q, op);
  KILN_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op,
             ": q, k and v must be 4-D (batch, heads, length, head_dim), got ", q.desc(), ", ",
             k.desc(), ", ", v.desc());
  KILN_CHECK(k.shape() == v.shape() && q.size(0) == k.size(0) && q.size(1) == k.size(1) &&
                 q.size(3) == k.size(3),
             op, ": q ", q.desc(), ", k ", k.desc(), " and v ", v.desc(),
             " must share batch, heads and head_dim, and k and v their length");
  KILN_CHECK(dropout_p >= 0 && dropout_p < 1, op, ": dropout_p ", dropout_p, " must be in [0, 1)");
  KILN_CHECK(!causal || q.size(2) <= k.size(2), op, ": causal attention needs Lq ", q.size(2),
             " <= Lk ", k.size(2));
  const double sc = scale.value_or(1.0 / std::sqrt(double(q.size(3))));
  const Backend& be = backend(q);
  if (dropout_p == 0 && be.attention && supports(be, FastPath::Attention, {&q, &k, &v})) {
    KILN_OP_SCOPE("scaled_dot_product_attention", q);
    // out as (B, Lq, H, D) in memory, seen as (B, H, Lq, D): the layout the output projection
    // reads as (B·Lq, H·D) with no copy.
    Tensor out = empty({q.size(0), q.size(2), q.size(1), q.size(3)},
                       TensorOptions(q.dtype()).with_device(q.device()))
                     .transpose(1, 2);
    Tensor lse = empty({q.size(0), q.size(1), q.size(2)},
                       TensorOptions(DType::f32).with_device(q.device()));
    auto last_dense = [](const Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
    const Tensor qd = last_dense(q.detach()), kd = last_dense(k.detach()),
                 vd = last_dense(v.detach());
    be.attention->forward(out, lse, qd, kd, vd, sc, causal);
    if (autograd::any_requires_grad({q, k, v})) {
      auto node = std::make_shared<AttentionBackward>(qd, kd, vd, out, lse, sc, causal);
      node->set_inputs({q, k, v});
      autograd::set_history(out, node);
    }
    return out;
  }
  return attention_composed(q, k, v, causal, dropout_p, sc);
}

Tensor packed_attention(const Tensor& qkv, bool causal, double dropout_p,
                        std::optional<double> scale) {
  const char* op = "packed_attention";
  check_defined(qkv, op, "qkv");
  check_float(qkv, op);
  KILN_CHECK(qkv.dim() == 5 && qkv.size(2) == 3, op,
             ": qkv must be (batch, length, 3, heads, head_dim), got ", qkv.desc());
  KILN_CHECK(dropout_p >= 0 && dropout_p < 1, op, ": dropout_p ", dropout_p, " must be in [0, 1)");
  const int64_t B = qkv.size(0), L = qkv.size(1), H = qkv.size(3), D = qkv.size(4);
  const double sc = scale.value_or(1.0 / std::sqrt(double(D)));
  auto part = [](const Tensor& t, int64_t i) { return t.select(2, i).transpose(1, 2); };
  const Backend& be = backend(qkv);
  const Tensor flat = qkv.detach();
  const Tensor q = part(flat, 0), k = part(flat, 1), v = part(flat, 2);
  if (dropout_p == 0 && be.attention && supports(be, FastPath::Attention, {&q, &k, &v})) {
    KILN_OP_SCOPE("packed_attention", qkv);
    Tensor out = empty({B, L, H, D}, TensorOptions(qkv.dtype()).with_device(qkv.device()));
    Tensor lse = empty({B, H, L}, TensorOptions(DType::f32).with_device(qkv.device()));
    be.attention->forward(out.transpose(1, 2), lse, q, k, v, sc, causal);
    if (autograd::any_requires_grad({qkv})) {
      auto node = std::make_shared<PackedAttentionBackward>(flat, out, lse, sc, causal);
      node->set_inputs({qkv});
      autograd::set_history(out, node);
    }
    return out;
  }
  return attention_composed(part(qkv, 0), part(qkv, 1), part(qkv, 2), causal, dropout_p, sc)
      .transpose(1, 2)
      .contiguous();
}

}  // namespace kiln::F
