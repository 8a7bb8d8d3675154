// Layer norm over the trailing dims (transformers' LayerNorm): validation, forward, backward,
// dispatch. Statistics are kept per row (f32 for f16/bf16/f32 data, f64 for f64), so the
// backward needs x, the statistics and the weight, nothing recomputed from scratch.
#include "ops/check.h"
#include "ops/ops.h"

namespace kiln::F {
namespace {

// f16/bf16 data keeps f32 parameters and statistics (mixed precision); other data its own dtype.
DType param_dtype(DType x) { return x == DType::f16 || x == DType::bf16 ? DType::f32 : x; }

class LayerNormBackward final : public Node {
 public:
  LayerNormBackward(const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                    Shape normalized_shape, int64_t rows, int64_t cols)
      : x_(x), weight_(weight), mean_(mean), rstd_(rstd), shape_(std::move(normalized_shape)),
        rows_(rows), cols_(cols) {}
  std::string name() const override { return "LayerNormBackward"; }
  // Every gradient may be added into the engine's buffer or a leaf's .grad (core/autograd.h):
  // dx into the residual stream's partial sum in a pre-norm transformer, without a separate add.
  bool can_accumulate_into(size_t i) const override { return i <= 2; }
  void release_saved() override {
    for (SavedTensor* s : {&x_, &weight_, &mean_, &rstd_}) s->release();
  }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    const Tensor x = x_.get(*this), w = weight_.get(*this);
    Tensor dy = grads[0];
    if (!dy.defined()) return {Tensor(), Tensor(), Tensor()};
    if (dy.dtype() != x.dtype()) dy = dy.to(x.dtype());
    dy = dy.contiguous();
    const TensorOptions popts = TensorOptions(param_dtype(x.dtype())).with_device(x.device());
    Tensor dx;
    GradientMode dx_mode = GradientMode::Set;
    if (needs_input_grad(0)) {
      const Tensor t = accumulate_target(0);
      if (t.defined() && t.dtype() == x.dtype() && t.is_contiguous()) {
        dx = t;  // a target known to hold zeros is written
        if (!accumulate_target_zero(0)) dx_mode = GradientMode::Accumulate;
      } else {
        dx = empty(x.shape(), TensorOptions(x.dtype()).with_device(x.device()));
      }
    }
    // The engine's targets when it offers one for every parameter gradient needed (the kernels
    // add both or write both), else fresh tensors.
    GradientMode mode = GradientMode::Set;
    Tensor dw, db;
    if (targets_usable(popts.dtype)) {
      mode = GradientMode::AddToZeros;
      for (size_t i : {1, 2})
        if (needs_input_grad(i) && !accumulate_target_zero(i)) mode = GradientMode::Accumulate;
      if (needs_input_grad(1)) dw = accumulate_target(1);
      if (needs_input_grad(2)) db = accumulate_target(2);
    } else {
      if (needs_input_grad(1)) dw = empty({cols_}, popts);
      if (needs_input_grad(2)) db = empty({cols_}, popts);
    }
    backend(x).layer_norm_backward(dx, dw.defined() ? dw.view({cols_}) : dw,
                                   db.defined() ? db.view({cols_}) : db, dy, x, w,
                                   mean_.get(*this), rstd_.get(*this), rows_, cols_, mode,
                                   dx_mode);
    if (dx.defined() && dx.is_same(accumulate_target(0))) dx.bump_version();
    if (mode == GradientMode::Set)
      return {dx, dw.defined() ? dw.view(shape_) : dw, db.defined() ? db.view(shape_) : db};
    for (const Tensor* t : {&dw, &db})
      if (t->defined()) t->bump_version();
    return {dx, dw, db};  // the targets themselves: already summed
  }

 private:
  // Whether every needed parameter gradient has a target, dense with the parameters' dtype.
  bool targets_usable(DType dtype) const {
    bool any = false;
    for (size_t i : {1, 2}) {
      if (!needs_input_grad(i)) continue;
      const Tensor t = accumulate_target(i);
      if (!t.defined() || t.dtype() != dtype || !t.is_contiguous()) return false;
      any = true;
    }
    return any;
  }

  SavedTensor x_, weight_, mean_, rstd_;
  Shape shape_;
  int64_t rows_, cols_;
};

}  // namespace

Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps) {
  const char* op = "layer_norm";
  check_defined(x, op, "x");
  check_float(x, op);
  const int64_t nd = int64_t(normalized_shape.size());
  KILN_CHECK(nd >= 1 && nd <= x.dim(), op, ": normalized_shape ", shape_str(normalized_shape),
             " must name 1..", x.dim(), " trailing dims of x ", x.desc());
  for (int64_t i = 0; i < nd; ++i)
    KILN_CHECK(x.size(x.dim() - nd + i) == normalized_shape[size_t(i)], op, ": normalized_shape ",
               shape_str(normalized_shape), " does not match the trailing dims of x ", x.desc());
  int64_t cols = 1;
  for (int64_t d : normalized_shape) cols *= d;
  KILN_CHECK(cols > 0, op, ": normalized_shape ", shape_str(normalized_shape), " is empty");
  KILN_CHECK(eps >= 0, op, ": eps ", eps, " must be >= 0");
  const DType pdtype = param_dtype(x.dtype());
  for (const auto& [p, what] : {std::pair{&weight, "weight"}, std::pair{&bias, "bias"}}) {
    if (!p->defined()) continue;
    KILN_CHECK(p->shape() == normalized_shape, op, ": ", what, " must have shape ",
               shape_str(normalized_shape), ", got ", p->desc());
    KILN_CHECK(p->dtype() == pdtype && p->device() == x.device(), op, ": ", what, " must be ",
               dtype_name(pdtype), " on ", x.device(), " for x ", x.desc(), ", got ", p->desc());
  }
  KILN_OP_SCOPE("layer_norm", x);
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  const Tensor xc = x.detach().contiguous();
  const Tensor wc = weight.defined() ? weight.detach().contiguous().view({cols}) : Tensor();
  const Tensor bc = bias.defined() ? bias.detach().contiguous().view({cols}) : Tensor();
  const TensorOptions sopts = TensorOptions(param_dtype(x.dtype())).with_device(x.device());
  Tensor y = empty(x.shape(), TensorOptions(x.dtype()).with_device(x.device()));
  Tensor mean = empty({rows}, sopts), rstd = empty({rows}, sopts);
  backend(x).layer_norm_forward(y, mean, rstd, xc, wc, bc, rows, cols, eps);
  if (autograd::any_requires_grad({x, weight, bias})) {
    auto node = std::make_shared<LayerNormBackward>(xc, wc, mean, rstd, normalized_shape, rows,
                                                    cols);
    node->set_inputs({x, weight, bias});
    autograd::set_history(y, node);
  }
  return y;
}

}  // namespace kiln::F
