// conv2d: validation, forward, backward (data, weight, bias), device dispatch.
#include "ops/check.h"
#include "ops/dgrad_sink.h"
#include "ops/ops.h"

namespace kiln::F {
namespace {

// Dense in its own layout, for the CUDA entry points (which take NCHW or NHWC tensors).
Tensor dense(const Tensor& t) { return t.contiguous(t.suggest_memory_format()); }

// Output extent of a dilated window sliding over a padded input.
int64_t conv_out_size(int64_t in, int64_t k, int64_t s, int64_t pad, int64_t d) {
  return (in + 2 * pad - d * (k - 1) - 1) / s + 1;
}

ConvParams validate(const Tensor& x, const Tensor& w, const Tensor& b, Pair stride, Pair padding,
                    Pair dilation, int64_t groups) {
  check_defined(x, "conv2d", "input");
  check_defined(w, "conv2d", "weight");
  check_dim(x, 4, "conv2d", "input");
  check_dim(w, 4, "conv2d", "weight");
  check_same(x, w, "conv2d");
  check_float(x, "conv2d");
  KILN_CHECK(stride.h > 0 && stride.w > 0, "conv2d: stride must be positive, got (", stride.h, ", ",
             stride.w, ")");
  KILN_CHECK(dilation.h > 0 && dilation.w > 0, "conv2d: dilation must be positive, got (",
             dilation.h, ", ", dilation.w, ")");
  KILN_CHECK(padding.h >= 0 && padding.w >= 0, "conv2d: padding must be non-negative, got (",
             padding.h, ", ", padding.w, ")");
  KILN_CHECK(groups > 0, "conv2d: groups must be positive, got ", groups);
  const int64_t c = x.size(1), o = w.size(0);
  KILN_CHECK(c % groups == 0, "conv2d: input ", x.desc(), " has ", c,
             " channels, not divisible by groups = ", groups);
  KILN_CHECK(o % groups == 0, "conv2d: weight ", w.desc(), " has ", o,
             " output channels, not divisible by groups = ", groups);
  KILN_CHECK(w.size(1) * groups == c, "conv2d: weight ", w.desc(), " expects ", w.size(1),
             " input channels per group, but input ", x.desc(), " has ", c,
             " channels / groups = ", groups);
  if (b.defined()) {
    check_same(x, b, "conv2d");
    KILN_CHECK(b.dim() == 1 && b.size(0) == o, "conv2d: bias ", b.desc(), " must be 1-D with ", o,
               " elements (weight ", w.desc(), ")");
  }
  const int64_t ekh = dilation.h * (w.size(2) - 1) + 1, ekw = dilation.w * (w.size(3) - 1) + 1;
  KILN_CHECK(w.size(2) > 0 && w.size(3) > 0, "conv2d: empty kernel in weight ", w.desc());
  KILN_CHECK(ekh <= x.size(2) + 2 * padding.h && ekw <= x.size(3) + 2 * padding.w,
             "conv2d: kernel ", w.desc(), " (dilated extent ", ekh, "x", ekw,
             ") is larger than the padded input ", x.desc(), " (padding ", padding.h, ", ",
             padding.w, "): the output size would be <= 0");
  ConvParams p;
  p.stride_h = stride.h;
  p.stride_w = stride.w;
  p.pad_h = padding.h;
  p.pad_w = padding.w;
  p.dil_h = dilation.h;
  p.dil_w = dilation.w;
  p.groups = groups;
  return p;
}

// dx = dgrad(dy, w), a fresh tensor in `fmt`; or, with `acc` defined, acc += dgrad(dy, w) and
// acc is returned (the backend fuses the `+=` where it can: cuDNN's beta = 1); acc_zero: acc
// is known to hold zeros (GradientMode::AddToZeros: the backend may write it instead).
Tensor run_backward_data(const Tensor& dy, const Tensor& w, const Shape& x_shape, MemoryFormat fmt,
                         const ConvParams& p, const Tensor& acc, bool acc_zero) {
  if (acc.defined()) {
    backend(dy).conv2d_backward_data(acc, dense(dy), dense(w), p,
                                     acc_zero ? GradientMode::AddToZeros
                                              : GradientMode::Accumulate);
    acc.bump_version();
    return acc;
  }
  Tensor dx =
      empty(x_shape, TensorOptions(dy.dtype()).with_device(dy.device()).with_memory_format(fmt));
  backend(dy).conv2d_backward_data(dx, dense(dy), dense(w), p, GradientMode::Set);
  return dx;
}

// dw = wgrad(dy, x), fresh in `fmt`, or acc += wgrad(dy, x) (acc_zero as above).
Tensor run_backward_weight(const Tensor& dy, const Tensor& x, const Shape& w_shape,
                           MemoryFormat fmt, const ConvParams& p, const Tensor& acc,
                           bool acc_zero) {
  if (acc.defined()) {
    backend(dy).conv2d_backward_weight(acc, dense(dy), dense(x), p,
                                       acc_zero ? GradientMode::AddToZeros
                                              : GradientMode::Accumulate);
    acc.bump_version();
    return acc;
  }
  Tensor dw =
      empty(w_shape, TensorOptions(dy.dtype()).with_device(dy.device()).with_memory_format(fmt));
  backend(dy).conv2d_backward_weight(dw, dense(dy), dense(x), p, GradientMode::Set);
  return dw;
}

class Conv2dBackward final : public Node {
 public:
  Conv2dBackward(const Tensor& x, const Tensor& w, const ConvParams& p)
      : x_format_(x.suggest_memory_format()), w_format_(w.suggest_memory_format()), p_(p) {}
  // After set_inputs: keeps x only for dw and w only for dx.
  void save(const Tensor& x, const Tensor& w) {
    if (needs_input_grad(1)) x_ = SavedTensor(x);
    if (needs_input_grad(0)) w_ = SavedTensor(w);
  }
  std::string name() const override { return "Conv2dBackward"; }
  // dx and dw may be accumulated into the engine's buffer (see Node in core/autograd.h).
  bool can_accumulate_into(size_t i) const override { return i <= 1; }
  void release_saved() override {
    x_.release();
    w_.release();
  }
  // A stride-1 convolution, 1x1 unpadded or 3x3 with padding 1, offers its data gradient to
  // the node its input came from (ops/dgrad_sink.h); true when that node took it (dx then stays
  // undefined here).
  bool hand_to_sink(const Tensor& dy, const Tensor& w) const {
    const Shape& ws = input_meta_[1].shape;
    if (ws.size() != 4 || p_.stride_h != 1 || p_.stride_w != 1 || p_.groups != 1 ||
        !next_edges_[0].valid())
      return false;
    const bool k1 = ws[2] == 1 && ws[3] == 1 && p_.pad_h == 0 && p_.pad_w == 0;
    const bool k3 = ws[2] == 3 && ws[3] == 3 && p_.pad_h == 1 && p_.pad_w == 1 && p_.dil_h == 1 &&
                    p_.dil_w == 1;
    if (!k1 && !k3) return false;
    auto* sink = dynamic_cast<detail::DgradSink*>(next_edges_[0].fn.get());
    return sink && sink->accept_dgrad(next_edges_[0].input_nr, dy, w);
  }
  // dx and dw are fresh tensors (`=`), or the engine's targets with `+=`; db = Σ_{n,h,w} dy.
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    const Tensor& g = grads[0];
    Tensor dx, dw, db;
    if (needs_input_grad(0)) {
      const Tensor w = w_.get(*this);
      if (!hand_to_sink(g, w))
        dx = run_backward_data(g, w, input_meta_[0].shape, x_format_, p_, target(0, {g, w}),
                               accumulate_target_zero(0));
    }
    if (needs_input_grad(1)) {
      const Tensor x = x_.get(*this);
      dw = run_backward_weight(g, x, input_meta_[1].shape, w_format_, p_, target(1, {g, x}),
                               accumulate_target_zero(1));
    }
    if (needs_input_grad(2)) db = sum(g, {0, 2, 3});
    return {dx, dw, db};
  }

 private:
  // The engine's target for input i, unless its dtype differs from dy's (mixed-precision
  // graphs: the gradient is converted after apply) or it shares memory with an operand (a
  // leaf's .grad may: cuDNN's output must not alias its inputs).
  Tensor target(size_t i, std::initializer_list<Tensor> operands) const {
    Tensor t = accumulate_target(i);
    const Tensor& dy = *operands.begin();
    if (!t.defined() || !dy.defined() || t.dtype() != dy.dtype()) return {};
    for (const Tensor& o : operands)
      if (o.defined() && t.shares_storage(o)) return {};
    return t;
  }

  SavedTensor x_, w_;
  MemoryFormat x_format_, w_format_;
  ConvParams p_;
};

}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, Pair stride, Pair padding,
              Pair dilation, int64_t groups, ChannelStats* stats) {
  if (stats) *stats = ChannelStats{};
  KILN_OP_SCOPE("conv2d", x);
  const ConvParams p = validate(x, weight, bias, stride, padding, dilation, groups);
  const int64_t oh = conv_out_size(x.size(2), weight.size(2), p.stride_h, p.pad_h, p.dil_h);
  const int64_t ow = conv_out_size(x.size(3), weight.size(3), p.stride_w, p.pad_w, p.dil_w);
  const MemoryFormat fmt = x.suggest_memory_format();
  Tensor y = empty({x.size(0), weight.size(0), oh, ow},
                   TensorOptions(x.dtype()).with_device(x.device()).with_memory_format(fmt));
  const Tensor xd = x.detach(), wd = weight.detach();
  const Tensor bd = bias.defined() ? bias.detach() : Tensor();
  const Backend& be = backend(x);
  bool have_stats = false;
  if (stats && !bd.defined() && be.conv2d_forward_stats) {
    const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
    Tensor sum = empty({y.size(1)}, f32), sqsum = empty({y.size(1)}, f32);
    have_stats = be.conv2d_forward_stats(y, sum, sqsum, dense(xd), dense(wd), p);
    if (have_stats) *stats = ChannelStats{sum, sqsum, y.version()};
  }
  if (!have_stats)
    be.conv2d_forward(y, dense(xd), dense(wd), bd.defined() ? bd.contiguous() : bd, p);
  if (autograd::any_requires_grad({x, weight, bias})) {
    auto node = std::make_shared<Conv2dBackward>(xd, wd, p);
    node->set_inputs({x, weight, bias});
    node->save(xd, wd);
    autograd::set_history(y, node);
  }
  return y;
}

}  // namespace kiln::F
