#pragma once
// The backend interface: one table of entry points per device type, the only way the layers
// above reach device code. ops/cpu/ fills the CPU table, cuda/ the CUDA table; both are
// registered explicitly in one place (ops/backends.cpp, register_builtin_backends) the first
// time a table is asked for — no static self-registration, which silently vanishes from static
// libraries.
//
//   kiln::backend(x).unary(UnaryOp::Exp, out, x, 0.0);     // the table of x's device
//
// The contract of every entry is written here, once; the backends' own headers only add what
// is particular to them (dtypes, layouts they take). Common to all entries:
// - Inputs are validated by the caller (ops/*.cpp, kiln::F) and outputs allocated by it with
//   the right shape and dtype. Unless an entry says otherwise, tensors may have any strides and
//   every element of each output is written (`=`); an entry that adds says `+=`.
// - A GPU backend runs everything on its current stream (cuda::current_stream()) without
//   synchronising the host, unless an entry says it synchronises.
// - Floating data is f32 or f64 on the CPU (f16/bf16 tensors are cast by the caller) and f32
//   or f16 on CUDA (f32 accumulation); batch-norm parameters and statistics are f32 on CUDA.
// - Entries marked "optional" may be null: a fast path the backend does not have. The caller
//   then takes the unfused composition, which defines the result.
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/fused_optim.h"
#include "core/kinds.h"
#include "core/storage.h"
#include "core/tensor.h"

namespace kiln {

using TensorRef = const Tensor&;

// What BatchNormStatsPaths::finalize computes, for the entries that take it: from sum and sqsum
// (C) of x over `count` = M values, save_mean (=), save_invstd (=) and scale_shift (2C) (=) =
// [weight·invstd, bias - mean·weight·invstd]; running_mean and running_var (when defined)
// r = (1 - momentum)·r + momentum·stat, the variance unbiased (M/(M-1)); and `counter` (a
// BatchNorm2d's num_batches_tracked, i64 scalar, when defined) += 1.
struct BnStatsFinalize {
  Tensor save_mean, save_invstd, scale_shift;  // outputs
  Tensor sum, sqsum, weight, bias, running_mean, running_var, counter;
  int64_t count = 0;
  double momentum = 0.1, eps = 1e-5;
};

// The fast paths an op may take where its backend supports them (Backend::supports). Each names
// the operands a query passes, in order.
enum class FastPath : uint8_t {
  // BatchNormReluPaths: x, residual, weight, bias, running_mean, running_var (training).
  BatchNormRelu,
  // BatchNormStatsPaths' required entries: x, residual, weight, bias, running_mean, running_var,
  // sum, sqsum (training; sum and sqsum undefined when they would come from compute).
  BatchNormStats,
  // BatchNormStatsPaths::backward_dgrad: dy1, w1, x, mask (the forward's ReLU bits, or
  // undefined for a mask recomputed from x).
  BatchNormStatsDgrad,
  // BatchNormStatsPaths::dual_backward_dgrad: dy1, w1, x.
  BatchNormStatsDualDgrad,
  // BatchNormStatsPaths::backward_dgrad_linear: dy1, w1, x, x2, w2, b2.
  BatchNormStatsDgradLinear,
  // BatchNormStatsPaths::relu_max_pool: x (the op checks the stem pool's geometry).
  BatchNormReluMaxPool,
  // BatchNormStatsPaths::relu_max_pool_backward: x.
  BatchNormReluMaxPoolBackward,
  // BatchNormStatsPaths::relu_conv1x1_forward_stats and relu_conv1x1_backward_weight (both): x,
  // w (O, C, 1, 1).
  BatchNormReluConv1x1,
  // AttentionPaths: q, k, v (B, H, L, D), as F::scaled_dot_product_attention gets them.
  Attention,
  // bias_gelu_forward/backward (F::linear_gelu's GEMM without bias, then bias + GELU in one
  // pass): x, weight, bias, as the op gets them.
  BiasGelu,
  // The tail fold (ops/dgrad_sink.h, ops/conv2d.cpp) on a 1x1 convolution: g (N, K, H, W) its
  // output gradient's first factor, x (N, C, H, W) its input, w (K, C, 1, 1): the backend wants
  // the fold for these operands and its two fold entries take them.
  TailFold,
  // The tail fold from a downsample block's tail (BatchNormStatsPaths::dual_backward_dgrad_coef;
  // conv3 still answers TailFold for its own operands): x, the tail's first input (conv3's
  // output).
  TailFoldDual,
  // Both sides of a downsample tail folded (dual_backward_dgrad_coef with dr undefined): g, the
  // gradient through the tail's ReLU. The shortcut's convolution still answers TailFold for its
  // own operands.
  TailFoldShortcut,
  // backward_dgrad and backward_dgrad_coef (relu + z, the mask bits) taking r compact: a
  // stride-2 unpadded 1x1 convolution's data gradient at x's even pixels, (N, C, ⌈H/2⌉, ⌈W/2⌉),
  // zero at the others (ops/dgrad_sink.h, wants_dgrad_stride2): x, mask.
  BatchNormStatsDgradStride2,
};

// Library-fused training batch norm + ReLU (+ residual add) (cuDNN's BN_ACTIVATION /
// BN_ADD_ACTIVATION), both entries or neither. forward: y = relu(bn(x) [+ z]) (z may be
// undefined), saved statistics and running stats as batch_norm_forward_training; returns the
// reserve space the backward needs (kept alive with y; may be empty). backward: dx, dz (when z
// was given) (=); dweight, dbias `=` or `+=` by `mode`.
struct BatchNormReluPaths {
  using Forward = Tensor (*)(TensorRef y, TensorRef save_mean, TensorRef save_invstd,
                             TensorRef x, TensorRef z, TensorRef weight, TensorRef bias,
                             TensorRef running_mean, TensorRef running_var, double momentum,
                             double eps);
  using Backward = void (*)(TensorRef dx, TensorRef dz, TensorRef dweight, TensorRef dbias,
                            TensorRef dy, TensorRef x, TensorRef y, TensorRef weight,
                            TensorRef bias, TensorRef save_mean, TensorRef save_invstd,
                            TensorRef reserve, double eps, GradientMode mode);
  constexpr BatchNormReluPaths(Forward f, Backward b) : forward(f), backward(b) {}
  const Forward forward;
  const Backward backward;
};

// Batch norm of an activation whose per-channel sums are known (conv2d_forward_stats, or
// `compute`), as one elementwise pass each way. The five required entries come together (the
// constructor takes them all); the optional ones after them each name their FastPath. x, z, y,
// dy, dx, dz, r: (N, C, H, W) of a layout and dtype supports(BatchNormStats) accepted;
// per-channel tensors f32 contiguous; M = N·H·W.
struct BatchNormStatsPaths {
  // BnStatsFinalize's outputs from its inputs.
  using Finalize = void (*)(const BnStatsFinalize& f);
  // y = act(x·scale + shift [+ z]), scale and shift = f.scale_shift: f finalized first, in the
  // same launch sequence. With Relu and z, `mask` (u8, numel/8) gets the ReLU's mask (bit j of
  // byte i: element 8i + j of y is positive). Gelu is only asked for without z.
  using Apply = void (*)(TensorRef y, TensorRef x, TensorRef z, const BnStatsFinalize& f,
                         Activation act, TensorRef mask);
  // g = dy through the activation's derivative (Relu: the forward's mask when z was given, else
  // recomputed from x; Gelu: gelu'(x·scale + shift) recomputed from x); dx (=), dz (=) = g when
  // defined; dweight = Σ g·x̂, dbias = Σ g when defined, `=` or `+=` by `mode`.
  using Backward = void (*)(TensorRef dx, TensorRef dz, TensorRef dweight, TensorRef dbias,
                            TensorRef dy, TensorRef x, TensorRef mask, TensorRef weight,
                            TensorRef save_mean, TensorRef save_invstd, TensorRef scale_shift,
                            Activation act, GradientMode mode);
  // Two batch norms meeting at a residual add: y = relu(x·ss_x + r·ss_r), mask as above, ss_x
  // and ss_r the scale_shift of f_x and f_r, each finalized first as in apply.
  using DualApply = void (*)(TensorRef y, TensorRef x, const BnStatsFinalize& f_x, TensorRef r,
                             const BnStatsFinalize& f_r, TensorRef mask);
  // Its backward: dx, dr (=); per side dweight, dbias when defined (`=` or `+=` by `mode`).
  using DualBackward = void (*)(TensorRef dx, TensorRef dr, TensorRef dweight_x,
                                TensorRef dbias_x, TensorRef dweight_r, TensorRef dbias_r,
                                TensorRef dy, TensorRef mask, TensorRef x, TensorRef weight_x,
                                TensorRef mean_x, TensorRef invstd_x, TensorRef r,
                                TensorRef weight_r, TensorRef mean_r, TensorRef invstd_r,
                                GradientMode mode);
  constexpr BatchNormStatsPaths(Finalize f, Apply a, Backward b, DualApply da, DualBackward db)
      : finalize(f), apply(a), backward(b), dual_apply(da), dual_backward(db) {}
  const Finalize finalize;
  const Apply apply;
  const Backward backward;
  const DualApply dual_apply;
  const DualBackward dual_backward;

  // Optional. sum, sqsum (C) (=) = Σx and Σx² per channel in a fixed order, for when the
  // convolution did not produce them.
  void (*compute)(TensorRef sum, TensorRef sqsum, TensorRef x) = nullptr;
  // Optional (FastPath::BatchNormStatsDgrad): backward's relu cases where dy is a stride-1
  // convolution's data gradient added onto r: dy = dgrad(dy1, w1) + r, w1 (K, C, 1, 1)
  // unpadded or (K, C, 3, 3) with padding 1, r undefined meaning zero — computed with the first
  // pass (on CUDA one GEMM with the sums in its epilogue). With `mask` (relu + z, the forward's
  // bits) dz (=) = dy masked by the ReLU; with mask undefined (relu alone) the mask is recomputed
  // from x and scale_shift, and dz is undefined. Where FastPath::BatchNormStatsDgradStride2 says
  // so, r may be compact (N, C, ⌈H/2⌉, ⌈W/2⌉): its values at x's even pixels, zero elsewhere
  // (here and in backward_dgrad_coef).
  void (*backward_dgrad)(TensorRef dx, TensorRef dz, TensorRef dweight, TensorRef dbias,
                         TensorRef dy1, TensorRef w1, TensorRef r, TensorRef x, TensorRef mask,
                         TensorRef weight, TensorRef save_mean, TensorRef save_invstd,
                         TensorRef scale_shift, GradientMode mode) = nullptr;
  // Optional (FastPath::BatchNormStatsDgrad, with mask): backward_dgrad's relu + z case
  // without dx. coef (3C f32, =) holds the batch norm's backward as per-channel factors, dx =
  // coef[c]·dz + coef[C + c]·x + coef[2C + c], for the convolution that produced x to take its
  // output gradient in that form (ops/dgrad_sink.h, FoldedGradTarget); dz (=), dweight and
  // dbias as backward_dgrad's. The pass that would write dx is not run.
  void (*backward_dgrad_coef)(TensorRef coef, TensorRef dz, TensorRef dweight, TensorRef dbias,
                              TensorRef dy1, TensorRef w1, TensorRef r, TensorRef x,
                              TensorRef mask, TensorRef weight, TensorRef save_mean,
                              TensorRef save_invstd, GradientMode mode) = nullptr;
  // Optional (FastPath::BatchNormStatsDualDgrad): dual_backward where dy = dgrad(dy1, w1) +
  // dy_rest is a stride-1 unpadded 1x1 convolution's data gradient, w1 (K, C, 1, 1), added onto
  // dy_rest (undefined meaning zero), computed with the first pass (on CUDA one GEMM with both
  // batch norms' sums in its epilogue).
  void (*dual_backward_dgrad)(TensorRef dx, TensorRef dr, TensorRef dweight_x, TensorRef dbias_x,
                              TensorRef dweight_r, TensorRef dbias_r, TensorRef dy1, TensorRef w1,
                              TensorRef dy_rest, TensorRef mask, TensorRef x, TensorRef weight_x,
                              TensorRef mean_x, TensorRef invstd_x, TensorRef r,
                              TensorRef weight_r, TensorRef mean_r, TensorRef invstd_r,
                              GradientMode mode) = nullptr;
  // Optional (FastPath::BatchNormStatsDualDgrad): dual_backward_dgrad without dx, the tail fold
  // of a block whose shortcut has its own batch norm. g (=, x's shape and layout) gets the
  // gradient through the ReLU; coef (6C f32, =) both sides' per-channel factors, x's first
  // (x's gradient is coef[c]·g + coef[C + c]·x + coef[2C + c], for the convolution that produced
  // x to take in that form: ops/dgrad_sink.h), r's after; dr (=) and the parameters' gradients
  // as dual_backward_dgrad's. The pass writes dr alone; with dr undefined (FastPath::
  // TailFoldShortcut: the shortcut's convolution takes r's side as factors too) there is no pass.
  void (*dual_backward_dgrad_coef)(TensorRef coef, TensorRef g, TensorRef dr,
                                   TensorRef dweight_x, TensorRef dbias_x, TensorRef dweight_r,
                                   TensorRef dbias_r, TensorRef dy1, TensorRef w1,
                                   TensorRef dy_rest, TensorRef mask, TensorRef x,
                                   TensorRef weight_x, TensorRef mean_x, TensorRef invstd_x,
                                   TensorRef r, TensorRef weight_r, TensorRef mean_r,
                                   TensorRef invstd_r, GradientMode mode) = nullptr;
  // Optional (FastPath::BatchNormStatsDgradLinear): backward_dgrad's relu case with the mask
  // recomputed from x and no other gradient, where dy = dgrad(dy1, w1) + x2 · w2ᵀ + b2 on x's
  // rows: x2 (N, C2, H, W) at x's positions, w2 (C, C2), b2 (C). The tail fold's data gradient
  // of a bottleneck's a2 (ops/conv2d.cpp): t = x2 · w2ᵀ + b2 is never written.
  void (*backward_dgrad_linear)(TensorRef dx, TensorRef dweight, TensorRef dbias, TensorRef dy1,
                                TensorRef w1, TensorRef x2, TensorRef w2, TensorRef b2,
                                TensorRef x, TensorRef weight, TensorRef save_mean,
                                TensorRef save_invstd, TensorRef scale_shift,
                                GradientMode mode) = nullptr;
  // Optional (FastPath::BatchNormReluMaxPool): the ResNet stem's tail in one pass, y =
  // max_pool2d(relu(x·scale + shift), 3x3, stride 2, padding 1) and the pool's indices
  // (max_pool2d_indices_dtype, y's shape and layout), equal to apply(relu) then
  // max_pool2d_forward; the normalised tensor is never written. at_max (=), when defined (x's
  // dtype, y's shape and layout): x at each maximum, for relu_max_pool_backward.
  void (*relu_max_pool)(TensorRef y, TensorRef indices, TensorRef at_max, TensorRef x,
                        TensorRef scale_shift) = nullptr;
  // Optional: whether relu_max_pool_backward on x would use at_max (the op then allocates it for
  // the forward and keeps it for the backward); null: never.
  bool (*relu_max_pool_at_max)(TensorRef x) = nullptr;
  // Optional (FastPath::BatchNormReluMaxPoolBackward): dy (y's gradient) through the pool and
  // the ReLU (mask recomputed from x) to dx (=); dweight, dbias as backward's; at_max the
  // forward's, or undefined.
  void (*relu_max_pool_backward)(TensorRef dx, TensorRef dweight, TensorRef dbias, TensorRef dy,
                                 TensorRef indices, TensorRef at_max, TensorRef x, TensorRef weight,
                                 TensorRef save_mean, TensorRef save_invstd, TensorRef scale_shift,
                                 GradientMode mode) = nullptr;
  // Optional (FastPath::BatchNormReluConv1x1, both or neither): a stride-1, unpadded 1x1
  // convolution without bias of relu(x·scale + shift) (a ResNet bottleneck's bn2 into conv3),
  // the normalised tensor never written. relu_conv1x1_forward_stats: y (N, O, H, W) (=) =
  // conv(relu(bn(x)), w), sum and sqsum (O) (=) = Σy and Σy² of y as stored, the next batch
  // norm's statistics. relu_conv1x1_backward_weight: dw (O, C, 1, 1) `=` or `+=` by `mode` =
  // dyᵀ · relu(x·scale + shift). Both give the bits of the apply pass followed by the plain
  // convolution.
  void (*relu_conv1x1_forward_stats)(TensorRef y, TensorRef sum, TensorRef sqsum, TensorRef x,
                                     TensorRef scale_shift, TensorRef w) = nullptr;
  void (*relu_conv1x1_backward_weight)(TensorRef dw, TensorRef dy, TensorRef x,
                                       TensorRef scale_shift, GradientMode mode) = nullptr;
};

// Fused scaled-dot-product attention that never materialises the L×L scores: both entries or
// neither. q (B, H, Lq, D), k, v (B, H, Lk, D) and out, dout, dq, dk, dv (their shapes) with the
// last dim dense and any other strides; lse (B, H, Lq) f32 contiguous. forward: out (=) =
// softmax(scale·q·kᵀ + mask)·v, mask -inf above the diagonal offset Lk - Lq when causal, and
// lse (=) = each row's log Σ exp of the masked scaled scores. backward: dq, dk, dv (=) from dout,
// the forward's out and lse; deterministic (no float atomics).
struct AttentionPaths {
  using Forward = void (*)(TensorRef out, TensorRef lse, TensorRef q, TensorRef k, TensorRef v,
                           double scale, bool causal);
  using Backward = void (*)(TensorRef dq, TensorRef dk, TensorRef dv, TensorRef dout,
                            TensorRef q, TensorRef k, TensorRef v, TensorRef out, TensorRef lse,
                            double scale, bool causal);
  constexpr AttentionPaths(Forward f, Backward b) : forward(f), backward(b) {}
  const Forward forward;
  const Backward backward;
};

struct Backend {
  const char* name = nullptr;  // "cpu", "cuda"

  // ---- memory ----
  // The allocator behind Storage for device `index` (a caching allocator on CUDA).
  Allocator* (*allocator)(int index) = nullptr;
  // dst = src converted to dst's dtype; same shape (the caller expands src); any strides. One
  // of the two lives on this backend's device, the other may be on the CPU. A copy to the host
  // synchronises before returning.
  void (*copy)(TensorRef dst, TensorRef src) = nullptr;
  // Every element of dst = value converted to dst's dtype.
  void (*fill)(TensorRef dst, double value) = nullptr;

  // ---- profiling hook (optional) ----
  // profile_begin names the op now entering (a string literal) and, when the backend's
  // profiler is on, starts timing it and returns a token for profile_end; else null. `t` is
  // the op's main input (its shape is described only when profiling). profile_end is called
  // once for every profile_begin, with its token (null too), when the op leaves: the backend
  // keeps a per-thread stack of the ops running, so errors (out of memory) can name them.
  void* (*profile_begin)(const char* name, TensorRef t) = nullptr;
  void (*profile_end)(void* token) = nullptr;

  // ---- elementwise and reductions ----
  // out = op(a, scalar); a has out's shape.
  void (*unary)(UnaryOp op, TensorRef out, TensorRef a, double scalar) = nullptr;
  // out = a (op) b, a and b already expanded to out's shape (zero strides where broadcast).
  // out may be a itself (in-place ops).
  void (*binary)(BinaryOp op, TensorRef out, TensorRef a, TensorRef b, double alpha) = nullptr;
  // out (rows) = Sum or Max over the trailing `inner` elements of each row of contiguous x
  // viewed (rows, inner); out contiguous.
  void (*reduce_rows)(ReduceOp op, TensorRef out, TensorRef x, int64_t rows,
                      int64_t inner) = nullptr;
  // Optional: out (cols) = Sum over the `outer` rows of contiguous x viewed (outer, cols), out
  // contiguous: a sum over a tensor's leading dims in memory order (a channels-last gradient
  // summed over N, H, W) without transposing it first. Deterministic: the same bits on every
  // call for the same shape. Null: the caller transposes x and calls reduce_rows.
  void (*reduce_cols)(TensorRef out, TensorRef x, int64_t outer, int64_t cols) = nullptr;
  // Over contiguous x (rows, inner), inner > 0: values (rows) = row maxima, indices (rows, i64)
  // = position of the first maximal element (NaN counts as maximal). Both contiguous.
  void (*max_rows)(TensorRef values, TensorRef indices, TensorRef x, int64_t rows,
                   int64_t inner) = nullptr;
  // dx contiguous (rows, inner) = 0 except dx[r, indices[r]] = g[r].
  void (*scatter_rows)(TensorRef dx, TensorRef g, TensorRef indices, int64_t rows,
                       int64_t inner) = nullptr;

  // ---- matmul and linear ----
  // out = op(a)·op(b), op = transpose when the flag is set (a then stores op(a) transposed);
  // a, b, out contiguous, all 2-D or all 3-D with one batch size.
  void (*matmul)(TensorRef out, TensorRef a, bool trans_a, TensorRef b, bool trans_b) = nullptr;
  // y (N, out) = x (N, in)·w (out, in)ᵀ + bias (out) (bias may be undefined); all contiguous.
  void (*linear_forward)(TensorRef y, TensorRef x, TensorRef w, TensorRef bias) = nullptr;
  // dw = dyᵀ·x (always written); dx = dy·w and db = Σ_n dy when defined. All contiguous.
  void (*linear_backward)(TensorRef dx, TensorRef dw, TensorRef db, TensorRef dy, TensorRef x,
                          TensorRef w) = nullptr;
  // Optional (FastPath::BiasGelu, F::linear_gelu's fused path; otherwise it composes linear and
  // gelu): the exact GELU of a GEMM's output y (rows, cols) plus bias (cols), out (=) =
  // gelu(y + bias); all contiguous, one dtype, one supports() accepted.
  void (*bias_gelu_forward)(TensorRef out, TensorRef y, TensorRef bias) = nullptr;
  // Its backward: dy (=) = dout·gelu'(y + bias), dy contiguous; dbias (=) = Σ_rows dy (of dy as
  // stored) in a fixed order when defined.
  void (*bias_gelu_backward)(TensorRef dy, TensorRef dbias, TensorRef dout, TensorRef y,
                             TensorRef bias) = nullptr;

  // ---- convolution ----
  // x (N, C, H, W), w (O, C/groups, kH, kW), y/dy (N, O, H', W'), bias (O) or undefined; 4-D
  // tensors dense in NCHW or NHWC (each may differ). The backward entries write `=`, or `+=`
  // with GradientMode::Accumulate (dx/dw must then not share memory with the other operands).
  void (*conv2d_forward)(TensorRef y, TensorRef x, TensorRef w, TensorRef bias,
                         const ConvParams& p) = nullptr;
  void (*conv2d_backward_data)(TensorRef dx, TensorRef dy, TensorRef w, const ConvParams& p,
                               GradientMode mode) = nullptr;
  void (*conv2d_backward_weight)(TensorRef dw, TensorRef dy, TensorRef x, const ConvParams& p,
                                 GradientMode mode) = nullptr;
  // Optional. The convolution (no bias) with the per-channel Σy and Σy² (sum, sqsum: f32 (O)
  // contiguous, `=`) for the batch norm that follows. Returns false — y, sum and sqsum then hold
  // nothing — when the backend has no such path for this problem; the backend alone decides
  // (tuning, determinism, layouts).
  bool (*conv2d_forward_stats)(TensorRef y, TensorRef sum, TensorRef sqsum, TensorRef x,
                               TensorRef w, const ConvParams& p) = nullptr;
  // Optional, both or neither: the tail fold (ops/dgrad_sink.h, FoldedGradTarget;
  // ops/conv2d.cpp; FastPath::TailFold). w (K, C, 1, 1) a 1x1 convolution's weight, coef (3K
  // f32) its output gradient's factors a, b, c (dy = a·g + b·y + c per output channel).
  // fold_prep (=): w1 (K, C, 1, 1) = a ⊙ w (row k scaled by a_k), m2t (C, C) = (wᵀ·diag(b)·w)ᵀ,
  // bias (C) = cᵀ·w, in w's dtype, contiguous. fold_weight_grad: dw (K, C, 1, 1) (=) = dyᵀ · x =
  // a ⊙ (gᵀ·x) + b ⊙ (w·xᵀx) + c ⊗ Σ_rows x, g (N, K, H, W) and x (N, C, H, W), the sums in f32
  // until dw (its three terms cancel in part).
  void (*conv1x1_fold_prep)(TensorRef w1, TensorRef m2t, TensorRef bias, TensorRef w,
                            TensorRef coef) = nullptr;
  void (*conv1x1_fold_weight_grad)(TensorRef dw, TensorRef g, TensorRef x, TensorRef w,
                                   TensorRef coef) = nullptr;

  // ---- pooling ----
  // x/dx (N, C, H, W), y/dy (N, C, H', W'); outputs any dense layout.
  // Max pooling saves, per output, the window-local position i·kernel_w + j of the window's
  // first maximal element (NaN counts as maximal) in `indices` (N, C, H', W') of dtype
  // max_pool2d_indices_dtype(p) (core/kinds.h); a window without input elements has y = -inf
  // and index 255 (u8) or -1 (i32). The backward routes dy to the saved positions, summing
  // where windows overlap.
  void (*max_pool2d_forward)(TensorRef y, TensorRef indices, TensorRef x,
                             const PoolParams& p) = nullptr;
  void (*max_pool2d_backward)(TensorRef dx, TensorRef dy, TensorRef indices,
                              const PoolParams& p) = nullptr;
  void (*avg_pool2d_forward)(TensorRef y, TensorRef x, const PoolParams& p) = nullptr;
  void (*avg_pool2d_backward)(TensorRef dx, TensorRef dy, const PoolParams& p) = nullptr;
  // PyTorch's window rule: output i over an input of n covers [floor(i·n/o), ceil((i+1)·n/o)).
  void (*adaptive_avg_pool2d_forward)(TensorRef y, TensorRef x) = nullptr;
  void (*adaptive_avg_pool2d_backward)(TensorRef dx, TensorRef dy) = nullptr;

  // ---- batch norm ----
  // x, y, dy, dx: (N, C, ...) dense; weight, bias, running stats (C); weight/bias undefined
  // mean 1 and 0. Training: y, save_mean, save_invstd = 1/sqrt(var_biased + eps) (=), and
  // running stats (when defined) r = (1 - momentum)·r + momentum·stat (unbiased variance).
  void (*batch_norm_forward_training)(TensorRef y, TensorRef save_mean, TensorRef save_invstd,
                                      TensorRef x, TensorRef weight, TensorRef bias,
                                      TensorRef running_mean, TensorRef running_var,
                                      double momentum, double eps) = nullptr;
  // y = (x - running_mean)/sqrt(running_var + eps)·weight + bias.
  void (*batch_norm_forward_eval)(TensorRef y, TensorRef x, TensorRef weight, TensorRef bias,
                                  TensorRef running_mean, TensorRef running_var,
                                  double eps) = nullptr;
  // With the forward's batch statistics: dx, dweight = Σ dy·x̂, dbias = Σ dy, each when defined.
  void (*batch_norm_backward)(TensorRef dx, TensorRef dweight, TensorRef dbias, TensorRef dy,
                              TensorRef x, TensorRef weight, TensorRef save_mean,
                              TensorRef save_invstd) = nullptr;

  // The local halves of a batch norm whose statistics are summed over several processes
  // (F::sync_batch_norm all-reduces `stats` and `sums` between them; with one process the
  // reduction is the identity). stats (2C+1) = [Σx, Σx², count]; apply: mean = Σx/n,
  // var = Σx²/n - mean² (biased, clamped at 0), then as batch_norm_forward_training; sums (2C)
  // = [Σdy, Σdy·x̂]; dx = weight·invstd·(dy - Σdy/n - x̂·Σdy·x̂/n) with n = count[0].
  void (*sync_batch_norm_stats)(TensorRef stats, TensorRef x) = nullptr;
  void (*sync_batch_norm_apply)(TensorRef y, TensorRef save_mean, TensorRef save_invstd,
                                TensorRef x, TensorRef weight, TensorRef bias,
                                TensorRef running_mean, TensorRef running_var, TensorRef stats,
                                double momentum, double eps) = nullptr;
  void (*sync_batch_norm_backward_sums)(TensorRef sums, TensorRef dy, TensorRef x,
                                        TensorRef mean, TensorRef invstd) = nullptr;
  void (*sync_batch_norm_backward_dx)(TensorRef dx, TensorRef dy, TensorRef x, TensorRef weight,
                                      TensorRef mean, TensorRef invstd, TensorRef sums,
                                      TensorRef count) = nullptr;

  // ---- layer norm, dropout, embedding, where (the transformer ops) ----
  // Layer norm over the trailing `cols` elements of each row of contiguous x (rows, cols): y (=)
  // of x's shape and dtype; mean, rstd (rows) (=) = the row's mean and 1/sqrt(biased variance +
  // eps), f32 (f64 for f64 x); weight, bias (cols) contiguous, f32 for f16/bf16 x (else x's
  // dtype), either may be undefined (1 and 0).
  void (*layer_norm_forward)(TensorRef y, TensorRef mean, TensorRef rstd, TensorRef x,
                             TensorRef weight, TensorRef bias, int64_t rows, int64_t cols,
                             double eps) = nullptr;
  // dx when defined, contiguous, `=` or `+=` by `dx_mode` (`+=` adds the value rounded to x's
  // dtype, as a separate add would); dweight = Σ_rows dy·x̂ and dbias = Σ_rows dy when defined,
  // `=` or `+=` by `mode`, in a fixed order (bit-reproducible, whatever dx's mode). dy
  // contiguous, x's dtype.
  void (*layer_norm_backward)(TensorRef dx, TensorRef dweight, TensorRef dbias, TensorRef dy,
                              TensorRef x, TensorRef weight, TensorRef mean, TensorRef rstd,
                              int64_t rows, int64_t cols, GradientMode mode,
                              GradientMode dx_mode) = nullptr;
  // Claims n elements of the device's Philox stream (core/philox.h): base (=) = *offset, then
  // *offset += n rounded up to a whole block of 4; both i64 (1) on the device. Device work only,
  // so a captured graph claims fresh elements on every replay.
  void (*philox_advance)(TensorRef base, TensorRef offset, int64_t n) = nullptr;
  // out (=) = in·keep/(1 - p), keep = (u ≥ p) with u element i's uniform of the stream (seed,
  // *base + i); in and out contiguous, one shape and dtype. The backward is the same call on
  // the gradient, with the same base.
  void (*dropout)(TensorRef out, TensorRef in, double p, uint64_t seed, TensorRef base) = nullptr;
  // out (N, D) (=) = weight[indices]; indices i64 (N) in [0, rows), weight (rows, D); all
  // contiguous.
  void (*embedding_forward)(TensorRef out, TensorRef weight, TensorRef indices) = nullptr;
  // dweight (rows, D) `=` or `+=` (mode): row r gets Σ of dout's rows whose index is r, added in
  // index order (bit-reproducible). All contiguous.
  void (*embedding_backward)(TensorRef dweight, TensorRef dout, TensorRef indices,
                             GradientMode mode) = nullptr;
  // out (=) = cond ? a : b element by element; all contiguous, one shape; cond bool, a, b and out
  // one dtype (any).
  void (*where)(TensorRef out, TensorRef cond, TensorRef a, TensorRef b) = nullptr;

  // ---- fast paths (optional): the backend alone decides when they run ----
  // Whether `path` takes these operands, in the order its FastPath names (undefined tensors
  // where the op has none). ops/ states what an op means (training or not, which operands it
  // has) and asks before every fast path, composing the op from the entries above otherwise;
  // dtypes, layouts, hardware and the backend's own switches are the backend's business alone.
  // Null: no fast paths (call through kiln::supports, below).
  bool (*supports)(FastPath path, std::initializer_list<const Tensor*> operands) = nullptr;
  // Library-fused batch norm + ReLU (+ residual add): FastPath::BatchNormRelu.
  const BatchNormReluPaths* batch_norm_relu = nullptr;
  // Batch norm of an activation whose per-channel sums are known: FastPath::BatchNormStats and
  // the paths built on it.
  const BatchNormStatsPaths* batch_norm_stats = nullptr;
  // Fused attention: FastPath::Attention.
  const AttentionPaths* attention = nullptr;

  // ---- softmax and cross-entropy ----
  // Over the last dim of contiguous (rows, cols) tensors. y = softmax(x) or log_softmax(x).
  void (*softmax_forward)(TensorRef y, TensorRef x, int64_t rows, int64_t cols,
                          bool log) = nullptr;
  // dx = y·(dy - Σ dy·y) (softmax) or dy - exp(y)·Σ dy (log_softmax, y = log-probabilities).
  void (*softmax_backward)(TensorRef dx, TensorRef dy, TensorRef y, int64_t rows, int64_t cols,
                           bool log) = nullptr;
  // Fused softmax-cross-entropy over contiguous logits (N, C) and i64 targets (N) in [0, C):
  // loss (0-d) = mean over rows of Σ_c q_c·(-log p_c), q = (1-ε)·onehot + ε/C; grad (N, C) =
  // (p - q)·grad_scale/N, rounded once to grad's dtype (the logits' dtype, or f32 for 16-bit
  // logits); correct (0-d i64, when defined) = rows whose first argmax is the target.
  void (*cross_entropy)(TensorRef loss, TensorRef grad, TensorRef correct, TensorRef logits,
                        TensorRef target, double label_smoothing, double grad_scale) = nullptr;

  // ---- fused optimizer and loss scaler (core/fused_optim.h holds their contracts) ----
  void (*fused_check_grads)(const fused::CheckArgs& a) = nullptr;
  void (*fused_clip_coef)(const float* partial, int64_t n, const float* scale, float max_norm,
                          float* norm, float* coef) = nullptr;
  void (*fused_step_begin)(int32_t* step, const float* found_inf) = nullptr;
  void (*fused_sgd_step)(const fused::StepArgs& a) = nullptr;
  void (*fused_adamw_step)(const fused::StepArgs& a) = nullptr;
  void (*loss_scaler_update)(const fused::ScalerArgs& a) = nullptr;
};

// The table of a device type. A kiln::Error naming the device when kiln was built without it.
const Backend& backend(DeviceType type);
inline const Backend& backend(const Tensor& t) { return backend(t.device().type); }
inline const Backend& backend(Device d) { return backend(d.type); }
// Whether kiln was built with a backend for `type`.
bool has_backend(DeviceType type);
// Whether `be` takes fast path `path` for these operands (false when it has no fast paths).
inline bool supports(const Backend& be, FastPath path,
                     std::initializer_list<const Tensor*> operands) {
  return be.supports != nullptr && be.supports(path, operands);
}

struct BackendRegistry {
  const Backend* tables[2] = {nullptr, nullptr};  // indexed by DeviceType
};
// Fills `r` with every backend this build has. Defined in ops/backends.cpp — the one place that
// knows the backends — and called once, by the first backend() call.
void register_builtin_backends(BackendRegistry& r);

// Marks one op for the profiling hook: the rest of the enclosing scope is timed on the device
// of `t` when its backend profiles (see Backend::profile_begin).
class OpProfileScope {
 public:
  OpProfileScope(const char* name, const Tensor& t);
  ~OpProfileScope();
  OpProfileScope(const OpProfileScope&) = delete;
  OpProfileScope& operator=(const OpProfileScope&) = delete;

 private:
  const Backend* backend_ = nullptr;
  void* token_ = nullptr;
};

}  // namespace kiln
