#pragma once
// An ImageFolder (data/image_folder.h) decoded once into memory, for data sets of small
// photographs (CIFAR-10's 32x32, Tiny ImageNet's 64x64): decoding them every epoch would cost more
// than training on them, and the whole set fits in memory (CIFAR-10's 50,000 training images are
// 150 MB as u8). The result feeds a DataLoader (data/loader.h) through a TensorDataset, and a
// DeviceLoader (data/device_loader.h) keeps it on the GPU.
//
//   const ImageFolder train("cifar10/train");
//   const int64_t side = small_image_side(train);     // 32, or 0 for larger photographs
//   FolderTensors t = decode_image_folder(train, {.size = side});
//   DataLoader loader(TensorDataset(t.images, t.labels), opts);
//
// Each image becomes u8 (3, S, S), RGB: as it is when it is S x S already, else resized (its
// shorter side to S) and centre-cropped, as the evaluation transform does it (data/transforms.h).
// JPEGs are decoded by libjpeg-turbo when kiln has it (as PIL decodes them) unless `stb` is set,
// PNGs by stb_image. Files are decoded by `threads` threads into their own slots, so the result
// does not depend on the number of threads or their timing.
//
// Unreadable files (corrupt, truncated, not an image) are skipped and counted, the first ten
// named in a warning on stderr; more than max(max_bad_fraction x files, min_bad_files) of them is
// an IoError naming them (the data's fault, not kiln's), as ImageLoader's limit.
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "data/image_folder.h"

namespace kiln::data {

struct FolderTensorsOptions {
  int64_t size = 32;  // S: the side of every image in the result
  int threads = 1;    // decoding threads (at least 1)
  bool stb = false;   // decode JPEGs with stb_image even when libjpeg-turbo is built in
  double max_bad_fraction = 0.01;
  int64_t min_bad_files = 5;
  bool warn = true;  // name the first unreadable files on stderr
};

struct FolderTensors {
  Tensor images;  // u8 (N, 3, S, S), the readable files in the folder's order
  Tensor labels;  // i64 (N), their class indices
  std::vector<std::string> unreadable;  // one "<path>: <reason>" per skipped file
};

// Throws kiln::Error for size < 1 or threads < 1; IoError past the bad-file limit or when no file
// of the folder can be read.
FolderTensors decode_image_folder(const ImageFolder& folder, const FolderTensorsOptions& opts);

// Whether `folder` holds small photographs, judged on up to `probe` files spread evenly over it
// (their headers only): the largest side among the readable ones when every one of them is at
// most `max_side` pixels on each side, else 0 (also when none of them can be read).
int64_t small_image_side(const ImageFolder& folder, int64_t max_side = 64, int64_t probe = 64);

// Per-channel mean and standard deviation of u8 images (N, C, H, W), as fractions of 255: the
// normalisation of a data set without published statistics. Summed exactly in integers, so the
// result does not depend on the order, the machine or its instruction set.
void channel_stats(const Tensor& images, std::vector<float>* mean, std::vector<float>* stddev);

}  // namespace kiln::data
