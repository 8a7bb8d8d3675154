#pragma once
// Layers over kiln::F and PyTorch's default initialisations.
//
// Defaults match torch.nn: Conv2d and Linear weights kaiming_uniform(a=√5), i.e.
// U(±1/√fan_in), biases U(±1/√fan_in); BatchNorm2d weight 1, bias 0, running_mean 0,
// running_var 1, num_batches_tracked 0 (i64). Random values come from `gen` (the default
// generator when null), so a seed fixes a model's initial weights. Parameters are created f32
// on the CPU; use Module::to to move or convert them.
#include <initializer_list>
#include <optional>

#include "core/generator.h"
#include "models/module.h"
#include "ops/ops.h"

namespace kiln::nn {

using F::Pair;

// ---------------- initialisers (in place, not recorded; return t) ----------------
namespace init {
enum class FanMode { FanIn, FanOut };
enum class Nonlinearity { Linear, ReLU, LeakyReLU };
// fan_in = size(1) * receptive field, fan_out = size(0) * receptive field (dim >= 2).
std::pair<int64_t, int64_t> fan_in_out(const Tensor& t);
// gain: 1 (Linear), √2 (ReLU), √(2/(1+a²)) (LeakyReLU with slope a).
double calculate_gain(Nonlinearity nl, double a = 0.0);
const Tensor& uniform_(const Tensor& t, double lo, double hi, Generator* gen = nullptr);
const Tensor& normal_(const Tensor& t, double mean, double std, Generator* gen = nullptr);
const Tensor& constant_(const Tensor& t, double value);
// std = gain / √fan, gain from `nl` with slope a.
const Tensor& kaiming_normal_(const Tensor& t, double a = 0.0, FanMode mode = FanMode::FanIn,
                              Nonlinearity nl = Nonlinearity::LeakyReLU, Generator* gen = nullptr);
// bound = gain · √(3 / fan).
const Tensor& kaiming_uniform_(const Tensor& t, double a = 0.0, FanMode mode = FanMode::FanIn,
                               Nonlinearity nl = Nonlinearity::LeakyReLU, Generator* gen = nullptr);
// A conv weight (out, in, kH, kW) that passes its input through: filter i < min(out, in) is 1
// at the centre of input channel i and 0 elsewhere, the other filters 0 (torch.nn.init.dirac_).
const Tensor& dirac_(const Tensor& t);
// A whitening filter bank learned from data (the CIFAR-10 speedruns' first layer): for a conv
// weight (2·D, C, kH, kW) with D = C·kH·kW, the kH x kW patches of `images` (N, C, H, W, any
// float dtype and device; every position, stride 1, no padding) give the D x D second-moment
// matrix Σ = E[p pᵀ] (no mean removed: normalised images are centred already), computed on the
// images' device in f32. With its eigen-decomposition Σ = Σ_k λ_k v_k v_kᵀ, largest λ first,
// filter k is v_k / √(λ_k + eps) and filter D + k is its negative, so the first D output
// channels have second moments λ_k / (λ_k + eps): near 1, uncorrelated. The eigensolver runs on
// the CPU in f64 (Eigen). Throws for a weight of another shape or fewer than D patches.
const Tensor& whitening_(const Tensor& weight, const Tensor& images, double eps = 5e-4);
}  // namespace init

class BatchNorm2d;

// x (N, in_channels, H, W) -> (N, out_channels, H', W').
// weight (out, in/groups, kH, kW); bias (out) when `bias`.
class Conv2d : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, Pair kernel, Pair stride = 1, Pair padding = 0,
         Pair dilation = 1, int64_t groups = 1, bool bias = true, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;
  // forward(x), also asking for the output's per-channel statistics (F::conv2d's `stats`).
  Tensor forward(const Tensor& x, F::ChannelStats* stats);
  // forward(relu(bn(y))) for y with the statistics `y_stats` (ConvBnRef::forward_relu_into), also
  // asking for the output's statistics: F::batch_norm_relu_conv1x1 where this is a stride-1,
  // unpadded 1x1 convolution without bias (relu(bn(y)) then never written), else the
  // composition.
  Tensor forward_bn_relu(const Tensor& y, const F::ChannelStats& y_stats, BatchNorm2d& bn,
                         F::ChannelStats* stats);
  std::string type_name() const override { return "Conv2d"; }
  std::string describe() const override;
  std::vector<std::string> half_parameters() const override;
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }  // undefined without bias
  // Re-draws weight (and bias) with PyTorch's default init.
  void reset_parameters(Generator* gen = nullptr);

 private:
  int64_t in_, out_, groups_;
  Pair kernel_, stride_, padding_, dilation_;
  Tensor weight_, bias_;
};

using F::StatsAllReduce;

// x (N, C, H, W). Training: batch statistics, running stats updated with `momentum`,
// num_batches_tracked += 1. Eval: running statistics.
// Synchronised (set_sync): in training the statistics are the global batch's, all ranks' x
// together (F::sync_batch_norm, one `reduce` call per forward and per backward); eval mode is
// unchanged.
class BatchNorm2d : public Module {
 public:
  explicit BatchNorm2d(int64_t channels, double eps = 1e-5, double momentum = 0.1);
  Tensor forward(const Tensor& x) override;
  // relu(bn(x) + residual), residual optional: F::batch_norm_relu with this module's state
  // (fused where the backend can). Counts a batch like forward(). Synchronised:
  // sync_batch_norm, then add and relu (not fused).
  Tensor forward_relu(const Tensor& x, const Tensor& residual = Tensor());
  // act(bn(x)), `stats` x's statistics when the op that made x produced them (F::conv2d's):
  // F::batch_norm_from_stats with this module's state — for GELU one fused pass each way where
  // the backend can (the statistics computed here when not given). Counts a batch like
  // forward(). Synchronised: sync_batch_norm, then the activation.
  Tensor forward_act(const Tensor& x, Activation act, const F::ChannelStats& stats = {});
  // This module's parameters and running statistics as the F:: batch-norm ops take them.
  F::BatchNormParams params() const;
  // Validates x (N, C, H, W) and, in training, counts a batch (num_batches_tracked += 1): what
  // every forward does first. For callers that run the batch norm through F:: themselves
  // (ConvBnRef), check alone where they hand params()' counter to an F op that counts.
  void check_and_count(const Tensor& x);
  void check(const Tensor& x) const;
  // An empty `reduce` turns synchronisation off. The reducer's captures must outlive training.
  void set_sync(StatsAllReduce reduce) { sync_ = std::move(reduce); }
  bool sync_enabled() const { return static_cast<bool>(sync_); }
  std::string type_name() const override { return "BatchNorm2d"; }
  std::string describe() const override;
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }
  const Tensor& running_mean() const { return running_mean_; }
  const Tensor& running_var() const { return running_var_; }
  const Tensor& num_batches_tracked() const { return num_batches_tracked_; }

 private:
  int64_t channels_;
  double eps_, momentum_;
  Tensor weight_, bias_, running_mean_, running_var_, num_batches_tracked_;
  StatsAllReduce sync_;
};

class MaxPool2d;

// A convolution and the batch norm that follows it: the one place that decides how the two
// run together. In training without synchronisation the convolution also produces the batch
// norm's per-channel statistics (F::conv2d's `stats`, a backend fast path: cuDNN's statistics
// epilogue on the GPU, saving the batch norm's own pass over the activation), and batch norm,
// residual add and ReLU run as one fused op (F::batch_norm_from_stats,
// F::batch_norm_add_batch_norm_relu). Otherwise each module runs on its own; the results are
// the same up to rounding. The modules are registered elsewhere (a ResNet block's conv1/bn1,
// or ConvBn below); this only refers to them.
// A BatchNorm2d followed by an activation, act(bn(x)), as one module (F::batch_norm_from_stats:
// for GELU one fused pass each way on CUDA f16 channels-last). Its state is BatchNorm2d's, under
// the same names.
class BatchNormAct2d : public BatchNorm2d {
 public:
  BatchNormAct2d(int64_t channels, Activation act, double eps = 1e-5, double momentum = 0.1);
  Tensor forward(const Tensor& x) override { return forward_act(x, act_); }
  Activation activation() const { return act_; }
  std::string type_name() const override { return "BatchNormAct2d"; }
  std::string describe() const override;

 private:
  Activation act_;
};

struct ConvBnRef {
  Conv2d& conv;
  BatchNorm2d& bn;
  // act(bn(conv(x)) [+ residual]), act = ReLU when `relu`.
  Tensor forward(const Tensor& x, bool relu, const Tensor& residual = Tensor()) const;
  // act(bn(conv(x))) for any Activation: the statistics from the convolution where it can.
  Tensor forward(const Tensor& x, Activation act) const;
  // relu(bn(conv(x)) + shortcut.bn(shortcut.conv(r))): a ResNet block's tail with a
  // convolution shortcut, one fused pass when both convolutions produce their statistics.
  Tensor forward_add(const Tensor& x, const ConvBnRef& shortcut, const Tensor& r) const;
  // next(relu(bn(conv(x)))) with next's output statistics in *next_stats (when given): a ResNet
  // bottleneck's conv2 → bn2 → ReLU → conv3, through Conv2d::forward_bn_relu.
  Tensor forward_relu_into(const Tensor& x, Conv2d& next, F::ChannelStats* next_stats) const;
  // The second halves of forward and forward_add for a y = conv(x) already computed, with its
  // statistics `stats` (undefined when the convolution gave none).
  Tensor finish(const Tensor& y, const F::ChannelStats& stats, bool relu,
                const Tensor& residual = Tensor()) const;
  Tensor finish_add(const Tensor& y, const F::ChannelStats& stats, const ConvBnRef& shortcut,
                    const Tensor& r) const;
  // Whether conv should produce bn's statistics (bn in training, not synchronised).
  bool stats_wanted() const;
  // pool(relu(bn(conv(x)))): the ResNet stem, one fused pass after the convolution where
  // F::batch_norm_relu_max_pool fuses.
  Tensor forward_max_pool(const Tensor& x, MaxPool2d& pool) const;
};

// torchvision's Sequential(Conv2d, BatchNorm2d) — a ResNet downsample — with its names ("0",
// "1", so `downsample.0.weight` and `downsample.1.running_mean` load as they are), run through
// ConvBnRef.
class ConvBn : public Module {
 public:
  // act(bn(conv(x))); act None: a ResNet downsample.
  ConvBn(std::shared_ptr<Conv2d> conv, std::shared_ptr<BatchNorm2d> bn,
         Activation act = Activation::None);
  Tensor forward(const Tensor& x) override;  // act(bn(conv(x)))
  ConvBnRef parts() const { return {*conv_, *bn_}; }
  std::string type_name() const override { return "Sequential"; }

 private:
  std::shared_ptr<Conv2d> conv_;
  std::shared_ptr<BatchNorm2d> bn_;
  Activation act_;
};

// Synchronised batch norm for data-parallel training: set_sync(reduce) on every BatchNorm2d in
// `root`'s tree (root included). Returns how many modules it set. `reduce` must not be empty.
int64_t enable_sync_batch_norm(Module& root, const StatsAllReduce& reduce);

// x (..., in) -> (..., out). weight (out, in), bias (out) when `bias`.
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "Linear"; }
  std::string describe() const override;
  std::vector<std::string> half_parameters() const override;
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }
  void reset_parameters(Generator* gen = nullptr);

 private:
  int64_t in_, out_;
  Tensor weight_, bias_;
};

class ReLU : public Module {
 public:
  Tensor forward(const Tensor& x) override { return F::relu(x); }
  std::string type_name() const override { return "ReLU"; }
};

class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(Pair kernel, std::optional<Pair> stride = std::nullopt, Pair padding = 0,
                     Pair dilation = 1)
      : kernel_(kernel), stride_(stride.value_or(kernel)), padding_(padding), dilation_(dilation) {}
  Tensor forward(const Tensor& x) override;
  // forward(relu(bn(y))) for y with the statistics `stats` (ConvBnRef::forward_max_pool):
  // F::batch_norm_relu_max_pool, one pass for the ResNet stem's pool.
  Tensor forward_bn_relu(const Tensor& y, const F::ChannelStats& stats, BatchNorm2d& bn);
  std::string type_name() const override { return "MaxPool2d"; }
  std::string describe() const override;

 private:
  Pair kernel_, stride_, padding_, dilation_;
};

class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(Pair kernel, std::optional<Pair> stride = std::nullopt, Pair padding = 0,
                     bool count_include_pad = true)
      : kernel_(kernel), stride_(stride.value_or(kernel)), padding_(padding),
        count_include_pad_(count_include_pad) {}
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "AvgPool2d"; }
  std::string describe() const override;

 private:
  Pair kernel_, stride_, padding_;
  bool count_include_pad_;
};

class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(Pair output_size) : output_(output_size) {}
  Tensor forward(const Tensor& x) override { return F::adaptive_avg_pool2d(x, output_); }
  std::string type_name() const override { return "AdaptiveAvgPool2d"; }
  std::string describe() const override;

 private:
  Pair output_;
};

class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1) : start_(start_dim), end_(end_dim) {}
  Tensor forward(const Tensor& x) override { return x.flatten(start_, end_); }
  std::string type_name() const override { return "Flatten"; }

 private:
  int64_t start_, end_;
};

// Applies its children in order; they are named "0", "1", ...
class Sequential : public Module {
 public:
  Sequential() = default;
  Sequential(std::initializer_list<ModulePtr> modules);
  void push_back(ModulePtr m);
  size_t size() const { return named_children().size(); }
  const ModulePtr& operator[](size_t i) const;
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "Sequential"; }
};

}  // namespace kiln::nn
