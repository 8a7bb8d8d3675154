#pragma once
// ResNet v1.5 (torchvision's): the bottleneck's stride sits on its 3x3 conv. Module and
// parameter names match torchvision exactly (`conv1.weight`, `layer1.0.downsample.0.weight`,
// `layer4.2.bn3.running_var`, `fc.bias`), so weights map one-to-one onto its state_dict.
//
// Init is torchvision's: convs kaiming_normal(fan_out, relu), BN weight 1 / bias 0, fc with
// PyTorch's Linear default; with zero_init_residual the last BN of every block starts at
// weight 0 so each residual branch starts as the identity.
//
// Input (N, in_channels, H, W) -> logits (N, num_classes).
#include <memory>
#include <string>
#include <vector>

#include "models/nn.h"

namespace kiln::models {

enum class BlockKind { Basic, Bottleneck };

// conv3x3 -> bn -> relu -> conv3x3 -> bn, + identity (or downsample(x)), relu.
class BasicBlock : public nn::Module {
 public:
  static constexpr int64_t kExpansion = 1;
  // downsample may be null.
  BasicBlock(int64_t in_planes, int64_t planes, int64_t stride,
             std::shared_ptr<nn::ConvBn> downsample,
             Generator* gen);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "BasicBlock"; }
  const std::shared_ptr<nn::BatchNorm2d>& last_bn() const { return bn2_; }

 private:
  std::shared_ptr<nn::Conv2d> conv1_, conv2_;
  std::shared_ptr<nn::BatchNorm2d> bn1_, bn2_;
  std::shared_ptr<nn::ReLU> relu_;
  std::shared_ptr<nn::ConvBn> downsample_;
};

// conv1x1 -> bn -> relu -> conv3x3(stride) -> bn -> relu -> conv1x1(x4) -> bn, + identity, relu.
class Bottleneck : public nn::Module {
 public:
  static constexpr int64_t kExpansion = 4;
  Bottleneck(int64_t in_planes, int64_t planes, int64_t stride,
             std::shared_ptr<nn::ConvBn> downsample,
             Generator* gen);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "Bottleneck"; }
  const std::shared_ptr<nn::BatchNorm2d>& last_bn() const { return bn3_; }

 private:
  std::shared_ptr<nn::Conv2d> conv1_, conv2_, conv3_;
  std::shared_ptr<nn::BatchNorm2d> bn1_, bn2_, bn3_;
  std::shared_ptr<nn::ReLU> relu_;
  std::shared_ptr<nn::ConvBn> downsample_;
};

struct ResNetOptions {
  int64_t num_classes = 1000;
  bool zero_init_residual = false;
  int64_t in_channels = 3;
  int64_t width = 64;  // channels of the stem and of layer1; doubled per stage
  // true: torchvision's stem (7x7/2 conv, 3x3/2 max pool). false: a 3x3/1 conv and no pool,
  // for small images such as 28x28 MNIST.
  bool imagenet_stem = true;
  uint64_t seed = 0;  // initial weights come from Generator(seed)
};

class ResNet : public nn::Module {
 public:
  // `layers`: blocks per stage (torchvision has 4 stages; fewer are allowed, min 1).
  ResNet(BlockKind block, std::vector<int64_t> layers, ResNetOptions opts = {});
  Tensor forward(const Tensor& x) override;  // (N, C, H, W) -> (N, num_classes)
  std::string type_name() const override { return "ResNet"; }
  const ResNetOptions& options() const { return opts_; }

 private:
  std::shared_ptr<nn::Sequential> make_layer(int64_t planes, int64_t blocks, int64_t stride,
                                             Generator* gen);

  BlockKind block_;
  ResNetOptions opts_;
  int64_t in_planes_;
  std::shared_ptr<nn::Conv2d> conv1_;
  std::shared_ptr<nn::BatchNorm2d> bn1_;
  std::shared_ptr<nn::ReLU> relu_;
  std::shared_ptr<nn::MaxPool2d> maxpool_;  // null without the ImageNet stem
  std::vector<std::shared_ptr<nn::Sequential>> layers_;
  std::shared_ptr<nn::AdaptiveAvgPool2d> avgpool_;
  std::shared_ptr<nn::Flatten> flatten_;  // not registered: torchvision calls torch.flatten
  std::shared_ptr<nn::Linear> fc_;
};

// Sets the weight of every residual block's last batch norm in `model` (BasicBlock's bn2,
// Bottleneck's bn3) to 0, as zero_init_residual does at construction, so that each residual
// branch starts as the identity (Goyal et al.; torchvision's option). Returns how many it set:
// 0 for a model without residual blocks.
int64_t zero_init_residual_bns(nn::Module& model);

std::shared_ptr<ResNet> resnet18(int64_t num_classes = 1000, bool zero_init_residual = false);
std::shared_ptr<ResNet> resnet34(int64_t num_classes = 1000, bool zero_init_residual = false);
std::shared_ptr<ResNet> resnet50(int64_t num_classes = 1000, bool zero_init_residual = false);
std::shared_ptr<ResNet> resnet101(int64_t num_classes = 1000, bool zero_init_residual = false);
std::shared_ptr<ResNet> resnet152(int64_t num_classes = 1000, bool zero_init_residual = false);

// For 28x28 single-channel images (MNIST, Fashion-MNIST): 3x3 stem, no max pool, three stages
// of BasicBlocks at width, 2·width, 4·width (strides 1, 2, 2). With the defaults (width 32, one
// block per stage) it has 308,074 parameters for 10 classes.
std::shared_ptr<ResNet> resnet_small(int64_t num_classes = 10, int64_t width = 32,
                                     int64_t blocks_per_stage = 1, int64_t in_channels = 1);

// "resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnet_small".
// Unknown names throw kiln::Error listing the valid ones.
std::shared_ptr<ResNet> make_model(const std::string& name, int64_t num_classes);
std::vector<std::string> model_names();

}  // namespace kiln::models
