// softmax / log_softmax: values over every dim against a naive reference, normalisation,
// large-logit stability, gradients, error paths.
#include <doctest/doctest.h>

#include <cmath>

#include "ops/ops.h"
#include "tests/gradcheck.h"

using namespace kiln;
using kiln::testing::compare;
using kiln::testing::gradcheck;
using kiln::testing::leaf;

namespace {

// softmax of 3-D x over `dim` with plain loops in f64 (no max subtraction: inputs are small).
Tensor ref_softmax3(const Tensor& x, int64_t dim, bool log) {
  const Shape s = x.shape();
  std::vector<double> v = x.to_vector<double>(), y(v.size());
  auto at = [&](int64_t i, int64_t j, int64_t k) { return size_t((i * s[1] + j) * s[2] + k); };
  for (int64_t i = 0; i < s[0]; ++i)
    for (int64_t j = 0; j < s[1]; ++j)
      for (int64_t k = 0; k < s[2]; ++k) {
        double z = 0;
        for (int64_t r = 0; r < s[size_t(dim)]; ++r) {
          int64_t idx[3] = {i, j, k};
          idx[dim] = r;
          z += std::exp(v[at(idx[0], idx[1], idx[2])]);
        }
        const double e = v[at(i, j, k)];
        y[at(i, j, k)] = log ? e - std::log(z) : std::exp(e) / z;
      }
  return from_vector<double>(y, s, DType::f64);
}

}  // namespace

TEST_CASE("softmax and log_softmax over each dim match a naive reference") {
  Tensor x = uniform({2, 3, 4}, -3.0, 3.0, DType::f64);
  for (int64_t dim = 0; dim < 3; ++dim) {
    CAPTURE(dim);
    Tensor s = F::softmax(x, dim), ls = F::log_softmax(x, dim);
    CHECK(s.is_contiguous());
    CHECK(ls.is_contiguous());
    KILN_CHECK_OK(compare(s, ref_softmax3(x, dim, false), 1e-12, 1e-12));
    KILN_CHECK_OK(compare(ls, ref_softmax3(x, dim, true), 1e-12, 1e-12));
    // Negative dims count from the end.
    KILN_CHECK_OK(compare(F::softmax(x, dim - 3), s, 0, 0));
    // Sums along dim are 1.
    KILN_CHECK_OK(compare(F::sum(s, {dim}), ones(F::sum(s, {dim}).shape(), DType::f64), 1e-12, 0));
  }
  // f32 and a non-contiguous (transposed) input.
  Tensor xt = x.to(DType::f32).transpose(0, 2);  // (4, 3, 2)
  Tensor st = F::softmax(xt, 1);
  KILN_CHECK_OK(compare(st, ref_softmax3(xt.contiguous(), 1, false), 1e-6, 1e-5));
}

TEST_CASE("softmax is stable for large logits") {
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    Tensor x = from_vector<double>({1000, 1001, -1000, -1001, 0, 0}, {3, 2}, dt);
    std::vector<double> s = F::softmax(x, 1).to_vector<double>();
    std::vector<double> ls = F::log_softmax(x, 1).to_vector<double>();
    for (size_t i = 0; i < 6; ++i) {
      CHECK(std::isfinite(s[i]));
      CHECK(std::isfinite(ls[i]));
    }
    const double p = 1.0 / (1.0 + std::exp(1.0)), lp = -std::log1p(std::exp(1.0));
    const double tol = dt == DType::f64 ? 1e-12 : 1e-5;
    KILN_CHECK_OK(compare(from_vector<double>(s, {3, 2}, DType::f64),
                          from_vector<double>({p, 1 - p, 1 - p, p, 0.5, 0.5}, {3, 2}, DType::f64),
                          tol, tol));
    KILN_CHECK_OK(compare(from_vector<double>(ls, {3, 2}, DType::f64),
                          from_vector<double>({lp, lp + 1, lp + 1, lp, std::log(0.5), std::log(0.5)},
                                              {3, 2}, DType::f64),
                          tol, tol));
  }
  // Large logits also give finite gradients.
  Tensor x = from_vector<double>({1000, 1001, 999}, {1, 3}, DType::f64);
  x.set_requires_grad(true);
  F::sum(F::mul(F::log_softmax(x, 1), from_vector<double>({1, 0, 0}, {1, 3}, DType::f64))).backward();
  for (double g : x.grad().to_vector<double>()) CHECK(std::isfinite(g));
}

TEST_CASE("softmax and log_softmax gradients") {
  for (Shape shape : std::vector<Shape>{{5}, {3, 4}, {2, 3, 4}}) {
    CAPTURE(shape_str(shape));
    Tensor x = leaf(shape, -2.0, 2.0);
    for (int64_t dim = 0; dim < int64_t(shape.size()); ++dim) {
      CAPTURE(dim);
      KILN_CHECK_OK(gradcheck([dim](auto& in) { return F::softmax(in[0], dim); }, {x}));
      KILN_CHECK_OK(gradcheck([dim](auto& in) { return F::log_softmax(in[0], dim); }, {x}));
    }
  }
  // Non-contiguous input and a chain through another op.
  Tensor x = leaf({3, 4}, -2.0, 2.0);
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::softmax(in[0].t(), 1); }, {x}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::exp(F::log_softmax(F::mul(in[0], 2.0), 0)); }, {x}));
}

TEST_CASE("softmax gradient of a constant upstream is zero") {
  // Σ_j softmax_j = 1, so d/dx Σ_j softmax_j = 0.
  Tensor x = leaf({2, 5}, -2.0, 2.0);
  F::sum(F::softmax(x, 1)).backward();
  KILN_CHECK_OK(compare(x.grad(), zeros({2, 5}, DType::f64), 1e-15, 0));
}

TEST_CASE("softmax errors") {
  Tensor x = ones({2, 3}, DType::f64);
  CHECK_THROWS_AS(F::softmax(x, 2), Error);
  CHECK_THROWS_AS(F::log_softmax(x, -3), Error);
  CHECK_THROWS_AS(F::softmax(ones({2, 3}, DType::i64), 1), Error);
  CHECK_THROWS_AS(F::softmax(Tensor(), 0), Error);
  try {
    F::log_softmax(x, 5);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("log_softmax: dim 5 out of range") != std::string::npos);
  }
}
