#pragma once
// kiln::F — the functional API. Every op validates its inputs once (errors name the op and the
// offending shapes, dtypes or devices), dispatches on the device to ops/cpu/ (Eigen; f32 and
// f64) or cuda/, and records an autograd Node when an input requires grad (core/autograd.h).
// Forward and backward of an op live in the same file: ops/<op>.cpp.
//
// Unless stated otherwise: inputs may have any strides; outputs are new contiguous tensors of
// the inputs' dtype and device; all inputs of one op must share dtype and device.
#include <array>
#include <functional>
#include <optional>
#include <vector>

#include "core/autograd.h"
#include "core/kinds.h"
#include "core/tensor.h"

namespace kiln::F {

// ---------------- elementwise (ops/elementwise.cpp) ----------------
// Binary ops broadcast like NumPy/PyTorch: trailing dims aligned, size-1 dims stretched.
Tensor add(const Tensor& a, const Tensor& b, double alpha = 1.0);  // a + alpha*b
Tensor sub(const Tensor& a, const Tensor& b, double alpha = 1.0);  // a - alpha*b
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor rsub(const Tensor& a, double b);  // b - a
Tensor rdiv(const Tensor& a, double b);  // b / a
Tensor pow(const Tensor& a, double exponent);
Tensor pow(const Tensor& a, const Tensor& exponent);  // broadcasting; a > 0 where differentiated
Tensor neg(const Tensor& a);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);
Tensor sqrt(const Tensor& a);
Tensor relu(const Tensor& a);  // gradient 0 at 0
Tensor sigmoid(const Tensor& a);
Tensor tanh(const Tensor& a);
// GELU, x·Φ(x) with Φ the standard normal CDF, or PyTorch's tanh approximation
// 0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³))).
enum class GeluApproximate { None, Tanh };
Tensor gelu(const Tensor& a, GeluApproximate approximate = GeluApproximate::None);
Tensor silu(const Tensor& a);  // x·sigmoid(x)
// Reduces a broadcast gradient back to `shape` (sums over stretched dims). Differentiable.
Tensor sum_to(const Tensor& g, const Shape& shape);
// Shape of broadcasting a against b; error naming `op` when incompatible.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

// Not differentiable: comparisons give bool tensors; argmax gives i64.
Tensor eq(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, double b);
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);

// In-place, not recorded (self must not require grad while grad mode is on). self's shape is
// kept; `other` broadcasts to it. Bumps self's version.
void add_(const Tensor& self, const Tensor& other, double alpha = 1.0);  // self += alpha*other
void add_(const Tensor& self, double value);
void mul_(const Tensor& self, const Tensor& other);
void mul_(const Tensor& self, double value);

// ---------------- reductions (ops/reduce.cpp) ----------------
Tensor sum(const Tensor& x);  // 0-d result
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim = false);
Tensor mean(const Tensor& x);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim = false);
Tensor max(const Tensor& x);  // gradient to the first maximal element
Tensor max(const Tensor& x, int64_t dim, bool keepdim = false);

// ---------------- linear algebra (ops/matmul.cpp) ----------------
// (n,k)x(k,m) -> (n,m); batched (..., n, k) x (..., k, m) with broadcast batch dims.
Tensor matmul(const Tensor& a, const Tensor& b);
// x (N, in), weight (out, in), bias (out) or undefined -> (N, out) = x·weightᵀ + bias.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());
// gelu(linear(x, weight, bias)), the exact GELU: a transformer MLP's first Linear and its
// activation. Where the backend has the bias-GELU entries (CUDA) the GEMM runs without a bias
// and the GELU's pass adds it (its backward gives the bias gradient from the same pass); else
// the composition, which defines the result.
Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias);

// ---------------- convolution and pooling (ops/conv2d.cpp, ops/pool.cpp) ----------------
struct Pair {
  int64_t h = 0, w = 0;
  Pair(int64_t v) : h(v), w(v) {}  // NOLINT: F::conv2d(x, w, b, /*stride=*/2)
  Pair(int64_t h_, int64_t w_) : h(h_), w(w_) {}
};
// Per-channel Σx and Σx² (f32, C values each, no autograd) of a tensor x, computed by the op
// that produced x, as of x's storage version `version`.
struct ChannelStats {
  Tensor sum, sqsum;
  uint64_t version = 0;
  bool defined() const { return sum.defined() && sqsum.defined(); }
};

// x (N, C, H, W), weight (O, C/groups, kH, kW), bias (O) or undefined -> (N, O, H', W').
// The output keeps x's memory format (NCHW or NHWC). With `stats`, the output's per-channel
// statistics come out of the convolution kernel itself where the backend can do that (CUDA,
// f16 channels-last, no bias: cuDNN's GenStats epilogue) and *stats is set; elsewhere *stats
// is left undefined. They feed F::batch_norm_from_stats.
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(), Pair stride = 1,
              Pair padding = 0, Pair dilation = 1, int64_t groups = 1,
              ChannelStats* stats = nullptr);
// Padding is implicit -inf. Output (N, C, H', W').
Tensor max_pool2d(const Tensor& x, Pair kernel, std::optional<Pair> stride = std::nullopt,
                  Pair padding = 0, Pair dilation = 1);
// count_include_pad: divide by the full window (PyTorch's default) or by the valid part.
Tensor avg_pool2d(const Tensor& x, Pair kernel, std::optional<Pair> stride = std::nullopt,
                  Pair padding = 0, bool count_include_pad = true);
// PyTorch's adaptive windows: start = floor(i*H/oh), end = ceil((i+1)*H/oh).
Tensor adaptive_avg_pool2d(const Tensor& x, Pair output_size);
Tensor flatten(const Tensor& x, int64_t start_dim = 1, int64_t end_dim = -1);

// ---------------- normalisation (ops/batch_norm.cpp) ----------------
// x (N, C, ...) ; weight, bias (C) or undefined; running_mean/var (C) or undefined.
// training: normalise with the batch statistics (biased variance) and, when running stats are
// given, update them in place: r = (1-momentum)*r + momentum*stat (unbiased variance for
// running_var), as PyTorch does. eval: normalise with the running statistics.
Tensor batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias,
                  const Tensor& running_mean, const Tensor& running_var, bool training,
                  double momentum = 0.1, double eps = 1e-5);

// relu(batch_norm(x) + residual) (residual may be undefined: relu(batch_norm(x))), with
// batch_norm's arguments and semantics. The tail of a ResNet block; on CUDA training with f16
// channels-last x (and residual) and f32 parameters it is one fused cuDNN kernel each way
// (ops/batch_norm_act.cpp), elsewhere the composition of batch_norm, add and relu.
Tensor batch_norm_relu(const Tensor& x, const Tensor& residual, const Tensor& weight,
                       const Tensor& bias, const Tensor& running_mean, const Tensor& running_var,
                       bool training, double momentum = 0.1, double eps = 1e-5);

// act(batch_norm(x) [+ residual]) (act: relu, or identity when !relu), with batch_norm's
// arguments and semantics, where `stats` are x's statistics from the op that produced it
// (F::conv2d's). On CUDA, training, f16 channels-last x (and residual) with channels a multiple
// of 8, f32 parameters and running stats, and stats current (x unmodified since), the forward is
// one elementwise pass (cuda/kernels.h) and the backward kiln's two-pass kernels; otherwise it
// is batch_norm_relu, or batch_norm [+ add], which define the result. num_batches_tracked (an
// i64 scalar, a BatchNorm2d's counter), when defined and training, is incremented — in the
// fused kernel when that runs.
Tensor batch_norm_from_stats(const Tensor& x, const ChannelStats& stats, const Tensor& residual,
                             bool relu, const Tensor& weight, const Tensor& bias,
                             const Tensor& running_mean, const Tensor& running_var, bool training,
                             double momentum = 0.1, double eps = 1e-5,
                             const Tensor& num_batches_tracked = Tensor());
// The same with any Activation: Relu and None as above (relu = true / false); Gelu is
// gelu(batch_norm(x) [+ residual]) (the exact GELU), fused on the same operands without a
// residual — and, where the backend can compute x's statistics itself, also when `stats` are
// not current (a batch norm after a pool): one pass for the sums, one elementwise pass forward;
// two passes backward, GELU's derivative recomputed from x. Elsewhere the composition.
Tensor batch_norm_from_stats(const Tensor& x, const ChannelStats& stats, const Tensor& residual,
                             Activation act, const Tensor& weight, const Tensor& bias,
                             const Tensor& running_mean, const Tensor& running_var, bool training,
                             double momentum = 0.1, double eps = 1e-5,
                             const Tensor& num_batches_tracked = Tensor());

// In backward, batch_norm_from_stats's fused node with relu (a ResNet block's tail with a
// residual, or an inner relu(bn(y))) takes the data gradient of a stride-1 convolution that
// reads its output (1x1 unpadded, or 3x3 with padding 1) into its own first pass where the backend
// supports it (FastPath::BatchNormStatsDgrad; on CUDA one GEMM with the statistics in its epilogue,
// cuda::set_dgrad_fusion_enabled switches it). dgrad_fusions() counts the gradients taken in.
uint64_t dgrad_fusions();

// The tail fold (ops/dgrad_sink.h, FoldedGradTarget): an identity block tail's batch-norm
// backward (batch_norm_from_stats with relu and a residual, its data gradient taken from the
// next convolution) hands a stride-1 1x1 conv3 without bias the factors of dy3 instead of
// writing it, where the backend has the pieces (BatchNormStatsPaths::backward_dgrad_coef,
// Backend::conv1x1_fold_prep and conv1x1_fold_weight_grad) and wants the fold for the operands
// (FastPath::TailFold; on CUDA cuda::set_tail_fold_enabled and set_tail_fold_min switch it).
// tail_folds() counts the gradients handed over.
uint64_t tail_folds();

// A stride-2 unpadded 1x1 convolution reading a block tail's output (a downsample block's
// shortcut) hands the tail's node its data gradient at the even pixels alone (ops/dgrad_sink.h,
// DgradSink::wants_dgrad_stride2), where the backend's GEMM reads it so
// (FastPath::BatchNormStatsDgradStride2; on CUDA cuda::set_dgrad_stride2_enabled switches it).
// stride2_compact_grads() counts those the tail's GEMM read compact; stride2_inplace_adds() those
// added in place, at the even pixels, into x's gradient from the other consumers where that
// gradient was the node's alone (a 3x3 stride-2 conv1 beside the shortcut, as in ResNet-18).
uint64_t stride2_compact_grads();
uint64_t stride2_inplace_adds();

// counter (a BatchNorm2d's num_batches_tracked, i64 scalar; may be undefined) += 1, in place,
// outside the graph: what the batch-norm ops below do in training where no kernel of theirs
// counted.
void count_batch(const Tensor& counter);

// One batch norm's parameters, running statistics and counter (F::batch_norm_from_stats's
// arguments).
struct BatchNormParams {
  Tensor weight, bias, running_mean, running_var;
  double momentum = 0.1, eps = 1e-5;
  Tensor num_batches_tracked;  // may be undefined
};
// relu(batch_norm(x) + batch_norm(r)), each batch norm with its own statistics (from the
// convolutions that produced x and r) and parameters: the tail of a ResNet block whose shortcut
// is a convolution + batch norm. Fused (one pass each way, the shortcut's normalised tensor
// never written) under batch_norm_from_stats's conditions for both; otherwise that composition.
Tensor batch_norm_add_batch_norm_relu(const Tensor& x, const ChannelStats& sx,
                                      const BatchNormParams& px, const Tensor& r,
                                      const ChannelStats& sr, const BatchNormParams& pr,
                                      bool training);
// conv2d(relu(batch_norm(x)), weight) for a stride-1, unpadded 1x1 convolution without bias,
// weight (O, C, 1, 1), the batch norm with x's statistics `stats` (from the convolution that
// produced x) and parameters p: a ResNet bottleneck's bn2 into conv3. *out_stats (when given)
// gets the output's statistics as conv2d's `stats` would. Fused where the backend has
// FastPath::BatchNormReluConv1x1 (training, out_stats given, batch_norm_from_stats's
// conditions): the normalised tensor is never written — the batch norm's scale, shift and ReLU
// are applied as the convolution's kernels load x, forward and weight gradient — with the
// composition's bits. Otherwise that composition.
Tensor batch_norm_relu_conv1x1(const Tensor& x, const ChannelStats& stats,
                               const BatchNormParams& p, bool training, const Tensor& weight,
                               ChannelStats* out_stats);

// max_pool2d(relu(batch_norm(x)), kernel, stride, padding, dilation): the ResNet stem's tail,
// with `stats` as in batch_norm_from_stats (may be undefined). On CUDA in training, for the
// stem's 3x3/2 pool with padding 1, under batch_norm_from_stats's conditions, it is one pass
// (statistics from a fixed-order pass when the convolution did not produce them) and the
// normalised tensor is never written; the backward rebuilds the pool's gradient inside the
// batch norm + ReLU backward (mask recomputed). Otherwise it is that composition, which defines
// the result: the fused forward equals it bit for bit (values and pool indices), the backward
// to rounding (its per-channel sums run in another fixed order). bn.num_batches_tracked as in
// batch_norm_from_stats (also for the add_batch_norm_relu above, per side).
Tensor batch_norm_relu_max_pool(const Tensor& x, const ChannelStats& stats,
                                const BatchNormParams& bn, bool training, Pair kernel,
                                std::optional<Pair> stride = std::nullopt, Pair padding = 0,
                                Pair dilation = 1);

// ---------------- synchronised batch norm (ops/sync_batch_norm.cpp) ----------------
// Sums a small dense 1-D statistics tensor IN PLACE over all data-parallel ranks (kiln-train:
// an NCCL all-reduce on the current stream; one rank: do nothing). The tensor has the
// statistics' dtype (f32 on CUDA, x's on the CPU) and lives on x's device. Every rank must
// make the same calls in the same order with the same sizes (a collective).
using StatsAllReduce = std::function<void(const Tensor&)>;

// batch_norm in training mode over the GLOBAL batch: the union along N of every rank's x.
// x (N, C, ...) NCHW or channels-last, the rank's shard (N may differ between ranks); weight,
// bias, running stats as in batch_norm (running_var gets the unbiased variance of the global
// batch). CPU: f32/f64 with parameters of x's dtype; CUDA: f32/f16/bf16 with f32 parameters.
// Forward: ONE all_reduce of the packed local [Σx (C), Σx² (C), count] (statistics dtype: f32
// on CUDA also for 16-bit x). Backward, when x needs a gradient: ONE all_reduce of the packed
// local [Σdy (C), Σdy·x̂ (C)] (an undefined dy counts as zeros, so every rank takes part).
// Gradients: dx (=) is this rank's slice of the full-batch batch_norm's dx for the upstream
// gradients of all ranks, i.e. ∂(Σ_ranks loss)/∂x; dweight (=) = Σ_local dy·x̂ and dbias (=) =
// Σ_local dy are this rank's parts, summing over ranks to the full-batch gradients. With a
// per-rank mean loss and GradBucketer's averaging this is big-batch training exactly (the
// reasoning is in ops/sync_batch_norm.cpp). Needs more than one value per channel on each
// rank (as batch_norm). No host synchronisation.
Tensor sync_batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias,
                       const Tensor& running_mean, const Tensor& running_var, double momentum,
                       double eps, const StatsAllReduce& all_reduce);

// ---------------- transformer ops (ops/layer_norm.cpp, ops/dropout.cpp, ops/join.cpp,
// ops/index.cpp, ops/attention.cpp) ----------------
// Layer norm over the trailing dims `normalized_shape` of x, with affine weight and bias of that
// shape (either may be undefined): y = (x - mean)/sqrt(var + eps)·weight + bias, statistics per
// row, the variance biased (PyTorch's F.layer_norm). For f16/bf16 x the parameters are f32 and
// the statistics f32; otherwise x's dtype.
Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps = 1e-5);
// Training: each element zeroed with probability p, the rest scaled by 1/(1-p); eval or p = 0: x
// itself. Draws from the device's counter-based stream (core/generator.h's philox_stream), so
// the mask is never stored (the backward draws it again) and a replayed CUDA graph draws fresh
// masks each step, equal bit for bit to the eager steps it recorded.
Tensor dropout(const Tensor& x, double p, bool training = true);
// Joins tensors of one shape but `dim` along `dim` (cat) or along a new dim (stack).
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);
// Views of x along `dim`: pieces of `size` (the last may be smaller), or `chunks` pieces of
// ceil(size/chunks) (PyTorch's split and chunk).
std::vector<Tensor> split(const Tensor& x, int64_t size, int64_t dim = 0);
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim = 0);
// weight (rows, D)[indices] -> (indices..., D); indices i64. The backward adds each index's row
// in index order (bit-reproducible). Out-of-range indices are an error on the CPU; on a GPU
// (where checking would synchronise) they read as zero rows and get no gradient.
Tensor embedding(const Tensor& indices, const Tensor& weight);
// cond ? a : b with broadcasting (cond bool); differentiable in a and b.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
// x with `value` where mask (bool, broadcast to x) is true.
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);
// softmax(scale·q·kᵀ [+ causal mask])·v, dropout_p applied to the attention weights in training;
// q (B, H, Lq, D), k and v (B, H, Lk, D); scale defaults to 1/sqrt(D); causal: query i sees keys
// j <= i + Lk - Lq. On a backend with FastPath::Attention (CUDA: f16/bf16, head_dim 64 or 128,
// no dropout) one fused kernel each way that never materialises the Lq×Lk scores; otherwise the
// composition of matmul, softmax and matmul. Returns (B, H, Lq, D), laid out as (B, Lq, H, D).
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    bool causal = false, double dropout_p = 0.0,
                                    std::optional<double> scale = std::nullopt);
// Self-attention over a packed projection: qkv (B, L, 3, H, D), the in-projection's output
// viewed, gives (B, L, H, D) contiguous — scaled_dot_product_attention of its three parts,
// transposed. On the fused path the backward writes one gradient of qkv directly (no per-part
// gradients scattered into zeros and summed).
Tensor packed_attention(const Tensor& qkv, bool causal = false, double dropout_p = 0.0,
                        std::optional<double> scale = std::nullopt);

// ---------------- softmax and losses (ops/softmax.cpp, ops/loss.cpp) ----------------
Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);
// logits (N, C), target (N) of class indices (i64 or i32) in [0, C). Mean over the batch.
// label_smoothing ε: the target distribution is (1-ε)·onehot + ε/C, as in PyTorch.
// f16/bf16 logits give an f32 loss; their gradient is computed in f32 and rounded to 16 bits
// once, after the upstream gradient (a loss scale) is multiplied in.
Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing = 0.0);

}  // namespace kiln::F
