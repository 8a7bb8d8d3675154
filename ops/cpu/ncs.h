#pragma once
// (N, C, S) addressing shared by the CPU batch-norm kernels (ops/cpu/batch_norm.cpp,
// ops/cpu/sync_batch_norm.cpp): every (N, C, ...) tensor is seen as (N, C, S), S the product of
// the spatial dims. Both dense layouts (row-major and channels-last) merge their spatial dims
// into one stride, so one loop nest serves NCHW, NHWC and (N, C). Internal to ops/cpu/.
#include <cstdint>

#include "core/tensor.h"

namespace kiln::cpu {

// Elements per OpenMP chunk in the per-channel loops.
inline constexpr int64_t kBnParallelGrain = 32768;

struct NCS {
  int64_t n, c, s;     // sizes
  int64_t sn, sc, ss;  // element strides
};

inline NCS ncs_of(const Tensor& t) {
  NCS v{t.size(0), t.size(1), 1, t.stride(0), t.stride(1), 1};
  for (int64_t d = 2; d < t.dim(); ++d) v.s *= t.size(d);
  if (t.dim() > 2) v.ss = t.stride(-1);
  return v;
}

}  // namespace kiln::cpu
