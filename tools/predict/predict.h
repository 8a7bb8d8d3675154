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
// eval mode, f32. The top-k softmax probabilities are printed under the image's path, each
// image as soon as it is predicted. Paths and class names are printed through text::printable
// (control characters escaped), so a name in a file cannot drive the terminal.
//
// Bad input: a path that does not exist, a folder without images, a folder or sub-folder that
// cannot be listed, an image that cannot be decoded: one "kiln-predict: error: ..." line each on
// stderr naming the path; everything else is still predicted, a last line counts the errors,
// and the exit code is 1. A model file that cannot be used (not a ResNet, metadata out of
// range, NaN or infinite weights) is one error line and exit code 1 before anything is
// predicted. So is output that cannot be written (stdout closed, full, or a broken pipe when
// SIGPIPE is ignored): predicting stops at the first failed write.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "data/image.h"
#include "optim/model_file.h"

namespace kiln::predict {

// The files that `paths` name: image files as given, folders expanded to their image files
// (recursively, sorted by path; links to folders inside them are not followed). A path that does
// not exist or cannot be reached, a folder without images and a folder or sub-folder that
// cannot be listed each add one message naming it to `errors`; the rest is still collected.
struct Inputs {
  std::vector<std::string> images;
  std::vector<std::string> errors;
};
Inputs collect_images(const std::vector<std::string>& paths);

// One decoded RGB image (data/image.h) as the model's input: f32 (in_channels, S, S) with
// S = info.image_size, normalised with info.mean/std.
Tensor preprocess(const data::Image& rgb, const ModelInfo& info);

struct Prediction {
  std::string path;
  std::vector<int64_t> classes;       // best first
  std::vector<double> probabilities;  // softmax, same order
  std::string error;                  // non-empty: the image could not be read
};

// Predicts the image at `path` with `model` (on `device`), `top` classes; an image
// that cannot be read gives `error` instead of throwing.
Prediction predict_image(const LoadedModel& model, const std::string& path, Device device,
                         int64_t top);
// predict_image for each of `images`, in order.
std::vector<Prediction> predict(const LoadedModel& model, const std::vector<std::string>& images,
                                Device device, int64_t top);

// Class k's name from the metadata, or "class k"; as stored (print it through text::printable).
std::string class_name(const ModelInfo& info, int64_t k);

// The tool: parses, predicts, prints; returns the exit code.
int main(const std::vector<std::string>& args);

}  // namespace kiln::predict
