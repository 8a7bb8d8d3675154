#pragma once
// Model files that describe themselves: the network's shape and the input it expects, stored in
// a weights file's safetensors `__metadata__` (optim/checkpoint.h's save_weights), so a tool can
// rebuild the model and preprocess images without being told (kiln-predict, kiln-convert).
//
// Metadata keys (all strings; lists are JSON arrays):
//   "format" = "kiln-model-1"
//   "arch" resnet_small|resnet18|...|resnet152|vit_s_16|vit_b_16   "num_classes" "in_channels"
//   "width" (a ViT's: its hidden size)
//   "stem" imagenet (7x7/2 conv + max pool) | small (3x3/1 conv, no pool) (a ViT's: imagenet)
//   "image_size"  model input side;  "resize_size"  evaluation resizes the shorter side to this,
//                 then centre-crops image_size (torchvision's Resize + CenterCrop)
//   "mean", "std" per input channel, on the 0..1 pixel scale: x = (pixel/255 - mean) / std
//   "class_names" ["T-shirt/top", ...] (may be absent: classes are then numbered)
// Other keys (training's "data", "epochs", "test_top1") pass through untouched.
//
// Accepted values (read_model_metadata and check_model_info; kiln-train's and kiln-convert's
// flags keep to them): arch one of kiln's ResNets, num_classes 1..kMaxClasses, in_channels
// 1..kMaxInChannels, width 1..kMaxWidth, image_size 1..kMaxImageSize, resize_size
// image_size..kMaxResizeSize, one mean and one std per input channel with |mean| <= kMaxNorm
// and kMinStd <= std <= kMaxNorm, class names absent or one per class. The bounds keep any
// value a file can hold from asking for an absurd allocation.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/serialization.h"
#include "models/resnet.h"

namespace kiln {

inline constexpr int64_t kMaxClasses = 1'000'000;
inline constexpr int64_t kMaxInChannels = 64;
inline constexpr int64_t kMaxWidth = 1024;
inline constexpr int64_t kMaxImageSize = 4096;
inline constexpr int64_t kMaxResizeSize = 8192;
inline constexpr double kMaxNorm = 1000;
inline constexpr double kMinStd = 1e-6;

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

// Why `name` cannot be a class name ("is empty", "is only whitespace", "is not valid UTF-8
// (byte 0xff at offset 3)", "holds control character U+001B": core/text.h), or "" when
// it can. A name that passes prints as it is (text::printable leaves it unchanged).
std::string class_name_problem(const std::string& name);
// Throws kiln::Error "<source>: class 3 'name' <problem>" for the first name with a problem,
// or "<source>: class 5 'cat' repeats class 2" for a duplicate.
void check_class_names(const std::vector<std::string>& names, const std::string& source);

// Throws kiln::Error "<source>: <field> <value> is outside <range>" when `info` breaks the
// accepted values above; class names are checked with check_class_names.
void check_model_info(const ModelInfo& info, const std::string& source);

// The metadata entries above for `info`; throws (check_model_info) rather than write values
// the reader would refuse, or class names that are not valid, printable UTF-8.
std::map<std::string, std::string> model_metadata(const ModelInfo& info);

// Reads the entries that are present over `defaults`; `absent` (optional) receives the names
// of the keys that were missing. A value that is malformed or outside the accepted values
// throws kiln::Error naming `source`, the key and the accepted range; so does a mean or std
// whose length is not in_channels. Without "resize_size" it is max(defaults', image_size).
// Class names are checked for their count only: older files may hold any strings, which
// printers pass through text::printable.
ModelInfo read_model_metadata(const std::map<std::string, std::string>& meta,
                              const std::string& source, const ModelInfo& defaults = {},
                              std::vector<std::string>* absent = nullptr);

// Throws kiln::Error naming `source` and the key when `meta` (a file's metadata) and `weights`
// (infer_model_info of the same file's tensors) disagree on arch, num_classes, in_channels,
// width or stem: checked before build_model, so a bad value never sizes a model.
void check_metadata_matches_weights(const ModelInfo& meta, const ModelInfo& weights,
                                    const std::string& source);

// The network described by `info` (arch, classes, channels, width, stem), initial weights from
// Generator(seed). Unknown archs throw, listing the valid ones.
std::shared_ptr<nn::Module> build_model(const ModelInfo& info, uint64_t seed = 0);
// The classifier's parameter-name prefix of an arch: "fc." (ResNets) or "heads.head." (ViTs).
std::string classifier_prefix(const std::string& arch);

// The model's shape read off torchvision-named weights (for files without metadata): classes
// and width from fc.weight / conv1.weight, channels and stem from conv1.weight's shape, and the
// arch from the blocks per stage (unknown layouts throw). Preprocessing keeps `defaults`' when
// it has one mean per input channel; else Fashion-MNIST's (28x28) for 1 channel, 0.5/0.5 for
// others.
ModelInfo infer_model_info(const NamedTensors& weights, const std::string& source,
                           const ModelInfo& defaults = {});

// A weights file (or a training checkpoint's model) turned back into a model (f32, CPU, eval
// mode): its metadata when it has them (checked against the weights), else infer_model_info;
// `notes` says what fell back to defaults (empty when nothing did). A file whose model tensors
// hold a NaN or an infinity is refused (check_finite: "model file '<path>': tensor '<name>'
// holds NaN or infinite values; ...", no source location).
struct LoadedModel {
  std::shared_ptr<nn::Module> model;
  ModelInfo info;
  std::string notes;
};
LoadedModel load_model_file(const std::string& path);

}  // namespace kiln
