#include "models/resnet.h"

#include <functional>
#include <map>

namespace kiln::models {

using nn::BatchNorm2d;
using nn::Conv2d;

namespace {

std::shared_ptr<Conv2d> conv3x3(int64_t in, int64_t out, int64_t stride, Generator* gen) {
  return std::make_shared<Conv2d>(in, out, 3, stride, 1, 1, 1, /*bias=*/false, gen);
}
std::shared_ptr<Conv2d> conv1x1(int64_t in, int64_t out, int64_t stride, Generator* gen) {
  return std::make_shared<Conv2d>(in, out, 1, stride, 0, 1, 1, /*bias=*/false, gen);
}

// relu(bn(conv(out)) + downsample(x)) (or + x without a downsample): nn::ConvBnRef decides
// what runs fused.
Tensor block_tail(Conv2d& conv, BatchNorm2d& bn, const Tensor& out, nn::ConvBn* downsample,
                  const Tensor& x) {
  const nn::ConvBnRef main{conv, bn};
  if (!downsample) return main.forward(out, /*relu=*/true, x);
  return main.forward_add(out, downsample->parts(), x);
}

}  // namespace

// ---------------- blocks ----------------
// Registration order fixes the parameter order; it follows torchvision's __init__.
BasicBlock::BasicBlock(int64_t in_planes, int64_t planes, int64_t stride,
                       std::shared_ptr<nn::ConvBn> downsample,
                       Generator* gen) {
  conv1_ = register_module("conv1", conv3x3(in_planes, planes, stride, gen));
  bn1_ = register_module("bn1", std::make_shared<BatchNorm2d>(planes));
  relu_ = register_module("relu", std::make_shared<nn::ReLU>());
  conv2_ = register_module("conv2", conv3x3(planes, planes, 1, gen));
  bn2_ = register_module("bn2", std::make_shared<BatchNorm2d>(planes));
  if (downsample) downsample_ = register_module("downsample", std::move(downsample));
}

// Each conv -> bn (-> add) -> relu goes through nn::ConvBnRef (block_tail for the last): on the
// GPU the convolution produces the batch norm's statistics and the rest is one fused pass each
// way (the module `relu` stays registered for torchvision's names).
Tensor BasicBlock::forward(const Tensor& x) {
  Tensor out = nn::ConvBnRef{*conv1_, *bn1_}.forward(x, /*relu=*/true);
  return block_tail(*conv2_, *bn2_, out, downsample_.get(), x);
}

Bottleneck::Bottleneck(int64_t in_planes, int64_t planes, int64_t stride,
                       std::shared_ptr<nn::ConvBn> downsample,
                       Generator* gen) {
  conv1_ = register_module("conv1", conv1x1(in_planes, planes, 1, gen));
  bn1_ = register_module("bn1", std::make_shared<BatchNorm2d>(planes));
  conv2_ = register_module("conv2", conv3x3(planes, planes, stride, gen));
  bn2_ = register_module("bn2", std::make_shared<BatchNorm2d>(planes));
  conv3_ = register_module("conv3", conv1x1(planes, planes * kExpansion, 1, gen));
  bn3_ = register_module("bn3", std::make_shared<BatchNorm2d>(planes * kExpansion));
  relu_ = register_module("relu", std::make_shared<nn::ReLU>());
  if (downsample) downsample_ = register_module("downsample", std::move(downsample));
}

// conv3 reads relu(bn2(y2)) through Conv2d::forward_bn_relu: on the GPU with KILN_CONV_PROLOGUE=1
// it applies bn2 as its kernels load y2, and relu(bn2(y2)) is never written (docs/lab/
// norm-conv.md, v22).
Tensor Bottleneck::forward(const Tensor& x) {
  Tensor out = nn::ConvBnRef{*conv1_, *bn1_}.forward(x, /*relu=*/true);
  const nn::ConvBnRef tail{*conv3_, *bn3_};
  F::ChannelStats s3;
  const Tensor y3 = nn::ConvBnRef{*conv2_, *bn2_}.forward_relu_into(
      out, *conv3_, tail.stats_wanted() ? &s3 : nullptr);
  if (!downsample_) return tail.finish(y3, s3, /*relu=*/true, x);
  return tail.finish_add(y3, s3, downsample_->parts(), x);
}

// ---------------- ResNet ----------------
ResNet::ResNet(BlockKind block, std::vector<int64_t> layers, ResNetOptions opts)
    : block_(block), opts_(opts), in_planes_(opts.width) {
  KILN_CHECK(!layers.empty() && layers.size() <= 4, "ResNet: expected 1 to 4 stages, got ",
             layers.size());
  for (int64_t n : layers) KILN_CHECK(n > 0, "ResNet: every stage needs at least one block");
  KILN_CHECK(opts.num_classes > 0 && opts.in_channels > 0 && opts.width > 0,
             "ResNet: num_classes, in_channels and width must be positive");
  Generator gen(opts.seed);
  if (opts.imagenet_stem) {
    conv1_ = register_module(
        "conv1", std::make_shared<Conv2d>(opts.in_channels, opts.width, 7, 2, 3, 1, 1, false, &gen));
  } else {
    conv1_ = register_module("conv1", conv3x3(opts.in_channels, opts.width, 1, &gen));
  }
  bn1_ = register_module("bn1", std::make_shared<BatchNorm2d>(opts.width));
  relu_ = register_module("relu", std::make_shared<nn::ReLU>());
  if (opts.imagenet_stem)
    maxpool_ = register_module("maxpool", std::make_shared<nn::MaxPool2d>(3, 2, 1));
  for (size_t i = 0; i < layers.size(); ++i) {
    int64_t planes = opts.width << i;
    layers_.push_back(register_module("layer" + std::to_string(i + 1),
                                      make_layer(planes, layers[i], i == 0 ? 1 : 2, &gen)));
  }
  avgpool_ = register_module("avgpool", std::make_shared<nn::AdaptiveAvgPool2d>(1));
  flatten_ = std::make_shared<nn::Flatten>(1);
  fc_ = register_module("fc", std::make_shared<nn::Linear>(in_planes_, opts.num_classes, true, &gen));

  // torchvision's init. The convs were drawn once with the default init; redraw them.
  for (const auto& [_, m] : named_modules()) {
    if (auto* c = dynamic_cast<const Conv2d*>(m)) {
      nn::init::kaiming_normal_(c->weight(), 0.0, nn::init::FanMode::FanOut,
                                nn::init::Nonlinearity::ReLU, &gen);
    }
    // BatchNorm2d already starts at weight 1, bias 0.
  }
  if (opts.zero_init_residual) zero_init_residual_bns(*this);
}

int64_t zero_init_residual_bns(nn::Module& model) {
  int64_t n = 0;
  for (const auto& [_, m] : model.named_modules()) {
    const nn::BatchNorm2d* bn = nullptr;
    if (auto* b = dynamic_cast<const Bottleneck*>(m)) bn = b->last_bn().get();
    if (auto* b = dynamic_cast<const BasicBlock*>(m)) bn = b->last_bn().get();
    if (bn == nullptr) continue;
    nn::init::constant_(bn->weight(), 0.0);
    ++n;
  }
  return n;
}

std::shared_ptr<nn::Sequential> ResNet::make_layer(int64_t planes, int64_t blocks, int64_t stride,
                                                   Generator* gen) {
  const int64_t expansion =
      block_ == BlockKind::Basic ? BasicBlock::kExpansion : Bottleneck::kExpansion;
  auto make_block = [&](int64_t in, int64_t s,
                        std::shared_ptr<nn::ConvBn> ds) -> nn::ModulePtr {
    if (block_ == BlockKind::Basic) return std::make_shared<BasicBlock>(in, planes, s, ds, gen);
    return std::make_shared<Bottleneck>(in, planes, s, ds, gen);
  };
  std::shared_ptr<nn::ConvBn> downsample;
  if (stride != 1 || in_planes_ != planes * expansion) {
    downsample = std::make_shared<nn::ConvBn>(conv1x1(in_planes_, planes * expansion, stride, gen),
                                              std::make_shared<BatchNorm2d>(planes * expansion));
  }
  auto layer = std::make_shared<nn::Sequential>();
  layer->push_back(make_block(in_planes_, stride, downsample));
  in_planes_ = planes * expansion;
  for (int64_t i = 1; i < blocks; ++i) layer->push_back(make_block(in_planes_, 1, nullptr));
  return layer;
}

Tensor ResNet::forward(const Tensor& x) {
  KILN_CHECK(x.dim() == 4 && x.size(1) == opts_.in_channels, "ResNet: expected input (N, ",
             opts_.in_channels, ", H, W), got ", x.desc());
  const nn::ConvBnRef stem{*conv1_, *bn1_};
  Tensor y = maxpool_ ? stem.forward_max_pool(x, *maxpool_) : stem.forward(x, /*relu=*/true);
  for (const auto& layer : layers_) y = layer->forward(y);
  y = flatten_->forward(avgpool_->forward(y));
  return fc_->forward(y);
}

// ---------------- factories ----------------
namespace {
std::shared_ptr<ResNet> make(BlockKind b, std::vector<int64_t> layers, int64_t num_classes,
                             bool zero_init_residual) {
  ResNetOptions o;
  o.num_classes = num_classes;
  o.zero_init_residual = zero_init_residual;
  return std::make_shared<ResNet>(b, std::move(layers), o);
}
}  // namespace

std::shared_ptr<ResNet> resnet18(int64_t n, bool z) { return make(BlockKind::Basic, {2, 2, 2, 2}, n, z); }
std::shared_ptr<ResNet> resnet34(int64_t n, bool z) { return make(BlockKind::Basic, {3, 4, 6, 3}, n, z); }
std::shared_ptr<ResNet> resnet50(int64_t n, bool z) { return make(BlockKind::Bottleneck, {3, 4, 6, 3}, n, z); }
std::shared_ptr<ResNet> resnet101(int64_t n, bool z) { return make(BlockKind::Bottleneck, {3, 4, 23, 3}, n, z); }
std::shared_ptr<ResNet> resnet152(int64_t n, bool z) { return make(BlockKind::Bottleneck, {3, 8, 36, 3}, n, z); }

std::shared_ptr<ResNet> resnet_small(int64_t num_classes, int64_t width, int64_t blocks_per_stage,
                                     int64_t in_channels) {
  ResNetOptions o;
  o.num_classes = num_classes;
  o.in_channels = in_channels;
  o.width = width;
  o.imagenet_stem = false;
  return std::make_shared<ResNet>(BlockKind::Basic,
                                  std::vector<int64_t>(3, blocks_per_stage), o);
}

namespace {
const std::map<std::string, std::function<std::shared_ptr<ResNet>(int64_t)>>& registry() {
  static const std::map<std::string, std::function<std::shared_ptr<ResNet>(int64_t)>> r = {
      {"resnet18", [](int64_t n) { return resnet18(n); }},
      {"resnet34", [](int64_t n) { return resnet34(n); }},
      {"resnet50", [](int64_t n) { return resnet50(n); }},
      {"resnet101", [](int64_t n) { return resnet101(n); }},
      {"resnet152", [](int64_t n) { return resnet152(n); }},
      {"resnet_small", [](int64_t n) { return resnet_small(n); }},
  };
  return r;
}
}  // namespace

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const auto& [n, _] : registry()) names.push_back(n);
  return names;
}

std::shared_ptr<ResNet> make_model(const std::string& name, int64_t num_classes) {
  auto it = registry().find(name);
  if (it == registry().end()) {
    std::string valid;
    for (const auto& n : model_names()) valid += (valid.empty() ? "" : ", ") + n;
    KILN_FAIL("make_model: unknown model '", name, "'; valid names: ", valid);
  }
  return it->second(num_classes);
}

}  // namespace kiln::models
