// CPU halves of sync_batch_norm, on the (N, C, S) addressing of ops/cpu/ncs.h.
#include <algorithm>
#include <cmath>

#include "ops/cpu/kernels.h"
#include "ops/cpu/ncs.h"

namespace kiln::cpu {

void sync_batch_norm_stats(const Tensor& stats, const Tensor& x) {
  dispatch_float(x.dtype(), "sync_batch_norm", [&]<typename T>() {
    const NCS v = ncs_of(x);
    const T* px = x.data<T>();
    const ChannelVec<T> out(stats);
#pragma omp parallel for if (x.numel() > kBnParallelGrain) schedule(static)
    for (int64_t c = 0; c < v.c; ++c) {
      double s1 = 0, s2 = 0;
      for_channel2(v, v, c, [&](int64_t o, int64_t) {
        const double e = double(px[o]);
        s1 += e;
        s2 += e * e;
      });
      out.set(c, s1);
      out.set(v.c + c, s2);
    }
    out.set(2 * v.c, double(v.n * v.s));
  });
}

void sync_batch_norm_apply(const Tensor& y, const Tensor& save_mean, const Tensor& save_invstd,
                           const Tensor& x, const Tensor& weight, const Tensor& bias,
                           const Tensor& running_mean, const Tensor& running_var,
                           const Tensor& stats, double momentum, double eps) {
  dispatch_float(x.dtype(), "sync_batch_norm", [&]<typename T>() {
    const NCS vx = ncs_of(x), vy = ncs_of(y);
    const T* px = x.data<T>();
    T* py = y.data<T>();
    const ChannelVec<T> st(stats), sm(save_mean), si(save_invstd), w(weight, 1.0), b(bias, 0.0);
    const ChannelVec<T> rm(running_mean), rv(running_var);
    const double n = st[2 * vx.c];
#pragma omp parallel for if (x.numel() > kBnParallelGrain) schedule(static)
    for (int64_t c = 0; c < vx.c; ++c) {
      const double mean = st[c] / n;
      const double var = std::max(st[vx.c + c] / n - mean * mean, 0.0);
      const double invstd = 1.0 / std::sqrt(var + eps);
      sm.set(c, mean);
      si.set(c, invstd);
      if (rm.p) {
        rm.set(c, (1.0 - momentum) * rm[c] + momentum * mean);
        rv.set(c, (1.0 - momentum) * rv[c] + momentum * var * n / (n - 1.0));
      }
      const double scale = invstd * w[c], shift = b[c];
      for_channel2(vx, vy, c, [&](int64_t ox, int64_t oy) {
        py[oy] = T((double(px[ox]) - mean) * scale + shift);
      });
    }
  });
}

void sync_batch_norm_backward_sums(const Tensor& sums, const Tensor& dy, const Tensor& x,
                                   const Tensor& mean, const Tensor& invstd) {
  dispatch_float(x.dtype(), "sync_batch_norm_backward", [&]<typename T>() {
    const NCS vx = ncs_of(x), vd = ncs_of(dy);
    const T* px = x.data<T>();
    const T* pd = dy.data<T>();
    const ChannelVec<T> out(sums), m(mean), is(invstd);
#pragma omp parallel for if (x.numel() > kBnParallelGrain) schedule(static)
    for (int64_t c = 0; c < vx.c; ++c) {
      const double mu = m[c], k = is[c];
      double s1 = 0, s2 = 0;
      for_channel2(vx, vd, c, [&](int64_t ox, int64_t od) {
        const double g = double(pd[od]);
        s1 += g;
        s2 += g * (double(px[ox]) - mu) * k;
      });
      out.set(c, s1);
      out.set(vx.c + c, s2);
    }
  });
}

void sync_batch_norm_backward_dx(const Tensor& dx, const Tensor& dy, const Tensor& x,
                                 const Tensor& weight, const Tensor& mean, const Tensor& invstd,
                                 const Tensor& sums, const Tensor& count) {
  dispatch_float(x.dtype(), "sync_batch_norm_backward", [&]<typename T>() {
    const NCS vx = ncs_of(x), vd = ncs_of(dy), vdx = ncs_of(dx);
    const T* px = x.data<T>();
    const T* pd = dy.data<T>();
    T* pdx = dx.data<T>();
    const ChannelVec<T> s(sums), m(mean), is(invstd), w(weight, 1.0);
    const double n = double(*count.data<T>());
#pragma omp parallel for if (x.numel() > kBnParallelGrain) schedule(static)
    for (int64_t c = 0; c < vx.c; ++c) {
      const double mu = m[c], k = is[c], scale = w[c] * k;
      const double mean_dy = s[c] / n, mean_dy_xhat = s[vx.c + c] / n;
      for (int64_t i = 0; i < vx.n; ++i) {
        const int64_t bx = i * vx.sn + c * vx.sc, bd = i * vd.sn + c * vd.sc,
                      bo = i * vdx.sn + c * vdx.sc;
        for (int64_t j = 0; j < vx.s; ++j) {
          const double xhat = (double(px[bx + j * vx.ss]) - mu) * k;
          pdx[bo + j * vdx.ss] =
              T(scale * (double(pd[bd + j * vd.ss]) - mean_dy - xhat * mean_dy_xhat));
        }
      }
    }
  });
}

}  // namespace kiln::cpu
