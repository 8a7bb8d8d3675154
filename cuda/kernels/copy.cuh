#pragma once
// Device-side copy and fill kernels used by cuda/copy.cpp. Host-callable; no device code here.
#include <cstdint>

#include "core/tensor.h"

namespace kiln::cuda {

// dst = convert(src) elementwise; both on the current device, same shape, any dtypes/strides.
// Launches on the current stream.
void launch_copy_strided(const Tensor& dst, const Tensor& src);
// Every element of dst (any strides) set to the element-sized bit pattern `bits`.
void launch_fill(const Tensor& dst, uint64_t bits);

}  // namespace kiln::cuda
