// cross_entropy: validation, fused forward (loss and logits gradient in one pass), backward,
// device dispatch. The gradient d(loss)/d(logits) = (softmax - q)/N is computed with the loss
// and saved; backward only scales it by the upstream gradient.
#include "ops/check.h"
#include "ops/ops.h"

namespace kiln::F {
namespace {

class CrossEntropyBackward final : public Node {
 public:
  explicit CrossEntropyBackward(const Tensor& grad) : grad_(grad) {}
  std::string name() const override { return "CrossEntropyBackward"; }
  void release_saved() override { grad_.release(); }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    Tensor grad = grad_.get(*this);
    // (N, C) · 0-d upstream. A loss scale such as 65536 does not fit in f16, so 16-bit
    // gradients are scaled in f32 and rounded once.
    if (grad.dtype() == DType::f16 || grad.dtype() == DType::bf16)
      return {mul(grad.to(DType::f32), grads[0].to(DType::f32)).to(grad.dtype())};
    return {mul(grad, grads[0].to(grad.dtype()))};
  }

 private:
  SavedTensor grad_;
};

// Host-side range check of CPU targets; the message names the first bad value and its index.
template <typename I>
void check_targets(const Tensor& target, int64_t classes) {
  const I* t = target.data<I>();
  for (int64_t i = 0; i < target.numel(); ++i)
    KILN_CHECK(t[i] >= 0 && int64_t(t[i]) < classes, "cross_entropy: target ", int64_t(t[i]),
               " at index ", i, " is out of range [0, ", classes, ")");
}

}  // namespace

Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing) {
  KILN_OP_SCOPE("cross_entropy", logits);
  check_defined(logits, "cross_entropy", "logits");
  check_defined(target, "cross_entropy", "target");
  check_float(logits, "cross_entropy");
  check_dim(logits, 2, "cross_entropy", "logits (N, C)");
  check_dim(target, 1, "cross_entropy", "target (N)");
  KILN_CHECK(target.dtype() == DType::i64 || target.dtype() == DType::i32,
             "cross_entropy: target must hold class indices (i64 or i32), got ", target.desc());
  KILN_CHECK(target.size(0) == logits.size(0), "cross_entropy: batch size mismatch: logits ",
             logits.desc(), " vs target ", target.desc());
  KILN_CHECK(target.device() == logits.device(), "cross_entropy: device mismatch: logits ",
             logits.desc(), " vs target ", target.desc());
  KILN_CHECK(logits.size(0) > 0 && logits.size(1) > 0, "cross_entropy: empty logits ",
             logits.desc());
  KILN_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0,
             "cross_entropy: label_smoothing must be in [0, 1], got ", label_smoothing);
  const int64_t n = logits.size(0), c = logits.size(1);
  const Tensor lc = logits.detach().contiguous();
  const Tensor tc = target.to(DType::i64).contiguous();
  // Targets on the host are range-checked here; on a device that would synchronise every step.
  if (tc.is_cpu()) check_targets<int64_t>(tc, c);
  const auto opts = TensorOptions(logits.dtype()).with_device(logits.device());
  Tensor grad = empty({n, c}, opts);
  // The loss in f32 (f64 for f64 logits): 16-bit logits give an f32 loss.
  Tensor loss = empty({}, opts.with_dtype(logits.dtype() == DType::f64 ? DType::f64 : DType::f32));
  Tensor correct = empty({}, opts.with_dtype(DType::i64));
  backend(logits).cross_entropy(loss, grad, correct, lc, tc, label_smoothing, 1.0);
  if (autograd::any_requires_grad({logits})) {
    auto node = std::make_shared<CrossEntropyBackward>(grad);
    node->set_inputs({logits});
    autograd::set_history(loss, node);
  }
  return loss;
}

}  // namespace kiln::F
