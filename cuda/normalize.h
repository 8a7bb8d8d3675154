#pragma once
// Image-batch kernels of the input pipeline (cuda/kernels/normalize.cu): the u8 -> float
// normalisation that follows the host->device copy of a loader batch, and the synthetic
// source's generators. All run on kiln::cuda::current_stream() without synchronising the host.
#include <cstdint>

#include "core/tensor.h"

namespace kiln::cuda {

// out (N, 3, H, W), f32 or f16, channels-last (NHWC in memory) =
//   (in[n, h, w, c] / 255 - mean[c]) / stddev[c]   computed in f32, then rounded to out's dtype;
// in: u8 (N, H, W, 3) contiguous on the same device. Validates dtypes, shapes and layouts.
// The CPU counterpart is data::normalize_nhwc_to_nchw (data/transforms.h).
void normalize_images(const Tensor& out, const Tensor& in, const float mean[3],
                      const float stddev[3]);

// Every byte i of the contiguous u8 tensor `out` = data::synthetic_byte(seed, i)
// (core/hash.h), as the CPU generator writes it.
void fill_synthetic_bytes(const Tensor& out, uint64_t seed);
// labels i64 (N) contiguous: labels[i] = data::synthetic_label(seed, i, classes).
void fill_synthetic_labels(const Tensor& labels, uint64_t seed, int64_t classes);

}  // namespace kiln::cuda
