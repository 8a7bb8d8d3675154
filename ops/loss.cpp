// cross_entropy: validation, fused forward (loss and logits gradient in one pass), backward,
// device dispatch. The gradient d(loss)/d(logits) = (softmax - q)/N is computed with the loss
// and saved; backward only scales it by the upstream gradient. For 16-bit logits it is saved in
// f32 and rounded to 16 bits once, after the upstream gradient (a loss scale such as 2^16) is
// multiplied in: at batch 256 x 1000 classes most entries (~4e-6) are f16 subnormals, so
// rounding before scaling would lose ~1.5% of their value (PyTorch's autocast scales in f32 too).
#include "ops/check.h"
#include "ops/ops.h"

namespace kiln::F {
namespace {

class CrossEntropyBackward final : public Node {
 public:
  CrossEntropyBackward(const Tensor& grad, DType logits_dtype)
      : grad_(grad), logits_dtype_(logits_dtype) {}
  std::string name() const override { return "CrossEntropyBackward"; }
  void release_saved() override { grad_.release(); }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    Tensor grad = grad_.get(*this);
    // (N, C) · 0-d upstream, in the saved gradient's dtype (f32 for 16-bit logits), then one
    // rounding to the logits' dtype.
    return {mul(grad, grads[0].to(grad.dtype())).to(logits_dtype_)};
  }

 private:
  SavedTensor grad_;
  DType logits_dtype_;
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
  const bool half = logits.dtype() == DType::f16 || logits.dtype() == DType::bf16;
  const auto opts = TensorOptions(logits.dtype()).with_device(logits.device());
  Tensor grad = empty({n, c}, opts.with_dtype(half ? DType::f32 : logits.dtype()));
  // The loss in f32 (f64 for f64 logits): 16-bit logits give an f32 loss.
  Tensor loss = empty({}, opts.with_dtype(logits.dtype() == DType::f64 ? DType::f64 : DType::f32));
  Tensor correct = empty({}, opts.with_dtype(DType::i64));
  // The CPU backend computes in f32 or f64: 16-bit logits are widened first.
  const Tensor in = half && lc.is_cpu() ? lc.to(DType::f32) : lc;
  backend(logits).cross_entropy(loss, grad, correct, in, tc, label_smoothing, 1.0);
  if (autograd::any_requires_grad({logits})) {
    auto node = std::make_shared<CrossEntropyBackward>(grad, logits.dtype());
    node->set_inputs({logits});
    autograd::set_history(loss, node);
  }
  return loss;
}

}  // namespace kiln::F
