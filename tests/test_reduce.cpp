// Reductions: sum, mean, max and argmax — forward values against a naive reference, shapes
// (keepdim, negative dims, several dims), ties, gradients and error paths.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/ops.h"
#include "tests/gradcheck.h"

using namespace kiln;
using kiln::testing::compare;
using kiln::testing::gradcheck;
using kiln::testing::leaf;

namespace {

enum class Ref { Sum, Mean, Max, Argmax };

// Naive reduction of x over `dims` (already non-negative; empty = all), walking every input
// element's multi-index. Returns values in the output's row-major order.
std::vector<double> reference(const Tensor& x, std::vector<int64_t> dims, Ref kind) {
  const Shape& s = x.shape();
  const size_t nd = s.size();
  if (dims.empty())
    for (size_t d = 0; d < nd; ++d) dims.push_back(int64_t(d));
  std::vector<bool> red(nd, false);
  for (int64_t d : dims) red[size_t(d)] = true;
  Shape out_shape;
  for (size_t d = 0; d < nd; ++d)
    if (!red[d]) out_shape.push_back(s[d]);
  const int64_t n_out = shape_numel(out_shape);
  std::vector<double> acc(size_t(n_out), kind == Ref::Max || kind == Ref::Argmax
                                             ? -std::numeric_limits<double>::infinity()
                                             : 0.0);
  std::vector<double> arg(size_t(n_out), -1), count(size_t(n_out), 0);
  std::vector<double> v = x.to_vector<double>();
  std::vector<int64_t> idx(nd, 0);
  for (size_t flat = 0; flat < v.size(); ++flat) {
    int64_t o = 0, r = 0;  // output position and position within the reduced dims
    for (size_t d = 0; d < nd; ++d) {
      if (red[d]) r = r * s[d] + idx[d];
      else o = o * s[d] + idx[d];
    }
    double& a = acc[size_t(o)];
    if (kind == Ref::Sum || kind == Ref::Mean) {
      a += v[flat];
    } else if (v[flat] > a) {
      a = v[flat];
      arg[size_t(o)] = double(r);
    }
    count[size_t(o)] += 1;
    for (int64_t d = int64_t(nd) - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < s[size_t(d)]) break;
      idx[size_t(d)] = 0;
    }
  }
  if (kind == Ref::Mean)
    for (size_t i = 0; i < acc.size(); ++i) acc[i] /= count[i];
  return kind == Ref::Argmax ? arg : acc;
}

Shape reduced_shape(const Shape& s, const std::vector<int64_t>& dims, bool keepdim) {
  Shape out;
  for (size_t d = 0; d < s.size(); ++d) {
    bool r = std::find(dims.begin(), dims.end(), int64_t(d)) != dims.end();
    if (!r) out.push_back(s[d]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

std::vector<int64_t> wrap(const std::vector<int64_t>& dims, int64_t nd) {
  std::vector<int64_t> w;
  for (int64_t d : dims) w.push_back(d < 0 ? d + nd : d);
  return w;
}

void check_values(const Tensor& actual, const std::vector<double>& expected, double tol) {
  std::vector<double> a = actual.to_vector<double>();
  REQUIRE(a.size() == expected.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CAPTURE(i);
    CHECK(a[i] == doctest::Approx(expected[i]).epsilon(tol).scale(1.0));
  }
}

// Distinct values (a permutation of 0.1*i, shifted) so max has no ties and a finite-difference
// step never changes the argmax.
Tensor distinct_leaf(const Shape& shape, int64_t mult = 7) {
  const int64_t n = shape_numel(shape);
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = 0.1 * double((i * mult) % n) - 0.05 * double(n);
  Tensor t = from_vector<double>(v, shape, DType::f64);
  t.set_requires_grad(true);
  return t;
}

}  // namespace

TEST_CASE("sum and mean over each dim, several dims and all, against a naive loop") {
  for (DType dt : {DType::f32, DType::f64}) {
    CAPTURE(dtype_name(dt));
    const double tol = dt == DType::f32 ? 1e-5 : 1e-12;
    Tensor x = randn({2, 3, 4}, dt);
    const std::vector<std::vector<int64_t>> dim_sets = {{0}, {1}, {2}, {-1}, {-3}, {0, 2},
                                                        {-1, 0}, {1, 2}, {0, 1, 2}};
    for (const auto& dims : dim_sets) {
      for (bool keepdim : {false, true}) {
        CAPTURE(keepdim);
        CAPTURE(dims.size());
        CAPTURE(dims[0]);
        std::vector<int64_t> w = wrap(dims, 3);
        Tensor s = F::sum(x, dims, keepdim);
        CHECK(s.dtype() == dt);
        CHECK(s.shape() == reduced_shape(x.shape(), w, keepdim));
        check_values(s, reference(x, w, Ref::Sum), tol);
        Tensor m = F::mean(x, dims, keepdim);
        CHECK(m.shape() == reduced_shape(x.shape(), w, keepdim));
        check_values(m, reference(x, w, Ref::Mean), tol);
      }
    }
    Tensor total = F::sum(x);
    CHECK(total.dim() == 0);
    check_values(total, reference(x, {}, Ref::Sum), tol);
    check_values(F::mean(x), reference(x, {}, Ref::Mean), tol);
  }
}

TEST_CASE("sum and mean: hand-worked values, non-contiguous input, 0-d input") {
  Tensor x = from_vector<double>({1, 2, 3, 4, 5, 6}, {2, 3});
  CHECK(F::sum(x, {0}).to_vector<double>() == std::vector<double>{5, 7, 9});
  CHECK(F::sum(x, {1}).to_vector<double>() == std::vector<double>{6, 15});
  CHECK(F::mean(x, {-1}, true).shape() == Shape{2, 1});
  CHECK(F::mean(x, {-1}, true).to_vector<double>() == std::vector<double>{2, 5});
  CHECK(F::sum(x).item() == 21.0);
  CHECK(F::mean(x).item() == 3.5);
  // transposed view: (3, 2), rows are x's columns
  Tensor xt = x.t();
  CHECK(F::sum(xt, {1}).to_vector<double>() == std::vector<double>{5, 7, 9});
  Tensor y = randn({3, 4, 5}, DType::f64).permute({2, 0, 1});
  check_values(F::sum(y, {0, 2}), reference(y, {0, 2}, Ref::Sum), 1e-12);
  Tensor s = full({}, 2.5, DType::f64);
  CHECK(F::sum(s).item() == 2.5);
  CHECK(F::sum(s, {0}).dim() == 0);
  CHECK(F::mean(s, {-1}).item() == 2.5);
}

TEST_CASE("sum and mean gradients") {
  Tensor x = leaf({2, 3, 4});
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::sum(in[0]); }, {x}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::mean(in[0]); }, {x}));
  for (const auto& dims : std::vector<std::vector<int64_t>>{{0}, {1}, {-1}, {0, 2}, {2, 0, 1}}) {
    for (bool keepdim : {false, true}) {
      CAPTURE(keepdim);
      CAPTURE(dims[0]);
      KILN_CHECK_OK(gradcheck([&](auto& in) { return F::sum(in[0], dims, keepdim); }, {x}));
      KILN_CHECK_OK(gradcheck([&](auto& in) { return F::mean(in[0], dims, keepdim); }, {x}));
    }
  }
  // through a non-contiguous view
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::mean(in[0].transpose(0, 2), {1}); }, {x}));
  // d mean / dx = 1/numel exactly
  Tensor y = leaf({4, 5});
  F::mean(y).backward();
  KILN_CHECK_OK(compare(y.grad(), full({4, 5}, 1.0 / 20.0, DType::f64), 1e-15, 0));
}

TEST_CASE("max and argmax along a dim, against a naive loop") {
  for (DType dt : {DType::f32, DType::f64}) {
    CAPTURE(dtype_name(dt));
    Tensor x = randn({3, 4, 5}, dt);
    for (int64_t dim : {0, 1, 2, -1, -2}) {
      for (bool keepdim : {false, true}) {
        CAPTURE(dim);
        CAPTURE(keepdim);
        std::vector<int64_t> w = wrap({dim}, 3);
        Tensor m = F::max(x, dim, keepdim);
        Tensor i = F::argmax(x, dim, keepdim);
        CHECK(m.shape() == reduced_shape(x.shape(), w, keepdim));
        CHECK(i.shape() == m.shape());
        CHECK(m.dtype() == dt);
        CHECK(i.dtype() == DType::i64);
        CHECK(m.to_vector<double>() == reference(x, w, Ref::Max));  // exact: max copies a value
        CHECK(i.to_vector<double>() == reference(x, w, Ref::Argmax));
      }
    }
    Tensor whole = F::max(x);
    CHECK(whole.dim() == 0);
    CHECK(whole.item() == reference(x, {}, Ref::Max)[0]);
  }
}

TEST_CASE("max: hand-worked values, ties go to the first index, NaN, non-contiguous, 0-d") {
  Tensor x = from_vector<double>({1, 5, 5, 2, 7, 7, 7, -1}, {2, 4});
  CHECK(F::max(x, 1).to_vector<double>() == std::vector<double>{5, 7});
  CHECK(F::argmax(x, 1).to_vector<int64_t>() == std::vector<int64_t>{1, 0});
  CHECK(F::argmax(x, 0).to_vector<int64_t>() == std::vector<int64_t>{1, 1, 1, 0});
  CHECK(F::argmax(x, -1, true).shape() == Shape{2, 1});
  CHECK(F::max(x).item() == 7.0);
  // whole-tensor max with ties: the gradient goes to the first maximal element only
  Tensor xl = x.detach().clone().set_requires_grad(true);
  F::max(xl).backward();
  CHECK(xl.grad().to_vector<double>() == std::vector<double>{0, 0, 0, 0, 1, 0, 0, 0});
  Tensor xd = x.detach().clone().set_requires_grad(true);
  F::sum(F::max(xd, 1)).backward();
  CHECK(xd.grad().to_vector<double>() == std::vector<double>{0, 1, 0, 0, 1, 0, 0, 0});
  // all equal -> index 0
  CHECK(F::argmax(full({3, 6}, 2.0), 1).to_vector<int64_t>() == std::vector<int64_t>{0, 0, 0});
  // NaN propagates and is the argmax
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Tensor n = from_vector<double>({1, nan, 5, nan}, {4});
  CHECK(std::isnan(F::max(n).item()));
  CHECK(F::argmax(n, 0).item() == 1.0);
  // transposed view: max over its dim 1 is over x's rows
  CHECK(F::max(x.t(), 1).to_vector<double>() == std::vector<double>{7, 7, 7, 2});
  CHECK(F::argmax(x.t(), 1).to_vector<int64_t>() == std::vector<int64_t>{1, 1, 1, 0});
  // -inf everywhere still has a max and an argmax
  Tensor ninf = full({2, 3}, -std::numeric_limits<double>::infinity(), DType::f64);
  CHECK(F::argmax(ninf, 1).to_vector<int64_t>() == std::vector<int64_t>{0, 0});
  CHECK(std::isinf(F::max(ninf).item()));
  Tensor s = full({}, -3.0, DType::f64);
  CHECK(F::max(s).item() == -3.0);
  CHECK(F::max(s, 0).dim() == 0);
  CHECK(F::argmax(s, -1).item() == 0.0);
}

TEST_CASE("max gradients away from ties") {
  Tensor x = distinct_leaf({3, 4, 5});
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::max(in[0]); }, {x}));
  for (int64_t dim : {0, 1, 2, -1}) {
    for (bool keepdim : {false, true}) {
      CAPTURE(dim);
      CAPTURE(keepdim);
      KILN_CHECK_OK(gradcheck([&](auto& in) { return F::max(in[0], dim, keepdim); }, {x}));
    }
  }
  Tensor y = distinct_leaf({4, 6}, 5);
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::max(in[0].t(), 1); }, {y}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::mul(F::max(in[0], 0, true), in[0]); }, {y}));
  CHECK_FALSE(F::argmax(x, 1).requires_grad());
}

TEST_CASE("reduction errors") {
  Tensor x = randn({2, 3});
  CHECK_THROWS_AS(F::sum(x, {2}), Error);
  CHECK_THROWS_AS(F::sum(x, {-3}), Error);
  CHECK_THROWS_AS(F::sum(x, {0, -2}), Error);  // repeated
  CHECK_THROWS_AS(F::sum(x, {}), Error);
  CHECK_THROWS_AS(F::mean(x, {}), Error);
  CHECK_THROWS_AS(F::sum(ones({2}, DType::i64)), Error);
  CHECK_THROWS_AS(F::max(x, 2), Error);
  CHECK_THROWS_AS(F::argmax(x, -3), Error);
  CHECK_THROWS_AS(F::max(ones({2}, DType::i32)), Error);
  CHECK_THROWS_AS(F::max(Tensor()), Error);
  // max over zero elements has no answer; the message names the op and the shape
  try {
    F::max(empty({3, 0}), 1);
    FAIL("expected an error");
  } catch (const Error& e) {
    std::string m = e.what();
    CHECK(m.find("max") != std::string::npos);
    CHECK(m.find("[3, 0]") != std::string::npos);
  }
  CHECK_THROWS_AS(F::max(empty({0})), Error);
  // ...but reducing a non-empty dim of an empty tensor is fine
  CHECK(F::max(empty({0, 3}), 1).shape() == Shape{0});
  CHECK(F::sum(empty({0, 3}), {0}).to_vector<float>() == std::vector<float>{0, 0, 0});
}

TEST_CASE("sums over the leading dims in memory order (reduce_cols) equal the transposing path") {
  // A channels-last tensor summed over N, H, W, and a matrix over its rows: the backend sums
  // columns where they lie; the result is the same bits as summing a contiguous copy.
  Generator g(9);
  const Tensor x = randn({3, 5, 4, 6}, {}, &g);
  const Tensor cl = x.contiguous(MemoryFormat::ChannelsLast);
  const Tensor a = F::sum(cl, {0, 2, 3}), b = F::sum(x, {0, 2, 3});
  CHECK(a.to_vector<float>() == b.to_vector<float>());
  const Tensor m = randn({37, 70}, {}, &g);  // 70 columns: two of the CPU's column blocks
  const std::vector<float> cols = F::sum(m, {0}).to_vector<float>();
  const std::vector<float> rows = F::sum(m.transpose(0, 1).contiguous(), {1}).to_vector<float>();
  CHECK(cols == rows);
  for (int64_t c : {0, 69}) {
    double want = 0;
    for (int64_t r = 0; r < 37; ++r) want += double(m.to_vector<float>()[size_t(r * 70 + c)]);
    CHECK(cols[size_t(c)] == float(want));
  }
}
