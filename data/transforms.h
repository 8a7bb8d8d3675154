#pragma once
// Image transforms on RGB u8 HWC pixels (data/image.h): the ImageNet training augmentation
// (RandomResizedCrop + horizontal flip) and the evaluation transform (Resize of the shorter
// side + CenterCrop), plus the normalisation to float that follows them.
//
// Resampling is separable bilinear (triangle filter) at pixel centres (align_corners=False).
// When shrinking by a factor s > 1 the triangle is widened to s source pixels, so every source
// pixel contributes (antialiasing, as PIL's bilinear resize does); when enlarging it is plain
// bilinear interpolation. Taps outside the source region are dropped and the remaining weights
// renormalised. Results are rounded to nearest and clamped to 0..255.
//
// Randomness comes only from the Generator passed in: the loader seeds one per (seed, epoch,
// sample position), so a sample's augmentation does not depend on threads or timing.
#include <cstdint>

#include "core/generator.h"
#include "data/image.h"

namespace kiln::data {

// A crop rectangle in source pixels: rows [top, top + height), columns [left, left + width).
struct CropBox {
  int64_t top = 0, left = 0, height = 0, width = 0;
};

struct RandomResizedCropParams {
  double scale_min = 0.08, scale_max = 1.0;             // crop area / image area
  double ratio_min = 3.0 / 4.0, ratio_max = 4.0 / 3.0;  // crop width / height (log-uniform)
  int attempts = 10;
};

// torchvision's RandomResizedCrop box: up to `attempts` times draw an area fraction
// U(scale_min, scale_max) and an aspect ratio exp(U(log ratio_min, log ratio_max)), round
// width = sqrt(area * ratio) and height = sqrt(area / ratio), and accept the first that fits in
// the image, at a uniformly drawn position. Otherwise fall back to a centred crop of the whole
// image, narrowed to the nearest allowed ratio when the image's own ratio is outside the range.
CropBox random_resized_crop_box(int64_t height, int64_t width, Generator& gen,
                                const RandomResizedCropParams& p = {});

// dst (out_h, out_w, C) = `box` of src (height, width, C) resampled to out_h x out_w, mirrored
// left-right when `flip`. The filter sees only pixels inside the box (crop, then resize).
void resized_crop(const uint8_t* src, int64_t height, int64_t width, int64_t channels, CropBox box,
                  uint8_t* dst, int64_t out_h, int64_t out_w, bool flip = false);

// A rectangle in fractional source coordinates (a crop box after DCT-domain scaling, or the
// source area an evaluation centre crop covers).
struct BoxF {
  double top = 0, left = 0, height = 0, width = 0;
};

// The general resampler the two functions above and below use: dst (out_h, out_w, C) = `box` of
// src (height, width, C) resampled (filter as described at the top), mirrored left-right when
// `flip`, with the filter's taps limited to the rows and columns of `limit` (which must lie
// inside the image and overlap the box). resized_crop(b) is resample_box(b, limit = b).
// Thread-safe; reuses per-thread scratch buffers, so it allocates nothing in steady state.
void resample_box(const uint8_t* src, int64_t height, int64_t width, int64_t channels, BoxF box,
                  CropBox limit, uint8_t* dst, int64_t out_h, int64_t out_w, bool flip);

// The size torchvision's Resize(size) gives: the shorter side becomes `size`, the longer one
// int(size * long / short). Returns {height, width}.
struct Size2 {
  int64_t height = 0, width = 0;
};
Size2 resize_shorter_side(int64_t height, int64_t width, int64_t size);

// Evaluation transform: Resize(resize) of the shorter side, then CenterCrop(crop x crop), as one
// resampling pass (the filter sees the whole image, as when resizing first). crop <= resize.
// dst (crop, crop, C).
void resize_center_crop(const uint8_t* src, int64_t height, int64_t width, int64_t channels,
                        int64_t resize, int64_t crop, uint8_t* dst);
// The source area (fractional source pixels) that resize_center_crop maps onto its output; its
// taps are limited to the whole image.
BoxF center_crop_source_box(int64_t height, int64_t width, int64_t resize, int64_t crop);

// Training transform: RandomResizedCrop(out) then a horizontal flip with p = 0.5 (when `flip`).
// Draws the box first, then the flip. dst (out, out, C).
void random_resized_crop_flip(const uint8_t* src, int64_t height, int64_t width, int64_t channels,
                              int64_t out, Generator& gen, bool flip, uint8_t* dst,
                              const RandomResizedCropParams& p = {});

// ImageNet statistics on the 0..1 scale (RGB).
inline constexpr float kImageNetMean[3] = {0.485f, 0.456f, 0.406f};
inline constexpr float kImageNetStd[3] = {0.229f, 0.224f, 0.225f};

// dst (N, 3, H, W) f32 contiguous = (src[n, h, w, c] / 255 - mean[c]) / std[c], src u8
// (N, H, W, 3). The CPU counterpart of cuda::normalize_images (cuda/normalize.h).
void normalize_nhwc_to_nchw(const uint8_t* src, int64_t n, int64_t height, int64_t width,
                            const float mean[3], const float stddev[3], float* dst);

}  // namespace kiln::data
