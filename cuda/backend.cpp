// The CUDA backend's table: the entry points of cuda/kernels.h, with small adapters where the
// table's contract and a kernel's signature differ.
#include "cuda/backend.h"

#include "core/switches.h"
#include "cuda/allocator.h"
#include "cuda/conv.h"
#include "cuda/cudnn_attention.h"
#include "cuda/kernels.h"
#include "cuda/profiler.h"

namespace kiln::cuda {
namespace {

void* profile_begin(const char* name, const Tensor& t) {
  set_last_profiled_op(name);
  push_current_op(name, &t);
  if (!name || !profiler_enabled()) return nullptr;
  return new ProfileOp(name, t.desc());
}

void profile_end(void* token) {
  delete static_cast<ProfileOp*>(token);
  pop_current_op();
}

// cuDNN's batch norm takes weight and bias as tensors; stand in for absent ones.
Tensor or_constant(const Tensor& p, const Tensor& x, double v) {
  return p.defined() ? p : full({x.size(1)}, v, TensorOptions(DType::f32).with_device(x.device()));
}

void bn_forward_training(const Tensor& y, const Tensor& save_mean, const Tensor& save_invstd,
                         const Tensor& x, const Tensor& weight, const Tensor& bias,
                         const Tensor& running_mean, const Tensor& running_var, double momentum,
                         double eps) {
  batch_norm_forward_training(y, save_mean, save_invstd, x, or_constant(weight, x, 1.0),
                              or_constant(bias, x, 0.0), running_mean, running_var, momentum,
                              eps);
}

void bn_forward_eval(const Tensor& y, const Tensor& x, const Tensor& weight, const Tensor& bias,
                     const Tensor& running_mean, const Tensor& running_var, double eps) {
  batch_norm_forward_eval(y, x, or_constant(weight, x, 1.0), or_constant(bias, x, 0.0),
                          running_mean, running_var, eps);
}

void bn_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dy,
                 const Tensor& x, const Tensor& weight, const Tensor& save_mean,
                 const Tensor& save_invstd) {
  batch_norm_backward(dx, dweight, dbias, dy, x, or_constant(weight, x, 1.0), save_mean,
                      save_invstd);
}

void conv_dgrad(const Tensor& dx, const Tensor& dy, const Tensor& w, const ConvParams& p,
                GradientMode mode) {
  // AddToZeros adds (beta = 1) as Accumulate does: the beta = 0 plan may round differently.
  conv2d_backward_data(dx, dy, w, p, mode != GradientMode::Set);
}

void conv_wgrad(const Tensor& dw, const Tensor& dy, const Tensor& x, const ConvParams& p,
                GradientMode mode) {
  conv2d_backward_weight(dw, dy, x, p, mode != GradientMode::Set,
                         mode == GradientMode::AddToZeros);
}

// The convolution's statistics for the batch norm that follows, so that kiln's own NHWC batch
// norm kernels run. From cuDNN's GenStats epilogue where a plan for it beats the plain
// convolution plus a statistics pass. Otherwise the plain convolution and kiln's fixed-order
// pass (bn_nhwc_stats) — always in deterministic mode (the epilogue adds across thread blocks in
// no fixed order), else from stats_min_channels() (128) up; below that false, and cuDNN's
// fused BN runs. Its semi-persistent kernels keep part of a small-channel tensor on chip between
// their two phases and beat kiln's two passes there (layer 1's BN+ReLU backward: 126 vs 147 µs);
// from 256 channels up kiln's kernels are faster per kernel (layers 3-4, in-situ profile: BN
// 12.2 vs 13.1 ms per step), though the whole step's gain was within noise (v12 in
// docs/lab/batch-norm.md). At 128 (v31; 256 before) layer 2's conv1s run on kiln's 1x1 GEMM with
// the statistics in its epilogue: b64 −0.06 to −0.08 ms a step, b256 level, on an H100
// (docs/lab/norm-conv.md). KILN_STATS_MIN_C moves the bar.
int64_t stats_min_channels() { return switches().stats_min_channels; }

bool conv_stats(const Tensor& y, const Tensor& sum, const Tensor& sqsum, const Tensor& x,
                const Tensor& w, const ConvParams& p) {
  const bool deterministic = conv_deterministic();
  // kiln's 1x1 GEMM with the statistics in its epilogue (fixed-order sums, so deterministic mode
  // takes it too), where kiln's BN kernels would run anyway: below stats_min_channels() cuDNN's
  // fused BN stays, as for the statistics pass.
  if ((deterministic || y.size(1) >= stats_min_channels()) &&
      conv1x1_stats_supported(y, x, w, p)) {
    conv1x1_forward_stats(y, sum, sqsum, x, w, p);
    return true;
  }
  // kiln's 3x3 implicit GEMM (up to KILN_CONV3X3_ROWS output rows), on the shapes whose
  // statistics come from cuDNN's GenStats plan or kiln's pass otherwise (C a multiple of 128).
  if (conv3x3_stats_supported(y, x, w, p)) {
    conv3x3_forward_stats(y, sum, sqsum, x, w, p);
    return true;
  }
  if (!deterministic && conv2d_forward_stats(y, sum, sqsum, x, w, p)) return true;
  if (!bn_nhwc_supported(y) || y.numel() == 0) return false;
  if (!deterministic && y.size(1) < stats_min_channels())
    return false;
  conv2d_forward(y, x, w, Tensor(), p);
  bn_nhwc_stats(sum, sqsum, y);
  return true;
}

void softmax_fwd(const Tensor& y, const Tensor& x, int64_t rows, int64_t cols, bool log) {
  softmax_forward(y.view({rows, cols}), x.view({rows, cols}), log);
}

void softmax_bwd(const Tensor& dx, const Tensor& dy, const Tensor& y, int64_t rows, int64_t cols,
                 bool log) {
  softmax_backward(dx.view({rows, cols}), dy.view({rows, cols}), y.view({rows, cols}), log);
}

Tensor bn_relu_forward(const Tensor& y, const Tensor& save_mean, const Tensor& save_invstd,
                       const Tensor& x, const Tensor& z, const Tensor& weight, const Tensor& bias,
                       const Tensor& running_mean, const Tensor& running_var, double momentum,
                       double eps) {
  if (z.defined())
    return batch_norm_add_relu_forward_training(y, save_mean, save_invstd, x, z, weight, bias,
                                                running_mean, running_var, momentum, eps);
  return batch_norm_relu_forward_training(y, save_mean, save_invstd, x, weight, bias,
                                          running_mean, running_var, momentum, eps);
}

void bn_relu_backward(const Tensor& dx, const Tensor& dz, const Tensor& dweight,
                      const Tensor& dbias, const Tensor& dy, const Tensor& x, const Tensor& y,
                      const Tensor& weight, const Tensor& bias, const Tensor& save_mean,
                      const Tensor& save_invstd, const Tensor& reserve, double eps,
                      GradientMode mode) {
  const bool acc = mode == GradientMode::Accumulate;
  if (dz.defined())
    return batch_norm_add_relu_backward(dx, dz, dweight, dbias, dy, x, y, weight, bias, save_mean,
                                        save_invstd, reserve, eps, acc);
  batch_norm_relu_backward(dx, dweight, dbias, dy, x, y, weight, bias, save_mean, save_invstd,
                           reserve, eps, acc);
}

void bn_stats_apply(const Tensor& y, const Tensor& x, const Tensor& z, const BnStatsFinalize& f,
                    Activation act, const Tensor& mask) {
  bn_nhwc_apply(y, x, z, f, act, mask);
}

void bn_stats_backward(const Tensor& dx, const Tensor& dz, const Tensor& dweight,
                       const Tensor& dbias, const Tensor& dy, const Tensor& x, const Tensor& mask,
                       const Tensor& weight, const Tensor& save_mean, const Tensor& save_invstd,
                       const Tensor& scale_shift, Activation act, GradientMode mode) {
  bn_nhwc_backward(dx, dz, dweight, dbias, dy, x, mask, weight, save_mean, save_invstd,
                   scale_shift, act, mode == GradientMode::Accumulate);
}

void bn_stats_dual_backward(const Tensor& dx, const Tensor& dr, const Tensor& dwx,
                            const Tensor& dbx, const Tensor& dwr, const Tensor& dbr,
                            const Tensor& dy, const Tensor& mask, const Tensor& x,
                            const Tensor& wx, const Tensor& mx, const Tensor& ix, const Tensor& r,
                            const Tensor& wr, const Tensor& mr, const Tensor& ir,
                            GradientMode mode) {
  bn_nhwc_dual_backward(dx, dr, dwx, dbx, dwr, dbr, dy, mask, x, wx, mx, ix, r, wr, mr, ir,
                        mode == GradientMode::Accumulate);
}

void bn_stats_dual_backward_dgrad(const Tensor& dx, const Tensor& dr, const Tensor& dwx,
                                  const Tensor& dbx, const Tensor& dwr, const Tensor& dbr,
                                  const Tensor& dy1, const Tensor& w1, const Tensor& dy_rest,
                                  const Tensor& mask, const Tensor& x, const Tensor& wx,
                                  const Tensor& mx, const Tensor& ix, const Tensor& r,
                                  const Tensor& wr, const Tensor& mr, const Tensor& ir,
                                  GradientMode mode) {
  bn_nhwc_dual_backward_dgrad(dx, dr, dwx, dbx, dwr, dbr, dy1, w1, dy_rest, mask, x, wx, mx, ix,
                              r, wr, mr, ir, mode == GradientMode::Accumulate);
}

void bn_stats_backward_dgrad(const Tensor& dx, const Tensor& dz, const Tensor& dweight,
                             const Tensor& dbias, const Tensor& dy1, const Tensor& w1,
                             const Tensor& r, const Tensor& x, const Tensor& mask,
                             const Tensor& weight, const Tensor& save_mean,
                             const Tensor& save_invstd, const Tensor& scale_shift,
                             GradientMode mode) {
  // The tail's mma.sync kernel adds r always; the wgmma kernel's forms (relu alone, every 3x3
  // convolution) take it undefined.
  Tensor rz = r.defined() || !mask.defined() || dgrad_weight_3x3(w1) ? r : zeros_like(x);
  Tensor g = dz.defined() ? dz : empty_like(x);
  bn_nhwc_backward_dgrad(dx, g, dweight, dbias, dy1, w1, rz, mask, x, weight, save_mean,
                         save_invstd, mode == GradientMode::Accumulate,
                         mask.defined() ? Tensor() : scale_shift);
}

void bn_stats_backward_dgrad_linear(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                                    const Tensor& dy1, const Tensor& w1, const Tensor& x2,
                                    const Tensor& w2, const Tensor& b2, const Tensor& x,
                                    const Tensor& weight, const Tensor& save_mean,
                                    const Tensor& save_invstd, const Tensor& scale_shift,
                                    GradientMode mode) {
  bn_nhwc_backward_dgrad(dx, empty_like(x), dweight, dbias, dy1, w1, Tensor(), Tensor(), x, weight,
                         save_mean, save_invstd, mode == GradientMode::Accumulate, scale_shift,
                         Tensor(), x2, w2, b2);
}

void bn_stats_backward_dgrad_coef(const Tensor& coef, const Tensor& dz, const Tensor& dweight,
                                  const Tensor& dbias, const Tensor& dy1, const Tensor& w1,
                                  const Tensor& r, const Tensor& x, const Tensor& mask,
                                  const Tensor& weight, const Tensor& save_mean,
                                  const Tensor& save_invstd, GradientMode mode) {
  KILN_CHECK(mask.defined() && dz.defined(),
             "backward_dgrad_coef (cuda): the relu + z form only (mask and dz defined)");
  Tensor rz = r.defined() || dgrad_weight_3x3(w1) ? r : zeros_like(x);
  bn_nhwc_backward_dgrad(Tensor(), dz, dweight, dbias, dy1, w1, rz, mask, x, weight, save_mean,
                         save_invstd, mode == GradientMode::Accumulate, Tensor(), coef);
}

void bn_stats_relu_max_pool_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                                     const Tensor& dy, const Tensor& indices, const Tensor& at_max,
                                     const Tensor& x, const Tensor& weight, const Tensor& save_mean,
                                     const Tensor& save_invstd, const Tensor& scale_shift,
                                     GradientMode mode) {
  bn_nhwc_relu_max_pool_backward(dx, dweight, dbias, dy, indices, at_max, x, weight, save_mean,
                                 save_invstd, scale_shift, mode == GradientMode::Accumulate);
}

constinit RuntimeSwitch g_dgrad_fusion{&Switches::fused_dgrad};  // KILN_FUSED_DGRAD
constinit RuntimeSwitch g_tail_fold{&Switches::tail_fold};         // KILN_TAIL_FOLD
constinit RuntimeSetting<int> g_tail_fold_min{&Switches::tail_fold_min};  // KILN_TAIL_FOLD_MIN
constinit RuntimeSwitch g_tail_fold_dual{&Switches::tail_fold_dual};  // KILN_TAIL_FOLD_DUAL
constinit RuntimeSwitch g_tail_fold_shortcut{
    &Switches::tail_fold_shortcut};  // KILN_TAIL_FOLD_SHORTCUT
constinit RuntimeSwitch g_dgrad_stride2{&Switches::dgrad_stride2};  // KILN_DGRAD_STRIDE2

// The fast paths' operands: f16 channels-last activations, f32 contiguous per-channel tensors.
bool nhwc_f16(const Tensor& t) {
  return t.defined() && t.is_cuda() && t.dtype() == DType::f16 && t.dim() == 4 &&
         t.is_contiguous(MemoryFormat::ChannelsLast);
}
bool per_channel(const Tensor& p, const Tensor& x) {
  return p.defined() && p.dtype() == DType::f32 && p.device() == x.device() && p.dim() == 1 &&
         p.size(0) == x.size(1) && p.is_contiguous();
}
// An undefined residual, or one of x's shape, layout and dtype on its device.
bool residual_fits(const Tensor& r, const Tensor& x) {
  return !r.defined() || (nhwc_f16(r) && r.shape() == x.shape() && r.device() == x.device());
}

bool supports(FastPath path, std::initializer_list<const Tensor*> operands) {
  const Tensor* const* t = operands.begin();
  auto expect = [&](size_t n) {
    KILN_CHECK(operands.size() == n, "supports(FastPath ", int(path), "): ", n,
               " operands expected, got ", operands.size());
  };
  switch (path) {
    case FastPath::BatchNormRelu: {  // cuDNN's fused kernels
      expect(6);
      const Tensor& x = *t[0];
      return switches().fused_bn && nhwc_f16(x) && residual_fits(*t[1], x) &&
             per_channel(*t[2], x) && per_channel(*t[3], x) && per_channel(*t[4], x) &&
             per_channel(*t[5], x);
    }
    case FastPath::BatchNormStats: {  // kiln's NHWC kernels (cuda/kernels/bn_nhwc_*.cu)
      expect(8);
      const Tensor& x = *t[0];
      const bool sums = !t[6]->defined() || (per_channel(*t[6], x) && per_channel(*t[7], x));
      return switches().fused_bn && bn_nhwc_supported(x) && residual_fits(*t[1], x) &&
             per_channel(*t[2], x) && per_channel(*t[3], x) && per_channel(*t[4], x) &&
             per_channel(*t[5], x) && x.numel() / x.size(1) > 1 && sums;
    }
    case FastPath::BatchNormStatsDgrad: {
      expect(4);
      const bool bits = t[3]->defined();
      return g_dgrad_fusion.get() && (bits || switches().fused_dgrad_relu) &&
             (dgrad_weight_3x3(*t[1]) ? dgrad3x3_bn_supported(*t[0], *t[1], *t[2])
                                      : dgrad1x1_bn_supported(*t[0], *t[1], *t[2], bits));
    }
    case FastPath::BatchNormStatsDgradLinear:
      expect(6);
      return g_dgrad_fusion.get() && switches().fused_dgrad_relu &&
             dgrad1x1_bn_linear_supported(*t[0], *t[1], *t[2], *t[3], *t[4], *t[5]);
    case FastPath::BatchNormStatsDualDgrad:
      expect(3);
      return g_dgrad_fusion.get() && dual_dgrad_supported(*t[0], *t[1], *t[2]);
    case FastPath::BatchNormReluMaxPool:
      expect(1);
      return switches().fused_bn && bn_nhwc_supported(*t[0]);
    case FastPath::BatchNormReluMaxPoolBackward:
      expect(1);
      return switches().fused_bn && bn_nhwc_supported(*t[0]);
    case FastPath::BatchNormReluConv1x1:  // kiln's wgmma kernels with the prologue
      expect(2);
      return conv1x1_bn_relu_supported(*t[0], *t[1]);
    case FastPath::Attention:
      expect(3);
      return attention_supported(*t[0], *t[1], *t[2]);
    case FastPath::TailFold:
      expect(3);
      return g_tail_fold.get() && t[1]->defined() && t[1]->numel() >= g_tail_fold_min.get() &&
             conv1x1_fold_supported(*t[0], *t[1], *t[2]);
    case FastPath::TailFoldDual:
      expect(1);
      return g_tail_fold.get() && g_tail_fold_dual.get() && nhwc_f16(*t[0]);
    case FastPath::TailFoldShortcut:
      expect(1);
      return g_tail_fold.get() && g_tail_fold_dual.get() && g_tail_fold_shortcut.get() &&
             nhwc_f16(*t[0]);
    case FastPath::BatchNormStatsDgradStride2: {
      // Where the block tail's GEMM reads the compact rows itself (dgrad1x1_bn_sums scatters r
      // for any other kernel: this says where the compact form pays, not where it is right).
      expect(2);
      return g_dgrad_stride2.get() && g_dgrad_fusion.get() && nhwc_f16(*t[0]) &&
             dgrad1x1_bn_stride2_supported(*t[0], *t[1]);
    }
    case FastPath::BiasGelu: {  // cuda/kernels/bias_gelu.cu: f32, f16, bf16
      expect(3);
      const DType d = t[0]->dtype();
      return t[2]->defined() && (d == DType::f32 || d == DType::f16 || d == DType::bf16);
    }
  }
  return false;
}

constexpr BatchNormReluPaths kBatchNormRelu{bn_relu_forward, bn_relu_backward};
// Fused attention: cuDNN's SDPA graphs where a plan builds for the problem (KILN_CUDNN_ATTENTION,
// cuda/cudnn_attention.h), kiln's kernels for everything else.
void attention_fwd(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                   const Tensor& v, double scale, bool causal) {
  if (!cudnn_attention_forward(out, lse, q, k, v, scale, causal))
    attention_forward(out, lse, q, k, v, scale, causal);
}
void attention_bwd(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                   const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                   const Tensor& lse, double scale, bool causal) {
  if (!cudnn_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, scale, causal))
    attention_backward(dq, dk, dv, dout, q, k, v, out, lse, scale, causal);
}
constexpr AttentionPaths kAttention{attention_fwd, attention_bwd};

void bn_stats_dual_backward_dgrad_coef(const Tensor& coef, const Tensor& g, const Tensor& dr,
                                       const Tensor& dwx, const Tensor& dbx, const Tensor& dwr,
                                       const Tensor& dbr, const Tensor& dy1, const Tensor& w1,
                                       const Tensor& dy_rest, const Tensor& mask,
                                       const Tensor& x, const Tensor& wx, const Tensor& mx,
                                       const Tensor& ix, const Tensor& r, const Tensor& wr,
                                       const Tensor& mr, const Tensor& ir, GradientMode mode) {
  bn_nhwc_dual_backward_dgrad_coef(coef, g, dr, dwx, dbx, dwr, dbr, dy1, w1, dy_rest, mask, x, wx,
                                   mx, ix, r, wr, mr, ir, mode == GradientMode::Accumulate);
}

void bn_relu_conv1x1_forward_stats(const Tensor& y, const Tensor& sum, const Tensor& sqsum,
                                   const Tensor& x, const Tensor& scale_shift, const Tensor& w) {
  conv1x1_bn_relu_forward_stats(y, sum, sqsum, x, scale_shift, w, ConvParams{});
}
void bn_relu_conv1x1_backward_weight(const Tensor& dw, const Tensor& dy, const Tensor& x,
                                     const Tensor& scale_shift, GradientMode mode) {
  conv1x1_bn_relu_backward_weight(dw, dy, x, scale_shift, ConvParams{},
                                  mode == GradientMode::Accumulate);
}

constexpr BatchNormStatsPaths make_bn_stats() {
  BatchNormStatsPaths p{bn_nhwc_finalize, bn_stats_apply, bn_stats_backward, bn_nhwc_dual_apply,
                        bn_stats_dual_backward};
  p.compute = bn_nhwc_stats;
  p.backward_dgrad = bn_stats_backward_dgrad;
  p.backward_dgrad_coef = bn_stats_backward_dgrad_coef;
  p.backward_dgrad_linear = bn_stats_backward_dgrad_linear;
  p.dual_backward_dgrad = bn_stats_dual_backward_dgrad;
  p.dual_backward_dgrad_coef = bn_stats_dual_backward_dgrad_coef;
  p.relu_max_pool = bn_nhwc_relu_max_pool;
  p.relu_max_pool_at_max = relu_max_pool_backward_uses_at_max;
  p.relu_max_pool_backward = bn_stats_relu_max_pool_backward;
  p.relu_conv1x1_forward_stats = bn_relu_conv1x1_forward_stats;
  p.relu_conv1x1_backward_weight = bn_relu_conv1x1_backward_weight;
  return p;
}
constexpr BatchNormStatsPaths kBatchNormStats = make_bn_stats();

Backend make_table() {
  Backend b;
  b.name = "cuda";
  b.allocator = caching_allocator;
  b.copy = copy_tensor;
  b.fill = fill_tensor;
  b.profile_begin = profile_begin;
  b.profile_end = profile_end;
  b.unary = unary;
  b.binary = binary;
  b.reduce_rows = reduce_rows;
  b.reduce_cols = reduce_cols;
  b.max_rows = max_rows;
  b.scatter_rows = scatter_rows;
  b.matmul = matmul;
  b.linear_forward = linear_forward;
  b.linear_backward = linear_backward;
  b.bias_gelu_forward = bias_gelu_forward;
  b.bias_gelu_backward = bias_gelu_backward;
  b.conv2d_forward = conv2d_forward;
  b.conv2d_backward_data = conv_dgrad;
  b.conv2d_backward_weight = conv_wgrad;
  b.conv2d_forward_stats = conv_stats;
  b.conv1x1_fold_prep = conv1x1_fold_prep;
  b.conv1x1_fold_weight_grad = conv1x1_fold_weight_grad;
  b.max_pool2d_forward = max_pool2d_forward;
  b.max_pool2d_backward = max_pool2d_backward;
  b.avg_pool2d_forward = avg_pool2d_forward;
  b.avg_pool2d_backward = avg_pool2d_backward;
  b.adaptive_avg_pool2d_forward = adaptive_avg_pool2d_forward;
  b.adaptive_avg_pool2d_backward = adaptive_avg_pool2d_backward;
  b.batch_norm_forward_training = bn_forward_training;
  b.batch_norm_forward_eval = bn_forward_eval;
  b.batch_norm_backward = bn_backward;
  b.sync_batch_norm_stats = sync_batch_norm_stats;
  b.sync_batch_norm_apply = sync_batch_norm_apply;
  b.sync_batch_norm_backward_sums = sync_batch_norm_backward_sums;
  b.sync_batch_norm_backward_dx = sync_batch_norm_backward_dx;
  b.supports = supports;
  b.batch_norm_relu = &kBatchNormRelu;
  b.batch_norm_stats = &kBatchNormStats;
  b.attention = &kAttention;
  b.layer_norm_forward = layer_norm_forward;
  b.layer_norm_backward = layer_norm_backward;
  b.philox_advance = philox_advance;
  b.dropout = dropout;
  b.embedding_forward = embedding_forward;
  b.embedding_backward = embedding_backward;
  b.where = where;
  b.softmax_forward = softmax_fwd;
  b.softmax_backward = softmax_bwd;
  b.cross_entropy = cross_entropy_fused;
  b.fused_check_grads = fused_check_grads;
  b.fused_clip_coef = fused_clip_coef;
  b.fused_step_begin = fused_step_begin;
  b.fused_sgd_step = fused_sgd_step;
  b.fused_adamw_step = fused_adamw_step;
  b.loss_scaler_update = loss_scaler_update;
  return b;
}

}  // namespace

const Backend& backend_table() {
  static const Backend table = make_table();
  return table;
}

bool dgrad_fusion_enabled() { return g_dgrad_fusion.get(); }
void set_dgrad_fusion_enabled(bool on) { g_dgrad_fusion.set(on); }
bool tail_fold_enabled() { return g_tail_fold.get(); }
bool tail_fold_dual_enabled() { return g_tail_fold_dual.get(); }
void set_tail_fold_dual_enabled(bool on) { g_tail_fold_dual.set(on); }
bool tail_fold_shortcut_enabled() { return g_tail_fold_shortcut.get(); }
bool dgrad_stride2_enabled() { return g_dgrad_stride2.get(); }
void set_dgrad_stride2_enabled(bool on) { g_dgrad_stride2.set(on); }
void set_tail_fold_shortcut_enabled(bool on) { g_tail_fold_shortcut.set(on); }
void set_tail_fold_enabled(bool on) { g_tail_fold.set(on); }
int64_t tail_fold_min() { return g_tail_fold_min.get(); }
void set_tail_fold_min(int64_t elements) {
  KILN_CHECK(elements >= 0 && elements <= (int64_t(1) << 30),
             "set_tail_fold_min: expected 0 to 2^30 elements, got ", elements);
  g_tail_fold_min.set(int(elements));
}

}  // namespace kiln::cuda
