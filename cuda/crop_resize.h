#pragma once
// The GPU input path's fused kernel (cuda/kernels/crop_resize.cu): for each sample of a batch,
// crop + resize (separable triangle filter, widened to the scale when shrinking: antialiased,
// as data/transforms.h describes) + horizontal flip + normalisation + the NHWC write, in one
// pass over decoded RGB u8 images already on the device.
//
// CPU reference: data::resample_box (data/transforms.h) followed by the normalisation of
// cuda::normalize_images. The kernel does not round to u8 between the two, so it differs from
// the reference by at most 0.5 / 255 / stddev (the reference's rounding) plus the output
// dtype's rounding (tests/gpu/test_crop_resize.cpp).
#include <cstdint>

#include "core/tensor.h"

namespace kiln::cuda {

// One output sample. Plain data, read by the kernel from device memory.
struct CropResizeJob {
  const uint8_t* src = nullptr;  // device; RGB interleaved rows: pixel (r, c) at src[r * pitch + 3 * c]
  int64_t pitch = 0;             // bytes per row
  float box_top = 0, box_left = 0, box_height = 0, box_width = 0;  // source area (pixels)
  int32_t lim_top = 0, lim_left = 0, lim_height = 0, lim_width = 0;  // taps stay inside
  int32_t flip = 0;  // mirror left-right
  int32_t pad = 0;
};

// out (N, 3, S, S), f16 or f32, channels-last (NHWC in memory), on the current device:
//   out[n] (=, every element written) = (resample(jobs[n]) / 255 - mean[c]) / stddev[c],
// jobs: N CropResizeJob in device memory (for example uploaded with cudaMemcpyAsync on the same
// stream). Runs on the current stream; does not synchronise; graph-capturable. Validates out's
// dtype/shape/layout and stddev > 0; the jobs must be valid (box of positive size overlapping
// the limit, limit inside the source, sources alive until the kernel has run).
void crop_resize_normalize(const Tensor& out, const CropResizeJob* jobs, int64_t n,
                           const float mean[3], const float stddev[3]);

}  // namespace kiln::cuda
