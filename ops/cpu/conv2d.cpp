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
#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
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

// Per-thread scratch (`per_thread` elements for each of `threads`), allocated before the OpenMP
// region: an exception must not leave a parallel region (std::terminate), so running out of
// memory here is a kiln::Error naming the op and the size.
template <typename T>
std::vector<T> thread_scratch(const char* op, int64_t per_thread, int threads, const Geometry& g) {
  int64_t n = 0;
  KILN_CHECK(!__builtin_mul_overflow(per_thread, int64_t(threads), &n), op,
             " (cpu): scratch size overflows");
  try {
    return std::vector<T>(size_t(n));
  } catch (const std::bad_alloc&) {
    KILN_FAIL(op, " (cpu): out of memory allocating ", n * int64_t(sizeof(T)),
              " bytes of im2col scratch (", threads, " threads x ", per_thread, " elements; batch ",
              g.n, ", ", g.c, " -> ", g.o, " channels)");
  }
}

// Catches what the body of an OpenMP loop throws (Eigen may allocate), skips the remaining
// iterations, and rethrows the first exception after the region, with the op's name.
class ParallelErrors {
 public:
  template <typename F>
  void run(F&& f) {
    if (failed_.load(std::memory_order_relaxed)) return;
    try {
      f();
    } catch (...) {
      std::lock_guard lk(mu_);
      if (!error_) error_ = std::current_exception();
      failed_ = true;
    }
  }
  void rethrow(const char* op) const {
    if (!error_) return;
    try {
      std::rethrow_exception(error_);
    } catch (const std::bad_alloc&) {
      KILN_FAIL(op, " (cpu): out of memory inside the parallel loop");
    }
  }

 private:
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  std::exception_ptr error_;
};

// An image's columns for the GEMM: the image itself where the geometry is direct, else its
// im2col in col.
template <typename T>
const T* columns_of(const Geometry& g, const T* img, T* col) {
  if (g.direct) return img;
  im2col(g, img, col);
  return col;
}

int thread_count(const Geometry& g) { return g.n > 1 ? omp_get_max_threads() : 1; }

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
      const int threads = thread_count(g);
      const int64_t per = col_scratch(g);
      std::vector<T> scratch = thread_scratch<T>("conv2d", per, threads, g);
      ParallelErrors errors;
#pragma omp parallel num_threads(threads)
      {
        T* col = scratch.data() + per * omp_get_thread_num();
#pragma omp for schedule(static)
        for (int64_t n = 0; n < g.n; ++n)
          errors.run([&] {
            const T* cols = columns_of(g, xp + n * g.c * g.in_plane(), col);
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
          });
      }
      errors.rethrow("conv2d");
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
      const int threads = thread_count(g);
      const int64_t per = col_scratch(g);
      std::vector<T> scratch = thread_scratch<T>("conv2d_backward_data", per, threads, g);
      ParallelErrors errors;
#pragma omp parallel num_threads(threads)
      {
        T* col = scratch.data() + per * omp_get_thread_num();
#pragma omp for schedule(static)
        for (int64_t n = 0; n < g.n; ++n)
          errors.run([&] {
            const T* gout = dyp + n * g.o * g.out_plane();
            T* img = dxp + n * g.c * g.in_plane();
            // Direct: the column gradient is the image gradient.
            T* cols = g.direct ? img : col;
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
          });
      }
      errors.rethrow("conv2d_backward_data");
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
      // Each image's product into its thread's buffer, then added into dw in image order, one
      // round of images at a time: dw = ((p0 + p1) + p2) + ... whatever the thread count, so a
      // run gives the same bits on 1 thread or 64 (kiln-train --deterministic on the CPU).
      const int nthreads = thread_count(g);
      const int64_t per = col_scratch(g);
      std::vector<T> scratch = thread_scratch<T>("conv2d_backward_weight", per, nthreads, g);
      std::vector<T> partial = thread_scratch<T>("conv2d_backward_weight", wsize, nthreads, g);
      T* out = dwc.data<T>();
      std::fill(out, out + wsize, T(0));
      ParallelErrors errors;
#pragma omp parallel num_threads(nthreads)
      {
        // The team the runtime started: every thread runs every round (the barriers need it).
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        T* acc = partial.data() + wsize * t;
        T* col = scratch.data() + per * t;
        for (int64_t n0 = 0; n0 < g.n; n0 += team) {
          const int64_t n = n0 + t, in_round = std::min<int64_t>(team, g.n - n0);
          if (n < g.n)
            errors.run([&] {
              const T* cols = columns_of(g, xp + n * g.c * g.in_plane(), col);
              const T* gout = dyp + n * g.o * g.out_plane();
              for (int64_t gr = 0; gr < g.groups; ++gr) {
                MapCM<T> dym(gout + gr * g.og * g.out_plane(), g.og, g.out_plane());
                MapCM<T> cm(cols + gr * g.k * g.out_plane(), g.k, g.out_plane());
                MapM<T> am(acc + gr * g.og * g.k, g.og, g.k);
                am.noalias() = dym * cm.transpose();
              }
            });
#pragma omp barrier
#pragma omp for schedule(static)
          for (int64_t i = 0; i < wsize; ++i)
            for (int64_t j = 0; j < in_round; ++j)  // in image order
              out[i] += partial[size_t(j * wsize + i)];
          // (the loop's implicit barrier: the buffers are free for the next round)
        }
      }
      errors.rethrow("conv2d_backward_weight");
    });
  });
}

}  // namespace kiln::cpu
