#pragma once
// The unary and binary families' scalar formulas on the device: core/elementwise_math.h's, the
// same the CPU backend uses, for the elementwise kernels and any fused kernel that wants them.
#include <cuda_runtime.h>

#include "core/elementwise_math.h"
#include "core/kinds.h"

namespace kiln::cuda {

using math::binary_apply;
using math::unary_apply;

}  // namespace kiln::cuda
