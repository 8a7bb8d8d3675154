#pragma once
// TensorDataset: N small images held in memory with one integer label each, the input of
// DataLoader (data/loader.h).
//
//   images  u8 (N, H, W) or (N, C, H, W), on the CPU; stored contiguous, (N, H, W) as C = 1
//   labels  (N) of an integer dtype (u8, i32, i64); stored as i64
//
// Read-only after construction, so many loader threads may read it at once.
#include <cstdint>

#include "core/tensor.h"

namespace kiln::data {

class TensorDataset {
 public:
  TensorDataset(const Tensor& images, const Tensor& labels) {
    KILN_CHECK(images.defined() && labels.defined(), "TensorDataset: undefined images or labels");
    KILN_CHECK(images.dtype() == DType::u8 && images.is_cpu(),
               "TensorDataset: images must be u8 on the CPU, got ", images.desc());
    KILN_CHECK(images.dim() == 3 || images.dim() == 4,
               "TensorDataset: images must be (N, H, W) or (N, C, H, W), got ", images.desc());
    KILN_CHECK(labels.dim() == 1 && labels.is_cpu(),
               "TensorDataset: labels must be 1-D on the CPU, got ", labels.desc());
    KILN_CHECK(
        labels.dtype() == DType::u8 || labels.dtype() == DType::i32 || labels.dtype() == DType::i64,
        "TensorDataset: labels must be u8, i32 or i64, got ", labels.desc());
    KILN_CHECK(images.size(0) == labels.size(0), "TensorDataset: ", images.size(0), " images but ",
               labels.size(0), " labels");
    Tensor x = images.contiguous();
    if (x.dim() == 3) x = x.unsqueeze(1);
    images_ = x.contiguous();
    labels_ = labels.to(DType::i64).contiguous();
    pixels_ = images_.data<uint8_t>();
    targets_ = labels_.data<int64_t>();
  }

  int64_t size() const { return images_.size(0); }
  int64_t channels() const { return images_.size(1); }
  int64_t height() const { return images_.size(2); }
  int64_t width() const { return images_.size(3); }
  int64_t image_numel() const { return channels() * height() * width(); }

  // Sample i's pixels, (C, H, W) contiguous. No bounds check: the loader owns the indices.
  const uint8_t* image(int64_t i) const { return pixels_ + i * image_numel(); }
  int64_t label(int64_t i) const { return targets_[i]; }

  const Tensor& images() const { return images_; }  // u8 (N, C, H, W)
  const Tensor& labels() const { return labels_; }  // i64 (N)

 private:
  Tensor images_;
  Tensor labels_;
  const uint8_t* pixels_ = nullptr;
  const int64_t* targets_ = nullptr;
};

}  // namespace kiln::data
