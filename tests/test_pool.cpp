// Pooling and flatten: forward against naive loops, gradients, memory formats, error paths.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/generator.h"
#include "ops/ops.h"
#include "tests/gradcheck.h"
#include "tests/test_util.h"

using namespace kiln;
using kiln::F::Pair;
using kiln::testing::compare;
using kiln::testing::error_of;
using kiln::testing::gradcheck;

namespace {

struct Win {
  int64_t kh, kw, sh, sw, ph, pw, dh = 1, dw = 1;
};

std::string win_str(const Win& v) {
  return "k=" + std::to_string(v.kh) + "x" + std::to_string(v.kw) + " s=" + std::to_string(v.sh) +
         "," + std::to_string(v.sw) + " p=" + std::to_string(v.ph) + "," + std::to_string(v.pw) +
         " d=" + std::to_string(v.dh) + "," + std::to_string(v.dw);
}

// Distinct values (a shuffled 0.01-spaced ramp) so every window has a unique maximum, far
// from the finite-difference step.
Tensor distinct(const Shape& shape, uint64_t seed, bool requires_grad = false) {
  const int64_t n = shape_numel(shape);
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = 0.01 * double(i) - 0.005 * double(n);
  Generator gen(seed);
  for (int64_t i = n - 1; i > 0; --i) std::swap(v[size_t(i)], v[gen.below(uint64_t(i + 1))]);
  Tensor t = from_vector<double>(v, shape, DType::f64);
  if (requires_grad) t.set_requires_grad(true);
  return t;
}

enum class Kind { Max, AvgInclude, AvgExclude };

// Naive pooling over logical NCHW values.
Tensor reference(Kind kind, const Tensor& x, const Win& v) {
  const int64_t n = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  const int64_t oh = (h + 2 * v.ph - v.dh * (v.kh - 1) - 1) / v.sh + 1;
  const int64_t ow = (w + 2 * v.pw - v.dw * (v.kw - 1) - 1) / v.sw + 1;
  const std::vector<double> xv = x.to_vector<double>();
  std::vector<double> y;
  for (int64_t p = 0; p < n * c; ++p)
    for (int64_t yy = 0; yy < oh; ++yy)
      for (int64_t xx = 0; xx < ow; ++xx) {
        double best = -std::numeric_limits<double>::infinity(), sum = 0;
        int64_t valid = 0;
        for (int64_t i = 0; i < v.kh; ++i)
          for (int64_t j = 0; j < v.kw; ++j) {
            const int64_t ih = yy * v.sh - v.ph + i * v.dh, iw = xx * v.sw - v.pw + j * v.dw;
            if (ih < 0 || ih >= h || iw < 0 || iw >= w) continue;
            const double e = xv[size_t((p * h + ih) * w + iw)];
            best = std::max(best, e);
            sum += e;
            ++valid;
          }
        if (kind == Kind::Max)
          y.push_back(best);
        else
          y.push_back(sum / double(kind == Kind::AvgInclude ? v.kh * v.kw : valid));
      }
  return from_vector<double>(y, {n, c, oh, ow}, DType::f64);
}

Tensor pool(Kind kind, const Tensor& x, const Win& v) {
  if (kind == Kind::Max)
    return F::max_pool2d(x, {v.kh, v.kw}, Pair{v.sh, v.sw}, {v.ph, v.pw}, {v.dh, v.dw});
  return F::avg_pool2d(x, {v.kh, v.kw}, Pair{v.sh, v.sw}, {v.ph, v.pw}, kind == Kind::AvgInclude);
}

const std::vector<std::pair<Shape, Win>> kWindows = {
    {{2, 3, 6, 6}, {2, 2, 2, 2, 0, 0}},         // the classic 2x2/2
    {{2, 2, 7, 8}, {3, 3, 2, 2, 1, 1}},         // ResNet stem pool shape
    {{1, 3, 9, 7}, {3, 2, 1, 2, 1, 0}},         // non-square, overlapping
    {{2, 2, 7, 7}, {2, 2, 1, 1, 1, 1}},         // padding = kernel/2
    {{2, 2, 9, 10}, {3, 3, 2, 3, 1, 1, 2, 2}},  // dilation (max only)
    {{3, 4, 5, 5}, {5, 5, 1, 1, 2, 2}},         // big padding
};

}  // namespace

TEST_CASE("max_pool2d and avg_pool2d forward match naive loops (f64, f32; NCHW, NHWC)") {
  for (const auto& [shape, v] : kWindows) {
    CAPTURE(shape_str(shape));
    CAPTURE(win_str(v));
    Tensor x = distinct(shape, 7);
    for (Kind kind : {Kind::Max, Kind::AvgInclude, Kind::AvgExclude}) {
      if (kind != Kind::Max && (v.dh != 1 || v.dw != 1)) continue;
      CAPTURE(int(kind));
      Tensor expected = reference(kind, x, v);
      KILN_CHECK_OK(compare(pool(kind, x, v), expected, 1e-12, 1e-12));
      KILN_CHECK_OK(compare(pool(kind, x.to(DType::f32), v), expected, 1e-5, 1e-5));
      Tensor yl = pool(kind, x.contiguous(MemoryFormat::ChannelsLast), v);
      CHECK(yl.suggest_memory_format() == MemoryFormat::ChannelsLast);
      KILN_CHECK_OK(compare(yl, expected, 1e-12, 1e-12));
    }
  }
  // count_include_pad differs only where windows overlap the padding.
  Tensor x = ones({1, 1, 3, 3}, DType::f64);
  CHECK(F::avg_pool2d(x, 3, 1, 1, true).to_vector<double>() ==
        std::vector<double>{4 / 9., 6 / 9., 4 / 9., 6 / 9., 1, 6 / 9., 4 / 9., 6 / 9., 4 / 9.});
  CHECK(F::avg_pool2d(x, 3, 1, 1, false).to_vector<double>() == std::vector<double>(9, 1.0));
  // stride defaults to the kernel
  CHECK(F::max_pool2d(distinct({1, 1, 6, 6}, 1), 3).shape() == Shape{1, 1, 2, 2});
}

TEST_CASE("max_pool2d and avg_pool2d gradients") {
  for (const auto& [shape, v] : kWindows) {
    CAPTURE(shape_str(shape));
    CAPTURE(win_str(v));
    Tensor x = distinct(shape, 11, true);
    KILN_CHECK_OK(gradcheck([&](auto& in) { return pool(Kind::Max, in[0], v); }, {x}));
    KILN_CHECK_OK(gradcheck(
        [&](auto& in) { return pool(Kind::Max, in[0].contiguous(MemoryFormat::ChannelsLast), v); },
        {x}));
    if (v.dh != 1 || v.dw != 1) continue;
    Tensor a = kiln::testing::leaf(shape);
    for (Kind kind : {Kind::AvgInclude, Kind::AvgExclude})
      KILN_CHECK_OK(gradcheck([&](auto& in) { return pool(kind, in[0], v); }, {a}));
    KILN_CHECK_OK(gradcheck(
        [&](auto& in) {
          return pool(Kind::AvgExclude, in[0].contiguous(MemoryFormat::ChannelsLast), v);
        },
        {a}));
  }
}

TEST_CASE("max_pool2d routes a tie's gradient to the first maximal element") {
  // One 2x2 window of equal values, one with the max repeated in its second row.
  Tensor x = from_vector<double>({1, 1, 0, 5, 1, 1, 5, 5}, {1, 1, 2, 4}, DType::f64);
  x.set_requires_grad(true);
  Tensor y = F::max_pool2d(x, 2);
  CHECK(y.to_vector<double>() == std::vector<double>{1, 5});
  y.backward(from_vector<double>({2, 3}, {1, 1, 1, 2}, DType::f64));
  CHECK(x.grad().to_vector<double>() == std::vector<double>{2, 0, 0, 3, 0, 0, 0, 0});
  // Padding is -inf: an all-negative window at the border still picks a real element.
  Tensor z = F::max_pool2d(full({1, 1, 2, 2}, -3.0, DType::f64), 2, 1, 1);
  CHECK(z.to_vector<double>() == std::vector<double>(9, -3.0));
}

TEST_CASE("adaptive_avg_pool2d: non-divisible windows, global pooling, gradients") {
  // Windows by PyTorch's rule: 5 -> 3: [0,2) [1,4) [3,5); 7 -> 2: [0,4) [3,7).
  Tensor x = kiln::testing::leaf({2, 3, 5, 7});
  const std::vector<double> xv = x.to_vector<double>();
  const int64_t hs[3][2] = {{0, 2}, {1, 4}, {3, 5}}, ws[2][2] = {{0, 4}, {3, 7}};
  std::vector<double> expected;
  for (int64_t p = 0; p < 6; ++p)
    for (auto& h : hs)
      for (auto& w : ws) {
        double s = 0;
        for (int64_t i = h[0]; i < h[1]; ++i)
          for (int64_t j = w[0]; j < w[1]; ++j) s += xv[size_t((p * 5 + i) * 7 + j)];
        expected.push_back(s / double((h[1] - h[0]) * (w[1] - w[0])));
      }
  Tensor ref = from_vector<double>(expected, {2, 3, 3, 2}, DType::f64);
  KILN_CHECK_OK(compare(F::adaptive_avg_pool2d(x, {3, 2}), ref, 1e-12, 1e-12));
  KILN_CHECK_OK(compare(F::adaptive_avg_pool2d(x.to(DType::f32), {3, 2}), ref, 1e-5, 1e-5));
  Tensor yl = F::adaptive_avg_pool2d(x.detach().contiguous(MemoryFormat::ChannelsLast), {3, 2});
  CHECK(yl.suggest_memory_format() == MemoryFormat::ChannelsLast);
  KILN_CHECK_OK(compare(yl, ref, 1e-12, 1e-12));
  // Global: the mean over H, W. Upsampling (out > in) repeats elements.
  KILN_CHECK_OK(compare(F::adaptive_avg_pool2d(x, 1), F::mean(x, {2, 3}, true), 1e-12, 1e-12));
  Tensor small = from_vector<double>({1, 2, 3, 4}, {1, 1, 2, 2}, DType::f64);
  CHECK(F::adaptive_avg_pool2d(small, {2, 4}).to_vector<double>() ==
        std::vector<double>{1, 1, 2, 2, 3, 3, 4, 4});
  // Gradients.
  for (Pair out : {Pair{3, 2}, Pair{1, 1}, Pair{5, 7}, Pair{2, 5}, Pair{7, 9}})
    KILN_CHECK_OK(gradcheck([&](auto& in) { return F::adaptive_avg_pool2d(in[0], out); }, {x}));
  KILN_CHECK_OK(gradcheck(
      [&](auto& in) {
        return F::adaptive_avg_pool2d(in[0].contiguous(MemoryFormat::ChannelsLast), {3, 2});
      },
      {x}));
}

TEST_CASE("pooling backward on multi-plane f32 batches agrees with f64") {
  Tensor x = distinct({8, 16, 14, 14}, 3);
  Tensor g = randn({8, 16, 7, 7}, DType::f64);
  for (int which = 0; which < 3; ++which) {
    CAPTURE(which);
    auto run = [&](DType dt) {
      Tensor xl = x.to(dt).detach().set_requires_grad(true);
      Tensor y = which == 0   ? F::max_pool2d(xl, 3, 2, 1)
                 : which == 1 ? F::avg_pool2d(xl, 3, 2, 1, false)
                              : F::adaptive_avg_pool2d(xl, 7);
      y.backward(g.to(dt));
      return xl.grad();
    };
    KILN_CHECK_OK(compare(run(DType::f32), run(DType::f64), 1e-5, 1e-5));
  }
}

TEST_CASE("flatten") {
  Tensor x = kiln::testing::leaf({2, 3, 4, 5});
  CHECK(F::flatten(x).shape() == Shape{2, 60});
  CHECK(F::flatten(x, 0).shape() == Shape{120});
  CHECK(F::flatten(x, 1, 2).shape() == Shape{2, 12, 5});
  CHECK(F::flatten(x, -2).shape() == Shape{2, 3, 20});
  CHECK(F::flatten(x).to_vector<double>() == x.to_vector<double>());
  // NHWC input: logical order is kept (reshape copies).
  Tensor xl = x.detach().contiguous(MemoryFormat::ChannelsLast);
  CHECK(F::flatten(xl).to_vector<double>() == x.to_vector<double>());
  KILN_CHECK_OK(
      gradcheck([](auto& in) { return F::flatten(in[0]); }, {kiln::testing::leaf({2, 2, 3})}));
  CHECK_THROWS_AS(F::flatten(x, 2, 1), Error);
  CHECK_THROWS_AS(F::flatten(Tensor()), Error);
}

namespace {
bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}
}  // namespace

TEST_CASE("pooling error paths name the op and the shapes") {
  Tensor x = randn({2, 3, 6, 6});
  std::string m = error_of([&] { F::max_pool2d(x, 3, 1, 2); });  // padding 2 > 3/2
  CHECK(has(m, "max_pool2d"));
  CHECK(has(m, "half of the kernel"));
  CHECK(has(error_of([&] { F::avg_pool2d(x, 2, 2, 2); }), "avg_pool2d"));
  m = error_of([&] { F::max_pool2d(x, 7); });  // kernel larger than the input
  CHECK(has(m, "[2, 3, 6, 6]"));
  CHECK(has(m, "larger than the padded input"));
  CHECK(has(m, "output size"));
  CHECK(error_of([&] { F::max_pool2d(x, 7, 1, 1); }).empty());            // fits once padded
  CHECK(has(error_of([&] { F::max_pool2d(x, 3, 1, 0, 3); }), "larger"));  // dilated extent 7
  CHECK(has(error_of([&] { F::max_pool2d(x, 0); }), "kernel"));
  CHECK(has(error_of([&] { F::max_pool2d(x, 2, Pair{0, 1}); }), "stride"));
  CHECK(has(error_of([&] { F::max_pool2d(x, 2, 2, 0, 0); }), "dilation"));
  CHECK(has(error_of([&] { F::avg_pool2d(x, 2, 2, -1); }), "padding"));
  CHECK(has(error_of([&] { F::max_pool2d(randn({3, 6, 6}), 2); }), "4-D"));
  CHECK(has(error_of([&] { F::avg_pool2d(ones({1, 1, 4, 4}, DType::i64), 2); }), "floating"));
  m = error_of([&] { F::adaptive_avg_pool2d(x, {0, 2}); });
  CHECK(has(m, "adaptive_avg_pool2d"));
  CHECK(has(m, "[2, 3, 6, 6]"));
  CHECK(has(error_of([&] { F::adaptive_avg_pool2d(randn({2, 3, 0, 4}), 1); }), "empty"));
}
