// CUDA pooling, softmax and fused cross-entropy kernels against naive f64 reference loops in
// this file, run on the very values the device holds. NCHW and NHWC; f32, f16, f64; channel
// counts that take the vectorised NHWC paths (multiples of 8) and those that do not. Outputs and
// input gradients are pre-filled with NaN, so an unwritten element fails; max pooling's saved
// indices are compared exactly (first maximum of the window on ties).
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "cuda/kernels.h"
#include "tests/gpu/gpu_test_util.h"

using namespace kiln;
using namespace kiln::gputest;

namespace {

const DType kDTypes[] = {DType::f32, DType::f16, DType::f64};
const MemoryFormat kFormats[] = {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast};

struct Dims {
  int64_t N, C, H, W, OH, OW;
  int64_t x(int64_t n, int64_t c, int64_t h, int64_t w) const { return ((n * C + c) * H + h) * W + w; }
  int64_t y(int64_t n, int64_t c, int64_t h, int64_t w) const { return ((n * C + c) * OH + h) * OW + w; }
};

int64_t out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) {
  return (in + 2 * p - d * (k - 1) - 1) / s + 1;
}

// Max pooling forward and backward: the first maximal element per window takes the gradient.
// idx: window-local position i*kw + j of that element, -1 for a window with no input element.
void max_pool_ref(const std::vector<double>& x, const std::vector<double>& dy, const Dims& D,
                  const PoolParams& p, std::vector<double>& y, std::vector<double>& dx,
                  std::vector<double>& idx) {
  y.assign(size_t(D.N * D.C * D.OH * D.OW), 0);
  idx.assign(y.size(), -1);
  dx.assign(x.size(), 0);
  for (int64_t n = 0; n < D.N; ++n)
    for (int64_t c = 0; c < D.C; ++c)
      for (int64_t oh = 0; oh < D.OH; ++oh)
        for (int64_t ow = 0; ow < D.OW; ++ow) {
          double best = -std::numeric_limits<double>::infinity();
          int64_t arg = -1, local = -1;
          for (int64_t i = 0; i < p.kernel_h; ++i)
            for (int64_t j = 0; j < p.kernel_w; ++j) {
              int64_t h = oh * p.stride_h - p.pad_h + i * p.dil_h;
              int64_t w = ow * p.stride_w - p.pad_w + j * p.dil_w;
              if (h < 0 || h >= D.H || w < 0 || w >= D.W) continue;
              if (arg < 0 || x[size_t(D.x(n, c, h, w))] > best) {
                best = x[size_t(D.x(n, c, h, w))];
                arg = D.x(n, c, h, w);
                local = i * p.kernel_w + j;
              }
            }
          y[size_t(D.y(n, c, oh, ow))] = best;
          idx[size_t(D.y(n, c, oh, ow))] = double(local);
          if (arg >= 0) dx[size_t(arg)] += dy[size_t(D.y(n, c, oh, ow))];
        }
}

// The saved indices as the reference writes them (u8 stores -1 as 255).
std::vector<double> indices_as_ref(const Tensor& idx) {
  std::vector<double> v = idx.to_vector<double>();
  if (idx.dtype() == DType::u8)
    for (double& e : v)
      if (e == 255) e = -1;
  return v;
}

void avg_pool_ref(const std::vector<double>& x, const std::vector<double>& dy, const Dims& D,
                  const PoolParams& p, std::vector<double>& y, std::vector<double>& dx) {
  y.assign(size_t(D.N * D.C * D.OH * D.OW), 0);
  dx.assign(x.size(), 0);
  for (int64_t n = 0; n < D.N; ++n)
    for (int64_t c = 0; c < D.C; ++c)
      for (int64_t oh = 0; oh < D.OH; ++oh)
        for (int64_t ow = 0; ow < D.OW; ++ow) {
          const int64_t hs = oh * p.stride_h - p.pad_h, ws = ow * p.stride_w - p.pad_w;
          // PyTorch: the divisor counts padding (clipped to the padded input) or not.
          const int64_t he = std::min(hs + p.kernel_h, D.H + p.pad_h);
          const int64_t we = std::min(ws + p.kernel_w, D.W + p.pad_w);
          int64_t valid = 0;
          double sum = 0;
          for (int64_t h = hs; h < he; ++h)
            for (int64_t w = ws; w < we; ++w)
              if (h >= 0 && h < D.H && w >= 0 && w < D.W) {
                sum += x[size_t(D.x(n, c, h, w))];
                ++valid;
              }
          const double div = p.count_include_pad ? double((he - hs) * (we - ws)) : double(valid);
          y[size_t(D.y(n, c, oh, ow))] = sum / div;
          for (int64_t h = std::max<int64_t>(hs, 0); h < std::min(he, D.H); ++h)
            for (int64_t w = std::max<int64_t>(ws, 0); w < std::min(we, D.W); ++w)
              dx[size_t(D.x(n, c, h, w))] += dy[size_t(D.y(n, c, oh, ow))] / div;
        }
}

void adaptive_ref(const std::vector<double>& x, const std::vector<double>& dy, const Dims& D,
                  std::vector<double>& y, std::vector<double>& dx) {
  y.assign(size_t(D.N * D.C * D.OH * D.OW), 0);
  dx.assign(x.size(), 0);
  for (int64_t n = 0; n < D.N; ++n)
    for (int64_t c = 0; c < D.C; ++c)
      for (int64_t oh = 0; oh < D.OH; ++oh)
        for (int64_t ow = 0; ow < D.OW; ++ow) {
          const int64_t h0 = oh * D.H / D.OH, h1 = ((oh + 1) * D.H + D.OH - 1) / D.OH;
          const int64_t w0 = ow * D.W / D.OW, w1 = ((ow + 1) * D.W + D.OW - 1) / D.OW;
          const double cnt = double((h1 - h0) * (w1 - w0));
          double sum = 0;
          for (int64_t h = h0; h < h1; ++h)
            for (int64_t w = w0; w < w1; ++w) {
              sum += x[size_t(D.x(n, c, h, w))];
              dx[size_t(D.x(n, c, h, w))] += dy[size_t(D.y(n, c, oh, ow))] / cnt;
            }
          y[size_t(D.y(n, c, oh, ow))] = sum / cnt;
        }
}

enum class Pool { Max, Avg, Adaptive };

// x_values: generator of x (uniform by default); quantised values make ties common.
void check_pool(Pool kind, DType t, MemoryFormat fmt, Shape in, const PoolParams& p, int64_t oh,
                int64_t ow, const std::string& what, bool ties = false) {
  CAPTURE(what);
  Dims D{in[0], in[1], in[2], in[3], oh, ow};
  std::vector<double> xs = uniform_values(shape_numel(in), -2, 2, 31);
  if (ties)
    for (double& v : xs) v = std::floor(v);  // {-2, -1, 0, 1}
  Tensor x = gpu_tensor(xs, in, t, fmt);
  Tensor dy = gpu_tensor(uniform_values(D.N * D.C * oh * ow, -1, 1, 32),
                         {D.N, D.C, oh, ow}, t, fmt);
  Tensor y = nan_output({D.N, D.C, oh, ow}, t, fmt);
  Tensor dx = nan_output(in, t, fmt);
  std::vector<double> xv = x.to_vector<double>(), dyv = dy.to_vector<double>(), wy, wdx, widx;
  switch (kind) {
    case Pool::Max: {
      Tensor idx = empty({D.N, D.C, oh, ow}, gpu_opts(max_pool2d_indices_dtype(p), fmt));
      idx.fill_(idx.dtype() == DType::u8 ? 254.0 : 1e6);  // a position no test window has
      cuda::max_pool2d_forward(y, idx, x, p);
      cuda::max_pool2d_backward(dx, dy, idx, p);
      max_pool_ref(xv, dyv, D, p, wy, wdx, widx);
      CHECK(indices_as_ref(idx) == widx);
      break;
    }
    case Pool::Avg:
      cuda::avg_pool2d_forward(y, x, p);
      cuda::avg_pool2d_backward(dx, dy, p);
      avg_pool_ref(xv, dyv, D, p, wy, wdx);
      break;
    case Pool::Adaptive:
      cuda::adaptive_avg_pool2d_forward(y, x);
      cuda::adaptive_avg_pool2d_backward(dx, dy);
      adaptive_ref(xv, dyv, D, wy, wdx);
      break;
  }
  check_close(y.to_vector<double>(), wy, tol_for(t), what + " forward");
  check_close(dx.to_vector<double>(), wdx, tol_for(t), what + " backward");
}

PoolParams pool(int64_t k, int64_t s, int64_t pad, int64_t dil = 1, bool incl = true) {
  PoolParams p;
  p.kernel_h = p.kernel_w = k;
  p.stride_h = p.stride_w = s;
  p.pad_h = p.pad_w = pad;
  p.dil_h = p.dil_w = dil;
  p.count_include_pad = incl;
  return p;
}

}  // namespace

TEST_CASE("max_pool2d forward/backward vs reference, NCHW and NHWC") {
  for (DType t : kDTypes)
    for (MemoryFormat f : kFormats) {
      const std::string tag = std::string(dtype_name(t)) +
                              (f == MemoryFormat::ChannelsLast ? " nhwc" : " nchw");
      check_pool(Pool::Max, t, f, {2, 3, 9, 9}, pool(3, 2, 1), out_size(9, 3, 2, 1, 1),
                 out_size(9, 3, 2, 1, 1), "3x3 s2 p1 " + tag);
      check_pool(Pool::Max, t, f, {2, 4, 8, 6}, pool(2, 2, 0), 4, 3, "2x2 s2 " + tag);
      check_pool(Pool::Max, t, f, {1, 3, 8, 7}, pool(3, 1, 1, 2), out_size(8, 3, 1, 1, 2),
                 out_size(7, 3, 1, 1, 2), "3x3 s1 p1 d2 " + tag);
      // 16 and 24 channels: the vectorised NHWC kernels for every dtype.
      check_pool(Pool::Max, t, f, {2, 16, 11, 11}, pool(3, 2, 1), 6, 6, "3x3 s2 p1 c16 " + tag);
      check_pool(Pool::Max, t, f, {2, 16, 10, 7}, pool(2, 2, 0), 5, 3, "2x2 s2 c16 " + tag);
      check_pool(Pool::Max, t, f, {1, 16, 6, 5}, pool(3, 1, 1), 6, 5, "3x3 s1 p1 c16 " + tag);
      check_pool(Pool::Max, t, f, {1, 16, 12, 12}, pool(4, 3, 2), out_size(12, 4, 3, 2, 1),
                 out_size(12, 4, 3, 2, 1), "4x4 s3 p2 c16 " + tag);
      check_pool(Pool::Max, t, f, {1, 24, 7, 9}, pool(3, 1, 1, 2), out_size(7, 3, 1, 1, 2),
                 out_size(9, 3, 1, 1, 2), "3x3 s1 p1 d2 c24 " + tag);
    }
}

TEST_CASE("max_pool2d ties go to the first maximum of the window") {
  for (DType t : kDTypes)
    for (MemoryFormat f : kFormats) {
      const std::string tag = std::string(dtype_name(t)) +
                              (f == MemoryFormat::ChannelsLast ? " nhwc" : " nchw");
      check_pool(Pool::Max, t, f, {2, 16, 9, 9}, pool(3, 2, 1), 5, 5, "ties c16 " + tag, true);
      check_pool(Pool::Max, t, f, {2, 3, 9, 9}, pool(3, 1, 1), 9, 9, "ties c3 " + tag, true);
    }
  // All equal: every window's first valid element is its maximum.
  Tensor x = full({1, 8, 4, 4}, 1.5, gpu_opts(DType::f16, MemoryFormat::ChannelsLast));
  PoolParams p = pool(3, 2, 1);
  Tensor y = nan_output({1, 8, 2, 2}, DType::f16, MemoryFormat::ChannelsLast);
  Tensor idx = empty({1, 8, 2, 2}, gpu_opts(DType::u8, MemoryFormat::ChannelsLast));
  cuda::max_pool2d_forward(y, idx, x, p);
  // Window (0,0) starts at (-1,-1): its first in-bounds position is (1,1) -> 4; the others
  // start in bounds on their first row: (0,1) -> 3 (row -1 is out), (1,0) -> 1, (1,1) -> 0.
  std::vector<double> iv = idx.to_vector<double>();  // NCHW logical order
  for (int64_t c = 0; c < 8; ++c) {
    CHECK(iv[size_t(c * 4 + 0)] == 4);
    CHECK(iv[size_t(c * 4 + 1)] == 3);
    CHECK(iv[size_t(c * 4 + 2)] == 1);
    CHECK(iv[size_t(c * 4 + 3)] == 0);
  }
}

TEST_CASE("max_pool2d: i32 indices for windows over 255 positions, and empty windows") {
  for (DType t : {DType::f32, DType::f16})
    for (MemoryFormat f : kFormats) {
      const std::string tag = std::string(dtype_name(t)) +
                              (f == MemoryFormat::ChannelsLast ? " nhwc" : " nchw");
      PoolParams big = pool(16, 4, 0);
      REQUIRE(max_pool2d_indices_dtype(big) == DType::i32);
      check_pool(Pool::Max, t, f, {1, 8, 20, 20}, big, 2, 2, "16x16 s4 " + tag);
      // kernel 2, dilation 5, padding 1 over 4x4: the window's two rows/cols are -1 and 4, both
      // outside, so y = -inf and no gradient flows.
      check_pool(Pool::Max, t, f, {1, 8, 4, 4}, pool(2, 1, 1, 5), 1, 1, "empty window " + tag);
    }
}

TEST_CASE("max_pool2d backward with dy, indices and dx in different layouts") {
  PoolParams p = pool(3, 2, 1);
  for (int64_t C : {3, 8}) {
    CAPTURE(C);
    Shape in{2, C, 7, 7};
    Tensor x = gpu_tensor(uniform_values(shape_numel(in), -2, 2, 40), in, DType::f32,
                          MemoryFormat::ChannelsLast);
    Tensor y = nan_output({2, C, 4, 4}, DType::f32, MemoryFormat::ChannelsLast);
    Tensor idx = empty({2, C, 4, 4}, gpu_opts(DType::u8, MemoryFormat::ChannelsLast));
    cuda::max_pool2d_forward(y, idx, x, p);
    Tensor dy = gpu_tensor(uniform_values(2 * C * 4 * 4, -1, 1, 41), {2, C, 4, 4}, DType::f32);
    Tensor dx = nan_output(in, DType::f32, MemoryFormat::Contiguous);
    cuda::max_pool2d_backward(dx, dy, idx, p);
    std::vector<double> wy, wdx, widx;
    max_pool_ref(x.to_vector<double>(), dy.to_vector<double>(), Dims{2, C, 7, 7, 4, 4}, p, wy,
                 wdx, widx);
    check_close(dx.to_vector<double>(), wdx, tol_for(DType::f32), "mixed layouts");
    CHECK(indices_as_ref(idx) == widx);
  }
}

TEST_CASE("avg_pool2d forward/backward, with and without counting padding") {
  for (DType t : kDTypes)
    for (MemoryFormat f : kFormats)
      for (bool incl : {true, false}) {
        const std::string tag = std::string(dtype_name(t)) +
                                (f == MemoryFormat::ChannelsLast ? " nhwc" : " nchw") +
                                (incl ? " incl" : " excl");
        check_pool(Pool::Avg, t, f, {2, 3, 9, 9}, pool(3, 2, 1, 1, incl), 5, 5, "3x3 s2 p1 " + tag);
        check_pool(Pool::Avg, t, f, {2, 4, 8, 6}, pool(2, 2, 0, 1, incl), 4, 3, "2x2 s2 " + tag);
        check_pool(Pool::Avg, t, f, {1, 2, 5, 5}, pool(3, 1, 1, 1, incl), 5, 5, "3x3 s1 p1 " + tag);
      }
}

TEST_CASE("adaptive_avg_pool2d forward/backward: global, uneven and enlarging windows") {
  for (DType t : kDTypes)
    for (MemoryFormat f : kFormats) {
      const std::string tag = std::string(dtype_name(t)) +
                              (f == MemoryFormat::ChannelsLast ? " nhwc" : " nchw");
      PoolParams unused;
      check_pool(Pool::Adaptive, t, f, {2, 8, 7, 7}, unused, 1, 1, "7x7->1x1 " + tag);
      check_pool(Pool::Adaptive, t, f, {3, 64, 7, 7}, unused, 1, 1, "7x7->1x1 c64 " + tag);
      check_pool(Pool::Adaptive, t, f, {2, 3, 5, 4}, unused, 1, 1, "5x4->1x1 c3 " + tag);
      check_pool(Pool::Adaptive, t, f, {2, 3, 9, 7}, unused, 4, 3, "9x7->4x3 " + tag);
      check_pool(Pool::Adaptive, t, f, {1, 2, 3, 5}, unused, 5, 7, "3x5->5x7 " + tag);
    }
}

TEST_CASE("softmax and log_softmax forward/backward over the last dim") {
  for (DType t : kDTypes) {
    for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
             {5, 10}, {256, 1000}, {3, 4097}, {1, 1}}) {
      for (bool log : {false, true}) {
        const std::string name = std::string(log ? "log_softmax " : "softmax ") +
                                 dtype_name(t) + " " + std::to_string(rows) + "x" +
                                 std::to_string(cols);
        CAPTURE(name);
        Tensor x = gpu_tensor(uniform_values(rows * cols, -4, 4, 50), {rows, cols}, t);
        Tensor y = nan_output({rows, cols}, t);
        cuda::softmax_forward(y, x, log);
        std::vector<double> xv = x.to_vector<double>(), want(xv.size());
        for (int64_t r = 0; r < rows; ++r) {
          const double* xr = &xv[size_t(r * cols)];
          double m = -INFINITY, s = 0;
          for (int64_t i = 0; i < cols; ++i) m = std::max(m, xr[i]);
          for (int64_t i = 0; i < cols; ++i) s += std::exp(xr[i] - m);
          for (int64_t i = 0; i < cols; ++i)
            want[size_t(r * cols + i)] = log ? xr[i] - m - std::log(s) : std::exp(xr[i] - m) / s;
        }
        Tol tol = tol_for(t);
        if (!log) tol.atol = t == DType::f64 ? 1e-15 : 1e-7;  // probabilities are small
        check_close(y.to_vector<double>(), want, tol, name + " forward");

        Tensor dy = gpu_tensor(uniform_values(rows * cols, -1, 1, 51), {rows, cols}, t);
        Tensor dx = nan_output({rows, cols}, t);
        cuda::softmax_backward(dx, dy, y, log);
        std::vector<double> yv = y.to_vector<double>(), gv = dy.to_vector<double>(), wdx(xv.size());
        for (int64_t r = 0; r < rows; ++r) {
          double s = 0;
          for (int64_t i = 0; i < cols; ++i) {
            const size_t k = size_t(r * cols + i);
            s += log ? gv[k] : gv[k] * yv[k];
          }
          for (int64_t i = 0; i < cols; ++i) {
            const size_t k = size_t(r * cols + i);
            wdx[k] = log ? gv[k] - std::exp(yv[k]) * s : yv[k] * (gv[k] - s);
          }
        }
        Tol btol = tol_for(t);
        if (!log) btol.atol = t == DType::f64 ? 1e-15 : (t == DType::f16 ? 1e-5 : 1e-7);
        check_close(dx.to_vector<double>(), wdx, btol, name + " backward");
      }
    }
  }
}

TEST_CASE("cross_entropy_fused: loss, gradient and top-1 count vs reference") {
  for (DType t : kDTypes) {
    for (auto [N, C] : std::vector<std::pair<int64_t, int64_t>>{{4, 5}, {256, 1000}, {3, 3000}}) {
      for (double eps : {0.0, 0.1}) {
        for (double scale : {1.0, 256.0}) {
          const std::string name = std::string(dtype_name(t)) + " " + std::to_string(N) + "x" +
                                   std::to_string(C) + " eps " + std::to_string(eps) +
                                   " scale " + std::to_string(scale);
          CAPTURE(name);
          Tensor logits = gpu_tensor(uniform_values(N * C, -3, 3, 60), {N, C}, t);
          std::vector<double> xv = logits.to_vector<double>();
          // Targets: the argmax for even rows (hits), a pseudo-random class for odd rows.
          std::vector<double> tv(static_cast<size_t>(N));
          std::vector<double> u = uniform_values(N, 0, double(C), 61);
          int64_t want_correct = 0;
          std::vector<int64_t> argmax(static_cast<size_t>(N));
          for (int64_t r = 0; r < N; ++r) {
            int64_t a = 0;
            for (int64_t i = 1; i < C; ++i)
              if (xv[size_t(r * C + i)] > xv[size_t(r * C + a)]) a = i;
            argmax[size_t(r)] = a;
            tv[size_t(r)] = r % 2 == 0 ? double(a) : std::floor(u[size_t(r)]);
            want_correct += int64_t(tv[size_t(r)]) == a;
          }
          Tensor target = gpu_tensor(tv, {N}, DType::i64);
          Tensor loss = full({}, std::nan(""), gpu_opts(DType::f32));
          Tensor correct = full({}, -5.0, gpu_opts(DType::i64));
          Tensor grad = nan_output({N, C}, t);
          cuda::cross_entropy_fused(loss, grad, correct, logits, target, eps, scale);

          double want_loss = 0;
          std::vector<double> wgrad(xv.size());
          for (int64_t r = 0; r < N; ++r) {
            const double* xr = &xv[size_t(r * C)];
            double m = -INFINITY, s = 0, slogp = 0;
            for (int64_t i = 0; i < C; ++i) m = std::max(m, xr[i]);
            for (int64_t i = 0; i < C; ++i) s += std::exp(xr[i] - m);
            const double lse = m + std::log(s);
            for (int64_t i = 0; i < C; ++i) slogp += xr[i] - lse;
            const int64_t tr = int64_t(tv[size_t(r)]);
            want_loss += -(1 - eps) * (xr[tr] - lse) - eps / double(C) * slogp;
            for (int64_t i = 0; i < C; ++i)
              wgrad[size_t(r * C + i)] =
                  (std::exp(xr[i] - lse) - eps / double(C) - (i == tr ? 1 - eps : 0)) * scale /
                  double(N);
          }
          want_loss /= double(N);
          CHECK(loss.item() == doctest::Approx(want_loss).epsilon(1e-5));
          CHECK(correct.item<int64_t>() == want_correct);
          Tol gt = tol_for(t);
          gt.atol = (t == DType::f64 ? 1e-15 : 1e-7) * scale;
          check_close(grad.to_vector<double>(), wgrad, gt, name + " grad");
        }
      }
    }
  }
}

TEST_CASE("cross_entropy_fused is deterministic and accepts i32 targets") {
  const int64_t N = 512, C = 100;
  Tensor logits = gpu_tensor(uniform_values(N * C, -3, 3, 70), {N, C}, DType::f16);
  std::vector<double> tv = uniform_values(N, 0, double(C), 71);
  for (auto& v : tv) v = std::floor(v);
  Tensor t64 = gpu_tensor(tv, {N}, DType::i64), t32 = gpu_tensor(tv, {N}, DType::i32);
  auto run = [&](const Tensor& target) {
    Tensor loss = empty({}, gpu_opts(DType::f32)), correct = empty({}, gpu_opts(DType::i64));
    Tensor grad = empty({N, C}, gpu_opts(DType::f16));
    cuda::cross_entropy_fused(loss, grad, correct, logits, target, 0.1, 1.0);
    return std::make_pair(float(loss.item()), correct.item<int64_t>());
  };
  auto a = run(t64), b = run(t64), c = run(t32);
  CHECK(a.first == b.first);  // bit-identical, not merely close
  CHECK(a.second == b.second);
  CHECK(c.first == a.first);
  CHECK(c.second == a.second);
}
