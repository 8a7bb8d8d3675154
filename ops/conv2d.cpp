// conv2d: validation, forward, backward (data, weight, bias), device dispatch.
#include <utility>

#include "core/autograd.h"
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

class Conv2dBackward final : public Node, public detail::FoldedGradTarget {
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
    fold_g_ = fold_coef_ = Tensor();
  }
  // The tail fold (ops/dgrad_sink.h): a stride-1 unpadded 1x1 convolution without bias whose
  // input and weight both need gradients, where the backend has the fold's entries and takes
  // the operands (FastPath::TailFold).
  bool can_take_folded(uint32_t output_nr, const Tensor& g) const override {
    const Shape& ws = input_meta_[1].shape;
    const Shape& xs = input_meta_[0].shape;
    if (output_nr != 0 || fold_g_.defined() || !needs_input_grad(0) || !needs_input_grad(1) ||
        needs_input_grad(2) || !x_.defined() || !w_.defined() || ws.size() != 4 ||
        xs.size() != 4 || ws[2] != 1 || ws[3] != 1 || p_.stride_h != 1 || p_.stride_w != 1 ||
        p_.pad_h != 0 || p_.pad_w != 0 || p_.groups != 1 || g.dim() != 4 ||
        g.shape() != Shape{xs[0], ws[0], xs[2], xs[3]})
      return false;
    const Backend& be = backend(g);
    if (be.conv1x1_fold_prep == nullptr || be.conv1x1_fold_weight_grad == nullptr) return false;
    const Tensor x = x_.get(*this), w = w_.get(*this);
    return supports(be, FastPath::TailFold, {&g, &x, &w});
  }
  void take_folded(uint32_t /*output_nr*/, const Tensor& g, const Tensor& coef) override {
    fold_g_ = g;
    fold_coef_ = coef;
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
  // A stride-2 unpadded 1x1 convolution's data gradient is zero but at x's even pixels: where
  // the node behind x takes those alone (ops/dgrad_sink.h), they are formed as the same
  // convolution's data gradient at stride 1 on the compact grid, (N, C, ⌈H/2⌉, ⌈W/2⌉), and
  // handed over; true when that node took them (dx then stays undefined here).
  bool hand_to_sink_stride2(const Tensor& dy, const Tensor& w) const {
    const Shape& ws = input_meta_[1].shape;
    const Shape& xs = input_meta_[0].shape;
    if (ws.size() != 4 || xs.size() != 4 || ws[2] != 1 || ws[3] != 1 || p_.stride_h != 2 ||
        p_.stride_w != 2 || p_.pad_h != 0 || p_.pad_w != 0 || p_.dil_h != 1 || p_.dil_w != 1 ||
        p_.groups != 1 || !next_edges_[0].valid())
      return false;
    auto* sink = dynamic_cast<detail::DgradSink*>(next_edges_[0].fn.get());
    const uint32_t nr = next_edges_[0].input_nr;
    if (sink == nullptr || !sink->wants_dgrad_stride2(nr)) return false;
    ConvParams p1 = p_;
    p1.stride_h = p1.stride_w = 1;
    const Shape sub{xs[0], xs[1], (xs[2] + 1) / 2, (xs[3] + 1) / 2};
    sink->take_dgrad_stride2(nr, run_backward_data(dy, w, sub, x_format_, p1, Tensor(), false));
    return true;
  }
  // The tail fold's whole data gradient, dgrad(dy, w) + x2 · w2ᵀ + b2, offered to the same node
  // (a 1x1 convolution: apply_folded's only case); true when it took it.
  bool hand_to_sink_linear(const Tensor& dy, const Tensor& w, const Tensor& x2, const Tensor& w2,
                           const Tensor& b2) const {
    if (!next_edges_[0].valid()) return false;
    auto* sink = dynamic_cast<detail::DgradSink*>(next_edges_[0].fn.get());
    return sink && sink->accept_dgrad_linear(next_edges_[0].input_nr, dy, w, x2, w2, b2);
  }
  // dx and dw are fresh tensors (`=`), or the engine's targets with `+=`; db = Σ_{n,h,w} dy.
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    if (fold_g_.defined()) return apply_folded(grads);
    return apply_plain(grads);
  }

 private:
  // The gradient came as factors (take_folded): dy = a·g + b·y + c per output channel, y =
  // x · wᵀ. With K output and C input channels (w: K × C):
  //   dx = dy · w = g · (a ⊙ w) + x · (wᵀ · diag(b) · w) + cᵀ · w
  //   dw = dyᵀ · x = a ⊙ (gᵀ · x) + b ⊙ (w · xᵀx) + c ⊗ Σ_rows x
  // (a ⊙ scales row k by a_k). The first term of dx is this convolution's data gradient with
  // the weight a ⊙ w, handed to the node behind x where it takes one (DgradSink); the second
  // and third are a C → C linear map of x's rows with bias, t, which that node then receives
  // as x's gradient from here, its sink adding the data gradient to it in its GEMM. The small
  // matrices (a ⊙ w, wᵀ·diag(b)·w, cᵀ·w) and dw (from gᵀ·x, xᵀx and Σx, summed in f32: the
  // terms cancel in part) are the backend's two fold entries. Nothing K wide is read but g, and
  // nothing K wide is written.
  std::vector<Tensor> apply_folded(std::vector<Tensor>& grads) {
    NoGradGuard no_grad;
    const Tensor g = std::exchange(fold_g_, Tensor());
    const Tensor coef = std::exchange(fold_coef_, Tensor());
    const Tensor x = x_.get(*this), w = w_.get(*this);
    const int64_t K = w.size(0), C = w.size(1);
    if (grads[0].defined()) {
      // Another consumer of y added to its gradient: dy formed in full (y recomputed), and the
      // plain backward. Not a ResNet's case.
      const Tensor y = conv2d(x, w).to(DType::f32);
      const Shape ch{1, K, 1, 1};
      const Tensor a = coef.narrow(0, 0, K), b = coef.narrow(0, K, K), c = coef.narrow(0, 2 * K, K);
      const Tensor dy = add(add(add(grads[0].to(DType::f32), mul(g.to(DType::f32), a.view(ch))),
                                mul(y, b.view(ch))),
                            c.view(ch));
      grads[0] = dy.to(g.dtype()).contiguous(g.suggest_memory_format());
      return apply_plain(grads);
    }
    const Backend& be = backend(g);
    const TensorOptions wopt = TensorOptions(w.dtype()).with_device(w.device());
    const Tensor wc = w.contiguous();
    Tensor dx, dw;
    if (needs_input_grad(0)) {
      Tensor w1 = empty({K, C, 1, 1}, wopt), m2t = empty({C, C}, wopt), bias = empty({C}, wopt);
      be.conv1x1_fold_prep(w1, m2t, bias, wc, coef);
      // The node behind x may take all of it in one GEMM, t never written; else t = x ·
      // (wᵀ·diag(b)·w) + cᵀ·w on x's rows (channels-last: an (N·H·W, C) matrix), the bias in
      // the GEMM's epilogue, and the data gradient added to it by the sink or by cuDNN (beta = 1).
      if (!hand_to_sink_linear(g, w1, x, m2t, bias)) {
        const int64_t N = x.size(0), H = x.size(2), W = x.size(3);
        const Tensor rows = x.permute({0, 2, 3, 1}).reshape({N * H * W, C});
        Tensor t = linear(rows, m2t, bias).view({N, H, W, C}).permute({0, 3, 1, 2});
        if (!hand_to_sink(g, w1))
          t = run_backward_data(g, w1, input_meta_[0].shape, x_format_, p_, t, false);
        dx = t;
      }
    }
    if (needs_input_grad(1)) {
      dw = empty(w.shape(), TensorOptions(wopt).with_memory_format(w_format_));
      be.conv1x1_fold_weight_grad(dw, g, x, wc, coef);
    }
    return {dx, dw, Tensor()};
  }

  std::vector<Tensor> apply_plain(std::vector<Tensor>& grads) {
    const Tensor& g = grads[0];
    Tensor dx, dw, db;
    if (needs_input_grad(0)) {
      const Tensor w = w_.get(*this);
      if (!hand_to_sink(g, w) && !hand_to_sink_stride2(g, w))
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
  Tensor fold_g_, fold_coef_;  // the output's gradient as factors (take_folded), until apply
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
