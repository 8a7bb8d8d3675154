#pragma once
// kiln-predict: what a trained model sees in images.
//
//   kiln-predict --weights model.safetensors IMAGE|FOLDER... [--top 5] [--device auto|cpu|cuda:N]
//
// The model is rebuilt from the file's metadata (optim/model_file.h: arch, width, channels,
// stem, class names); a file without metadata (an older kiln file, a torchvision export) is read
// off its weights, with ImageNet's preprocessing for 3-channel and Fashion-MNIST's for
// 1-channel models, and says so. Each image (JPEG or PNG; folders are searched recursively for
// .jpg/.jpeg/.png, sorted by path) is decoded to RGB, turned to grey for 1-channel models
// (0.299 R + 0.587 G + 0.114 B), resized (shorter side to resize_size) and centre-cropped to
// image_size as the trainer's evaluation does, normalised with the file's mean/std, and run in
// eval mode, f32. The top-k softmax probabilities are printed under the image's path.
//
// Bad input: a path that does not exist, a folder without images, an image that cannot be
// decoded, a file that is not a ResNet: one line each on stderr naming the path; images that
// can be read are still predicted; the exit code is 1 when anything failed.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "data/image.h"
#include "optim/model_file.h"

namespace kiln::predict {

// The files that `paths` name: image files as given, folders expanded to their image files
// (recursively, sorted). Throws cli::UsageError for a missing path or an image-less folder.
std::vector<std::string> collect_images(const std::vector<std::string>& paths);

// One decoded RGB image (data/image.h) as the model's input: f32 (in_channels, S, S) with
// S = info.image_size, normalised with info.mean/std.
Tensor preprocess(const data::Image& rgb, const ModelInfo& info);

struct Prediction {
  std::string path;
  std::vector<int64_t> classes;       // best first
  std::vector<double> probabilities;  // softmax, same order
  std::string error;                  // non-empty: the image could not be read
};

// Predicts every image with `model` (on `device`), `top` classes each.
std::vector<Prediction> predict(const LoadedModel& model, const std::vector<std::string>& images,
                                Device device, int64_t top);

// Class k's name from the metadata, or "class k".
std::string class_name(const ModelInfo& info, int64_t k);

// The tool: parses, predicts, prints; returns the exit code.
int main(const std::vector<std::string>& args);

}  // namespace kiln::predict
