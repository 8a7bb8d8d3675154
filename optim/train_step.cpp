#include "optim/train_step.h"

#include "core/autograd.h"
#include "core/switches.h"
#include "ops/ops.h"

namespace kiln::optim {

namespace {
constinit RuntimeSwitch g_overwrite{&Switches::grad_overwrite};  // KILN_GRAD_OVERWRITE
}  // namespace

bool grad_overwrite_enabled() { return g_overwrite.get(); }
void set_grad_overwrite_enabled(bool on) { g_overwrite.set(on); }

ClassifierStep::ClassifierStep(nn::Module& model, FusedOptimizer& opt, DynamicLossScaler& scaler,
                               double label_smoothing, double clip_grad_norm)
    : model_(model), opt_(opt), scaler_(scaler), label_smoothing_(label_smoothing),
      max_grad_norm_(clip_grad_norm) {
  KILN_CHECK(clip_grad_norm >= 0, "ClassifierStep: clip_grad_norm ", clip_grad_norm,
             " must be >= 0 (0: no clipping)");
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(opt.device());
  // Σ loss·N in f64: kiln-train logs each step's loss as the difference of two readings of this
  // sum. In f32, late in an ImageNet-sized epoch, that difference kept only ~3 digits, and a
  // resumed run (its sum restarted) rounded it otherwise.
  loss_sum_ = zeros({}, TensorOptions(DType::f64).with_device(opt.device()));
  correct_sum_ = zeros({}, f32);
}

void ClassifierStep::run(const Tensor& x, const Tensor& y) {
  KILN_CHECK(x.dim() >= 2 && y.dim() == 1 && x.size(0) == y.size(0),
             "ClassifierStep: inputs ", x.desc(), " and labels ", y.desc(), " do not match");
  opt_.zero_grad();
  Tensor logits = model_(x);
  Tensor loss = F::cross_entropy(logits, y, label_smoothing_);
  // zero_grad just zeroed the gradient arena: the first write into each .grad may overwrite
  // (KILN_GRAD_OVERWRITE=0: always add).
  autograd::backward({scaler_.scale(loss)}, {Tensor()}, /*retain_graph=*/false,
                     g_overwrite.get() ? opt_.grad_arena() : Tensor());
  if (max_grad_norm_ > 0) {
    scaler_.unscale_(opt_);
    clip_grad_norm_(opt_, max_grad_norm_);
  }
  scaler_.step(opt_);
  if (after_step_) after_step_();
  scaler_.update();
  NoGradGuard no_grad;
  const double n = double(y.size(0));
  F::add_(loss_sum_, loss.detach().to(DType::f64), n);
  F::add_(correct_sum_, F::sum(F::eq(F::argmax(logits.detach(), 1), y).to(DType::f32)));
}

void ClassifierStep::reset_metrics() {
  loss_sum_.zero_();
  correct_sum_.zero_();
}

}  // namespace kiln::optim
