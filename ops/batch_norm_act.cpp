// relu(batch_norm(x) [+ residual]): the tail of every ResNet block. Where the backend supports
// a fast path for the operands at hand (core/backend.h: Backend::supports, the
// BatchNormReluPaths and BatchNormStatsPaths sub-tables; on CUDA cuDNN's BN_ACTIVATION /
// BN_ADD_ACTIVATION kernels and kiln's NHWC kernels), in training, it is one fused pass each way,
// saving the separate add and ReLU passes over the activation and their saved tensors.
// Elsewhere it is the composition of F::batch_norm, F::add and F::relu, which defines the
// result. The ResNet stem's batch norm + ReLU + max pool (batch_norm_relu_max_pool) is fused the
// same way, and so is a bottleneck's bn2 + ReLU into its 1x1 conv3 (batch_norm_relu_conv1x1). Which operands a path takes is the backend's decision alone: nothing here knows a
// device, a dtype or a switch.

#include <atomic>
#include <utility>

#include "ops/check.h"
#include "ops/dgrad_sink.h"
#include "ops/ops.h"

namespace kiln::F {
namespace {

std::atomic<uint64_t> g_dgrad_fusions{0};
std::atomic<uint64_t> g_tail_folds{0};
std::atomic<uint64_t> g_stride2_compact{0};
std::atomic<uint64_t> g_stride2_inplace{0};

// The library-fused BN + ReLU path: training, and the backend takes these operands.
bool relu_path(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
               const Tensor& running_mean, const Tensor& running_var, bool training) {
  const Backend& be = backend(x);
  return training && be.batch_norm_relu &&
         supports(be, FastPath::BatchNormRelu,
                  {&x, &residual, &weight, &bias, &running_mean, &running_var});
}

// The engine's accumulate-into targets for parameter gradients `inputs` of `node` (see Node in
// core/autograd.h) when every needed one is usable by the kernels (contiguous f32 of C values
// on x's device); else none, and the gradients come back fresh.
std::vector<Tensor> param_targets(const Node& node, std::initializer_list<size_t> inputs,
                                  const Tensor& x) {
  std::vector<Tensor> out;
  for (size_t i : inputs) {
    if (!node.needs_input_grad(i)) {
      out.emplace_back();
      continue;
    }
    Tensor t = node.accumulate_target(i);
    if (!(t.defined() && t.dtype() == DType::f32 && t.is_contiguous() && t.dim() == 1 &&
          t.size(0) == x.size(1) && t.device() == x.device()))
      return {};
    out.push_back(t);
  }
  return out;
}

// How a node adds into the targets param_targets gave it: AddToZeros when every one it needs is
// known to hold zeros (Node::accumulate_target_zero: the kernels then write instead of adding),
// else Accumulate.
GradientMode target_mode(const Node& node, std::initializer_list<size_t> inputs) {
  for (size_t i : inputs)
    if (node.needs_input_grad(i) && !node.accumulate_target_zero(i)) return GradientMode::Accumulate;
  return GradientMode::AddToZeros;
}

class BatchNormActBackward final : public Node {
 public:
  BatchNormActBackward(const Tensor& x, const Tensor& y, const Tensor& weight, const Tensor& bias,
                       const Tensor& save_mean, const Tensor& save_invstd, const Tensor& reserve,
                       bool add, double eps)
      : x_(x), y_(y), weight_(weight), bias_(bias), save_mean_(save_mean),
        save_invstd_(save_invstd), reserve_(reserve), add_(add), eps_(eps) {}
  std::string name() const override {
    return add_ ? "BatchNormAddReluBackward" : "BatchNormReluBackward";
  }
  void release_saved() override {
    for (SavedTensor* s : {&x_, &y_, &weight_, &bias_, &save_mean_, &save_invstd_, &reserve_})
      s->release();
  }
  // dweight and dbias may be added straight into the parameters' .grad (cuDNN's betaParamDiff).
  bool can_accumulate_into(size_t i) const override { return i == 2 || i == 3; }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    Tensor x = x_.get(*this), y = y_.get(*this), w = weight_.get(*this), b = bias_.get(*this);
    Tensor dy = grads[0];
    if (!dy.defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    if (!dy.is_contiguous(MemoryFormat::ChannelsLast) || dy.dtype() != x.dtype())
      dy = dy.to(x.dtype()).contiguous(MemoryFormat::ChannelsLast);
    Tensor dx = empty_like(x);
    Tensor dz = add_ ? empty_like(x) : Tensor();
    const std::vector<Tensor> targets = param_targets(*this, {2, 3}, x);
    const bool acc = !targets.empty();
    // cuDNN always computes both; an unwanted one into a scratch the backend provides.
    Tensor dw = acc ? targets[0] : empty_like(w), db = acc ? targets[1] : empty_like(b);
    backend(x).batch_norm_relu->backward(dx, dz, dw, db, dy, x, y, w, b, save_mean_.get(*this),
                                         save_invstd_.get(*this), reserve_.get(*this), eps_,
                                         acc ? target_mode(*this, {2, 3}) : GradientMode::Set);
    return {needs_input_grad(0) ? dx : Tensor(), needs_input_grad(1) ? dz : Tensor(),
            needs_input_grad(2) ? dw : Tensor(), needs_input_grad(3) ? db : Tensor()};
  }

 private:
  SavedTensor x_, y_, weight_, bias_, save_mean_, save_invstd_, reserve_;
  bool add_;
  double eps_;
};

// Backward of batch_norm_from_stats's fused path (BatchNormStatsPaths). With relu it takes the
// data gradient of the stride-1 convolution that reads its output (a ResNet block's tail: the
// next block's conv1; a bottleneck's relu(bn1): conv2, 3x3; relu(bn2): conv3) into its own first
// pass where the backend can (ops/dgrad_sink.h).
class BatchNormStatsBackward final : public Node, public detail::DgradSink {
 public:
  BatchNormStatsBackward(const Tensor& x, const Tensor& mask, const Tensor& weight,
                         const Tensor& save_mean, const Tensor& save_invstd,
                         const Tensor& scale_shift, Activation act, bool add)
      : x_(x), mask_(mask), weight_(weight), save_mean_(save_mean), save_invstd_(save_invstd),
        scale_shift_(scale_shift), act_(act), add_(add) {}
  std::string name() const override {
    if (act_ == Activation::Gelu) return "BatchNormGeluBackward";
    const bool relu = act_ == Activation::Relu;
    return add_ ? (relu ? "BatchNormAddReluBackward" : "BatchNormAddBackward")
                : (relu ? "BatchNormReluBackward" : "BatchNormBackward");
  }
  void release_saved() override {
    for (SavedTensor* s : {&x_, &mask_, &weight_, &save_mean_, &save_invstd_, &scale_shift_})
      s->release();
    dy1_ = w1_ = x2_ = w2_ = b2_ = dsub_ = Tensor();
  }
  // dweight and dbias may be added straight into the parameters' .grad.
  bool can_accumulate_into(size_t i) const override { return i == 2 || i == 3; }
  // The ReLU's mask: the forward's bits with a residual (a block tail), else recomputed from x
  // with the forward's scale and shift (a block's inner relu(bn(y)), read by conv3 alone).
  bool accept_dgrad(uint32_t output_nr, const Tensor& dy1, const Tensor& w1) override {
    if (output_nr != 0 || act_ != Activation::Relu || dy1_.defined() || !x_.defined() ||
        !(add_ ? mask_.defined() : scale_shift_.defined()))
      return false;
    const Tensor x = x_.get(*this);
    const Tensor mask = add_ ? mask_.get(*this) : Tensor();
    const Backend& be = backend(x);
    if (!be.batch_norm_stats->backward_dgrad ||
        !supports(be, FastPath::BatchNormStatsDgrad, {&dy1, &w1, &x, &mask}))
      return false;
    dy1_ = dy1;
    w1_ = w1;
    ++g_dgrad_fusions;
    return true;
  }
  // The tail fold's data gradient of a2 whole (ops/dgrad_sink.h): a relu(bn(x)) whose mask is
  // recomputed from x, the backend's linear form present.
  bool accept_dgrad_linear(uint32_t output_nr, const Tensor& dy1, const Tensor& w1,
                           const Tensor& x2, const Tensor& w2, const Tensor& b2) override {
    if (output_nr != 0 || act_ != Activation::Relu || add_ || dy1_.defined() || !x_.defined() ||
        !scale_shift_.defined())
      return false;
    const Tensor x = x_.get(*this);
    const Backend& be = backend(x);
    if (!be.batch_norm_stats->backward_dgrad_linear ||
        !supports(be, FastPath::BatchNormStatsDgradLinear, {&dy1, &w1, &x, &x2, &w2, &b2}))
      return false;
    dy1_ = dy1;
    w1_ = w1;
    x2_ = x2;
    w2_ = w2;
    b2_ = b2;
    ++g_dgrad_fusions;
    return true;
  }
  // A block tail (relu + z, the forward's bits) takes a stride-2 shortcut's data gradient
  // compact (ops/dgrad_sink.h) where its GEMM reads it so.
  bool wants_dgrad_stride2(uint32_t output_nr) const override {
    if (output_nr != 0 || act_ != Activation::Relu || !add_ || dsub_.defined() ||
        !x_.defined() || !mask_.defined())
      return false;
    const Tensor x = x_.get(*this), mask = mask_.get(*this);
    const Backend& be = backend(x);
    return be.batch_norm_stats->backward_dgrad && be.batch_norm_stats->backward_dgrad_coef &&
           supports(be, FastPath::BatchNormStatsDgradStride2, {&x, &mask});
  }
  void take_dgrad_stride2(uint32_t /*output_nr*/, const Tensor& dx_sub) override {
    dsub_ = dx_sub;
  }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    // Whether x's gradient as the engine hands it is this node's alone: then it may be added to
    // in place.
    const bool grad_own = autograd::sole_handle(grads[0]);
    Tensor x = x_.get(*this), w = weight_.get(*this);
    Tensor dy = grads[0];
    // The conv1 gradient taken in: dy is then what the other consumers added (maybe nothing).
    const Tensor dy1 = std::exchange(dy1_, Tensor()), w1 = std::exchange(w1_, Tensor());
    const Tensor x2 = std::exchange(x2_, Tensor()), w2 = std::exchange(w2_, Tensor()),
                 b2 = std::exchange(b2_, Tensor());
    // A stride-2 shortcut's gradient at x's even pixels (take_dgrad_stride2): the GEMM's r as it
    // is when conv1's gradient came in and nothing else did. Otherwise (a network other than
    // ResNet-50's, e.g. ResNet-18's 3x3 stride-2 conv1 beside the shortcut) it is added to dy at
    // those pixels — in place where dy is this node's alone, so that a quarter of x's gradient
    // is read and written, not all of it — or scattered into zeros where nothing else came.
    Tensor dsub = std::exchange(dsub_, Tensor());
    if (dsub.defined()) {
      dsub = dsub.to(x.dtype()).contiguous(MemoryFormat::ChannelsLast);
      if (dy.defined() || !dy1.defined() || x2.defined()) {
        Tensor full;
        if (dy.defined()) {
          full = dy.to(x.dtype()).contiguous(MemoryFormat::ChannelsLast);
          if (full.shares_storage(grads[0])) {
            if (grad_own)
              ++g_stride2_inplace;
            else
              full = full.clone();
          }
        } else {
          full = zeros_like(x);
        }
        const Tensor even = full.slice(2, 0, x.size(2), 2).slice(3, 0, x.size(3), 2);
        even.copy_(dy.defined() ? add(even, dsub) : dsub);
        dy = full;
        dsub = Tensor();
      }
    }
    // The GEMM's residual: x's gradient from the other consumers, or the compact one.
    const Tensor& r = dsub.defined() ? dsub : dy;
    if (dsub.defined()) ++g_stride2_compact;
    if (x2.defined() && dy.defined()) {
      // Another consumer added to x's gradient (not a ResNet's case): the linear map written
      // and added to it, and the plain form below.
      const int64_t N = x2.size(0), H = x2.size(2), W = x2.size(3), C2 = x2.size(1);
      const Tensor rows = x2.permute({0, 2, 3, 1}).reshape({N * H * W, C2});
      const Tensor t = linear(rows, w2, b2).view({N, H, W, x.size(1)}).permute({0, 3, 1, 2});
      dy = add(dy.to(t.dtype()), t).contiguous(MemoryFormat::ChannelsLast);
    }
    if (!dy.defined() && !dy1.defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    if (dy.defined() && (!dy.is_contiguous(MemoryFormat::ChannelsLast) || dy.dtype() != x.dtype()))
      dy = dy.to(x.dtype()).contiguous(MemoryFormat::ChannelsLast);
    const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
    Tensor dx = empty_like(x);
    Tensor dz = add_ && (needs_input_grad(1) || dy1.defined()) ? empty_like(x) : Tensor();
    const std::vector<Tensor> targets = param_targets(*this, {2, 3}, x);
    const bool acc = !targets.empty();
    Tensor dw = acc ? targets[0] : needs_input_grad(2) ? empty({x.size(1)}, f32) : Tensor();
    Tensor db = acc ? targets[1] : needs_input_grad(3) ? empty({x.size(1)}, f32) : Tensor();
    const GradientMode mode = acc ? target_mode(*this, {2, 3}) : GradientMode::Set;
    detail::FoldedGradTarget* fold = dy1.defined() && add_ ? fold_target(dz) : nullptr;
    if (fold != nullptr) {
      // The tail fold: x's gradient goes to the convolution that produced x as factors, and the
      // pass that would write it does not run.
      Tensor coef = empty({3 * x.size(1)}, f32);
      backend(x).batch_norm_stats->backward_dgrad_coef(coef, dz, dw, db, dy1, w1, r, x,
                                                       mask_.get(*this), w,
                                                       save_mean_.get(*this),
                                                       save_invstd_.get(*this), mode);
      fold->take_folded(next_edges_[0].input_nr, dz, coef);
      ++g_tail_folds;
      dx = Tensor();
    } else if (x2.defined() && !dy.defined()) {
      backend(x).batch_norm_stats->backward_dgrad_linear(dx, dw, db, dy1, w1, x2, w2, b2, x, w,
                                                         save_mean_.get(*this),
                                                         save_invstd_.get(*this),
                                                         scale_shift_.get(*this), mode);
    } else if (dy1.defined()) {
      backend(x).batch_norm_stats->backward_dgrad(dx, dz, dw, db, dy1, w1, r, x,
                                                  add_ ? mask_.get(*this) : Tensor(), w,
                                                  save_mean_.get(*this), save_invstd_.get(*this),
                                                  add_ ? Tensor() : scale_shift_.get(*this), mode);
    } else {
      // The ReLU mask: the forward's bits when a residual was added, else recomputed from x.
      Tensor mask = act_ == Activation::Relu && add_ ? mask_.get(*this) : Tensor();
      backend(x).batch_norm_stats->backward(dx, dz, dw, db, dy, x, mask, w, save_mean_.get(*this),
                                            save_invstd_.get(*this), scale_shift_.get(*this),
                                            act_, mode);
    }
    return {needs_input_grad(0) ? dx : Tensor(), needs_input_grad(1) ? dz : Tensor(), dw, db};
  }

 private:
  // The node behind x's edge when it takes x's gradient as factors (the tail fold), else null.
  detail::FoldedGradTarget* fold_target(const Tensor& g) const {
    if (!g.defined() || !needs_input_grad(0) ||
        !backend(g).batch_norm_stats->backward_dgrad_coef)
      return nullptr;
    auto* t = dynamic_cast<detail::FoldedGradTarget*>(next_edges_[0].fn.get());
    return t != nullptr && t->can_take_folded(next_edges_[0].input_nr, g) ? t : nullptr;
  }

  SavedTensor x_, mask_, weight_, save_mean_, save_invstd_, scale_shift_;
  Activation act_;
  bool add_;
  Tensor dy1_, w1_;  // a convolution's data gradient operands, taken in (accept_dgrad)
  Tensor x2_, w2_, b2_;  // and its linear map's, with accept_dgrad_linear
  Tensor dsub_;  // a stride-2 convolution's data gradient at x's even pixels (take_dgrad_stride2)
};

// Backward of batch_norm_add_batch_norm_relu's fused path. Inputs: x, r, wx, bx, wr, br. Takes
// the data gradient of the stride-1 1x1 convolution that reads its output (the next block's
// conv1) into its own first pass where the backend can (ops/dgrad_sink.h), as
// BatchNormStatsBackward does for a block tail with an identity shortcut.
class DualBatchNormBackward final : public Node, public detail::DgradSink {
 public:
  DualBatchNormBackward(const Tensor& x, const Tensor& r, const Tensor& mask, const Tensor& wx,
                        const Tensor& wr, const Tensor& mean_x, const Tensor& invstd_x,
                        const Tensor& mean_r, const Tensor& invstd_r)
      : x_(x), r_(r), mask_(mask), wx_(wx), wr_(wr), mean_x_(mean_x), invstd_x_(invstd_x),
        mean_r_(mean_r), invstd_r_(invstd_r) {}
  std::string name() const override { return "BatchNormAddBatchNormReluBackward"; }
  void release_saved() override {
    for (SavedTensor* s : {&x_, &r_, &mask_, &wx_, &wr_, &mean_x_, &invstd_x_, &mean_r_, &invstd_r_})
      s->release();
    dy1_ = w1_ = Tensor();
  }
  bool can_accumulate_into(size_t i) const override { return i >= 2 && i <= 5; }
  bool accept_dgrad(uint32_t output_nr, const Tensor& dy1, const Tensor& w1) override {
    if (output_nr != 0 || dy1_.defined() || !x_.defined()) return false;
    const Tensor x = x_.get(*this);
    const Backend& be = backend(x);
    if (!be.batch_norm_stats->dual_backward_dgrad ||
        !supports(be, FastPath::BatchNormStatsDualDgrad, {&dy1, &w1, &x}))
      return false;
    dy1_ = dy1;
    w1_ = w1;
    ++g_dgrad_fusions;
    return true;
  }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    Tensor x = x_.get(*this), r = r_.get(*this);
    Tensor dy = grads[0];
    // The conv1 gradient taken in: dy is then what the other consumers added (maybe nothing).
    const Tensor dy1 = std::exchange(dy1_, Tensor()), w1 = std::exchange(w1_, Tensor());
    if (!dy.defined() && !dy1.defined()) return std::vector<Tensor>(6);
    if (dy.defined() && (!dy.is_contiguous(MemoryFormat::ChannelsLast) || dy.dtype() != x.dtype()))
      dy = dy.to(x.dtype()).contiguous(MemoryFormat::ChannelsLast);
    const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
    const int64_t c = x.size(1);
    auto param_grad = [&](size_t i) { return needs_input_grad(i) ? empty({c}, f32) : Tensor(); };
    Tensor dx, dr;
    const std::vector<Tensor> targets = param_targets(*this, {2, 3, 4, 5}, x);
    const bool acc = !targets.empty();
    Tensor dwx = acc ? targets[0] : param_grad(2), dbx = acc ? targets[1] : param_grad(3);
    Tensor dwr = acc ? targets[2] : param_grad(4), dbr = acc ? targets[3] : param_grad(5);
    const GradientMode mode = acc ? target_mode(*this, {2, 3, 4, 5}) : GradientMode::Set;
    // x stands for g (the gradient through the ReLU) in the question: same shape and layout.
    detail::FoldedGradTarget* fold = dy1.defined() ? fold_target(x) : nullptr;
    if (fold != nullptr) {
      // The tail fold, x's side: x's gradient goes to conv3 as factors (the first 3C of coef),
      // and the pass writes dr alone; or r's side to the shortcut's convolution as well (the
      // last 3C), and there is no pass.
      detail::FoldedGradTarget* fold_r = shortcut_fold_target(x);
      if (fold_r == nullptr) dr = empty_like(r);
      Tensor g = empty_like(x), coef = empty({6 * c}, f32);
      backend(x).batch_norm_stats->dual_backward_dgrad_coef(
          coef, g, dr, dwx, dbx, dwr, dbr, dy1, w1, dy, mask_.get(*this), x, wx_.get(*this),
          mean_x_.get(*this), invstd_x_.get(*this), r, wr_.get(*this), mean_r_.get(*this),
          invstd_r_.get(*this), mode);
      fold->take_folded(next_edges_[0].input_nr, g, coef.narrow(0, 0, 3 * c));
      ++g_tail_folds;
      if (fold_r != nullptr) {
        fold_r->take_folded(next_edges_[1].input_nr, g, coef.narrow(0, 3 * c, 3 * c));
        ++g_tail_folds;
      }
    } else if (dy1.defined()) {
      dx = empty_like(x);
      dr = empty_like(r);
      backend(x).batch_norm_stats->dual_backward_dgrad(
          dx, dr, dwx, dbx, dwr, dbr, dy1, w1, dy, mask_.get(*this), x, wx_.get(*this),
          mean_x_.get(*this), invstd_x_.get(*this), r, wr_.get(*this), mean_r_.get(*this),
          invstd_r_.get(*this), mode);
    } else {
      dx = empty_like(x);
      dr = empty_like(r);
      backend(x).batch_norm_stats->dual_backward(
          dx, dr, dwx, dbx, dwr, dbr, dy, mask_.get(*this), x, wx_.get(*this), mean_x_.get(*this),
          invstd_x_.get(*this), r, wr_.get(*this), mean_r_.get(*this), invstd_r_.get(*this), mode);
    }
    return {needs_input_grad(0) ? dx : Tensor(), needs_input_grad(1) ? dr : Tensor(), dwx, dbx,
            dwr, dbr};
  }

 private:
  // The node behind x's edge (conv3) when it takes x's gradient as factors, else null.
  detail::FoldedGradTarget* fold_target(const Tensor& g) const {
    if (!g.defined() || !needs_input_grad(0)) return nullptr;
    const Backend& be = backend(g);
    if (!be.batch_norm_stats->dual_backward_dgrad_coef ||
        !supports(be, FastPath::TailFoldDual, {&g}))
      return nullptr;
    auto* t = dynamic_cast<detail::FoldedGradTarget*>(next_edges_[0].fn.get());
    return t != nullptr && t->can_take_folded(next_edges_[0].input_nr, g) ? t : nullptr;
  }
  // With x's side folded: the node behind r's edge (the shortcut's convolution) when it takes
  // r's gradient as factors of the same g, else null. r's convolution is another node than x's.
  detail::FoldedGradTarget* shortcut_fold_target(const Tensor& g) const {
    if (!needs_input_grad(1) || !next_edges_[1].valid() ||
        next_edges_[1].fn == next_edges_[0].fn ||
        !supports(backend(g), FastPath::TailFoldShortcut, {&g}))
      return nullptr;
    auto* t = dynamic_cast<detail::FoldedGradTarget*>(next_edges_[1].fn.get());
    return t != nullptr && t->can_take_folded(next_edges_[1].input_nr, g) ? t : nullptr;
  }

  SavedTensor x_, r_, mask_, wx_, wr_, mean_x_, invstd_x_, mean_r_, invstd_r_;
  Tensor dy1_, w1_;  // the next convolution's data gradient operands, taken in (accept_dgrad)
};

// The BatchNormStats path: training, and the backend takes x, the residual, the parameters and
// the statistics (sum and sqsum undefined: they would come from its `compute`).
bool stats_path(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias,
                const Tensor& running_mean, const Tensor& running_var, const Tensor& sum,
                const Tensor& sqsum, bool training) {
  const Backend& be = backend(x);
  return training && be.batch_norm_stats &&
         supports(be, FastPath::BatchNormStats,
                  {&x, &residual, &weight, &bias, &running_mean, &running_var, &sum, &sqsum});
}

// ... with `stats` that are x's current statistics.
bool stats_fusable(const Tensor& x, const ChannelStats& stats, const Tensor& residual,
                   const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                   const Tensor& running_var, bool training) {
  return stats.defined() && stats.version == x.version() &&
         stats_path(x, residual, weight, bias, running_mean, running_var, stats.sum, stats.sqsum,
                    training);
}

// The finalize every fused path shares: per-channel scale and shift from the statistics, the
// running statistics and the counter updated — by the backend entry it is handed to
// (apply and dual_apply run it first; finalize on its own).
BnStatsFinalize finalize_stats(const Tensor& x, const ChannelStats& st, const BatchNormParams& p,
                               const char* op) {
  autograd::check_inplace(p.running_mean, op);
  autograd::check_inplace(p.running_var, op);
  const int64_t C = x.size(1);
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
  BnStatsFinalize f;
  f.save_mean = empty({C}, f32);
  f.save_invstd = empty({C}, f32);
  f.scale_shift = empty({2 * C}, f32);
  f.sum = st.sum;
  f.sqsum = st.sqsum;
  f.weight = p.weight.detach();
  f.bias = p.bias.detach();
  f.running_mean = p.running_mean;
  f.running_var = p.running_var;
  f.counter = p.num_batches_tracked;
  f.count = x.numel() / C;
  f.momentum = p.momentum;
  f.eps = p.eps;
  // The running statistics and the counter change in place, outside the graph.
  p.running_mean.bump_version();
  p.running_var.bump_version();
  if (f.counter.defined()) f.counter.bump_version();
  return f;
}

// Backward of batch_norm_relu_conv1x1's fused path. Inputs: x, weight, bias (the batch
// norm's), w (the convolution's); the gradient is the convolution output's. x's and the batch
// norm's gradients: the convolution's data gradient through the ReLU and the batch norm (on CUDA
// one GEMM with the sums in its epilogue where backward_dgrad takes it, as the unfused pair's
// DgradSink would); w's: dyᵀ · relu(bn(x)) recomputed as the kernel loads x.
class BatchNormReluConv1x1Backward final : public Node {
 public:
  BatchNormReluConv1x1Backward(const Tensor& x, const Tensor& weight, const Tensor& w,
                               const Tensor& save_mean, const Tensor& save_invstd,
                               const Tensor& scale_shift)
      : x_(x), weight_(weight), w_(w), save_mean_(save_mean), save_invstd_(save_invstd),
        scale_shift_(scale_shift) {}
  std::string name() const override { return "BatchNormReluConv1x1Backward"; }
  void release_saved() override {
    for (SavedTensor* s : {&x_, &weight_, &w_, &save_mean_, &save_invstd_, &scale_shift_})
      s->release();
  }
  // The batch norm's dweight and dbias, and the convolution's dw, may go straight into .grad.
  bool can_accumulate_into(size_t i) const override { return i >= 1 && i <= 3; }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    Tensor dy = grads[0];
    if (!dy.defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    const Tensor x = x_.get(*this), w = w_.get(*this), ss = scale_shift_.get(*this);
    if (!dy.is_contiguous(MemoryFormat::ChannelsLast) || dy.dtype() != x.dtype())
      dy = dy.to(x.dtype()).contiguous(MemoryFormat::ChannelsLast);
    const Backend& be = backend(x);
    Tensor dx, dwb, dbb, dw;
    if (needs_input_grad(0) || needs_input_grad(1) || needs_input_grad(2)) {
      const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
      const std::vector<Tensor> targets = param_targets(*this, {1, 2}, x);
      const bool acc = !targets.empty();
      dwb = acc ? targets[0] : needs_input_grad(1) ? empty({x.size(1)}, f32) : Tensor();
      dbb = acc ? targets[1] : needs_input_grad(2) ? empty({x.size(1)}, f32) : Tensor();
      const GradientMode mode = acc ? target_mode(*this, {1, 2}) : GradientMode::Set;
      dx = empty_like(x);
      const Tensor none;
      if (be.batch_norm_stats->backward_dgrad &&
          supports(be, FastPath::BatchNormStatsDgrad, {&dy, &w, &x, &none})) {
        be.batch_norm_stats->backward_dgrad(dx, Tensor(), dwb, dbb, dy, w, Tensor(), x, Tensor(),
                                            weight_.get(*this), save_mean_.get(*this),
                                            save_invstd_.get(*this), ss, mode);
        ++g_dgrad_fusions;
      } else {  // the data gradient, then the batch norm's backward with the mask from x
        Tensor da = empty_like(x);
        be.conv2d_backward_data(da, dy, w, ConvParams{}, GradientMode::Set);
        be.batch_norm_stats->backward(dx, Tensor(), dwb, dbb, da, x, Tensor(), weight_.get(*this),
                                      save_mean_.get(*this), save_invstd_.get(*this), ss,
                                      Activation::Relu, mode);
      }
      if (!needs_input_grad(0)) dx = Tensor();
    }
    if (needs_input_grad(3)) {
      // The engine's .grad when it has dy's dtype and w's shape, else a fresh tensor.
      Tensor t = accumulate_target(3);
      if (t.defined() && t.dtype() == dy.dtype() && t.shape() == w.shape() &&
          !t.shares_storage(dy) && !t.shares_storage(x)) {
        be.batch_norm_stats->relu_conv1x1_backward_weight(
            t, dy, x, ss,
            accumulate_target_zero(3) ? GradientMode::AddToZeros : GradientMode::Accumulate);
        t.bump_version();
        dw = t;
      } else {
        dw = empty(w.shape(), TensorOptions(dy.dtype()).with_device(dy.device()));
        be.batch_norm_stats->relu_conv1x1_backward_weight(dw, dy, x, ss, GradientMode::Set);
      }
    }
    return {dx, dwb, dbb, dw};
  }

 private:
  SavedTensor x_, weight_, w_, save_mean_, save_invstd_, scale_shift_;
};

// Backward of batch_norm_relu_max_pool's fused path. Inputs: x, weight, bias. at_max: x at each
// maximum, where the backend asked for it (relu_max_pool_at_max), else undefined.
class BatchNormReluMaxPoolBackward final : public Node {
 public:
  BatchNormReluMaxPoolBackward(const Tensor& x, const Tensor& indices, const Tensor& at_max,
                               const Tensor& weight, const BnStatsFinalize& f, const PoolParams& p)
      : x_(x),
        indices_(indices),
        at_max_(at_max),
        weight_(weight),
        save_mean_(f.save_mean),
        save_invstd_(f.save_invstd),
        scale_shift_(f.scale_shift),
        p_(p) {}
  std::string name() const override { return "BatchNormReluMaxPoolBackward"; }
  void release_saved() override {
    for (SavedTensor* s :
         {&x_, &indices_, &at_max_, &weight_, &save_mean_, &save_invstd_, &scale_shift_})
      s->release();
  }
  bool can_accumulate_into(size_t i) const override { return i == 1 || i == 2; }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    Tensor x = x_.get(*this);
    Tensor dy = grads[0];
    if (!dy.defined()) return {Tensor(), Tensor(), Tensor()};
    if (!dy.is_contiguous(MemoryFormat::ChannelsLast) || dy.dtype() != x.dtype())
      dy = dy.to(x.dtype()).contiguous(MemoryFormat::ChannelsLast);
    const Backend& be = backend(x);
    const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
    const std::vector<Tensor> targets = param_targets(*this, {1, 2}, x);
    const bool acc = !targets.empty();
    const GradientMode mode = acc ? target_mode(*this, {1, 2}) : GradientMode::Set;
    Tensor dw = acc ? targets[0] : needs_input_grad(1) ? empty({x.size(1)}, f32) : Tensor();
    Tensor db = acc ? targets[1] : needs_input_grad(2) ? empty({x.size(1)}, f32) : Tensor();
    Tensor dx = empty_like(x);
    const BatchNormStatsPaths& bn = *be.batch_norm_stats;
    if (bn.relu_max_pool_backward &&
        supports(be, FastPath::BatchNormReluMaxPoolBackward, {&x})) {
      bn.relu_max_pool_backward(dx, dw, db, dy, indices_.get(*this), at_max_.get(*this), x,
                                weight_.get(*this), save_mean_.get(*this), save_invstd_.get(*this),
                                scale_shift_.get(*this), mode);
    } else {
      Tensor dact = empty_like(x);  // the gradient at the ReLU's output
      be.max_pool2d_backward(dact, dy, indices_.get(*this), p_);
      bn.backward(dx, Tensor(), dw, db, dact, x, Tensor(), weight_.get(*this),
                  save_mean_.get(*this), save_invstd_.get(*this), scale_shift_.get(*this),
                  Activation::Relu, mode);
    }
    return {needs_input_grad(0) ? dx : Tensor(), dw, db};
  }

 private:
  SavedTensor x_, indices_, at_max_, weight_, save_mean_, save_invstd_, scale_shift_;
  PoolParams p_;
};

}  // namespace

void count_batch(const Tensor& counter) {
  if (!counter.defined()) return;
  NoGradGuard no_grad;
  if (counter.is_cpu()) {
    ++*counter.data<int64_t>();
    counter.bump_version();
  } else {  // stays on the device: no host synchronisation; one integer kernel
    add_(counter, 1.0);
  }
}

uint64_t dgrad_fusions() { return g_dgrad_fusions.load(); }
uint64_t tail_folds() { return g_tail_folds.load(); }
uint64_t stride2_compact_grads() { return g_stride2_compact.load(); }
uint64_t stride2_inplace_adds() { return g_stride2_inplace.load(); }

Tensor batch_norm_from_stats(const Tensor& x, const ChannelStats& stats, const Tensor& residual,
                             Activation act, const Tensor& weight, const Tensor& bias,
                             const Tensor& running_mean, const Tensor& running_var, bool training,
                             double momentum, double eps, const Tensor& num_batches_tracked) {
  check_defined(x, "batch_norm_from_stats", "x");
  const bool gelu = act == Activation::Gelu, relu = act == Activation::Relu;
  ChannelStats st = stats;
  // GELU has no other fused path: without the convolution's statistics they are one more pass
  // over x here (the unfused batch norm reads x for them too).
  if (gelu && !residual.defined() &&
      !stats_fusable(x, st, residual, weight, bias, running_mean, running_var, training) &&
      backend(x).batch_norm_stats && backend(x).batch_norm_stats->compute &&
      stats_path(x, residual, weight, bias, running_mean, running_var, Tensor(), Tensor(),
                 training)) {
    KILN_OP_SCOPE("batch_norm_stats", x);
    const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
    st = ChannelStats{empty({x.size(1)}, f32), empty({x.size(1)}, f32), x.version()};
    backend(x).batch_norm_stats->compute(st.sum, st.sqsum, x.detach());
  }
  if (!(gelu && residual.defined()) &&
      stats_fusable(x, st, residual, weight, bias, running_mean, running_var, training)) {
    KILN_OP_SCOPE(gelu                 ? "batch_norm_gelu"
                  : residual.defined() ? "batch_norm_add_relu"
                  : relu               ? "batch_norm_relu"
                                       : "batch_norm",
                  x);
    const BnStatsFinalize f = finalize_stats(
        x, st, {weight, bias, running_mean, running_var, momentum, eps, num_batches_tracked},
        "batch_norm_from_stats (running statistics update)");
    Tensor y = empty_like(x);
    Tensor mask = relu && residual.defined()
                      ? empty({x.numel() / 8}, TensorOptions(DType::u8).with_device(x.device()))
                      : Tensor();
    backend(x).batch_norm_stats->apply(y, x.detach(),
                                       residual.defined() ? residual.detach() : Tensor(), f, act,
                                       mask);
    if (autograd::any_requires_grad({x, residual, weight, bias})) {
      auto node = std::make_shared<BatchNormStatsBackward>(
          x.detach(), mask, weight.detach(), f.save_mean, f.save_invstd, f.scale_shift, act,
          residual.defined());
      node->set_inputs({x, residual, weight, bias});
      autograd::set_history(y, node);
    }
    return y;
  }
  if (training) count_batch(num_batches_tracked);
  if (relu) return batch_norm_relu(x, residual, weight, bias, running_mean, running_var, training,
                                   momentum, eps);
  Tensor y = batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps);
  if (residual.defined()) y = add(y, residual);
  return gelu ? F::gelu(y) : y;
}

Tensor batch_norm_from_stats(const Tensor& x, const ChannelStats& stats, const Tensor& residual,
                             bool relu, const Tensor& weight, const Tensor& bias,
                             const Tensor& running_mean, const Tensor& running_var, bool training,
                             double momentum, double eps, const Tensor& num_batches_tracked) {
  return batch_norm_from_stats(x, stats, residual, relu ? Activation::Relu : Activation::None,
                               weight, bias, running_mean, running_var, training, momentum, eps,
                               num_batches_tracked);
}

Tensor batch_norm_add_batch_norm_relu(const Tensor& x, const ChannelStats& sx,
                                      const BatchNormParams& px, const Tensor& r,
                                      const ChannelStats& sr, const BatchNormParams& pr,
                                      bool training) {
  check_defined(x, "batch_norm_add_batch_norm_relu", "x");
  check_defined(r, "batch_norm_add_batch_norm_relu", "r");
  if (r.shape() == x.shape() &&
      stats_fusable(x, sx, Tensor(), px.weight, px.bias, px.running_mean, px.running_var,
                    training) &&
      stats_fusable(r, sr, Tensor(), pr.weight, pr.bias, pr.running_mean, pr.running_var,
                    training) &&
      r.device() == x.device()) {
    KILN_OP_SCOPE("batch_norm_add_batch_norm_relu", x);
    const char* what = "batch_norm_add_batch_norm_relu (running statistics update)";
    const BnStatsFinalize fx = finalize_stats(x, sx, px, what), fr = finalize_stats(r, sr, pr, what);
    Tensor y = empty_like(x);
    Tensor mask = empty({x.numel() / 8}, TensorOptions(DType::u8).with_device(x.device()));
    backend(x).batch_norm_stats->dual_apply(y, x.detach(), fx, r.detach(), fr, mask);
    if (autograd::any_requires_grad({x, r, px.weight, px.bias, pr.weight, pr.bias})) {
      auto node = std::make_shared<DualBatchNormBackward>(
          x.detach(), r.detach(), mask, px.weight.detach(), pr.weight.detach(), fx.save_mean,
          fx.save_invstd, fr.save_mean, fr.save_invstd);
      node->set_inputs({x, r, px.weight, px.bias, pr.weight, pr.bias});
      autograd::set_history(y, node);
    }
    return y;
  }
  Tensor shortcut = batch_norm_from_stats(r, sr, Tensor(), false, pr.weight, pr.bias,
                                          pr.running_mean, pr.running_var, training, pr.momentum,
                                          pr.eps, pr.num_batches_tracked);
  return batch_norm_from_stats(x, sx, shortcut, true, px.weight, px.bias, px.running_mean,
                               px.running_var, training, px.momentum, px.eps,
                               px.num_batches_tracked);
}

Tensor batch_norm_relu_conv1x1(const Tensor& x, const ChannelStats& stats,
                               const BatchNormParams& p, bool training, const Tensor& weight,
                               ChannelStats* out_stats) {
  if (out_stats) *out_stats = ChannelStats{};
  check_defined(x, "batch_norm_relu_conv1x1", "x");
  check_defined(weight, "batch_norm_relu_conv1x1", "weight");
  const Backend& be = backend(x);
  if (out_stats && be.batch_norm_stats &&
      stats_fusable(x, stats, Tensor(), p.weight, p.bias, p.running_mean, p.running_var,
                    training) &&
      be.batch_norm_stats->relu_conv1x1_forward_stats &&
      be.batch_norm_stats->relu_conv1x1_backward_weight &&
      supports(be, FastPath::BatchNormReluConv1x1, {&x, &weight})) {
    KILN_OP_SCOPE("batch_norm_relu_conv1x1", x);
    const BnStatsFinalize f =
        finalize_stats(x, stats, p, "batch_norm_relu_conv1x1 (running statistics update)");
    be.batch_norm_stats->finalize(f);
    const int64_t O = weight.size(0);
    Tensor y = empty({x.size(0), O, x.size(2), x.size(3)},
                     TensorOptions(x.dtype()).with_device(x.device()).with_memory_format(
                         MemoryFormat::ChannelsLast));
    const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
    Tensor sum = empty({O}, f32), sqsum = empty({O}, f32);
    const Tensor xd = x.detach(), wd = weight.detach();
    be.batch_norm_stats->relu_conv1x1_forward_stats(y, sum, sqsum, xd, f.scale_shift, wd);
    *out_stats = ChannelStats{sum, sqsum, y.version()};
    if (autograd::any_requires_grad({x, p.weight, p.bias, weight})) {
      auto node = std::make_shared<BatchNormReluConv1x1Backward>(
          xd, p.weight.detach(), wd, f.save_mean, f.save_invstd, f.scale_shift);
      node->set_inputs({x, p.weight, p.bias, weight});
      autograd::set_history(y, node);
    }
    return y;
  }
  const Tensor a = batch_norm_from_stats(x, stats, Tensor(), true, p.weight, p.bias,
                                         p.running_mean, p.running_var, training, p.momentum,
                                         p.eps, p.num_batches_tracked);
  return conv2d(a, weight, Tensor(), 1, 0, 1, 1, out_stats);
}

Tensor batch_norm_relu(const Tensor& x, const Tensor& residual, const Tensor& weight,
                       const Tensor& bias, const Tensor& running_mean, const Tensor& running_var,
                       bool training, double momentum, double eps) {
  check_defined(x, "batch_norm_relu", "x");
  if (relu_path(x, residual, weight, bias, running_mean, running_var, training)) {
    KILN_OP_SCOPE(residual.defined() ? "batch_norm_add_relu" : "batch_norm_relu", x);
    autograd::check_inplace(running_mean, "batch_norm_relu (running_mean update)");
    autograd::check_inplace(running_var, "batch_norm_relu (running_var update)");
    const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
    Tensor y = empty_like(x);
    Tensor save_mean = empty({x.size(1)}, f32), save_invstd = empty({x.size(1)}, f32);
    Tensor reserve;
    {
      NoGradGuard no_grad;  // running statistics change in place, outside the graph
      running_mean.bump_version();
      running_var.bump_version();
      reserve = backend(x).batch_norm_relu->forward(y, save_mean, save_invstd, x, residual,
                                                    weight, bias, running_mean, running_var,
                                                    momentum, eps);
    }
    if (autograd::any_requires_grad({x, residual, weight, bias})) {
      auto node = std::make_shared<BatchNormActBackward>(x, y, weight, bias, save_mean,
                                                         save_invstd, reserve,
                                                         residual.defined(), eps);
      node->set_inputs({x, residual, weight, bias});
      autograd::set_history(y, node);
    }
    return y;
  }
  Tensor y = batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps);
  if (residual.defined()) y = add(y, residual);
  return relu(y);
}

Tensor batch_norm_relu_max_pool(const Tensor& x, const ChannelStats& stats,
                                const BatchNormParams& bn, bool training, Pair kernel,
                                std::optional<Pair> stride, Pair padding, Pair dilation) {
  check_defined(x, "batch_norm_relu_max_pool", "x");
  const Pair s = stride.value_or(kernel);
  const bool stem_pool = kernel.h == 3 && kernel.w == 3 && s.h == 2 && s.w == 2 &&
                         padding.h == 1 && padding.w == 1 && dilation.h == 1 && dilation.w == 1;
  const Backend& be = backend(x);
  const Tensor none;
  if (stem_pool && be.batch_norm_stats && be.batch_norm_stats->relu_max_pool &&
      supports(be, FastPath::BatchNormReluMaxPool, {&x}) &&
      (stats_fusable(x, stats, none, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                     training) ||
       (be.batch_norm_stats->compute && stats_path(x, none, bn.weight, bn.bias, bn.running_mean,
                                                   bn.running_var, none, none, training)))) {
    KILN_OP_SCOPE("batch_norm_relu_max_pool", x);
    ChannelStats st = stats;
    if (!stats_fusable(x, st, Tensor(), bn.weight, bn.bias, bn.running_mean, bn.running_var,
                       training)) {
      const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
      st = ChannelStats{empty({x.size(1)}, f32), empty({x.size(1)}, f32), x.version()};
      be.batch_norm_stats->compute(st.sum, st.sqsum, x.detach());
    }
    const BnStatsFinalize f =
        finalize_stats(x, st, bn, "batch_norm_relu_max_pool (running statistics update)");
    be.batch_norm_stats->finalize(f);
    PoolParams p;
    p.kernel_h = p.kernel_w = 3;
    p.stride_h = p.stride_w = 2;
    p.pad_h = p.pad_w = 1;
    const Shape out{x.size(0), x.size(1), (x.size(2) - 1) / 2 + 1, (x.size(3) - 1) / 2 + 1};
    const TensorOptions nhwc =
        TensorOptions(x.dtype()).with_device(x.device()).with_memory_format(
            MemoryFormat::ChannelsLast);
    Tensor y = empty(out, nhwc);
    Tensor indices = empty(out, nhwc.with_dtype(max_pool2d_indices_dtype(p)));
    const bool grad = autograd::any_requires_grad({x, bn.weight, bn.bias});
    const Tensor at_max = grad && be.batch_norm_stats->relu_max_pool_at_max &&
                                  be.batch_norm_stats->relu_max_pool_at_max(x)
                              ? empty(out, nhwc)
                              : Tensor();
    be.batch_norm_stats->relu_max_pool(y, indices, at_max, x.detach(), f.scale_shift);
    if (grad) {
      auto node = std::make_shared<BatchNormReluMaxPoolBackward>(x.detach(), indices, at_max,
                                                                 bn.weight.detach(), f, p);
      node->set_inputs({x, bn.weight, bn.bias});
      autograd::set_history(y, node);
    }
    return y;
  }
  return max_pool2d(batch_norm_from_stats(x, stats, Tensor(), /*relu=*/true, bn.weight, bn.bias,
                                          bn.running_mean, bn.running_var, training, bn.momentum,
                                          bn.eps, bn.num_batches_tracked),
                    kernel, stride, padding, dilation);
}

}  // namespace kiln::F
