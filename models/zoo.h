#pragma once
// Every network kiln builds by name, whatever its family: the ResNets (models/resnet.h) and the
// vision transformers (models/vit.h), as torchvision names them.
//
//   auto net = models::create_model("vit_b_16", 1000);   // nn::Module, torchvision's init
#include <memory>
#include <string>
#include <vector>

#include "core/generator.h"
#include "models/module.h"

namespace kiln::models {

enum class Family { ResNet, ViT };

// "resnet18" ... "resnet152", "resnet_small", "vit_b_16", "vit_s_16", "vit_t_4" (for 32x32
// photos: 4x4 patches).
std::vector<std::string> all_model_names();
// The family of a name from all_model_names(); kiln::Error listing the valid names otherwise.
Family family_of(const std::string& name);
// Whether `name` is one of the vision transformers (false for an unknown name).
bool is_vit_name(const std::string& name);
// The network `name` for `num_classes` classes (224x224 inputs for vit_b_16 and vit_s_16, 32x32
// for vit_t_4), weights drawn from
// `gen` (the default generator when null); `dropout` is the ViTs' (their blocks' and the
// embeddings'; ResNets have none).
std::shared_ptr<nn::Module> create_model(const std::string& name, int64_t num_classes,
                                         Generator* gen = nullptr, double dropout = 0.0);
// Forward + backward FLOPs of one 224x224 image's training step (3x the forward's multiply-adds
// x 2), for MFU: 24.3 G for ResNet-50 (measured in docs/performance.md), 105.9 G for vit_b_16
// (PyTorch's FlopCounterMode), 27.6 G for vit_s_16 (counted from its layers), 2.19 G for vit_t_4
// at 32x32, six times torchvision's published multiply-adds for the other ResNets; 0 when
// unknown (resnet_small: its width varies).
double train_gflop_per_image(const std::string& name);
// The input side create_model's network is built for: 32 for vit_t_4, 224 for the others (a
// ResNet takes any size).
int64_t default_image_size(const std::string& name);

}  // namespace kiln::models
