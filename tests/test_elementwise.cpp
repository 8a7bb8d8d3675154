// Elementwise ops: forward values, broadcasting, gradients, in-place and error paths.
#include <doctest/doctest.h>

#include <cmath>

#include "ops/ops.h"
#include "tests/gradcheck.h"

using namespace kiln;
using kiln::testing::gradcheck;
using kiln::testing::leaf;

TEST_CASE("add/sub/mul/div forward with broadcasting") {
  Tensor a = from_vector<double>({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = from_vector<double>({10, 20, 30}, {3});
  CHECK(F::add(a, b).to_vector<double>() == std::vector<double>{11, 22, 33, 14, 25, 36});
  CHECK(F::sub(a, b, 2.0).to_vector<double>() == std::vector<double>{-19, -38, -57, -16, -35, -54});
  Tensor c = from_vector<double>({2, 4}, {2, 1});
  CHECK(F::mul(a, c).to_vector<double>() == std::vector<double>{2, 4, 6, 16, 20, 24});
  CHECK(F::div(a, c).to_vector<double>() == std::vector<double>{0.5, 1, 1.5, 1, 1.25, 1.5});
  // both sides broadcast: (2,1) with (3) -> (2,3)
  CHECK(F::add(c, b).shape() == Shape{2, 3});
  CHECK(F::add(c, b).to_vector<double>() == std::vector<double>{12, 22, 32, 14, 24, 34});
  CHECK_THROWS_AS(F::add(a, from_vector<double>({1, 2}, {2})), Error);
}

TEST_CASE("unary forward values") {
  Tensor x = from_vector<double>({-1.0, 0.5, 2.0}, {3});
  auto r = F::relu(x).to_vector<double>();
  CHECK(r == std::vector<double>{0.0, 0.5, 2.0});
  CHECK(F::exp(x).to_vector<double>()[2] == doctest::Approx(std::exp(2.0)));
  CHECK(F::sigmoid(x).to_vector<double>()[0] == doctest::Approx(1.0 / (1.0 + std::exp(1.0))));
  CHECK(F::tanh(x).to_vector<double>()[1] == doctest::Approx(std::tanh(0.5)));
  CHECK(F::pow(x, 2.0).to_vector<double>() == std::vector<double>{1.0, 0.25, 4.0});
  CHECK(F::rsub(x, 1.0).to_vector<double>() == std::vector<double>{2.0, 0.5, -1.0});
  CHECK(F::rdiv(x, 1.0).to_vector<double>() == std::vector<double>{-1.0, 2.0, 0.5});
  CHECK(F::gt(x, 0.0).dtype() == DType::boolean);
  CHECK(F::gt(x, 0.0).to_vector<int>() == std::vector<int>{0, 1, 1});
  Tensor i = from_vector<int64_t>({3, 1, 4}, {3}, DType::i64);
  Tensor j = from_vector<int64_t>({3, 2, 4}, {3}, DType::i64);
  CHECK(F::eq(i, j).to_vector<int>() == std::vector<int>{1, 0, 1});
}

TEST_CASE("binary gradients, broadcasting both ways") {
  for (auto [sa, sb] : std::vector<std::pair<Shape, Shape>>{
           {{3, 4}, {3, 4}}, {{3, 4}, {4}}, {{3, 1}, {1, 4}}, {{2, 3, 4}, {3, 1}}, {{4}, {2, 3, 4}}}) {
    CAPTURE(shape_str(sa));
    CAPTURE(shape_str(sb));
    Tensor a = leaf(sa, 0.5, 2.0), b = leaf(sb, 0.5, 2.0);
    KILN_CHECK_OK(gradcheck([](auto& in) { return F::add(in[0], in[1], 0.7); }, {a, b}));
    KILN_CHECK_OK(gradcheck([](auto& in) { return F::sub(in[0], in[1]); }, {a, b}));
    KILN_CHECK_OK(gradcheck([](auto& in) { return F::mul(in[0], in[1]); }, {a, b}));
    KILN_CHECK_OK(gradcheck([](auto& in) { return F::div(in[0], in[1]); }, {a, b}));
    KILN_CHECK_OK(gradcheck([](auto& in) { return F::pow(in[0], in[1]); }, {a, b}));
  }
}

TEST_CASE("unary gradients") {
  Tensor x = leaf({3, 5}, -2.0, 2.0);
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::neg(in[0]); }, {x}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::exp(in[0]); }, {x}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::sigmoid(in[0]); }, {x}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::tanh(in[0]); }, {x}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::mul(in[0], 3.5); }, {x}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::add(in[0], 3.5); }, {x}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::rsub(in[0], 3.5); }, {x}));
  Tensor p = leaf({3, 5}, 0.5, 2.0);
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::log(in[0]); }, {p}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::sqrt(in[0]); }, {p}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::pow(in[0], 2.5); }, {p}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::rdiv(in[0], 2.0); }, {p}));
  // relu away from its kink at 0
  Tensor r = from_vector<double>({-1.5, -0.3, 0.2, 0.9, 1.7, -2.0}, {2, 3}, DType::f64);
  r.set_requires_grad(true);
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::relu(in[0]); }, {r}));
}

TEST_CASE("same tensor feeds both inputs") {
  Tensor x = leaf({4}, 0.5, 2.0);
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::mul(in[0], in[0]); }, {x}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::div(in[0], in[0]); }, {x}));
  // d(x*x)/dx = 2x exactly
  x.set_grad(Tensor());
  F::sum(F::mul(x, x)).backward();
  KILN_CHECK_OK(kiln::testing::compare(x.grad(), F::mul(x.detach(), 2.0), 1e-12, 0));
}

TEST_CASE("in-place ops") {
  Tensor a = from_vector<float>({1, 2, 3, 4}, {2, 2});
  uint64_t v0 = a.version();
  a.add_(from_vector<float>({10, 20}, {2}), 0.5);
  CHECK(a.to_vector<float>() == std::vector<float>{6, 12, 8, 14});
  a.mul_(2.0);
  CHECK(a.to_vector<float>() == std::vector<float>{12, 24, 16, 28});
  CHECK(a.version() > v0);
  CHECK_THROWS_AS(a.add_(from_vector<float>({1, 2, 3, 4, 5, 6, 7, 8}, {2, 2, 2})), Error);
  Tensor w = ones({2}, TensorOptions(DType::f32).with_requires_grad());
  CHECK_THROWS_AS(w.add_(1.0), Error);  // recording: refused
  {
    NoGradGuard ng;
    w.add_(1.0);
  }
  CHECK(w.to_vector<float>() == std::vector<float>{2, 2});
  // self read through another layout: x += xᵀ must use the old values of x.
  Tensor x = from_vector<float>({0, 1, 2, 3}, {2, 2});
  x.add_(x.t());
  CHECK(x.to_vector<float>() == std::vector<float>{0, 3, 3, 6});
}

TEST_CASE("dtype and device mismatches are errors") {
  Tensor a = ones({2}, DType::f32), b = ones({2}, DType::f64);
  CHECK_THROWS_AS(F::add(a, b), Error);
  try {
    F::mul(a, b);
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("dtype mismatch") != std::string::npos);
  }
  CHECK_THROWS_AS(F::exp(ones({2}, DType::i64)), Error);
}

TEST_CASE("a + alpha*b rounds the product on its own, whatever the CPU (no FMA contraction)") {
  // (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 lies halfway between two floats and rounds (to even) to
  // 1 + 2^-11, so c + alpha*b with c = -(1 + 2^-11) is exactly 0 when the product is rounded
  // first and 2^-24 when the compiler fuses both into one FMA. kiln's C++ is compiled with
  // -ffp-contract=off (CMakeLists.txt) so that results compared bit for bit elsewhere (the fused
  // optimizers against optim::SGD/AdamW, resample_box's RGB and one-channel passes) cannot depend
  // on -march: this fails on an FMA-capable build where the flag went missing. Long enough for
  // the vectorised loop and its scalar tail.
  const float a = 1.0f + 0x1p-12f, c = -(1.0f + 0x1p-11f);
  const int64_t n = 1027;
  Tensor out = F::add(full({n}, c), full({n}, a), a);
  for (float v : out.to_vector<float>()) REQUIRE(v == 0.0f);
  Tensor acc = full({n}, c);
  acc.add_(full({n}, a), a);  // the in-place kernel optim::SGD uses
  for (float v : acc.to_vector<float>()) REQUIRE(v == 0.0f);
}
