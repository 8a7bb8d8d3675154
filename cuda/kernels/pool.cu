// 2-D max, average and adaptive-average pooling, forward and backward, for NCHW or NHWC
// strided tensors. Backward gathers: one thread per input element (or input vector) sums the
// windows that cover it, so dx is written once (`=`), with no atomics and a fixed summation order
// (deterministic). Threads walk the written tensor in its memory order (channels fastest for
// NHWC) so stores coalesce.
//
// Fast paths for dense NHWC tensors whose channel count is a multiple of the 16-byte vector
// (8 halves, 4 floats, 2 doubles): one thread per 16-byte channel vector, max pooling forward and
// backward and global (1x1) average pooling forward and backward. Coordinates are 32-bit there.
#include <cstdint>
#include <limits>

#include "cuda/kernels/common.cuh"
#include "cuda/kernels.h"

namespace kiln::cuda {
namespace {

struct PoolGeom {
  int64_t N, C, H, W, OH, OW;
  int64_t sx[4];  // strides of the (N, C, H, W) side
  int64_t sy[4];  // strides of the (N, C, OH, OW) side
  int64_t si[4];  // strides of max pooling's indices (N, C, OH, OW)
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

// Window-local position (i*kw + j) of the first maximal element of window (oh, ow) (NaN counts
// as maximal) and its value; `empty` (and -inf) if the window holds no input element.
template <typename T, typename I>
__device__ inline I window_argmax(const PoolGeom& g, const T* x, int64_t n, int64_t c, int64_t oh,
                                  int64_t ow, acc_t<T>* value) {
  using Cc = acc_t<T>;
  Cc best = -std::numeric_limits<Cc>::infinity();
  I arg = I(-1);
  bool first = true;
  const int64_t hs = oh * g.sh - g.ph, ws = ow * g.sw - g.pw;
  for (int i = 0; i < g.kh; ++i) {
    const int64_t h = hs + int64_t(i) * g.dh;
    if (h < 0 || h >= g.H) continue;
    for (int j = 0; j < g.kw; ++j) {
      const int64_t w = ws + int64_t(j) * g.dw;
      if (w < 0 || w >= g.W) continue;
      const Cc v = cvt<Cc>(x[at(g.sx, n, c, h, w)]);
      if (first || (isnan(v) && !isnan(best)) || v > best) {
        best = v;
        arg = I(i * g.kw + j);
      }
      first = false;
    }
  }
  *value = best;
  return arg;
}

template <typename T, typename I>
__global__ void max_pool_fwd(PoolGeom g, T* y, I* idx, const T* x, int64_t n_out) {
  pdl_start();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_out;
       i += int64_t(gridDim.x) * blockDim.x) {
    const Idx4 o = decompose(i, g.C, g.OH, g.OW, g.channels_fastest);
    acc_t<T> v;
    const I arg = window_argmax<T, I>(g, x, o.n, o.c, o.a, o.b, &v);
    y[at(g.sy, o.n, o.c, o.a, o.b)] = cvt<T>(v);
    idx[at(g.si, o.n, o.c, o.a, o.b)] = arg;
  }
}

template <typename T, typename I>
__global__ void max_pool_bwd(PoolGeom g, T* dx, const T* dy, const I* idx, int64_t n_in) {
  pdl_start();
  using Cc = acc_t<T>;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_in;
       i += int64_t(gridDim.x) * blockDim.x) {
    const Idx4 p = decompose(i, g.C, g.H, g.W, g.channels_fastest);
    Cc acc = 0;
    for (int ki = 0; ki < g.kh; ++ki) {
      const int64_t th = p.a + g.ph - int64_t(ki) * g.dh;
      if (th < 0 || th % g.sh != 0 || th / g.sh >= g.OH) continue;
      const int64_t oh = th / g.sh;
      for (int kj = 0; kj < g.kw; ++kj) {
        const int64_t tw = p.b + g.pw - int64_t(kj) * g.dw;
        if (tw < 0 || tw % g.sw != 0 || tw / g.sw >= g.OW) continue;
        const int64_t ow = tw / g.sw;
        if (idx[at(g.si, p.n, p.c, oh, ow)] == I(ki * g.kw + kj))
          acc += cvt<Cc>(dy[at(g.sy, p.n, p.c, oh, ow)]);
      }
    }
    dx[at(g.sx, p.n, p.c, p.a, p.b)] = cvt<T>(acc);
  }
}

// ---- dense NHWC, one thread per 16-byte channel vector ----
template <typename T>
struct alignas(16) Vec {
  static constexpr int n = int(16 / sizeof(T));
  T v[n];
};
// The indices matching one Vec<T>: 2..8 u8 or i32, loaded as one access where it fits 16 bytes.
template <typename I, int V>
struct alignas(sizeof(I) * V > 16 ? 16 : sizeof(I) * V) IVec {
  I v[V];
};

// a %= b, returning the remainder and leaving the quotient in a; 32-bit division when a fits.
__device__ inline int divmod(int64_t& a, int b) {
  if (a >= 0 && a <= int64_t(UINT32_MAX)) {
    const uint32_t ua = uint32_t(a), q = ua / uint32_t(b);
    a = q;
    return int(ua - q * uint32_t(b));
  }
  const int64_t q = a / b;
  const int r = int(a - q * b);
  a = q;
  return r;
}

struct NhwcGeom {
  int H, W, OH, OW, CV;  // CV: channel vectors per pixel
  int kh, kw, sh, sw, ph, pw, dh, dw;
};

template <typename T, typename I>
__global__ void max_pool_fwd_nhwc(NhwcGeom g, T* y, I* idx, const T* x, int64_t n_out) {
  pdl_start();
  constexpr int V = Vec<T>::n;
  using Cc = acc_t<T>;
  const int64_t C = int64_t(g.CV) * V;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_out;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t n = i;
    const int cv = divmod(n, g.CV);
    const int ow = divmod(n, g.OW);
    const int oh = divmod(n, g.OH);
    Cc best[V];
    IVec<I, V> arg;
#pragma unroll
    for (int l = 0; l < V; ++l) {
      best[l] = -std::numeric_limits<Cc>::infinity();
      arg.v[l] = I(-1);
    }
    bool first = true;
    const int hs = oh * g.sh - g.ph, ws = ow * g.sw - g.pw;
    for (int ki = 0; ki < g.kh; ++ki) {
      const int h = hs + ki * g.dh;
      if (h < 0 || h >= g.H) continue;
      for (int kj = 0; kj < g.kw; ++kj) {
        const int w = ws + kj * g.dw;
        if (w < 0 || w >= g.W) continue;
        const Vec<T> v =
            *reinterpret_cast<const Vec<T>*>(x + ((n * g.H + h) * g.W + w) * C + int64_t(cv) * V);
        const I k = I(ki * g.kw + kj);
#pragma unroll
        for (int l = 0; l < V; ++l) {
          const Cc f = cvt<Cc>(v.v[l]);
          if (first || (isnan(f) && !isnan(best[l])) || f > best[l]) {
            best[l] = f;
            arg.v[l] = k;
          }
        }
        first = false;
      }
    }
    Vec<T> out;
#pragma unroll
    for (int l = 0; l < V; ++l) out.v[l] = cvt<T>(best[l]);
    const int64_t o = i * V;  // the output is dense NHWC: vector i starts at element i*V
    *reinterpret_cast<Vec<T>*>(y + o) = out;
    *reinterpret_cast<IVec<I, V>*>(idx + o) = arg;
  }
}

template <typename T, typename I>
__global__ void max_pool_bwd_nhwc(NhwcGeom g, T* dx, const T* dy, const I* idx, int64_t n_in) {
  pdl_start();
  constexpr int V = Vec<T>::n;
  using Cc = acc_t<T>;
  const int64_t C = int64_t(g.CV) * V;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_in;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t n = i;
    const int cv = divmod(n, g.CV);
    const int w = divmod(n, g.W);
    const int h = divmod(n, g.H);
    Cc acc[V];
#pragma unroll
    for (int l = 0; l < V; ++l) acc[l] = 0;
    // Adds dy of output (oh, ow) where a lane's argmax is window position k.
    auto gather = [&](int oh, int ow, I k) {
      const int64_t o = ((n * g.OH + oh) * g.OW + ow) * C + int64_t(cv) * V;
      const IVec<I, V> iv = *reinterpret_cast<const IVec<I, V>*>(idx + o);
      bool any = false;
#pragma unroll
      for (int l = 0; l < V; ++l) any |= iv.v[l] == k;
      if (!any) return;  // dy is read only where some lane took this window's maximum
      const Vec<T> d = *reinterpret_cast<const Vec<T>*>(dy + o);
#pragma unroll
      for (int l = 0; l < V; ++l)
        if (iv.v[l] == k) acc[l] += cvt<Cc>(d.v[l]);
    };
    if (g.dh == 1 && g.dw == 1) {
      // Undilated: the windows covering row hp = h + ph are oh in [ceil((hp - kh + 1) / sh),
      // floor(hp / sh)], at kernel row hp - oh·sh; four divisions per thread instead of two per
      // kernel position (integer division dominated this kernel's time).
      const int hp = h + g.ph, wp = w + g.pw;
      const int oh_lo = hp < g.kh ? 0 : (hp - g.kh + g.sh) / g.sh;
      const int oh_hi = min(hp / g.sh, g.OH - 1);
      const int ow_lo = wp < g.kw ? 0 : (wp - g.kw + g.sw) / g.sw;
      const int ow_hi = min(wp / g.sw, g.OW - 1);
      for (int oh = oh_lo; oh <= oh_hi; ++oh)
        for (int ow = ow_lo; ow <= ow_hi; ++ow)
          gather(oh, ow, I((hp - oh * g.sh) * g.kw + (wp - ow * g.sw)));
    } else {
      for (int ki = 0; ki < g.kh; ++ki) {
        const int th = h + g.ph - ki * g.dh;
        if (th < 0 || th % g.sh != 0) continue;
        const int oh = th / g.sh;
        if (oh >= g.OH) continue;
        for (int kj = 0; kj < g.kw; ++kj) {
          const int tw = w + g.pw - kj * g.dw;
          if (tw < 0 || tw % g.sw != 0) continue;
          const int ow = tw / g.sw;
          if (ow >= g.OW) continue;
          gather(oh, ow, I(ki * g.kw + kj));
        }
      }
    }
    Vec<T> out;
#pragma unroll
    for (int l = 0; l < V; ++l) out.v[l] = cvt<T>(acc[l]);
    *reinterpret_cast<Vec<T>*>(dx + i * V) = out;
  }
}

// The same for 3x3 windows, stride 2, padding 1, undilated (ResNet's stem pool): one thread per
// 2x2 block of input pixels (rows 2a, 2a+1, columns 2b, 2b+1) and channel vector. Exactly the
// windows (a..a+1, b..b+1) cover the block (window a' spans rows 2a'-1..2a'+1), so their
// indices and dy are loaded once for all 4 pixels, not once per covering window per pixel.
// Each pixel adds in max_pool_bwd_nhwc's order (window row, then column): bit-identical to it.
template <typename T, typename I>
__global__ void max_pool_bwd_nhwc_k3s2(NhwcGeom g, T* dx, const T* dy, const I* idx,
                                       int64_t n_blocks) {
  pdl_start();
  constexpr int V = Vec<T>::n;
  using Cc = acc_t<T>;
  const int64_t C = int64_t(g.CV) * V;
  const int BH = (g.H + 1) / 2, BW = (g.W + 1) / 2;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_blocks;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t n = i;
    const int cv = divmod(n, g.CV);
    const int b = divmod(n, BW);
    const int a = divmod(n, BH);
    IVec<I, V> iv[4];
    Vec<T> d[4];
    bool ok[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int oh = a + (q >> 1), ow = b + (q & 1);
      ok[q] = oh < g.OH && ow < g.OW;
      if (ok[q]) {
        const int64_t o = ((n * g.OH + oh) * g.OW + ow) * C + int64_t(cv) * V;
        iv[q] = *reinterpret_cast<const IVec<I, V>*>(idx + o);
        d[q] = *reinterpret_cast<const Vec<T>*>(dy + o);
      }
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int dh = p >> 1, dw = p & 1, h = 2 * a + dh, w = 2 * b + dw;
      if (h >= g.H || w >= g.W) continue;
      Cc acc[V];
#pragma unroll
      for (int l = 0; l < V; ++l) acc[l] = 0;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int qh = q >> 1, qw = q & 1;
        // window a+1 (b+1) starts at row 2a+1 (column 2b+1): it does not cover dh = 0 (dw = 0)
        if (!ok[q] || (qh && !dh) || (qw && !dw)) continue;
        const I k = I((qh ? 0 : dh + 1) * 3 + (qw ? 0 : dw + 1));
#pragma unroll
        for (int l = 0; l < V; ++l)
          if (iv[q].v[l] == k) acc[l] += cvt<Cc>(d[q].v[l]);
      }
      Vec<T> out;
#pragma unroll
      for (int l = 0; l < V; ++l) out.v[l] = cvt<T>(acc[l]);
      *reinterpret_cast<Vec<T>*>(dx + ((n * g.H + h) * g.W + w) * C + int64_t(cv) * V) = out;
    }
  }
}

// Global average pooling, x (N, HW, C) -> y (N, C): one thread per (n, channel vector).
template <typename T>
__global__ void global_avg_fwd_nhwc(int HW, int CV, T* y, const T* x, int64_t n_out) {
  pdl_start();
  constexpr int V = Vec<T>::n;
  using Cc = acc_t<T>;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_out;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t n = i;
    const int cv = divmod(n, CV);
    const T* p = x + n * HW * CV * V + int64_t(cv) * V;
    Cc acc[V];
#pragma unroll
    for (int l = 0; l < V; ++l) acc[l] = 0;
#pragma unroll 4
    for (int s = 0; s < HW; ++s) {
      const Vec<T> v = *reinterpret_cast<const Vec<T>*>(p + int64_t(s) * CV * V);
#pragma unroll
      for (int l = 0; l < V; ++l) acc[l] += cvt<Cc>(v.v[l]);
    }
    Vec<T> out;
#pragma unroll
    for (int l = 0; l < V; ++l) out.v[l] = cvt<T>(acc[l] / Cc(HW));
    *reinterpret_cast<Vec<T>*>(y + i * V) = out;
  }
}

// dx (N, HW, C) = dy (N, C) / HW: one thread per dx channel vector.
template <typename T>
__global__ void global_avg_bwd_nhwc(int HW, int CV, T* dx, const T* dy, int64_t n_in) {
  pdl_start();
  constexpr int V = Vec<T>::n;
  using Cc = acc_t<T>;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_in;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t n = i;
    const int cv = divmod(n, CV);
    divmod(n, HW);
    const Vec<T> d = *reinterpret_cast<const Vec<T>*>(dy + (n * CV + cv) * V);
    Vec<T> out;
#pragma unroll
    for (int l = 0; l < V; ++l) out.v[l] = cvt<T>(cvt<Cc>(d.v[l]) / Cc(HW));
    *reinterpret_cast<Vec<T>*>(dx + i * V) = out;
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
  pdl_start();
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
  pdl_start();
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
  pdl_start();
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
  pdl_start();
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
                        const PoolParams* p, const Tensor* indices = nullptr) {
  PoolGeom g{};
  g.N = xs.size(0);
  g.C = xs.size(1);
  g.H = xs.size(2);
  g.W = xs.size(3);
  g.OH = ys.size(2);
  g.OW = ys.size(3);
  for (int d = 0; d < 4; ++d) {
    g.sx[d] = xs.stride(d);
    g.sy[d] = ys.stride(d);
    g.si[d] = indices ? indices->stride(d) : 0;
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

// Calls f.template operator()<I>() with I the element type of max pooling's indices.
template <typename F>
void dispatch_index(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::u8: f.template operator()<uint8_t>(); break;
    case DType::i32: f.template operator()<int32_t>(); break;
    default: KILN_FAIL(op, " (cuda): indices must be u8 or i32, got ", dtype_name(t));
  }
}

bool aligned(const Tensor& t, size_t bytes) {
  return reinterpret_cast<uintptr_t>(t.raw_data()) % bytes == 0;
}
constexpr int64_t kIntMax = std::numeric_limits<int>::max();

// Dense NHWC, whole 16-byte channel vectors, 32-bit spatial coordinates.
template <typename T>
bool nhwc_vectorisable(const Tensor& t) {
  return t.is_contiguous(MemoryFormat::ChannelsLast) && t.size(1) % Vec<T>::n == 0 &&
         aligned(t, 16) && t.size(2) * t.size(3) <= kIntMax && t.size(1) <= kIntMax;
}
template <typename T, typename I>
bool indices_vectorisable(const Tensor& t) {
  return t.is_contiguous(MemoryFormat::ChannelsLast) && t.size(1) % Vec<T>::n == 0 &&
         aligned(t, alignof(IVec<I, Vec<T>::n>));
}

NhwcGeom make_nhwc_geom(const Tensor& xs, const Tensor& ys, int vec, const PoolParams& p) {
  NhwcGeom g{};
  g.H = int(xs.size(2));
  g.W = int(xs.size(3));
  g.OH = int(ys.size(2));
  g.OW = int(ys.size(3));
  g.CV = int(xs.size(1) / vec);
  g.kh = int(p.kernel_h); g.kw = int(p.kernel_w);
  g.sh = int(p.stride_h); g.sw = int(p.stride_w);
  g.ph = int(p.pad_h); g.pw = int(p.pad_w);
  g.dh = int(p.dil_h); g.dw = int(p.dil_w);
  return g;
}

// y (N, C, 1, 1) addressed as n*C + c: contiguous or channels-last.
bool flat_nc(const Tensor& y) {
  return y.is_contiguous() || y.is_contiguous(MemoryFormat::ChannelsLast);
}

}  // namespace

void max_pool2d_forward(const Tensor& y, const Tensor& indices, const Tensor& x,
                        const PoolParams& p) {
  if (y.numel() == 0) return;
  dispatch_device_float(y.dtype(), "max_pool2d", [&]<typename T>() {
    dispatch_index(indices.dtype(), "max_pool2d", [&]<typename I>() {
      cudaStream_t s = current_stream();
      if (nhwc_vectorisable<T>(x) && nhwc_vectorisable<T>(y) &&
          indices_vectorisable<T, I>(indices)) {
        const int64_t n = y.numel() / Vec<T>::n;
        launch(max_pool_fwd_nhwc<T, I>, grid_for(n), kBlock, 0, s,
               make_nhwc_geom(x, y, Vec<T>::n, p), ptr<T>(y), ptr<I>(indices), ptr<T>(x), n);
      } else {
        const int64_t n = y.numel();
        launch(max_pool_fwd<T, I>, grid_for(n), kBlock, 0, s, make_pool_geom(x, y, y, &p, &indices),
               ptr<T>(y), ptr<I>(indices), ptr<T>(x), n);
      }
      KILN_CUDA_CHECK_LAUNCH();
    });
  });
}

void max_pool2d_backward(const Tensor& dx, const Tensor& dy, const Tensor& indices,
                         const PoolParams& p) {
  if (dx.numel() == 0) return;
  dispatch_device_float(dx.dtype(), "max_pool2d backward", [&]<typename T>() {
    dispatch_index(indices.dtype(), "max_pool2d backward", [&]<typename I>() {
      cudaStream_t s = current_stream();
      if (nhwc_vectorisable<T>(dx) && nhwc_vectorisable<T>(dy) &&
          indices_vectorisable<T, I>(indices)) {
        const NhwcGeom g = make_nhwc_geom(dx, dy, Vec<T>::n, p);
        const bool k3s2 = p.kernel_h == 3 && p.kernel_w == 3 && p.stride_h == 2 &&
                          p.stride_w == 2 && p.pad_h == 1 && p.pad_w == 1 && p.dil_h == 1 &&
                          p.dil_w == 1;
        if (k3s2) {
          const int64_t n = dx.size(0) * ((g.H + 1) / 2) * ((g.W + 1) / 2) * g.CV;
          launch(max_pool_bwd_nhwc_k3s2<T, I>, grid_for(n), kBlock, 0, s, g, ptr<T>(dx), ptr<T>(dy),
                 ptr<I>(indices), n);
        } else {
          const int64_t n = dx.numel() / Vec<T>::n;
          launch(max_pool_bwd_nhwc<T, I>, grid_for(n), kBlock, 0, s, g, ptr<T>(dx), ptr<T>(dy),
                 ptr<I>(indices), n);
        }
      } else {
        const int64_t n = dx.numel();
        launch(max_pool_bwd<T, I>, grid_for(n), kBlock, 0, s,
               make_pool_geom(dx, dy, dx, &p, &indices), ptr<T>(dx), ptr<T>(dy), ptr<I>(indices),
               n);
      }
      KILN_CUDA_CHECK_LAUNCH();
    });
  });
}

void avg_pool2d_forward(const Tensor& y, const Tensor& x, const PoolParams& p) {
  PoolGeom g = make_pool_geom(x, y, y, &p);
  run("avg_pool2d", y, [&]<typename T>(unsigned grid, int64_t n, cudaStream_t s) {
    launch(avg_pool_fwd<T>, grid, kBlock, 0, s, g, ptr<T>(y), ptr<T>(x), n);
  });
}

void avg_pool2d_backward(const Tensor& dx, const Tensor& dy, const PoolParams& p) {
  PoolGeom g = make_pool_geom(dx, dy, dx, &p);
  run("avg_pool2d backward", dx, [&]<typename T>(unsigned grid, int64_t n, cudaStream_t s) {
    launch(avg_pool_bwd<T>, grid, kBlock, 0, s, g, ptr<T>(dx), ptr<T>(dy), n);
  });
}

void adaptive_avg_pool2d_forward(const Tensor& y, const Tensor& x) {
  if (y.numel() == 0) return;
  if (y.size(2) == 1 && y.size(3) == 1) {
    const bool done = dispatch_device_float(y.dtype(), "adaptive_avg_pool2d", [&]<typename T>() {
      if (!nhwc_vectorisable<T>(x) || !flat_nc(y) || !aligned(y, 16)) return false;
      const int64_t n = y.numel() / Vec<T>::n;
      launch(global_avg_fwd_nhwc<T>, grid_for(n), kBlock, 0, current_stream(),
             int(x.size(2) * x.size(3)), int(x.size(1) / Vec<T>::n), ptr<T>(y), ptr<T>(x), n);
      KILN_CUDA_CHECK_LAUNCH();
      return true;
    });
    if (done) return;
  }
  PoolGeom g = make_pool_geom(x, y, y, nullptr);
  run("adaptive_avg_pool2d", y, [&]<typename T>(unsigned grid, int64_t n, cudaStream_t s) {
    launch(adaptive_avg_fwd<T>, grid, kBlock, 0, s, g, ptr<T>(y), ptr<T>(x), n);
  });
}

void adaptive_avg_pool2d_backward(const Tensor& dx, const Tensor& dy) {
  if (dx.numel() == 0) return;
  if (dy.size(2) == 1 && dy.size(3) == 1) {
    const bool done =
        dispatch_device_float(dx.dtype(), "adaptive_avg_pool2d backward", [&]<typename T>() {
          if (!nhwc_vectorisable<T>(dx) || !flat_nc(dy) || !aligned(dy, 16)) return false;
          const int64_t n = dx.numel() / Vec<T>::n;
          launch(global_avg_bwd_nhwc<T>, grid_for(n), kBlock, 0, current_stream(),
                 int(dx.size(2) * dx.size(3)), int(dx.size(1) / Vec<T>::n), ptr<T>(dx), ptr<T>(dy),
                 n);
          KILN_CUDA_CHECK_LAUNCH();
          return true;
        });
    if (done) return;
  }
  PoolGeom g = make_pool_geom(dx, dy, dx, nullptr);
  run("adaptive_avg_pool2d backward", dx,
      [&]<typename T>(unsigned grid, int64_t n, cudaStream_t s) {
        launch(adaptive_avg_bwd<T>, grid, kBlock, 0, s, g, ptr<T>(dx), ptr<T>(dy), n);
      });
}

}  // namespace kiln::cuda
