#pragma once
// Image-batch kernels of the input pipeline (cuda/kernels/normalize.cu): the u8 -> float
// normalisation that follows the host->device copy of a loader batch, the gather + crop + flip +
// normalise of a device-resident dataset (data/device_loader.h), and the synthetic source's
// generators. All run on kiln::cuda::current_stream() without synchronising the host.
#include <cstdint>

#include "core/tensor.h"

namespace kiln::cuda {

// out (N, 3, H, W), f32 or f16, channels-last (NHWC in memory) =
//   (in[n, h, w, c] / 255 - mean[c]) / stddev[c]   computed in f32, then rounded to out's dtype;
// in: u8 (N, H, W, 3) contiguous on the same device. Validates dtypes, shapes and layouts.
// The CPU counterpart is data::normalize_nhwc_to_nchw (data/transforms.h).
void normalize_images(const Tensor& out, const Tensor& in, const float mean[3],
                      const float stddev[3]);

// One sample of a gathered batch: dataset image `index`, cropped at (top, left) of the image
// zero-padded by `pad` on each side (top, left in [0, 2 * pad]), mirrored left-right when flip
// is non-zero. Four i32, so a batch's jobs are an i32 (B, 4) tensor.
struct GatherJob {
  int32_t index, top, left, flip;
};
static_assert(sizeof(GatherJob) == 4 * sizeof(int32_t), "GatherJob is read as i32 (B, 4)");

// x (B, C, H, W), f32 or f16, contiguous (NCHW) or channels-last (NHWC), = lut[c * 256 + p] of
// p, the pixel (c, h, w) of job b's padded, cropped, maybe mirrored image; padding reads as
// p = 0, or with `reflect` as the pixel mirrored about the edge (pad < H, W). Rounded once to x's dtype, so f32 output equals data::crop_flip_normalize's bit for
// bit. y i64 (B) = labels[jobs[b].index]; pass y undefined to skip the labels.
// images u8 (N, C, H, W) contiguous, labels i64 (N), jobs i32 (B, 4) contiguous (GatherJob
// rows), lut f32 (C * 256), all on x's device. Indices and offsets are trusted (the caller
// draws them); everything else is validated. Sets x and y.
void gather_crop_flip_normalize(const Tensor& x, const Tensor& y, const Tensor& images,
                                const Tensor& labels, const Tensor& jobs, int64_t pad,
                                const Tensor& lut, bool reflect = false);

// Every byte i of the contiguous u8 tensor `out` = data::synthetic_byte(seed, i)
// (core/hash.h), as the CPU generator writes it.
void fill_synthetic_bytes(const Tensor& out, uint64_t seed);
// labels i64 (N) contiguous: labels[i] = data::synthetic_label(seed, i, classes).
void fill_synthetic_labels(const Tensor& labels, uint64_t seed, int64_t classes);

}  // namespace kiln::cuda
