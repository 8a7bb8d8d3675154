// CPU batch-norm kernels, on the (N, C, S) addressing of ops/cpu/ncs.h.
#include <cmath>
#include <vector>

#include "ops/cpu/kernels.h"
#include "ops/cpu/ncs.h"

namespace kiln::cpu {
namespace {

// Calls f(offset) for every element of channel c.
template <typename F>
inline void for_channel(const NCS& v, int64_t c, F&& f) {
  for (int64_t n = 0; n < v.n; ++n) {
    const int64_t base = n * v.sn + c * v.sc;
    for (int64_t s = 0; s < v.s; ++s) f(base + s * v.ss);
  }
}

}  // namespace

void batch_norm_forward_training(const Tensor& y, const Tensor& save_mean,
                                 const Tensor& save_invstd, const Tensor& x, const Tensor& weight,
                                 const Tensor& bias, const Tensor& running_mean,
                                 const Tensor& running_var, double momentum, double eps) {
  dispatch_float(x.dtype(), "batch_norm", [&]<typename T>() {
    const NCS vx = ncs_of(x), vy = ncs_of(y);
    const T* px = x.data<T>();
    T* py = y.data<T>();
    T* pm = save_mean.data<T>();
    T* pi = save_invstd.data<T>();
    const ChannelVec<T> w(weight, 1.0), b(bias, 0.0);
    T* rm = running_mean.defined() ? running_mean.data<T>() : nullptr;
    T* rv = running_var.defined() ? running_var.data<T>() : nullptr;
    const int64_t rms = rm ? running_mean.stride(0) : 0, rvs = rv ? running_var.stride(0) : 0;
    const double m = double(vx.n * vx.s);
#pragma omp parallel for if (x.numel() > kBnParallelGrain) schedule(static)
    for (int64_t c = 0; c < vx.c; ++c) {
      // Two passes: the mean first, then squared deviations (no cancellation as E[x²]-E[x]²).
      double sum = 0;
      for_channel(vx, c, [&](int64_t o) { sum += double(px[o]); });
      const double mean = sum / m;
      double sq = 0;
      for_channel(vx, c, [&](int64_t o) {
        const double d = double(px[o]) - mean;
        sq += d * d;
      });
      const double invstd = 1.0 / std::sqrt(sq / m + eps);
      pm[c * save_mean.stride(0)] = T(mean);
      pi[c * save_invstd.stride(0)] = T(invstd);
      const double scale = invstd * w[c], shift = b[c] - mean * scale;
      for_channel2(vx, vy, c, [&](int64_t ox, int64_t oy) { py[oy] = T(double(px[ox]) * scale + shift); });
      if (rm) rm[c * rms] = T((1.0 - momentum) * double(rm[c * rms]) + momentum * mean);
      if (rv) rv[c * rvs] = T((1.0 - momentum) * double(rv[c * rvs]) + momentum * sq / (m - 1.0));
    }
  });
}

void batch_norm_forward_eval(const Tensor& y, const Tensor& x, const Tensor& weight,
                             const Tensor& bias, const Tensor& running_mean,
                             const Tensor& running_var, double eps) {
  dispatch_float(x.dtype(), "batch_norm", [&]<typename T>() {
    const NCS vx = ncs_of(x), vy = ncs_of(y);
    const T* px = x.data<T>();
    T* py = y.data<T>();
    const ChannelVec<T> w(weight, 1.0), b(bias, 0.0);
    const ChannelVec<T> rm(running_mean, 0.0), rv(running_var, 1.0);
#pragma omp parallel for if (x.numel() > kBnParallelGrain) schedule(static)
    for (int64_t c = 0; c < vx.c; ++c) {
      const double scale = w[c] / std::sqrt(rv[c] + eps), shift = b[c] - rm[c] * scale;
      for_channel2(vx, vy, c, [&](int64_t ox, int64_t oy) { py[oy] = T(double(px[ox]) * scale + shift); });
    }
  });
}

// The same computation as sync_batch_norm's backward with the identity reduction: its two
// halves (ops/cpu/sync_batch_norm.cpp) are the one core both ops share.
void batch_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& weight,
                         const Tensor& save_mean, const Tensor& save_invstd) {
  const int64_t c = x.size(1);
  const TensorOptions opts(x.dtype());
  Tensor sums = empty({2 * c}, opts);  // [Σdy, Σdy·x̂] per channel
  sync_batch_norm_backward_sums(sums, dy, x, save_mean, save_invstd);
  if (dbias.defined()) dbias.copy_(sums.narrow(0, 0, c));
  if (dweight.defined()) dweight.copy_(sums.narrow(0, c, c));
  if (!dx.defined()) return;
  const Tensor count = full({1}, double(x.numel() / c), opts);
  sync_batch_norm_backward_dx(dx, dy, x, weight, save_mean, save_invstd, sums, count);
}

}  // namespace kiln::cpu
