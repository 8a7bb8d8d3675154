#pragma once
// Internal to optim/: runs a fused kernel on the arenas' device — the CPU reference
// (fused::ref) or its CUDA twin (cuda/optim.h).
#include "core/fused_optim.h"

#ifdef KILN_WITH_CUDA
#include "cuda/optim.h"
#define KILN_FUSED_CUDA(expr) (expr)
#else
#define KILN_FUSED_CUDA(expr) \
  KILN_FAIL("fused optimizer: cuda tensors, but kiln was built without CUDA")
#endif

// KILN_FUSED_CALL(device, ref::name, cuda::name, args...)
#define KILN_FUSED_CALL(device, ref_fn, cuda_fn, ...) \
  do {                                                 \
    if ((device).is_cuda()) {                          \
      KILN_FUSED_CUDA(cuda_fn(__VA_ARGS__));           \
    } else {                                           \
      ref_fn(__VA_ARGS__);                             \
    }                                                  \
  } while (0)
