// CPU convolution: im2col + Eigen GEMM, one image per OpenMP iteration.
//
// Per image, the columns of all groups form one (C*kH*kW, H'*W') matrix; group g reads the
// row block [g*K, (g+1)*K) with K = C/groups*kH*kW, and the weight viewed as (O, K) row-major
// gives its row block [g*O/groups, ...). A 1x1 convolution with unit stride and no padding
// needs no im2col: the image itself is the column matrix.
//
// Eigen's GEMM runs single-threaded inside our parallel region (it checks for nesting) and
// multi-threaded when there is a single image, so both batch and single-image calls use the
// cores.

// GCC 12 reports false "may be used uninitialized" warnings inside its AVX-512 intrinsics
// when Eigen's GEMM is inlined here (-march=native).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <omp.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cstring>
#include <vector>

#include "ops/cpu/kernels.h"

namespace kiln::cpu {
namespace {

template <typename T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using MapM = Eigen::Map<Mat<T>>;
template <typename T>
using MapCM = Eigen::Map<const Mat<T>>;

struct Geometry {
  int64_t n, c, h, w;         // input
  int64_t o, kh, kw;          // weight
  int64_t oh, ow;             // output
  int64_t groups, cg, og, k;  // per group: input channels, output channels, GEMM depth
  ConvParams p;
  bool direct;  // 1x1, stride 1, no padding: the image is its own column matrix

  Geometry(const Tensor& x, const Tensor& wt, const Tensor& y, const ConvParams& prm)
      : n(x.size(0)),
        c(x.size(1)),
        h(x.size(2)),
        w(x.size(3)),
        o(wt.size(0)),
        kh(wt.size(2)),
        kw(wt.size(3)),
        oh(y.size(2)),
        ow(y.size(3)),
        groups(prm.groups),
        p(prm) {
    cg = c / groups;
    og = o / groups;
    k = cg * kh * kw;
    direct =
        kh == 1 && kw == 1 && p.stride_h == 1 && p.stride_w == 1 && p.pad_h == 0 && p.pad_w == 0;
  }
  int64_t in_plane() const { return h * w; }
  int64_t out_plane() const { return oh * ow; }
  int64_t col_rows() const { return c * kh * kw; }

  // Output columns [lo, hi) whose input column ow*stride + off lies inside [0, w).
  void valid_range(int64_t off, int64_t& lo, int64_t& hi) const {
    const int64_t s = p.stride_w;
    lo = off >= 0 ? 0 : (-off + s - 1) / s;
    hi = (w - 1 - off) < 0 ? 0 : (w - 1 - off) / s + 1;
    lo = std::min(lo, ow);
    hi = std::max(std::min(hi, ow), lo);
  }
};

// col (C*kH*kW, H'*W') = the receptive fields of one image (C, H, W); zeros in the padding.
template <typename T>
void im2col(const Geometry& g, const T* img, T* col) {
  const ConvParams& p = g.p;
  for (int64_t ch = 0; ch < g.c; ++ch) {
    for (int64_t i = 0; i < g.kh; ++i) {
      for (int64_t j = 0; j < g.kw; ++j) {
        T* row = col + ((ch * g.kh + i) * g.kw + j) * g.out_plane();
        const int64_t off_w = j * p.dil_w - p.pad_w;
        int64_t lo, hi;
        g.valid_range(off_w, lo, hi);
        for (int64_t y = 0; y < g.oh; ++y) {
          T* dst = row + y * g.ow;
          const int64_t ih = y * p.stride_h - p.pad_h + i * p.dil_h;
          if (ih < 0 || ih >= g.h) {
            std::fill(dst, dst + g.ow, T(0));
            continue;
          }
          const T* src = img + (ch * g.h + ih) * g.w + off_w;
          std::fill(dst, dst + lo, T(0));
          if (p.stride_w == 1) {
            std::memcpy(dst + lo, src + lo, size_t(hi - lo) * sizeof(T));
          } else {
            for (int64_t x = lo; x < hi; ++x) dst[x] = src[x * p.stride_w];
          }
          std::fill(dst + hi, dst + g.ow, T(0));
        }
      }
    }
  }
}

// img (C, H, W) += the adjoint of im2col applied to col. img must be zeroed by the caller.
template <typename T>
void col2im(const Geometry& g, const T* col, T* img) {
  const ConvParams& p = g.p;
  for (int64_t ch = 0; ch < g.c; ++ch) {
    for (int64_t i = 0; i < g.kh; ++i) {
      for (int64_t j = 0; j < g.kw; ++j) {
        const T* row = col + ((ch * g.kh + i) * g.kw + j) * g.out_plane();
        const int64_t off_w = j * p.dil_w - p.pad_w;
        int64_t lo, hi;
        g.valid_range(off_w, lo, hi);
        for (int64_t y = 0; y < g.oh; ++y) {
          const int64_t ih = y * p.stride_h - p.pad_h + i * p.dil_h;
          if (ih < 0 || ih >= g.h) continue;
          const T* src = row + y * g.ow;
          T* dst = img + (ch * g.h + ih) * g.w + off_w;
          for (int64_t x = lo; x < hi; ++x) dst[x * p.stride_w] += src[x];
        }
      }
    }
  }
}

// Runs f(target) where target is `out` itself when it is contiguous NCHW, else a contiguous
// scratch tensor copied into `out` afterwards.
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

int64_t col_scratch(const Geometry& g) { return g.direct ? 0 : g.col_rows() * g.out_plane(); }

}  // namespace

void conv2d_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias,
                    const ConvParams& p) {
  const Tensor xc = x.contiguous(), wc = w.contiguous();
  const Tensor bc = bias.defined() ? bias.contiguous() : Tensor();
  const Geometry g(xc, wc, y, p);
  dispatch_float(y.dtype(), "conv2d", [&]<typename T>() {
    write_contiguous(y, [&](const Tensor& yc) {
      const T* xp = xc.data<T>();
      const T* wp = wc.data<T>();
      const T* bp = bc.defined() ? bc.data<T>() : nullptr;
      T* yp = yc.data<T>();
#pragma omp parallel if (g.n > 1)
      {
        std::vector<T> col(size_t(col_scratch(g)));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < g.n; ++n) {
          const T* img = xp + n * g.c * g.in_plane();
          const T* cols = img;
          if (!g.direct) {
            im2col(g, img, col.data());
            cols = col.data();
          }
          T* out = yp + n * g.o * g.out_plane();
          for (int64_t gr = 0; gr < g.groups; ++gr) {
            MapCM<T> wm(wp + gr * g.og * g.k, g.og, g.k);
            MapCM<T> cm(cols + gr * g.k * g.out_plane(), g.k, g.out_plane());
            MapM<T> ym(out + gr * g.og * g.out_plane(), g.og, g.out_plane());
            ym.noalias() = wm * cm;
          }
          if (bp) {
            MapM<T> ym(out, g.o, g.out_plane());
            ym.colwise() += Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>>(bp, g.o);
          }
        }
      }
    });
  });
}

void conv2d_backward_data(const Tensor& dx, const Tensor& dy, const Tensor& w,
                          const ConvParams& p) {
  const Tensor dyc = dy.contiguous(), wc = w.contiguous();
  const Geometry g(dx, wc, dyc, p);
  dispatch_float(dx.dtype(), "conv2d_backward_data", [&]<typename T>() {
    write_contiguous(dx, [&](const Tensor& dxc) {
      const T* dyp = dyc.data<T>();
      const T* wp = wc.data<T>();
      T* dxp = dxc.data<T>();
#pragma omp parallel if (g.n > 1)
      {
        std::vector<T> col(size_t(col_scratch(g)));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < g.n; ++n) {
          const T* gout = dyp + n * g.o * g.out_plane();
          T* img = dxp + n * g.c * g.in_plane();
          // Direct: the column gradient is the image gradient.
          T* cols = g.direct ? img : col.data();
          for (int64_t gr = 0; gr < g.groups; ++gr) {
            MapCM<T> wm(wp + gr * g.og * g.k, g.og, g.k);
            MapCM<T> dym(gout + gr * g.og * g.out_plane(), g.og, g.out_plane());
            MapM<T> cm(cols + gr * g.k * g.out_plane(), g.k, g.out_plane());
            cm.noalias() = wm.transpose() * dym;
          }
          if (!g.direct) {
            std::fill(img, img + g.c * g.in_plane(), T(0));
            col2im(g, cols, img);
          }
        }
      }
    });
  });
}

void conv2d_backward_weight(const Tensor& dw, const Tensor& dy, const Tensor& x,
                            const ConvParams& p) {
  const Tensor dyc = dy.contiguous(), xc = x.contiguous();
  const Geometry g(xc, dw, dyc, p);
  dispatch_float(dw.dtype(), "conv2d_backward_weight", [&]<typename T>() {
    write_contiguous(dw, [&](const Tensor& dwc) {
      const T* dyp = dyc.data<T>();
      const T* xp = xc.data<T>();
      const int64_t wsize = g.o * g.k;
      // One accumulator per thread, summed in thread order afterwards: deterministic for a
      // given thread count.
      const int nthreads = g.n > 1 ? omp_get_max_threads() : 1;
      std::vector<std::vector<T>> partial(static_cast<size_t>(nthreads));
#pragma omp parallel num_threads(nthreads)
      {
        std::vector<T>& acc = partial[size_t(omp_get_thread_num())];
        acc.assign(size_t(wsize), T(0));
        std::vector<T> col(size_t(col_scratch(g)));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < g.n; ++n) {
          const T* img = xp + n * g.c * g.in_plane();
          const T* cols = img;
          if (!g.direct) {
            im2col(g, img, col.data());
            cols = col.data();
          }
          const T* gout = dyp + n * g.o * g.out_plane();
          for (int64_t gr = 0; gr < g.groups; ++gr) {
            MapCM<T> dym(gout + gr * g.og * g.out_plane(), g.og, g.out_plane());
            MapCM<T> cm(cols + gr * g.k * g.out_plane(), g.k, g.out_plane());
            MapM<T> am(acc.data() + gr * g.og * g.k, g.og, g.k);
            am.noalias() += dym * cm.transpose();
          }
        }
      }
      T* out = dwc.data<T>();
      std::fill(out, out + wsize, T(0));
      for (const std::vector<T>& part : partial)  // empty when the runtime gave fewer threads
        for (size_t i = 0; i < part.size(); ++i) out[i] += part[i];
    });
  });
}

}  // namespace kiln::cpu
