#include "models/nn.h"

#include <Eigen/Eigenvalues>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <unordered_set>

namespace kiln::nn {

namespace {
std::string pair_str(Pair p) {
  return p.h == p.w ? std::to_string(p.h)
                    : "(" + std::to_string(p.h) + ", " + std::to_string(p.w) + ")";
}
}  // namespace

// ---------------- init ----------------
namespace init {

std::pair<int64_t, int64_t> fan_in_out(const Tensor& t) {
  KILN_CHECK(t.dim() >= 2, "init: fan in/out needs a tensor with at least 2 dims, got ", t.desc());
  int64_t receptive = 1;
  for (int64_t d = 2; d < t.dim(); ++d) receptive *= t.size(d);
  return {t.size(1) * receptive, t.size(0) * receptive};
}

double calculate_gain(Nonlinearity nl, double a) {
  switch (nl) {
    case Nonlinearity::Linear: return 1.0;
    case Nonlinearity::ReLU: return std::sqrt(2.0);
    case Nonlinearity::LeakyReLU: return std::sqrt(2.0 / (1.0 + a * a));
  }
  KILN_FAIL("calculate_gain: bad nonlinearity");
}

// Values are drawn on the host in f64 and copied, so a seed gives the same weights on every
// device and dtype.
template <typename Draw>
static const Tensor& fill_host(const Tensor& t, Draw&& draw) {
  std::vector<double> v(size_t(t.numel()));
  for (double& x : v) x = draw();
  NoGradGuard no_grad;
  t.copy_(from_vector(v, t.shape(), DType::f64));
  return t;
}

const Tensor& uniform_(const Tensor& t, double lo, double hi, Generator* gen) {
  KILN_CHECK(lo <= hi, "init::uniform_: lo ", lo, " > hi ", hi);
  Generator& g = gen ? *gen : default_generator();
  return fill_host(t, [&] { return lo + (hi - lo) * g.uniform(); });
}

const Tensor& normal_(const Tensor& t, double mean, double std, Generator* gen) {
  Generator& g = gen ? *gen : default_generator();
  return fill_host(t, [&] { return mean + std * g.normal(); });
}

const Tensor& constant_(const Tensor& t, double value) {
  NoGradGuard no_grad;
  t.fill_(value);
  return t;
}

static double kaiming_std(const Tensor& t, double a, FanMode mode, Nonlinearity nl) {
  auto [fan_in, fan_out] = fan_in_out(t);
  int64_t fan = mode == FanMode::FanIn ? fan_in : fan_out;
  KILN_CHECK(fan > 0, "kaiming init: zero fan for ", t.desc());
  return calculate_gain(nl, a) / std::sqrt(double(fan));
}

const Tensor& kaiming_normal_(const Tensor& t, double a, FanMode mode, Nonlinearity nl,
                              Generator* gen) {
  return normal_(t, 0.0, kaiming_std(t, a, mode, nl), gen);
}

const Tensor& kaiming_uniform_(const Tensor& t, double a, FanMode mode, Nonlinearity nl,
                               Generator* gen) {
  double bound = std::sqrt(3.0) * kaiming_std(t, a, mode, nl);
  return uniform_(t, -bound, bound, gen);
}

const Tensor& dirac_(const Tensor& t) {
  KILN_CHECK(t.defined() && t.dim() == 4 && is_floating(t.dtype()),
             "dirac_: expected a floating (out, in, kH, kW) conv weight, got ", t.desc());
  const int64_t O = t.size(0), I = t.size(1), kh = t.size(2), kw = t.size(3);
  std::vector<float> w(size_t(O * I * kh * kw), 0.0f);
  for (int64_t i = 0; i < std::min(O, I); ++i) w[size_t(((i * I + i) * kh + kh / 2) * kw + kw / 2)] = 1;
  NoGradGuard no_grad;
  t.copy_(from_vector(w, t.shape()));
  return t;
}

const Tensor& whitening_(const Tensor& weight, const Tensor& images, double eps) {
  KILN_CHECK(weight.defined() && weight.dim() == 4 && images.defined() && images.dim() == 4 &&
                 is_floating(images.dtype()) && is_floating(weight.dtype()),
             "whitening_: expected a floating conv weight (2·C·kH·kW, C, kH, kW) and floating "
             "images (N, C, H, W), got ",
             weight.desc(), " and ", images.desc());
  const int64_t C = weight.size(1), kh = weight.size(2), kw = weight.size(3), D = C * kh * kw;
  KILN_CHECK(weight.size(0) == 2 * D && images.size(1) == C, "whitening_: a weight ",
             weight.desc(), " whitens ", C, "-channel images into 2 x ", D,
             " filters (out = 2·C·kH·kW); got images ", images.desc());
  KILN_CHECK(eps > 0, "whitening_: eps must be > 0, got ", eps);
  const int64_t Ho = images.size(2) - kh + 1, Wo = images.size(3) - kw + 1;
  KILN_CHECK(Ho >= 1 && Wo >= 1 && images.size(0) * Ho * Wo >= D, "whitening_: images ",
             images.desc(), " hold fewer than ", D, " patches of ", kh, "x", kw);
  NoGradGuard no_grad;
  const int64_t M = images.size(0) * Ho * Wo;
  // X (D, M): row (c, dy, dx) holds pixel (c, y + dy, x + dx) of every patch, in weight order.
  std::vector<Tensor> rows;
  rows.reserve(size_t(D));
  const Tensor x = images.to(DType::f32);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t dy = 0; dy < kh; ++dy)
      for (int64_t dx = 0; dx < kw; ++dx)
        rows.push_back(x.select(1, c).narrow(1, dy, Ho).narrow(2, dx, Wo).contiguous().reshape({M}));
  const Tensor X = F::stack(rows, 0);
  const std::vector<float> cov = F::matmul(X, X.transpose(0, 1).contiguous())
                                     .to(Device::cpu())
                                     .to_vector<float>();
  Eigen::MatrixXd sigma(D, D);
  for (int64_t i = 0; i < D; ++i)
    for (int64_t j = 0; j < D; ++j)  // symmetrised: the f32 sums may differ in the last bit
      sigma(i, j) = 0.5 * (double(cov[size_t(i * D + j)]) + double(cov[size_t(j * D + i)])) / double(M);
  const Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> eig(sigma);
  KILN_CHECK(eig.info() == Eigen::Success, "whitening_: the eigensolver did not converge");
  std::vector<float> w(size_t(2 * D * D));
  for (int64_t k = 0; k < D; ++k) {
    const int64_t src = D - 1 - k;  // Eigen sorts eigenvalues ascending
    const double scale = 1.0 / std::sqrt(std::max(eig.eigenvalues()(src), 0.0) + eps);
    for (int64_t j = 0; j < D; ++j) {
      const double v = eig.eigenvectors()(j, src) * scale;
      w[size_t(k * D + j)] = float(v);
      w[size_t((D + k) * D + j)] = float(-v);
    }
  }
  weight.copy_(from_vector(w, weight.shape()));
  return weight;
}

}  // namespace init

// PyTorch's reset_parameters for Conv and Linear: kaiming_uniform(a=√5) gives U(±1/√fan_in).
static void default_init(const Tensor& weight, const Tensor& bias, Generator* gen) {
  init::kaiming_uniform_(weight, std::sqrt(5.0), init::FanMode::FanIn,
                         init::Nonlinearity::LeakyReLU, gen);
  if (bias.defined()) {
    double bound = 1.0 / std::sqrt(double(init::fan_in_out(weight).first));
    init::uniform_(bias, -bound, bound, gen);
  }
}

// ---------------- Conv2d ----------------
Conv2d::Conv2d(int64_t in_channels, int64_t out_channels, Pair kernel, Pair stride, Pair padding,
               Pair dilation, int64_t groups, bool bias, Generator* gen)
    : in_(in_channels), out_(out_channels), groups_(groups), kernel_(kernel), stride_(stride),
      padding_(padding), dilation_(dilation) {
  KILN_CHECK(in_channels > 0 && out_channels > 0 && groups > 0 && in_channels % groups == 0 &&
                 out_channels % groups == 0,
             "Conv2d: channels (", in_channels, ", ", out_channels,
             ") must be positive and divisible by groups (", groups, ")");
  KILN_CHECK(kernel.h > 0 && kernel.w > 0 && stride.h > 0 && stride.w > 0, "Conv2d: kernel ",
             pair_str(kernel), " and stride ", pair_str(stride), " must be positive");
  weight_ = register_parameter("weight", empty({out_, in_ / groups_, kernel.h, kernel.w}));
  if (bias) bias_ = register_parameter("bias", empty({out_}));
  reset_parameters(gen);
}

void Conv2d::reset_parameters(Generator* gen) { default_init(weight_, bias_, gen); }

Tensor Conv2d::forward(const Tensor& x) {
  return F::conv2d(x, weight_, bias_, stride_, padding_, dilation_, groups_);
}

Tensor Conv2d::forward(const Tensor& x, F::ChannelStats* stats) {
  return F::conv2d(x, weight_, bias_, stride_, padding_, dilation_, groups_, stats);
}

Tensor Conv2d::forward_bn_relu(const Tensor& y, const F::ChannelStats& y_stats, BatchNorm2d& bn,
                               F::ChannelStats* stats) {
  const bool pointwise = kernel_.h == 1 && kernel_.w == 1 && stride_.h == 1 && stride_.w == 1 &&
                         padding_.h == 0 && padding_.w == 0 && dilation_.h == 1 &&
                         dilation_.w == 1 && groups_ == 1 && !bias_.defined();
  if (pointwise && bn.is_training() && !bn.sync_enabled())
    return F::batch_norm_relu_conv1x1(y, y_stats, bn.params(), /*training=*/true, weight_, stats);
  return forward(bn.forward_act(y, Activation::Relu, y_stats), stats);
}

std::string Conv2d::describe() const {
  std::ostringstream os;
  os << "Conv2d(" << in_ << ", " << out_ << ", kernel=" << pair_str(kernel_)
     << ", stride=" << pair_str(stride_) << ", padding=" << pair_str(padding_);
  if (dilation_.h != 1 || dilation_.w != 1) os << ", dilation=" << pair_str(dilation_);
  if (groups_ != 1) os << ", groups=" << groups_;
  if (!bias_.defined()) os << ", bias=false";
  os << ")";
  return os.str();
}

// ---------------- BatchNorm2d ----------------
BatchNorm2d::BatchNorm2d(int64_t channels, double eps, double momentum)
    : channels_(channels), eps_(eps), momentum_(momentum) {
  KILN_CHECK(channels > 0, "BatchNorm2d: channels must be positive, got ", channels);
  weight_ = register_parameter("weight", ones({channels}));
  bias_ = register_parameter("bias", zeros({channels}));
  running_mean_ = register_buffer("running_mean", zeros({channels}));
  running_var_ = register_buffer("running_var", ones({channels}));
  num_batches_tracked_ = register_buffer("num_batches_tracked", zeros({}, DType::i64));
}

void BatchNorm2d::check(const Tensor& x) const {
  KILN_CHECK(x.dim() == 4 && x.size(1) == channels_, "BatchNorm2d(", channels_,
             "): expected input (N, ", channels_, ", H, W), got ", x.desc());
}

void BatchNorm2d::check_and_count(const Tensor& x) {
  check(x);
  if (is_training()) F::count_batch(num_batches_tracked_);
}

Tensor BatchNorm2d::forward(const Tensor& x) {
  check_and_count(x);
  if (is_training() && sync_)
    return F::sync_batch_norm(x, weight_, bias_, running_mean_, running_var_, momentum_, eps_,
                              sync_);
  return F::batch_norm(x, weight_, bias_, running_mean_, running_var_, is_training(), momentum_,
                       eps_);
}

Tensor BatchNorm2d::forward_relu(const Tensor& x, const Tensor& residual) {
  check_and_count(x);
  if (is_training() && sync_) {  // no fused sync kernel: the composition batch_norm_relu defines
    Tensor y = F::sync_batch_norm(x, weight_, bias_, running_mean_, running_var_, momentum_, eps_,
                                  sync_);
    return F::relu(residual.defined() ? F::add(y, residual) : y);
  }
  return F::batch_norm_relu(x, residual, weight_, bias_, running_mean_, running_var_,
                            is_training(), momentum_, eps_);
}

Tensor BatchNorm2d::forward_act(const Tensor& x, Activation act, const F::ChannelStats& stats) {
  if (act == Activation::Relu && !stats.defined()) return forward_relu(x);
  if (!is_training() || sync_) {
    Tensor y = BatchNorm2d::forward(x);  // not a subclass's forward (BatchNormAct2d's is this)
    return act == Activation::Gelu ? F::gelu(y) : act == Activation::Relu ? F::relu(y) : y;
  }
  check(x);  // F counts the batch (in its kernel when fused)
  return F::batch_norm_from_stats(x, stats, Tensor(), act, weight_, bias_, running_mean_,
                                  running_var_, /*training=*/true, momentum_, eps_,
                                  num_batches_tracked_);
}

BatchNormAct2d::BatchNormAct2d(int64_t channels, Activation act, double eps, double momentum)
    : BatchNorm2d(channels, eps, momentum), act_(act) {}

std::string BatchNormAct2d::describe() const {
  const char* names[] = {"none", "relu", "gelu"};
  std::string d = BatchNorm2d::describe();
  d.insert(d.size() - 1, std::string(", act=") + names[static_cast<int>(act_)]);
  return "BatchNormAct2d" + d.substr(std::string("BatchNorm2d").size());
}

F::BatchNormParams BatchNorm2d::params() const {
  return F::BatchNormParams{weight_,   bias_, running_mean_,       running_var_,
                            momentum_, eps_,  num_batches_tracked_};
}

// ---------------- ConvBnRef, ConvBn ----------------
namespace {

// Whether the convolution should produce bn's statistics: only for a batch norm that uses its
// own batch's statistics (training, not synchronised across processes).
bool wants_stats(const BatchNorm2d& bn) { return bn.is_training() && !bn.sync_enabled(); }

// act(bn(y) [+ residual]) with y's statistics `stats` when the convolution produced them.
Tensor bn_tail(BatchNorm2d& bn, const Tensor& y, const F::ChannelStats& stats,
               const Tensor& residual, bool relu) {
  if (!(wants_stats(bn) && stats.defined())) {
    if (relu) return bn.forward_relu(y, residual);
    Tensor z = bn.forward(y);
    return residual.defined() ? F::add(z, residual) : z;
  }
  bn.check(y);  // F counts the batch (in its kernel when fused)
  const F::BatchNormParams p = bn.params();
  return F::batch_norm_from_stats(y, stats, residual, relu, p.weight, p.bias, p.running_mean,
                                  p.running_var, /*training=*/true, p.momentum, p.eps,
                                  p.num_batches_tracked);
}

}  // namespace

Tensor ConvBnRef::forward(const Tensor& x, bool relu, const Tensor& residual) const {
  F::ChannelStats stats;
  Tensor y = conv.forward(x, wants_stats(bn) ? &stats : nullptr);
  return bn_tail(bn, y, stats, residual, relu);
}

Tensor ConvBnRef::finish(const Tensor& y, const F::ChannelStats& stats, bool relu,
                         const Tensor& residual) const {
  return bn_tail(bn, y, stats, residual, relu);
}

bool ConvBnRef::stats_wanted() const { return wants_stats(bn); }

Tensor ConvBnRef::forward_relu_into(const Tensor& x, Conv2d& next,
                                    F::ChannelStats* next_stats) const {
  F::ChannelStats stats;
  Tensor y = conv.forward(x, wants_stats(bn) ? &stats : nullptr);
  if (!(wants_stats(bn) && stats.defined()))
    return next.forward(bn_tail(bn, y, stats, Tensor(), true), next_stats);
  bn.check(y);  // F counts the batch (in its kernel when fused)
  return next.forward_bn_relu(y, stats, bn, next_stats);
}

Tensor ConvBnRef::forward(const Tensor& x, Activation act) const {
  if (act != Activation::Gelu) return forward(x, act == Activation::Relu);
  F::ChannelStats stats;
  Tensor y = conv.forward(x, wants_stats(bn) ? &stats : nullptr);
  return bn.forward_act(y, act, stats);
}

Tensor ConvBnRef::forward_add(const Tensor& x, const ConvBnRef& shortcut, const Tensor& r) const {
  const bool want = wants_stats(bn) && wants_stats(shortcut.bn);
  F::ChannelStats sx;
  Tensor y = conv.forward(x, want ? &sx : nullptr);
  return finish_add(y, sx, shortcut, r);
}

Tensor ConvBnRef::finish_add(const Tensor& y, const F::ChannelStats& sx,
                             const ConvBnRef& shortcut, const Tensor& r) const {
  const bool want = wants_stats(bn) && wants_stats(shortcut.bn);
  F::ChannelStats sr;
  Tensor yr = shortcut.conv.forward(r, want ? &sr : nullptr);
  if (!(want && sx.defined() && sr.defined()))
    return bn_tail(bn, y, sx, bn_tail(shortcut.bn, yr, sr, Tensor(), false), true);
  bn.check(y);  // F counts both batches
  shortcut.bn.check(yr);
  return F::batch_norm_add_batch_norm_relu(y, sx, bn.params(), yr, sr, shortcut.bn.params(),
                                           /*training=*/true);
}

Tensor ConvBnRef::forward_max_pool(const Tensor& x, MaxPool2d& pool) const {
  F::ChannelStats stats;
  Tensor y = conv.forward(x, wants_stats(bn) ? &stats : nullptr);
  if (!wants_stats(bn)) return pool.forward(bn.forward_relu(y, Tensor()));
  return pool.forward_bn_relu(y, stats, bn);
}

ConvBn::ConvBn(std::shared_ptr<Conv2d> conv, std::shared_ptr<BatchNorm2d> bn, Activation act)
    : act_(act) {
  KILN_CHECK(conv && bn, "ConvBn: conv and bn must be non-null");
  conv_ = register_module("0", std::move(conv));
  bn_ = register_module("1", std::move(bn));
}

Tensor ConvBn::forward(const Tensor& x) { return parts().forward(x, act_); }

std::string BatchNorm2d::describe() const {
  std::ostringstream os;
  os << "BatchNorm2d(" << channels_ << ", eps=" << eps_ << ", momentum=" << momentum_
     << (sync_ ? ", sync" : "") << ")";
  return os.str();
}

int64_t enable_sync_batch_norm(Module& root, const StatsAllReduce& reduce) {
  KILN_CHECK(reduce, "enable_sync_batch_norm: the statistics all-reduce is empty");
  int64_t count = 0;
  std::unordered_set<const Module*> seen;  // a module reachable twice is counted once
  std::vector<Module*> stack{&root};
  while (!stack.empty()) {
    Module* m = stack.back();
    stack.pop_back();
    if (!seen.insert(m).second) continue;
    if (auto* bn = dynamic_cast<BatchNorm2d*>(m)) {
      bn->set_sync(reduce);
      ++count;
    }
    const auto& children = m->named_children();
    for (auto it = children.rbegin(); it != children.rend(); ++it)
      stack.push_back(it->second.get());
  }
  return count;
}

// ---------------- Linear ----------------
Linear::Linear(int64_t in_features, int64_t out_features, bool bias, Generator* gen)
    : in_(in_features), out_(out_features) {
  KILN_CHECK(in_features > 0 && out_features > 0, "Linear: features (", in_features, ", ",
             out_features, ") must be positive");
  weight_ = register_parameter("weight", empty({out_, in_}));
  if (bias) bias_ = register_parameter("bias", empty({out_}));
  reset_parameters(gen);
}

void Linear::reset_parameters(Generator* gen) { default_init(weight_, bias_, gen); }

Tensor Linear::forward(const Tensor& x) {
  if (x.dim() <= 2) return F::linear(x, weight_, bias_);
  Shape out = x.shape();
  out.back() = out_;
  return F::linear(x.reshape({-1, x.size(-1)}), weight_, bias_).view(out);
}

std::vector<std::string> Linear::half_parameters() const {
  return bias_.defined() ? std::vector<std::string>{"weight", "bias"}
                         : std::vector<std::string>{"weight"};
}

std::vector<std::string> Conv2d::half_parameters() const {
  return bias_.defined() ? std::vector<std::string>{"weight", "bias"}
                         : std::vector<std::string>{"weight"};
}

std::string Linear::describe() const {
  std::ostringstream os;
  os << "Linear(" << in_ << ", " << out_ << (bias_.defined() ? "" : ", bias=false") << ")";
  return os.str();
}

// ---------------- pooling ----------------
Tensor MaxPool2d::forward(const Tensor& x) {
  return F::max_pool2d(x, kernel_, stride_, padding_, dilation_);
}

Tensor MaxPool2d::forward_bn_relu(const Tensor& y, const F::ChannelStats& stats,
                                  BatchNorm2d& bn) {
  bn.check(y);  // F counts the batch
  return F::batch_norm_relu_max_pool(y, stats, bn.params(), bn.is_training(), kernel_, stride_,
                                     padding_, dilation_);
}
std::string MaxPool2d::describe() const {
  return "MaxPool2d(kernel=" + pair_str(kernel_) + ", stride=" + pair_str(stride_) +
         ", padding=" + pair_str(padding_) + ")";
}

Tensor AvgPool2d::forward(const Tensor& x) {
  return F::avg_pool2d(x, kernel_, stride_, padding_, count_include_pad_);
}
std::string AvgPool2d::describe() const {
  return "AvgPool2d(kernel=" + pair_str(kernel_) + ", stride=" + pair_str(stride_) +
         ", padding=" + pair_str(padding_) + ")";
}

std::string AdaptiveAvgPool2d::describe() const {
  return "AdaptiveAvgPool2d(" + pair_str(output_) + ")";
}

// ---------------- Sequential ----------------
Sequential::Sequential(std::initializer_list<ModulePtr> modules) {
  for (const ModulePtr& m : modules) push_back(m);
}

void Sequential::push_back(ModulePtr m) { register_module(std::to_string(size()), std::move(m)); }

const ModulePtr& Sequential::operator[](size_t i) const {
  KILN_CHECK(i < size(), "Sequential: index ", i, " out of range for ", size(), " modules");
  return named_children()[i].second;
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  for (const auto& [_, m] : named_children()) y = m->forward(y);
  return y;
}

}  // namespace kiln::nn
