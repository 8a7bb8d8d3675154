// 2-D max, average and adaptive-average pooling, forward and backward, for NCHW or NHWC
// strided tensors. One thread per output element forward; backward gathers: one thread per
// input element sums the windows that cover it, so dx is written once (`=`), with no atomics
// and a fixed summation order (deterministic). Threads walk the written tensor in its memory
// order (channels fastest for NHWC) so stores coalesce.
#include <limits>

#include "cuda/kernels/common.cuh"
#include "cuda/ops.h"

namespace kiln::cuda {
namespace {

struct PoolGeom {
  int64_t N, C, H, W, OH, OW;
  int64_t sx[4];  // strides of the (N, C, H, W) side
  int64_t sy[4];  // strides of the (N, C, OH, OW) side
  int64_t sxr[4];  // strides of x where max pooling's backward re-reads it
  int kh, kw, sh, sw, ph, pw, dh, dw;
  bool include_pad;
  bool channels_fastest;  // the tensor a thread writes is NHWC
};

struct Idx4 {
  int64_t n, c, a, b;
};

// Logical (n, c, a, b) of linear index i over (N, C, A, B), in the written tensor's memory order.
__device__ inline Idx4 decompose(int64_t i, int64_t C, int64_t A, int64_t B, bool c_fastest) {
  Idx4 r;
  if (c_fastest) {
    r.c = i % C; i /= C;
    r.b = i % B; i /= B;
    r.a = i % A; r.n = i / A;
  } else {
    r.b = i % B; i /= B;
    r.a = i % A; i /= A;
    r.c = i % C; r.n = i / C;
  }
  return r;
}

__device__ inline int64_t at(const int64_t* s, int64_t n, int64_t c, int64_t a, int64_t b) {
  return n * s[0] + c * s[1] + a * s[2] + b * s[3];
}

// The first maximal element of window (oh, ow) (NaN counts as maximal), as h*W + w; -1 if the
// window holds no input element.
template <typename T>
__device__ inline int64_t window_argmax(const PoolGeom& g, const T* x, int64_t n, int64_t c,
                                        int64_t oh, int64_t ow, acc_t<T>* value) {
  using Cc = acc_t<T>;
  Cc best = -std::numeric_limits<Cc>::infinity();
  int64_t arg = -1;
  const int64_t hs = oh * g.sh - g.ph, ws = ow * g.sw - g.pw;
  for (int i = 0; i < g.kh; ++i) {
    const int64_t h = hs + int64_t(i) * g.dh;
    if (h < 0 || h >= g.H) continue;
    for (int j = 0; j < g.kw; ++j) {
      const int64_t w = ws + int64_t(j) * g.dw;
      if (w < 0 || w >= g.W) continue;
      const Cc v = cvt<Cc>(x[at(g.sxr, n, c, h, w)]);
      if (arg < 0 || (isnan(v) && !isnan(best)) || v > best) {
        best = v;
        arg = h * g.W + w;
      }
    }
  }
  *value = best;
  return arg;
}

template <typename T>
__global__ void max_pool_fwd(PoolGeom g, T* y, const T* x, int64_t n_out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_out;
       i += int64_t(gridDim.x) * blockDim.x) {
    const Idx4 o = decompose(i, g.C, g.OH, g.OW, g.channels_fastest);
    acc_t<T> v;
    window_argmax(g, x, o.n, o.c, o.a, o.b, &v);
    y[at(g.sy, o.n, o.c, o.a, o.b)] = cvt<T>(v);
  }
}

template <typename T>
__global__ void max_pool_bwd(PoolGeom g, T* dx, const T* dy, const T* x, int64_t n_in) {
  using Cc = acc_t<T>;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_in;
       i += int64_t(gridDim.x) * blockDim.x) {
    const Idx4 p = decompose(i, g.C, g.H, g.W, g.channels_fastest);
    const int64_t self = p.a * g.W + p.b;
    Cc acc = 0;
    for (int ki = 0; ki < g.kh; ++ki) {
      const int64_t th = p.a + g.ph - int64_t(ki) * g.dh;
      if (th < 0 || th % g.sh != 0 || th / g.sh >= g.OH) continue;
      const int64_t oh = th / g.sh;
      for (int kj = 0; kj < g.kw; ++kj) {
        const int64_t tw = p.b + g.pw - int64_t(kj) * g.dw;
        if (tw < 0 || tw % g.sw != 0 || tw / g.sw >= g.OW) continue;
        const int64_t ow = tw / g.sw;
        Cc unused;
        if (window_argmax(g, x, p.n, p.c, oh, ow, &unused) == self)
          acc += cvt<Cc>(dy[at(g.sy, p.n, p.c, oh, ow)]);
      }
    }
    dx[at(g.sx, p.n, p.c, p.a, p.b)] = cvt<T>(acc);
  }
}

// PyTorch's divisor: the window clipped to the padded input, or to the input itself.
__device__ inline int64_t avg_divisor(const PoolGeom& g, int64_t oh, int64_t ow) {
  int64_t hs = oh * g.sh - g.ph, ws = ow * g.sw - g.pw;
  int64_t he = min(hs + g.kh, g.H + g.ph), we = min(ws + g.kw, g.W + g.pw);
  if (g.include_pad) return (he - hs) * (we - ws);
  hs = max(hs, int64_t(0));
  ws = max(ws, int64_t(0));
  he = min(he, g.H);
  we = min(we, g.W);
  return (he - hs) * (we - ws);
}

template <typename T>
__global__ void avg_pool_fwd(PoolGeom g, T* y, const T* x, int64_t n_out) {
  using Cc = acc_t<T>;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_out;
       i += int64_t(gridDim.x) * blockDim.x) {
    const Idx4 o = decompose(i, g.C, g.OH, g.OW, g.channels_fastest);
    const int64_t hs = o.a * g.sh - g.ph, ws = o.b * g.sw - g.pw;
    const int64_t h0 = max(hs, int64_t(0)), w0 = max(ws, int64_t(0));
    const int64_t h1 = min(hs + g.kh, g.H), w1 = min(ws + g.kw, g.W);
    Cc acc = 0;
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t w = w0; w < w1; ++w) acc += cvt<Cc>(x[at(g.sx, o.n, o.c, h, w)]);
    y[at(g.sy, o.n, o.c, o.a, o.b)] = cvt<T>(acc / Cc(avg_divisor(g, o.a, o.b)));
  }
}

template <typename T>
__global__ void avg_pool_bwd(PoolGeom g, T* dx, const T* dy, int64_t n_in) {
  using Cc = acc_t<T>;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_in;
       i += int64_t(gridDim.x) * blockDim.x) {
    const Idx4 p = decompose(i, g.C, g.H, g.W, g.channels_fastest);
    Cc acc = 0;
    for (int ki = 0; ki < g.kh; ++ki) {
      const int64_t th = p.a + g.ph - ki;
      if (th < 0 || th % g.sh != 0 || th / g.sh >= g.OH) continue;
      const int64_t oh = th / g.sh;
      for (int kj = 0; kj < g.kw; ++kj) {
        const int64_t tw = p.b + g.pw - kj;
        if (tw < 0 || tw % g.sw != 0 || tw / g.sw >= g.OW) continue;
        const int64_t ow = tw / g.sw;
        acc += cvt<Cc>(dy[at(g.sy, p.n, p.c, oh, ow)]) / Cc(avg_divisor(g, oh, ow));
      }
    }
    dx[at(g.sx, p.n, p.c, p.a, p.b)] = cvt<T>(acc);
  }
}

// Adaptive windows: [floor(i*in/out), ceil((i+1)*in/out)).
__device__ inline int64_t ad_start(int64_t i, int64_t in, int64_t out) { return i * in / out; }
__device__ inline int64_t ad_end(int64_t i, int64_t in, int64_t out) {
  return ((i + 1) * in + out - 1) / out;
}

template <typename T>
__global__ void adaptive_avg_fwd(PoolGeom g, T* y, const T* x, int64_t n_out) {
  using Cc = acc_t<T>;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_out;
       i += int64_t(gridDim.x) * blockDim.x) {
    const Idx4 o = decompose(i, g.C, g.OH, g.OW, g.channels_fastest);
    const int64_t h0 = ad_start(o.a, g.H, g.OH), h1 = ad_end(o.a, g.H, g.OH);
    const int64_t w0 = ad_start(o.b, g.W, g.OW), w1 = ad_end(o.b, g.W, g.OW);
    Cc acc = 0;
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t w = w0; w < w1; ++w) acc += cvt<Cc>(x[at(g.sx, o.n, o.c, h, w)]);
    y[at(g.sy, o.n, o.c, o.a, o.b)] = cvt<T>(acc / Cc((h1 - h0) * (w1 - w0)));
  }
}

template <typename T>
__global__ void adaptive_avg_bwd(PoolGeom g, T* dx, const T* dy, int64_t n_in) {
  using Cc = acc_t<T>;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_in;
       i += int64_t(gridDim.x) * blockDim.x) {
    const Idx4 p = decompose(i, g.C, g.H, g.W, g.channels_fastest);
    // Windows covering h: oh in [floor(h*OH/H), ceil((h+1)*OH/H)); checked exactly below.
    const int64_t oh0 = p.a * g.OH / g.H, oh1 = min(g.OH, ((p.a + 1) * g.OH + g.H - 1) / g.H);
    const int64_t ow0 = p.b * g.OW / g.W, ow1 = min(g.OW, ((p.b + 1) * g.OW + g.W - 1) / g.W);
    Cc acc = 0;
    for (int64_t oh = oh0; oh < oh1; ++oh) {
      const int64_t h0 = ad_start(oh, g.H, g.OH), h1 = ad_end(oh, g.H, g.OH);
      if (p.a < h0 || p.a >= h1) continue;
      for (int64_t ow = ow0; ow < ow1; ++ow) {
        const int64_t w0 = ad_start(ow, g.W, g.OW), w1 = ad_end(ow, g.W, g.OW);
        if (p.b < w0 || p.b >= w1) continue;
        acc += cvt<Cc>(dy[at(g.sy, p.n, p.c, oh, ow)]) / Cc((h1 - h0) * (w1 - w0));
      }
    }
    dx[at(g.sx, p.n, p.c, p.a, p.b)] = cvt<T>(acc);
  }
}

// `xs` is the (N, C, H, W) tensor, `ys` the (N, C, OH, OW) one; `written` decides thread order.
PoolGeom make_pool_geom(const Tensor& xs, const Tensor& ys, const Tensor& written,
                        const PoolParams* p) {
  PoolGeom g{};
  g.N = xs.size(0);
  g.C = xs.size(1);
  g.H = xs.size(2);
  g.W = xs.size(3);
  g.OH = ys.size(2);
  g.OW = ys.size(3);
  for (int d = 0; d < 4; ++d) {
    g.sx[d] = xs.stride(d);
    g.sxr[d] = xs.stride(d);
    g.sy[d] = ys.stride(d);
  }
  if (p) {
    g.kh = int(p->kernel_h); g.kw = int(p->kernel_w);
    g.sh = int(p->stride_h); g.sw = int(p->stride_w);
    g.ph = int(p->pad_h); g.pw = int(p->pad_w);
    g.dh = int(p->dil_h); g.dw = int(p->dil_w);
    g.include_pad = p->count_include_pad;
  }
  g.channels_fastest = written.stride(1) == 1 && written.size(1) > 1;
  return g;
}

template <typename Launch>
void run(const char* op, const Tensor& written, Launch&& launch) {
  const int64_t n = written.numel();
  if (n == 0) return;
  dispatch_device_float(written.dtype(), op, [&]<typename T>() {
    launch.template operator()<T>(grid_for(n), n, current_stream());
    KILN_CUDA_CHECK_LAUNCH();
  });
}

template <typename T>
T* ptr(const Tensor& t) { return static_cast<T*>(t.raw_data()); }

}  // namespace

void max_pool2d_forward(const Tensor& y, const Tensor& x, const PoolParams& p) {
  PoolGeom g = make_pool_geom(x, y, y, &p);
  run("max_pool2d", y, [&]<typename T>(unsigned grid, int64_t n, cudaStream_t s) {
    max_pool_fwd<T><<<grid, kBlock, 0, s>>>(g, ptr<T>(y), ptr<T>(x), n);
  });
}

void max_pool2d_backward(const Tensor& dx, const Tensor& dy, const Tensor& x,
                         const PoolParams& p) {
  PoolGeom g = make_pool_geom(dx, dy, dx, &p);
  for (int d = 0; d < 4; ++d) g.sxr[d] = x.stride(d);  // x may be laid out unlike dx
  run("max_pool2d backward", dx, [&]<typename T>(unsigned grid, int64_t n, cudaStream_t s) {
    max_pool_bwd<T><<<grid, kBlock, 0, s>>>(g, ptr<T>(dx), ptr<T>(dy), ptr<T>(x), n);
  });
}

void avg_pool2d_forward(const Tensor& y, const Tensor& x, const PoolParams& p) {
  PoolGeom g = make_pool_geom(x, y, y, &p);
  run("avg_pool2d", y, [&]<typename T>(unsigned grid, int64_t n, cudaStream_t s) {
    avg_pool_fwd<T><<<grid, kBlock, 0, s>>>(g, ptr<T>(y), ptr<T>(x), n);
  });
}

void avg_pool2d_backward(const Tensor& dx, const Tensor& dy, const PoolParams& p) {
  PoolGeom g = make_pool_geom(dx, dy, dx, &p);
  run("avg_pool2d backward", dx, [&]<typename T>(unsigned grid, int64_t n, cudaStream_t s) {
    avg_pool_bwd<T><<<grid, kBlock, 0, s>>>(g, ptr<T>(dx), ptr<T>(dy), n);
  });
}

void adaptive_avg_pool2d_forward(const Tensor& y, const Tensor& x) {
  PoolGeom g = make_pool_geom(x, y, y, nullptr);
  run("adaptive_avg_pool2d", y, [&]<typename T>(unsigned grid, int64_t n, cudaStream_t s) {
    adaptive_avg_fwd<T><<<grid, kBlock, 0, s>>>(g, ptr<T>(y), ptr<T>(x), n);
  });
}

void adaptive_avg_pool2d_backward(const Tensor& dx, const Tensor& dy) {
  PoolGeom g = make_pool_geom(dx, dy, dx, nullptr);
  run("adaptive_avg_pool2d backward", dx,
      [&]<typename T>(unsigned grid, int64_t n, cudaStream_t s) {
        adaptive_avg_bwd<T><<<grid, kBlock, 0, s>>>(g, ptr<T>(dx), ptr<T>(dy), n);
      });
}

}  // namespace kiln::cuda
