#pragma once
// Model files that describe themselves: the network's shape and the input it expects, stored in
// a weights file's safetensors `__metadata__` (optim/checkpoint.h's save_weights), so a tool can
// rebuild the model and preprocess images without being told (kiln-predict, kiln-convert).
//
// Metadata keys (all strings; lists are JSON arrays):
//   "format" = "kiln-model-1"
//   "arch" resnet_small|resnet18|...|resnet152   "num_classes" "in_channels" "width"
//   "stem" imagenet (7x7/2 conv + max pool) | small (3x3/1 conv, no pool)
//   "image_size"  model input side;  "resize_size"  evaluation resizes the shorter side to this,
//                 then centre-crops image_size (torchvision's Resize + CenterCrop)
//   "mean", "std" per input channel, on the 0..1 pixel scale: x = (pixel/255 - mean) / std
//   "class_names" ["T-shirt/top", ...] (may be absent: classes are then numbered)
// Other keys (training's "data", "epochs", "test_top1") pass through untouched.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/serialization.h"
#include "models/resnet.h"

namespace kiln {

struct ModelInfo {
  std::string arch = "resnet50";
  int64_t num_classes = 1000;
  int64_t in_channels = 3;
  int64_t width = 64;
  bool imagenet_stem = true;
  int64_t image_size = 224;
  int64_t resize_size = 256;
  std::vector<float> mean = {0.485f, 0.456f, 0.406f};  // ImageNet's (data/transforms.h)
  std::vector<float> std = {0.229f, 0.224f, 0.225f};
  std::vector<std::string> class_names;  // empty, or num_classes names
};

// The metadata entries above for `info`.
std::map<std::string, std::string> model_metadata(const ModelInfo& info);

// Reads the entries that are present over `defaults`; `absent` (optional) receives the names
// of the keys that were missing. A malformed value throws kiln::Error naming `source` and the key.
ModelInfo read_model_metadata(const std::map<std::string, std::string>& meta,
                              const std::string& source, const ModelInfo& defaults = {},
                              std::vector<std::string>* absent = nullptr);

// The network described by `info` (arch, classes, channels, width, stem), initial weights from
// Generator(seed). Unknown archs throw, listing the valid ones.
std::shared_ptr<models::ResNet> build_model(const ModelInfo& info, uint64_t seed = 0);

// The model's shape read off torchvision-named weights (for files without metadata): classes
// and width from fc.weight / conv1.weight, channels and stem from conv1.weight's shape, and the
// arch from the blocks per stage (unknown layouts throw). Preprocessing keeps `defaults`'.
ModelInfo infer_model_info(const NamedTensors& weights, const std::string& source,
                           const ModelInfo& defaults = {});

// A weights file (or a training checkpoint's model) turned back into a model (f32, CPU, eval
// mode): its metadata when it has them, else infer_model_info; `notes` says what fell back to
// defaults (empty when nothing did).
struct LoadedModel {
  std::shared_ptr<models::ResNet> model;
  ModelInfo info;
  std::string notes;
};
LoadedModel load_model_file(const std::string& path);

}  // namespace kiln
