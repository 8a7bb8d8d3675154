#pragma once
// Warp-level reduction helpers shared by the row reductions and the softmax kernels.
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::cuda {

inline constexpr unsigned kFullMask = 0xffffffffu;

template <typename C>
__device__ inline C warp_sum(C v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(kFullMask, v, m);
  return v;
}

// max that propagates NaN (as the CPU backend does).
template <typename C>
__device__ inline C nan_max(C a, C b) {
  return (isnan(a) || a > b) ? a : b;
}

template <typename C>
__device__ inline C warp_max(C v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = nan_max(v, __shfl_xor_sync(kFullMask, v, m));
  return v;
}

// (value, index) pairs: the larger value wins, NaN beats numbers, ties go to the lower index.
template <typename C>
__device__ inline bool arg_better(C bv, int64_t bi, C av, int64_t ai) {
  const bool an = isnan(av), bn = isnan(bv);
  if (an != bn) return bn;
  if (an || bv == av) return bi < ai;
  return bv > av;
}

template <typename C>
__device__ inline void warp_argmax(C& v, int64_t& i) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    C ov = __shfl_xor_sync(kFullMask, v, m);
    int64_t oi = __shfl_xor_sync(kFullMask, i, m);
    if (arg_better(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

}  // namespace kiln::cuda
