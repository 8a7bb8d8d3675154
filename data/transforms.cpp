#include "data/transforms.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace kiln::data {
namespace {

// The taps of one axis: output i reads source indices start[i] .. start[i] + count[i] - 1
// with weights w[i * max_taps + t], which sum to 1; the weights past count[i] are 0. When
// `fixed`, start[i] + taps stays inside [lo, hi) for every i, where taps is the largest count
// (a window that would reach past hi is moved left, its weights behind leading zeros), so a pass
// may read `taps` taps of every output in one unrolled loop: the extra zero weights add exact
// zeros, so the sums are bit for bit those of the exact windows.
struct AxisPlan {
  std::vector<int64_t> start;
  std::vector<int64_t> count;
  std::vector<float> w;
  int64_t max_taps = 0;  // the weights' stride
  int64_t taps = 0;      // the largest count
  bool fixed = true;
};

// Output pixel i covers source coordinates origin + [i, i + 1) * scale; taps are restricted to
// source indices [lo, hi).
AxisPlan plan_axis(int64_t out, double origin, double scale, int64_t lo, int64_t hi) {
  const double support = std::max(scale, 1.0);  // triangle half-width in source pixels
  AxisPlan p;
  p.max_taps = int64_t(std::ceil(support)) * 2 + 2;
  p.start.resize(size_t(out));
  p.count.resize(size_t(out));
  p.w.assign(size_t(out * p.max_taps), 0.0f);
  std::vector<double> tmp(size_t(p.max_taps));
  for (int64_t i = 0; i < out; ++i) {
    const double center = origin + (double(i) + 0.5) * scale;
    const int64_t first = std::max<int64_t>(lo, int64_t(std::floor(center - support - 0.5)));
    const int64_t last = std::min<int64_t>(hi - 1, int64_t(std::ceil(center + support - 0.5)));
    double total = 0.0;
    int64_t n = 0, s = -1;
    for (int64_t j = first; j <= last && n < p.max_taps; ++j) {
      const double x = std::abs((double(j) + 0.5 - center) / support);
      const double wt = x < 1.0 ? 1.0 - x : 0.0;
      if (wt <= 0.0 && n == 0) continue;  // skip leading zero taps
      if (s < 0) s = j;
      tmp[size_t(n++)] = wt;
      total += wt;
    }
    while (n > 0 && tmp[size_t(n - 1)] <= 0.0) --n;
    if (total <= 0.0) {  // cannot happen for a centre inside [lo, hi); nearest pixel as a guard
      s = std::clamp<int64_t>(int64_t(center), lo, hi - 1);
      n = 1;
      tmp[0] = total = 1.0;
    }
    p.start[size_t(i)] = s;
    p.count[size_t(i)] = n;
    p.taps = std::max(p.taps, n);
    for (int64_t t = 0; t < n; ++t) p.w[size_t(i * p.max_taps + t)] = float(tmp[size_t(t)] / total);
  }
  // Windows that would end past hi move left (within lo), their weights behind zeros.
  for (int64_t i = 0; i < out; ++i) {
    int64_t& s = p.start[size_t(i)];
    const int64_t shift = std::clamp<int64_t>(s + p.taps - hi, 0, s - lo);
    if (shift > 0) {
      float* w = p.w.data() + i * p.max_taps;
      std::copy_backward(w, w + p.count[size_t(i)], w + p.count[size_t(i)] + shift);
      std::fill(w, w + shift, 0.0f);
      s -= shift;
      p.count[size_t(i)] += shift;
    }
    if (s + p.taps > hi) p.fixed = false;  // a limit narrower than the window
  }
  return p;
}

// Round to nearest (ties to even), then clamp to 0..255. Adding and subtracting 1.5 * 2^23
// rounds a float in (-2^22, 2^22) to an integer in the current (default: to nearest even) mode,
// as std::nearbyint does, without the libm call that builds without SSE4.1 make of nearbyint;
// every value this file rounds is a weighted mean of bytes (non-negative weights that sum to
// 1), well inside that range. The clamp is on the integer: with -ftrapping-math (GCC's default)
// a float compare may not be made branch-free, and the loops over a row would not vectorise.
inline uint8_t to_u8(float v) {
  constexpr float kRound = 0x1.8p23f;  // without -ffast-math the compiler keeps both steps
  const int i = int((v + kRound) - kRound);
  return uint8_t(i < 0 ? 0 : i > 255 ? 255 : i);
}

// One RGB pixel as a 4-lane float vector (R, G, B and a lane that belongs to the next pixel):
// GCC and Clang lower it to SSE on any x86-64 and to NEON on ARM, with no intrinsics.
using F4 = float __attribute__((vector_size(16)));

inline F4 load4(const float* p) {
  F4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store4(float* p, F4 v) { std::memcpy(p, &v, sizeof v); }

// The horizontal pass of one RGB row of floats: out[j * 3 + c] = sum over output j's taps t of
// w[t] * row[(start - first + t) * 3 + c], where `row` holds source columns from `first` on. A
// pixel's three channels are one vector, so a tap is one load, one multiply and one add; each
// lane adds its taps in order, exactly as a loop over one channel does, so the sums are bit for
// bit those of a scalar pass. Reads one float past the last column the taps reach and writes one
// float past out[out_w * 3 - 1] (the next pixel's store overwrites it). T > 0: every output has
// T taps (a fixed plan), unrolled; T == 0: each output its own count.
template <int T>
void rgb_row(const float* row, int64_t first, const AxisPlan& rx, int64_t out_w, bool flip,
             float* out) {
  for (int64_t j = 0; j < out_w; ++j) {
    const int64_t pj = flip ? out_w - 1 - j : j;
    const float* w = rx.w.data() + pj * rx.max_taps;
    const float* s = row + (rx.start[size_t(pj)] - first) * 3;
    const int64_t n = T > 0 ? T : rx.count[size_t(pj)];
    F4 a = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t t = 0; t < n; ++t) a += w[t] * load4(s + t * 3);
    store4(out + j * 3, a);
  }
}

// rgb_row with the tap loop unrolled for the usual window sizes.
void rgb_row_dispatch(const float* row, int64_t first, const AxisPlan& rx, int64_t out_w,
                      bool flip, float* out) {
  switch (rx.fixed ? rx.taps : 0) {
    case 2: return rgb_row<2>(row, first, rx, out_w, flip, out);
    case 3: return rgb_row<3>(row, first, rx, out_w, flip, out);
    case 4: return rgb_row<4>(row, first, rx, out_w, flip, out);
    case 5: return rgb_row<5>(row, first, rx, out_w, flip, out);
    case 6: return rgb_row<6>(row, first, rx, out_w, flip, out);
    case 7: return rgb_row<7>(row, first, rx, out_w, flip, out);
    case 8: return rgb_row<8>(row, first, rx, out_w, flip, out);
    case 9: return rgb_row<9>(row, first, rx, out_w, flip, out);
    case 10: return rgb_row<10>(row, first, rx, out_w, flip, out);
    default: return rgb_row<0>(row, first, rx, out_w, flip, out);
  }
}

// The horizontal pass of one row of floats with C channels (source columns from `first` on):
// RGB as above, other channel counts one channel at a time, each output its own taps.
void horizontal_row(const float* row, int64_t first, int64_t C, const AxisPlan& rx,
                    int64_t out_w, bool flip, float* out) {
  if (C == 3) return rgb_row_dispatch(row, first, rx, out_w, flip, out);
  for (int64_t j = 0; j < out_w; ++j) {
    const int64_t pj = flip ? out_w - 1 - j : j;
    const float* w = rx.w.data() + pj * rx.max_taps;
    const float* s = row + (rx.start[size_t(pj)] - first) * C;
    const int64_t taps = rx.count[size_t(pj)];
    for (int64_t c = 0; c < C; ++c) {
      float a = 0.0f;
      for (int64_t t = 0; t < taps; ++t) a += w[t] * s[t * C + c];
      out[j * C + c] = a;
    }
  }
}

// The two separable passes. The order follows the shape: when shrinking vertically (fewer
// output rows than source rows the taps reach) the vertical pass runs first, one output row at a
// time over only the columns the horizontal taps reach, so the horizontal pass runs on out_h rows;
// otherwise each needed source row gets its horizontal pass first. Both passes work on floats
// (u8 -> float is exact), and each output sums its taps in plan order, whatever the channel
// count, so an RGB image and each of its channels alone give the same bytes.
void resample(const uint8_t* src, int64_t width, int64_t channels, const AxisPlan& ry,
              const AxisPlan& rx, uint8_t* dst, int64_t out_h, int64_t out_w, bool flip) {
  int64_t row0 = INT64_MAX, row1 = 0;
  for (int64_t i = 0; i < out_h; ++i) {
    row0 = std::min(row0, ry.start[size_t(i)]);
    row1 = std::max(row1, ry.start[size_t(i)] + ry.count[size_t(i)]);
  }
  int64_t col0 = INT64_MAX, col1 = 0;
  for (int64_t j = 0; j < out_w; ++j) {
    col0 = std::min(col0, rx.start[size_t(j)]);
    col1 = std::max(col1, rx.start[size_t(j)] + (rx.fixed ? rx.taps : rx.count[size_t(j)]));
  }
  const int64_t C = channels, cw = (col1 - col0) * C, ow = out_w * C;
  // Per-thread scratch: loader workers resample thousands of images; no allocation per image.
  // Each buffer has one float of slack for rgb_row's fourth lane.
  thread_local std::vector<float> tmp, line, acc;
  if (out_h < row1 - row0) {
    // Raw pointers, not vector<>::operator[]: a byte store may alias a vector's own members,
    // which would keep the compiler from vectorising the loops.
    line.resize(size_t(cw + 1));
    tmp.resize(size_t(ow + 1));
    float* const ln = line.data();
    const float* const hz = tmp.data();
    ln[cw] = 0.0f;
    for (int64_t i = 0; i < out_h; ++i) {
      std::fill(ln, ln + cw, 0.0f);
      const float* w = ry.w.data() + i * ry.max_taps;
      for (int64_t t = 0; t < ry.count[size_t(i)]; ++t) {
        const float wt = w[t];
        const uint8_t* srow = src + (ry.start[size_t(i)] + t) * width * C + col0 * C;
        for (int64_t k = 0; k < cw; ++k) ln[k] += wt * float(srow[k]);
      }
      horizontal_row(ln, col0, C, rx, out_w, flip, tmp.data());
      uint8_t* drow = dst + i * ow;
      for (int64_t k = 0; k < ow; ++k) drow[k] = to_u8(hz[k]);
    }
    return;
  }
  line.resize(size_t(cw + 1));
  tmp.resize(size_t((row1 - row0) * ow + 1));
  acc.resize(size_t(ow));
  float* const ln = line.data();
  float* const hz = tmp.data();
  float* const ac = acc.data();
  ln[cw] = 0.0f;
  for (int64_t r = row0; r < row1; ++r) {
    const uint8_t* srow = src + r * width * C + col0 * C;
    for (int64_t k = 0; k < cw; ++k) ln[k] = float(srow[k]);
    horizontal_row(ln, col0, C, rx, out_w, flip, hz + (r - row0) * ow);
  }
  // Vertical pass row by row, taps outer so the inner loop runs over contiguous floats.
  for (int64_t i = 0; i < out_h; ++i) {
    const float* w = ry.w.data() + i * ry.max_taps;
    const float* t0 = hz + (ry.start[size_t(i)] - row0) * ow;
    std::fill(ac, ac + ow, 0.0f);
    for (int64_t t = 0; t < ry.count[size_t(i)]; ++t) {
      const float wt = w[t];
      const float* row = t0 + t * ow;
      for (int64_t k = 0; k < ow; ++k) ac[k] += wt * row[k];
    }
    uint8_t* drow = dst + i * ow;
    for (int64_t k = 0; k < ow; ++k) drow[k] = to_u8(ac[k]);
  }
}

}  // namespace

CropBox random_resized_crop_box(int64_t height, int64_t width, Generator& gen,
                                const RandomResizedCropParams& p) {
  KILN_CHECK(height > 0 && width > 0, "random_resized_crop_box: bad image size ", height, "x",
             width);
  KILN_CHECK(p.scale_min > 0 && p.scale_min <= p.scale_max && p.ratio_min > 0 &&
                 p.ratio_min <= p.ratio_max,
             "random_resized_crop_box: bad scale (", p.scale_min, ", ", p.scale_max, ") or ratio (",
             p.ratio_min, ", ", p.ratio_max, ")");
  const double area = double(height) * double(width);
  const double log_lo = std::log(p.ratio_min), log_hi = std::log(p.ratio_max);
  for (int a = 0; a < p.attempts; ++a) {
    const double target = area * (p.scale_min + (p.scale_max - p.scale_min) * gen.uniform());
    const double ratio = std::exp(log_lo + (log_hi - log_lo) * gen.uniform());
    const auto w = int64_t(std::nearbyint(std::sqrt(target * ratio)));
    const auto h = int64_t(std::nearbyint(std::sqrt(target / ratio)));
    if (w > 0 && w <= width && h > 0 && h <= height) {
      const auto top = int64_t(gen.below(uint64_t(height - h + 1)));
      const auto left = int64_t(gen.below(uint64_t(width - w + 1)));
      return {top, left, h, w};
    }
  }
  const double in_ratio = double(width) / double(height);
  int64_t w = width, h = height;
  if (in_ratio < p.ratio_min)
    h = int64_t(std::nearbyint(double(w) / p.ratio_min));
  else if (in_ratio > p.ratio_max)
    w = int64_t(std::nearbyint(double(h) * p.ratio_max));
  h = std::clamp<int64_t>(h, 1, height);
  w = std::clamp<int64_t>(w, 1, width);
  return {(height - h) / 2, (width - w) / 2, h, w};
}

void resample_box(const uint8_t* src, int64_t height, int64_t width, int64_t channels, BoxF b,
                  CropBox lim, uint8_t* dst, int64_t out_h, int64_t out_w, bool flip) {
  KILN_CHECK(lim.height > 0 && lim.width > 0 && lim.top >= 0 && lim.left >= 0 &&
                 lim.top + lim.height <= height && lim.left + lim.width <= width,
             "resample_box: limit (top ", lim.top, ", left ", lim.left, ", ", lim.height, "x",
             lim.width, ") outside the ", height, "x", width, " image");
  KILN_CHECK(b.height > 0 && b.width > 0 && b.top < double(lim.top + lim.height) &&
                 b.top + b.height > double(lim.top) && b.left < double(lim.left + lim.width) &&
                 b.left + b.width > double(lim.left),
             "resample_box: box (top ", b.top, ", left ", b.left, ", ", b.height, "x", b.width,
             ") does not overlap its limit");
  KILN_CHECK(out_h > 0 && out_w > 0, "resample_box: bad output size ", out_h, "x", out_w);
  const AxisPlan ry =
      plan_axis(out_h, b.top, b.height / double(out_h), lim.top, lim.top + lim.height);
  const AxisPlan rx =
      plan_axis(out_w, b.left, b.width / double(out_w), lim.left, lim.left + lim.width);
  resample(src, width, channels, ry, rx, dst, out_h, out_w, flip);
}

void resized_crop(const uint8_t* src, int64_t height, int64_t width, int64_t channels, CropBox b,
                  uint8_t* dst, int64_t out_h, int64_t out_w, bool flip) {
  KILN_CHECK(b.height > 0 && b.width > 0 && b.top >= 0 && b.left >= 0 &&
                 b.top + b.height <= height && b.left + b.width <= width,
             "resized_crop: box (top ", b.top, ", left ", b.left, ", ", b.height, "x", b.width,
             ") outside the ", height, "x", width, " image");
  const BoxF f{double(b.top), double(b.left), double(b.height), double(b.width)};
  resample_box(src, height, width, channels, f, b, dst, out_h, out_w, flip);
}

Size2 resize_shorter_side(int64_t height, int64_t width, int64_t size) {
  KILN_CHECK(height > 0 && width > 0 && size > 0, "resize_shorter_side: bad sizes ", height, "x",
             width, " -> ", size);
  if (width <= height) return {int64_t(double(size) * double(height) / double(width)), size};
  return {size, int64_t(double(size) * double(width) / double(height))};
}

BoxF center_crop_source_box(int64_t height, int64_t width, int64_t resize, int64_t crop) {
  KILN_CHECK(crop > 0 && crop <= resize, "resize_center_crop: crop ", crop,
             " must be in 1..resize (", resize, ")");
  const Size2 r = resize_shorter_side(height, width, resize);
  // torchvision's CenterCrop offset: round((resized - crop) / 2), Python's half-to-even.
  const double top = std::nearbyint(double(r.height - crop) / 2.0);
  const double left = std::nearbyint(double(r.width - crop) / 2.0);
  const double sy = double(height) / double(r.height), sx = double(width) / double(r.width);
  return {top * sy, left * sx, double(crop) * sy, double(crop) * sx};
}

void resize_center_crop(const uint8_t* src, int64_t height, int64_t width, int64_t channels,
                        int64_t resize, int64_t crop, uint8_t* dst) {
  const BoxF box = center_crop_source_box(height, width, resize, crop);
  resample_box(src, height, width, channels, box, CropBox{0, 0, height, width}, dst, crop, crop,
               false);
}

void random_resized_crop_flip(const uint8_t* src, int64_t height, int64_t width, int64_t channels,
                              int64_t out, Generator& gen, bool flip, uint8_t* dst,
                              const RandomResizedCropParams& p) {
  const CropBox box = random_resized_crop_box(height, width, gen, p);
  const bool mirror = flip && gen.uniform() < 0.5;
  resized_crop(src, height, width, channels, box, dst, out, out, mirror);
}

void normalize_nhwc_to_nchw(const uint8_t* src, int64_t n, int64_t height, int64_t width,
                            const float mean[3], const float stddev[3], float* dst) {
  float lut[3][256];
  for (int c = 0; c < 3; ++c)
    for (int v = 0; v < 256; ++v) lut[c][v] = (float(v) / 255.0f - mean[c]) / stddev[c];
  const int64_t hw = height * width;
#pragma omp parallel for if (n > 1)
  for (int64_t b = 0; b < n; ++b) {
    const uint8_t* s = src + b * hw * 3;
    float* d = dst + b * 3 * hw;
    for (int64_t p = 0; p < hw; ++p)
      for (int c = 0; c < 3; ++c) d[c * hw + p] = lut[c][s[p * 3 + c]];
  }
}

}  // namespace kiln::data
