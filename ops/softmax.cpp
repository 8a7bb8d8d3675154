// softmax and log_softmax over any dim: validation, forward, backward, device dispatch.
// The kernels work on the last dim of contiguous (rows, cols); another dim is permuted last
// and made contiguous first, and the result permuted back.
#include "ops/check.h"
#include "ops/ops.h"

namespace kiln::F {
namespace {

// Moves `dim` last (perm) and back (inv); identity when dim is already last.
struct DimLast {
  std::vector<int64_t> perm, inv;
  bool identity = true;
  int64_t rows = 0, cols = 0;

  DimLast(const Tensor& x, int64_t dim) {
    const int64_t nd = x.dim();
    for (int64_t i = 0; i < nd; ++i)
      if (i != dim) perm.push_back(i);
    perm.push_back(dim);
    inv.resize(size_t(nd));
    for (int64_t i = 0; i < nd; ++i) inv[size_t(perm[size_t(i)])] = i;
    identity = dim == nd - 1;
    cols = x.size(dim);
    rows = cols == 0 ? 0 : x.numel() / cols;
  }
  Tensor to_last(const Tensor& t) const {
    return identity ? t.detach().contiguous() : t.detach().permute(perm).contiguous();
  }
  Tensor from_last(const Tensor& t) const { return identity ? t : t.permute(inv).contiguous(); }
};

const char* op_name(bool log) { return log ? "log_softmax" : "softmax"; }

class SoftmaxBackward final : public Node {
 public:
  SoftmaxBackward(const Tensor& y_last, DimLast layout, bool log)
      : y_last_(y_last), layout_(std::move(layout)), log_(log) {}
  std::string name() const override { return log_ ? "LogSoftmaxBackward" : "SoftmaxBackward"; }
  void release_saved() override { y_last_.release(); }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    Tensor y = y_last_.get(*this);
    Tensor dy = layout_.to_last(grads[0]);
    Tensor dx = empty(y.shape(), TensorOptions(y.dtype()).with_device(y.device()));
    backend(y).softmax_backward(dx, dy, y, layout_.rows, layout_.cols, log_);
    return {layout_.from_last(dx)};
  }

 private:
  SavedTensor y_last_;  // output with the softmax dim last, contiguous
  DimLast layout_;
  bool log_;
};

Tensor softmax_impl(const Tensor& x, int64_t dim, bool log) {
  KILN_OP_SCOPE(log ? "log_softmax" : "softmax", x);
  const char* op = op_name(log);
  check_defined(x, op);
  check_float(x, op);
  const int64_t nd = x.dim();
  KILN_CHECK(nd >= 1, op, ": input must have at least one dim, got ", x.desc());
  KILN_CHECK(dim >= -nd && dim < nd, op, ": dim ", dim, " out of range for ", x.desc());
  if (dim < 0) dim += nd;
  DimLast layout(x, dim);
  Tensor xl = layout.to_last(x);
  Tensor yl = empty(xl.shape(), TensorOptions(x.dtype()).with_device(x.device()));
  backend(x).softmax_forward(yl, xl, layout.rows, layout.cols, log);
  Tensor out = layout.from_last(yl);
  if (autograd::any_requires_grad({x})) {
    auto node = std::make_shared<SoftmaxBackward>(yl, layout, log);
    node->set_inputs({x});
    autograd::set_history(out, node);
  }
  return out;
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, false); }
Tensor log_softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, true); }

}  // namespace kiln::F
