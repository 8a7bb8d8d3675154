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

// Element c of a (C)-like tensor of any stride, or `dflt` when the tensor is undefined.
template <typename T>
struct ChannelVec {
  T* p = nullptr;
  int64_t stride = 0;
  double dflt = 0;
  ChannelVec(const Tensor& t, double d = 0) : dflt(d) {
    if (t.defined()) {
      p = t.data<T>();
      stride = t.stride(0);
    }
  }
  double operator[](int64_t c) const { return p ? double(p[c * stride]) : dflt; }
  void set(int64_t c, double v) const { p[c * stride] = T(v); }
};

// Calls f(offset_a, offset_b) for every element of channel c of two same-shaped tensors.
template <typename F>
inline void for_channel2(const NCS& a, const NCS& b, int64_t c, F&& f) {
  for (int64_t n = 0; n < a.n; ++n) {
    const int64_t ba = n * a.sn + c * a.sc, bb = n * b.sn + c * b.sc;
    for (int64_t s = 0; s < a.s; ++s) f(ba + s * a.ss, bb + s * b.ss);
  }
}

}  // namespace kiln::cpu
