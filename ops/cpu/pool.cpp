// CPU pooling: direct loops over contiguous NCHW planes, OpenMP over the N*C planes. Each plane
// of dx is written by one thread only, so the backward passes need no atomics.
#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/cpu/kernels.h"

namespace kiln::cpu {
namespace {

constexpr int64_t kParallelGrain = 16384;  // elements touched; below this one thread is faster

// Runs f(target) with a contiguous NCHW target, copied into `out` when out is laid out otherwise.
template <typename F>
void write_contiguous(const Tensor& out, F&& f) {
  if (out.is_contiguous()) {
    f(out);
    return;
  }
  Tensor tmp = empty(out.shape(), TensorOptions(out.dtype()));
  f(tmp);
  out.copy_(tmp);
}

struct Planes {
  int64_t count, h, w, oh, ow;
  Planes(const Tensor& in, const Tensor& out)
      : count(in.size(0) * in.size(1)),
        h(in.size(2)),
        w(in.size(3)),
        oh(out.size(2)),
        ow(out.size(3)) {}
  int64_t in_plane() const { return h * w; }
  int64_t out_plane() const { return oh * ow; }
};

// Window-local position i·kernel_w + j of the first maximal element of window (oy, ox), -1
// when the window holds no input element. NaN wins, as in PyTorch.
template <typename T>
int64_t window_argmax(const T* plane, const Planes& g, const PoolParams& p, int64_t oy,
                      int64_t ox) {
  int64_t best_at = -1;
  T best = -std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < p.kernel_h; ++i) {
    const int64_t ih = oy * p.stride_h - p.pad_h + i * p.dil_h;
    if (ih < 0 || ih >= g.h) continue;
    for (int64_t j = 0; j < p.kernel_w; ++j) {
      const int64_t iw = ox * p.stride_w - p.pad_w + j * p.dil_w;
      if (iw < 0 || iw >= g.w) continue;
      const T v = plane[ih * g.w + iw];
      if (best_at < 0 || v > best || std::isnan(v)) {
        best = v;
        best_at = i * p.kernel_w + j;
        if (std::isnan(v)) return best_at;
      }
    }
  }
  return best_at;
}

// Clipped window [h0, h1) x [w0, w1) of output (oy, ox) and the divisor of its average.
struct AvgWindow {
  int64_t h0, h1, w0, w1, divisor;
  AvgWindow(const Planes& g, const PoolParams& p, int64_t oy, int64_t ox) {
    h0 = oy * p.stride_h - p.pad_h;
    w0 = ox * p.stride_w - p.pad_w;
    h1 = std::min(h0 + p.kernel_h, g.h + p.pad_h);
    w1 = std::min(w0 + p.kernel_w, g.w + p.pad_w);
    const int64_t full = (h1 - h0) * (w1 - w0);
    h0 = std::max<int64_t>(h0, 0);
    w0 = std::max<int64_t>(w0, 0);
    h1 = std::min(h1, g.h);
    w1 = std::min(w1, g.w);
    divisor = p.count_include_pad ? full : (h1 - h0) * (w1 - w0);
  }
};

inline int64_t adaptive_start(int64_t i, int64_t in, int64_t out) { return i * in / out; }
inline int64_t adaptive_end(int64_t i, int64_t in, int64_t out) {
  return ((i + 1) * in + out - 1) / out;
}

}  // namespace

// The window-local position i·kernel_w + j of window (oy, ox)'s first maximal element as
// stored in the indices tensor, and back to an offset in the plane.
static int64_t local_to_plane(int64_t local, const Planes& g, const PoolParams& p, int64_t oy,
                       int64_t ox) {
  const int64_t i = local / p.kernel_w, j = local % p.kernel_w;
  return (oy * p.stride_h - p.pad_h + i * p.dil_h) * g.w + (ox * p.stride_w - p.pad_w + j * p.dil_w);
}

void max_pool2d_forward(const Tensor& y, const Tensor& indices, const Tensor& x,
                        const PoolParams& p) {
  const Tensor xc = x.contiguous();
  const Planes g(xc, y);
  const bool u8 = indices.dtype() == DType::u8;
  dispatch_float(y.dtype(), "max_pool2d", [&]<typename T>() {
    write_contiguous(indices, [&](const Tensor& ic) {
      write_contiguous(y, [&](const Tensor& yc) {
        const T* xp = xc.data<T>();
        T* yp = yc.data<T>();
        uint8_t* i8 = u8 ? ic.data<uint8_t>() : nullptr;
        int32_t* i32 = u8 ? nullptr : ic.data<int32_t>();
#pragma omp parallel for if (y.numel() * p.kernel_h * p.kernel_w > kParallelGrain)
        for (int64_t pl = 0; pl < g.count; ++pl) {
          const T* plane = xp + pl * g.in_plane();
          T* out = yp + pl * g.out_plane();
          for (int64_t oy = 0; oy < g.oh; ++oy)
            for (int64_t ox = 0; ox < g.ow; ++ox) {
              const int64_t local = window_argmax(plane, g, p, oy, ox);
              const int64_t o = pl * g.out_plane() + oy * g.ow + ox;
              out[oy * g.ow + ox] = local < 0 ? -std::numeric_limits<T>::infinity()
                                              : plane[local_to_plane(local, g, p, oy, ox)];
              if (u8)
                i8[o] = local < 0 ? uint8_t(255) : uint8_t(local);
              else
                i32[o] = int32_t(local);
            }
        }
      });
    });
  });
}

void max_pool2d_backward(const Tensor& dx, const Tensor& dy, const Tensor& indices,
                         const PoolParams& p) {
  const Tensor dyc = dy.contiguous(), ic = indices.contiguous();
  const Planes g(dx, dyc);
  const bool u8 = ic.dtype() == DType::u8;
  dispatch_float(dx.dtype(), "max_pool2d_backward", [&]<typename T>() {
    write_contiguous(dx, [&](const Tensor& dxc) {
      const T* dyp = dyc.data<T>();
      T* dxp = dxc.data<T>();
#pragma omp parallel for if (dy.numel() * p.kernel_h * p.kernel_w > kParallelGrain)
      for (int64_t pl = 0; pl < g.count; ++pl) {
        const T* gout = dyp + pl * g.out_plane();
        T* gin = dxp + pl * g.in_plane();
        std::fill(gin, gin + g.in_plane(), T(0));
        for (int64_t oy = 0; oy < g.oh; ++oy)
          for (int64_t ox = 0; ox < g.ow; ++ox) {
            const int64_t o = pl * g.out_plane() + oy * g.ow + ox;
            const int64_t local = u8 ? (ic.data<uint8_t>()[o] == 255 ? -1 : ic.data<uint8_t>()[o])
                                     : int64_t(ic.data<int32_t>()[o]);
            if (local >= 0) gin[local_to_plane(local, g, p, oy, ox)] += gout[oy * g.ow + ox];
          }
      }
    });
  });
}

void avg_pool2d_forward(const Tensor& y, const Tensor& x, const PoolParams& p) {
  const Tensor xc = x.contiguous();
  const Planes g(xc, y);
  dispatch_float(y.dtype(), "avg_pool2d", [&]<typename T>() {
    write_contiguous(y, [&](const Tensor& yc) {
      const T* xp = xc.data<T>();
      T* yp = yc.data<T>();
#pragma omp parallel for if (y.numel() * p.kernel_h * p.kernel_w > kParallelGrain)
      for (int64_t pl = 0; pl < g.count; ++pl) {
        const T* plane = xp + pl * g.in_plane();
        T* out = yp + pl * g.out_plane();
        for (int64_t oy = 0; oy < g.oh; ++oy)
          for (int64_t ox = 0; ox < g.ow; ++ox) {
            const AvgWindow win(g, p, oy, ox);
            T s = 0;
            for (int64_t ih = win.h0; ih < win.h1; ++ih)
              for (int64_t iw = win.w0; iw < win.w1; ++iw) s += plane[ih * g.w + iw];
            out[oy * g.ow + ox] = win.divisor > 0 ? s / T(win.divisor) : T(0);
          }
      }
    });
  });
}

void avg_pool2d_backward(const Tensor& dx, const Tensor& dy, const PoolParams& p) {
  const Tensor dyc = dy.contiguous();
  const Planes g(dx, dyc);
  dispatch_float(dx.dtype(), "avg_pool2d_backward", [&]<typename T>() {
    write_contiguous(dx, [&](const Tensor& dxc) {
      const T* dyp = dyc.data<T>();
      T* dxp = dxc.data<T>();
#pragma omp parallel for if (dy.numel() * p.kernel_h * p.kernel_w > kParallelGrain)
      for (int64_t pl = 0; pl < g.count; ++pl) {
        const T* gout = dyp + pl * g.out_plane();
        T* gin = dxp + pl * g.in_plane();
        std::fill(gin, gin + g.in_plane(), T(0));
        for (int64_t oy = 0; oy < g.oh; ++oy)
          for (int64_t ox = 0; ox < g.ow; ++ox) {
            const AvgWindow win(g, p, oy, ox);
            if (win.divisor == 0) continue;
            const T v = gout[oy * g.ow + ox] / T(win.divisor);
            for (int64_t ih = win.h0; ih < win.h1; ++ih)
              for (int64_t iw = win.w0; iw < win.w1; ++iw) gin[ih * g.w + iw] += v;
          }
      }
    });
  });
}

void adaptive_avg_pool2d_forward(const Tensor& y, const Tensor& x) {
  const Tensor xc = x.contiguous();
  const Planes g(xc, y);
  dispatch_float(y.dtype(), "adaptive_avg_pool2d", [&]<typename T>() {
    write_contiguous(y, [&](const Tensor& yc) {
      const T* xp = xc.data<T>();
      T* yp = yc.data<T>();
#pragma omp parallel for if (x.numel() > kParallelGrain)
      for (int64_t pl = 0; pl < g.count; ++pl) {
        const T* plane = xp + pl * g.in_plane();
        T* out = yp + pl * g.out_plane();
        for (int64_t oy = 0; oy < g.oh; ++oy) {
          const int64_t h0 = adaptive_start(oy, g.h, g.oh), h1 = adaptive_end(oy, g.h, g.oh);
          for (int64_t ox = 0; ox < g.ow; ++ox) {
            const int64_t w0 = adaptive_start(ox, g.w, g.ow), w1 = adaptive_end(ox, g.w, g.ow);
            T s = 0;
            for (int64_t ih = h0; ih < h1; ++ih)
              for (int64_t iw = w0; iw < w1; ++iw) s += plane[ih * g.w + iw];
            out[oy * g.ow + ox] = s / T((h1 - h0) * (w1 - w0));
          }
        }
      }
    });
  });
}

void adaptive_avg_pool2d_backward(const Tensor& dx, const Tensor& dy) {
  const Tensor dyc = dy.contiguous();
  const Planes g(dx, dyc);
  dispatch_float(dx.dtype(), "adaptive_avg_pool2d_backward", [&]<typename T>() {
    write_contiguous(dx, [&](const Tensor& dxc) {
      const T* dyp = dyc.data<T>();
      T* dxp = dxc.data<T>();
#pragma omp parallel for if (dx.numel() > kParallelGrain)
      for (int64_t pl = 0; pl < g.count; ++pl) {
        const T* gout = dyp + pl * g.out_plane();
        T* gin = dxp + pl * g.in_plane();
        std::fill(gin, gin + g.in_plane(), T(0));
        for (int64_t oy = 0; oy < g.oh; ++oy) {
          const int64_t h0 = adaptive_start(oy, g.h, g.oh), h1 = adaptive_end(oy, g.h, g.oh);
          for (int64_t ox = 0; ox < g.ow; ++ox) {
            const int64_t w0 = adaptive_start(ox, g.w, g.ow), w1 = adaptive_end(ox, g.w, g.ow);
            const T v = gout[oy * g.ow + ox] / T((h1 - h0) * (w1 - w0));
            for (int64_t ih = h0; ih < h1; ++ih)
              for (int64_t iw = w0; iw < w1; ++iw) gin[ih * g.w + iw] += v;
          }
        }
      }
    });
  });
}

}  // namespace kiln::cpu
