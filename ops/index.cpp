// Index lookups and selections: embedding (a gather, its backward a deterministic scatter-add)
// and where / masked_fill (elementwise selection with broadcasting).
#include "ops/check.h"
#include "ops/ops.h"

namespace kiln::F {
namespace {

class EmbeddingBackward final : public Node {
 public:
  EmbeddingBackward(const Tensor& indices, Shape weight_shape)
      : indices_(indices), weight_shape_(std::move(weight_shape)) {}
  std::string name() const override { return "EmbeddingBackward"; }
  void release_saved() override { indices_ = Tensor(); }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    const Tensor& g = grads[0];  // (indices..., D)
    if (!g.defined()) return {Tensor()};
    Tensor dw = empty(weight_shape_, TensorOptions(g.dtype()).with_device(g.device()));
    backend(g).embedding_backward(dw, g.contiguous().view({indices_.numel(), weight_shape_[1]}),
                                  indices_, GradientMode::Set);
    return {dw};
  }

 private:
  Tensor indices_;  // i64, contiguous, flat
  Shape weight_shape_;
};

// The gradient of where(cond, a, b) for one side: g where the side was taken, else 0, summed
// back to the side's shape.
Tensor where_grad(const Tensor& g, const Tensor& cond, bool take_a, const Shape& shape) {
  const Tensor zero = zeros_like(g);
  return sum_to(take_a ? where(cond, g, zero) : where(cond, zero, g), shape);
}

class WhereBackward final : public Node {
 public:
  WhereBackward(const Tensor& cond, Shape a, Shape b)
      : cond_(cond), a_(std::move(a)), b_(std::move(b)) {}
  std::string name() const override { return "WhereBackward"; }
  void release_saved() override { cond_ = Tensor(); }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    const Tensor& g = grads[0];
    if (!g.defined()) return {Tensor(), Tensor()};
    return {needs_input_grad(0) ? where_grad(g, cond_, true, a_) : Tensor(),
            needs_input_grad(1) ? where_grad(g, cond_, false, b_) : Tensor()};
  }

 private:
  Tensor cond_;  // broadcast to the output's shape
  Shape a_, b_;
};

}  // namespace

Tensor embedding(const Tensor& indices, const Tensor& weight) {
  const char* op = "embedding";
  check_defined(indices, op, "indices");
  check_defined(weight, op, "weight");
  KILN_CHECK(indices.dtype() == DType::i64, op, ": indices must be i64, got ", indices.desc());
  check_dim(weight, 2, op, "weight");
  KILN_CHECK(indices.device() == weight.device(), op, ": indices ", indices.desc(),
             " and weight ", weight.desc(), " are on different devices");
  const Tensor idx = indices.contiguous().view({indices.numel()});
  if (idx.numel() > 0 && idx.is_cpu()) {
    // Indices on the host are range-checked here; on a device that would cost a synchronisation
    // (and break graph capture), so its kernels give an out-of-range index a zero row instead.
    const Tensor& h = idx;
    const int64_t* p = h.data<int64_t>();
    for (int64_t i = 0; i < h.numel(); ++i)
      KILN_CHECK(p[i] >= 0 && p[i] < weight.size(0), op, ": index ", p[i], " at position ", i,
                 " is outside the table's ", weight.size(0), " rows");
  }
  KILN_OP_SCOPE("embedding", weight);
  Shape shape = indices.shape();
  shape.push_back(weight.size(1));
  Tensor out = empty(shape, TensorOptions(weight.dtype()).with_device(weight.device()));
  backend(weight).embedding_forward(out.view({idx.numel(), weight.size(1)}),
                                    weight.detach().contiguous(), idx);
  if (autograd::any_requires_grad({weight})) {
    auto node = std::make_shared<EmbeddingBackward>(idx, weight.shape());
    node->set_inputs({weight});
    autograd::set_history(out, node);
  }
  return out;
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  const char* op = "where";
  check_defined(cond, op, "cond");
  check_same(a, b, op);
  KILN_CHECK(cond.dtype() == DType::boolean, op, ": cond must be bool, got ", cond.desc());
  KILN_CHECK(cond.device() == a.device(), op, ": cond ", cond.desc(), " and a ", a.desc(),
             " are on different devices");
  const Shape shape =
      broadcast_shapes(broadcast_shapes(cond.shape(), a.shape(), op), b.shape(), op);
  KILN_OP_SCOPE("where", a);
  auto dense = [&](const Tensor& t) { return t.detach().broadcast_to(shape).contiguous(); };
  const Tensor c = dense(cond);
  Tensor out = empty(shape, TensorOptions(a.dtype()).with_device(a.device()));
  backend(a).where(out, c, dense(a), dense(b));
  if (autograd::any_requires_grad({a, b})) {
    auto node = std::make_shared<WhereBackward>(c, a.shape(), b.shape());
    node->set_inputs({a, b});
    autograd::set_history(out, node);
  }
  return out;
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  check_defined(x, "masked_fill", "x");
  return where(mask, full({}, value, TensorOptions(x.dtype()).with_device(x.device())), x);
}

}  // namespace kiln::F
