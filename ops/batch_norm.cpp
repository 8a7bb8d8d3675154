// Batch normalisation: validation, forward (training and eval), backward, device dispatch.
#include <algorithm>

#include "ops/check.h"
#include "ops/ops.h"

namespace kiln::F {
namespace {

// The statistics' dtype: the parameters' when any is given, else x's (f32 for 16-bit x, as the
// CUDA kernels keep statistics in f32).
DType stat_dtype(const Tensor& x, const std::vector<Tensor>& params) {
  for (const Tensor& p : params)
    if (p.defined()) return p.dtype();
  return x.dtype() == DType::f16 || x.dtype() == DType::bf16 ? DType::f32 : x.dtype();
}

void validate(const Tensor& x, const std::vector<Tensor>& params, bool training) {
  static const char* kNames[] = {"weight", "bias", "running_mean", "running_var"};
  check_defined(x, "batch_norm", "x");
  check_float(x, "batch_norm");
  KILN_CHECK(x.dim() >= 2, "batch_norm: x must be (N, C, ...), got ", x.desc());
  const int64_t c = x.size(1);
  const DType pd = stat_dtype(x, params);
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i];
    if (!p.defined()) continue;
    KILN_CHECK(p.dim() == 1 && p.size(0) == c, "batch_norm: ", kNames[i], " must be (", c,
               ") for x ", x.desc(), ", got ", p.desc());
    KILN_CHECK(p.dtype() == pd, "batch_norm: ", kNames[i], " ", p.desc(),
               " does not share the dtype of the other parameters (", dtype_name(pd), ")");
    KILN_CHECK(p.device() == x.device(), "batch_norm: device mismatch: x ", x.desc(), " vs ",
               kNames[i], " ", p.desc());
  }
  if (x.is_cpu())
    KILN_CHECK(pd == x.dtype(), "batch_norm: on the CPU the parameters must have x's dtype: x ",
               x.desc(), ", parameters ", dtype_name(pd));
  else
    KILN_CHECK(pd == DType::f32, "batch_norm: on CUDA the parameters and statistics must be f32, "
               "got ", dtype_name(pd), " for x ", x.desc());
  const Tensor &rm = params[2], &rv = params[3];
  KILN_CHECK(rm.defined() == rv.defined(), "batch_norm: running_mean and running_var must be "
             "given together (got ", rm.desc(), " and ", rv.desc(), ")");
  if (training) {
    KILN_CHECK(x.numel() / std::max<int64_t>(c, 1) > 1, "batch_norm: training needs more than one "
               "value per channel, got x ", x.desc());
    if (rm.defined()) {
      autograd::check_inplace(rm, "batch_norm (running_mean update)");
      autograd::check_inplace(rv, "batch_norm (running_var update)");
    }
  } else {
    KILN_CHECK(rm.defined(), "batch_norm: eval mode needs running_mean and running_var");
  }
}

// t itself when dense in either layout (the kernels read both), else a copy in `fmt`.
Tensor dense(const Tensor& t, MemoryFormat fmt) {
  if (t.is_contiguous() || t.is_contiguous(MemoryFormat::ChannelsLast)) return t;
  return t.contiguous(fmt);
}

// Dims of x other than the channel dim: the reduction of dweight and dbias.
std::vector<int64_t> non_channel_dims(int64_t nd) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < nd; ++d) dims.push_back(d);
  return dims;
}

class BatchNormBackward final : public Node {
 public:
  BatchNormBackward(const Tensor& x, const Tensor& weight, const Tensor& mean,
                    const Tensor& invstd, MemoryFormat fmt)
      : x_(x), weight_(weight), mean_(mean), invstd_(invstd), fmt_(fmt) {}
  std::string name() const override { return "BatchNormBackward"; }
  void release_saved() override {
    x_.release();
    weight_.release();
    mean_.release();
    invstd_.release();
  }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor()};
    Tensor x = x_.get(*this), mean = mean_.get(*this), invstd = invstd_.get(*this);
    Tensor w = weight_.defined() ? weight_.get(*this) : Tensor();
    Tensor dy = dense(grads[0], fmt_);
    const int64_t c = x.size(1);
    const auto popts = TensorOptions(mean.dtype()).with_device(x.device());
    Tensor dx, dw, db;
    if (needs_input_grad(0))
      dx = empty(x.shape(), TensorOptions(x.dtype()).with_device(x.device()).with_memory_format(fmt_));
    if (needs_input_grad(1)) dw = empty({c}, popts);
    if (needs_input_grad(2)) db = empty({c}, popts);
    backend(x).batch_norm_backward(dx, dw, db, dy, x, w, mean, invstd);
    return {dx, dw, db};
  }

 private:
  SavedTensor x_, weight_, mean_, invstd_;
  MemoryFormat fmt_;
};

// Eval mode is a per-channel affine map of x; its backward is composed of F:: ops.
class BatchNormEvalBackward final : public Node {
 public:
  BatchNormEvalBackward(const Tensor& x, const Tensor& weight, const Tensor& rm, const Tensor& rv,
                        double eps)
      : x_(x), weight_(weight), rm_(rm), rv_(rv), eps_(eps) {}
  std::string name() const override { return "BatchNormEvalBackward"; }
  void release_saved() override {
    x_.release();
    weight_.release();
    rm_.release();
    rv_.release();
  }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    const Tensor& g = grads[0];
    if (!g.defined()) return {Tensor(), Tensor(), Tensor()};
    Tensor x = x_.get(*this);
    Shape bshape(size_t(x.dim()), 1);
    bshape[1] = x.size(1);
    Tensor invstd = rdiv(sqrt(add(rv_.get(*this), eps_)), 1.0);  // (C), the parameters' dtype
    auto per_channel = [&](const Tensor& t) { return t.to(x.dtype()).reshape(bshape); };
    const std::vector<int64_t> dims = non_channel_dims(x.dim());
    Tensor dx, dw, db;
    if (needs_input_grad(0))
      dx = mul(g, per_channel(weight_.defined() ? mul(invstd, weight_.get(*this)) : invstd));
    if (needs_input_grad(1)) {
      Tensor xhat = mul(sub(x, per_channel(rm_.get(*this))), per_channel(invstd));
      dw = sum(mul(g, xhat), dims);
    }
    if (needs_input_grad(2)) db = sum(g, dims);
    return {dx, dw, db};
  }

 private:
  SavedTensor x_, weight_, rm_, rv_;
  double eps_;
};

}  // namespace

Tensor batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias,
                  const Tensor& running_mean, const Tensor& running_var, bool training,
                  double momentum, double eps) {
  KILN_OP_SCOPE("batch_norm", x);
  validate(x, {weight, bias, running_mean, running_var}, training);
  const MemoryFormat fmt = x.suggest_memory_format();
  const Tensor xc = x.detach().contiguous(fmt);
  const int64_t c = x.size(1);
  Tensor y = empty(x.shape(), TensorOptions(x.dtype()).with_device(x.device()).with_memory_format(fmt));
  const bool record = autograd::any_requires_grad({x, weight, bias});
  const Tensor w = weight.defined() ? weight.detach() : Tensor();
  const Tensor b = bias.defined() ? bias.detach() : Tensor();

  if (!training) {
    backend(x).batch_norm_forward_eval(y, xc, w, b, running_mean, running_var, eps);
    if (record) {
      auto node = std::make_shared<BatchNormEvalBackward>(xc, w, running_mean, running_var, eps);
      node->set_inputs({x, weight, bias});
      autograd::set_history(y, node);
    }
    return y;
  }

  const auto sopts = TensorOptions(stat_dtype(x, {weight, bias, running_mean, running_var}))
                         .with_device(x.device());
  Tensor save_mean = empty({c}, sopts), save_invstd = empty({c}, sopts);
  if (running_mean.defined()) {
    running_mean.bump_version();
    running_var.bump_version();
  }
  backend(x).batch_norm_forward_training(y, save_mean, save_invstd, xc, w, b, running_mean,
                                         running_var, momentum, eps);
  if (record) {
    auto node = std::make_shared<BatchNormBackward>(xc, w, save_mean, save_invstd, fmt);
    node->set_inputs({x, weight, bias});
    autograd::set_history(y, node);
  }
  return y;
}

}  // namespace kiln::F
