// The transformer ops on the CPU (the reference backend): values against direct formulas in
// double, f64 finite-difference gradchecks at several shapes, and the properties each op
// promises (dropout's rate, scale, determinism and replay; cat/split round trips; embedding's
// repeated indices; attention's causal mask and its equality with the composition).
#include <doctest/doctest.h>

#include <cmath>

#include "core/generator.h"
#include "core/philox.h"
#include "ops/ops.h"
#include "tests/gradcheck.h"

using namespace kiln;
using kiln::testing::compare;
using kiln::testing::gradcheck;
using kiln::testing::leaf;

namespace {

std::vector<double> values(const Tensor& t) { return t.contiguous().to_vector<double>(); }

}  // namespace

TEST_CASE("gelu, gelu (tanh) and silu: values and gradients") {
  const std::vector<double> xs = {-3.0, -1.2, -0.3, 0.0, 0.4, 1.1, 2.7};
  const Tensor x = from_vector<double>(xs, {7}, DType::f64);
  const auto ge = values(F::gelu(x)), gt = values(F::gelu(x, F::GeluApproximate::Tanh)),
             si = values(F::silu(x));
  for (size_t i = 0; i < xs.size(); ++i) {
    const double v = xs[i];
    CHECK(ge[i] == doctest::Approx(0.5 * v * (1 + std::erf(v / std::sqrt(2.0)))).epsilon(1e-14));
    CHECK(gt[i] == doctest::Approx(0.5 * v *
                                   (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))))
                       .epsilon(1e-14));
    CHECK(si[i] == doctest::Approx(v / (1 + std::exp(-v))).epsilon(1e-14));
  }
  for (const Shape& s : {Shape{5}, Shape{3, 4}, Shape{2, 3, 5}}) {
    CAPTURE(shape_str(s));
    Tensor a = leaf(s, -3.0, 3.0);
    KILN_CHECK_OK(gradcheck([](auto& in) { return F::gelu(in[0]); }, {a}));
    KILN_CHECK_OK(
        gradcheck([](auto& in) { return F::gelu(in[0], F::GeluApproximate::Tanh); }, {a}));
    KILN_CHECK_OK(gradcheck([](auto& in) { return F::silu(in[0]); }, {a}));
  }
  // f32 follows the same formula (the CUDA kernels are checked against this path).
  const Tensor x32 = x.to(DType::f32);
  KILN_CHECK_OK(compare(F::gelu(x32).to(DType::f64), F::gelu(x), 1e-6, 1e-6));
}

// On the CPU linear_gelu is the composition; the CUDA path is checked against this in
// tests/gpu/test_transformer_ops.cpp.
TEST_CASE("linear_gelu: gelu(linear(x, w, b)), values and gradients") {
  Generator g(4);
  const Tensor x = randn({5, 3}, DType::f64, &g), w = randn({4, 3}, DType::f64, &g),
               b = randn({4}, DType::f64, &g);
  KILN_CHECK_OK(compare(F::linear_gelu(x, w, b), F::gelu(F::linear(x, w, b)), 0.0, 0.0));
  Tensor xl = leaf({5, 3}, -2.0, 2.0), wl = leaf({4, 3}, -1.0, 1.0), bl = leaf({4}, -1.0, 1.0);
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::linear_gelu(in[0], in[1], in[2]); },
                          {xl, wl, bl}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::linear_gelu(in[0], in[1], Tensor()); },
                          {xl, wl}));
}

TEST_CASE("layer_norm: values, statistics per row, gradients of x, weight and bias") {
  Generator g(3);
  const Tensor x = randn({4, 6}, DType::f64, &g) * 3.0 + 1.5;
  const Tensor w = randn({6}, DType::f64, &g), b = randn({6}, DType::f64, &g);
  const Tensor y = F::layer_norm(x, {6}, w, b, 1e-5);
  const auto xv = values(x), wv = values(w), bv = values(b), yv = values(y);
  for (int r = 0; r < 4; ++r) {
    double m = 0, v = 0;
    for (int j = 0; j < 6; ++j) m += xv[size_t(r * 6 + j)] / 6;
    for (int j = 0; j < 6; ++j) v += std::pow(xv[size_t(r * 6 + j)] - m, 2) / 6;
    for (int j = 0; j < 6; ++j) {
      const double want = (xv[size_t(r * 6 + j)] - m) / std::sqrt(v + 1e-5) * wv[size_t(j)] +
                          bv[size_t(j)];
      CHECK(yv[size_t(r * 6 + j)] == doctest::Approx(want).epsilon(1e-12));
    }
  }
  // Gradients: 2-D and 3-D x, normalised over one and over two trailing dims, with and without
  // the affine parameters.
  for (const auto& [xs, ns] : std::vector<std::pair<Shape, Shape>>{
           {{3, 5}, {5}}, {{2, 3, 4}, {4}}, {{2, 3, 4}, {3, 4}}, {{1, 7}, {7}}}) {
    CAPTURE(shape_str(xs));
    CAPTURE(shape_str(ns));
    Tensor a = leaf(xs, -2.0, 2.0), wt = leaf(ns, 0.5, 1.5), bs = leaf(ns, -0.5, 0.5);
    KILN_CHECK_OK(gradcheck([&](auto& in) { return F::layer_norm(in[0], ns, in[1], in[2]); },
                            {a, wt, bs}));
    KILN_CHECK_OK(
        gradcheck([&](auto& in) { return F::layer_norm(in[0], ns, Tensor(), Tensor()); }, {a}));
  }
  CHECK_THROWS_AS(F::layer_norm(x, {5}, w, b), Error);         // not the trailing dims
  CHECK_THROWS_AS(F::layer_norm(x, {6}, w.narrow(0, 0, 5), b), Error);  // wrong weight shape
  CHECK_THROWS_AS(F::layer_norm(x, {6}, w.to(DType::f32), b), Error);   // wrong weight dtype
}

TEST_CASE("dropout: rate, scale, eval identity, one stream, the same mask in backward") {
  manual_seed(7);
  const int64_t n = 200000;
  Tensor x = full({n}, 2.0, TensorOptions(DType::f32));
  Tensor y = F::dropout(x, 0.25, true);
  const auto yv = values(y);
  int64_t kept = 0;
  for (double v : yv) {
    CHECK((v == 0.0 || v == doctest::Approx(2.0 / 0.75)));
    kept += v != 0.0;
  }
  // 150,000 expected; 5 standard deviations is ~970.
  CHECK(std::abs(double(kept) - 0.75 * double(n)) < 1000.0);
  CHECK(F::dropout(x, 0.25, false).is_same(x));
  CHECK(F::dropout(x, 0.0, true).is_same(x));
  // The next call draws the next elements: another mask.
  const auto y2 = values(F::dropout(x, 0.25, true));
  int64_t same = 0;
  for (size_t i = 0; i < yv.size(); ++i) same += (yv[i] == 0) == (y2[i] == 0);
  CHECK(same < n);
  // The mask is element i's Philox uniform: the first call (seed 7) used elements [0, n).
  const uint64_t seed = philox_stream(Device::cpu()).seed;
  for (int64_t i : {int64_t(0), int64_t(1), int64_t(3), int64_t(12345), n - 1})
    CHECK((yv[size_t(i)] != 0) == (philox::uniform(seed, uint64_t(i)) >= 0.25f));
  // manual_seed rewinds the stream: the same mask again.
  manual_seed(7);
  CHECK(values(F::dropout(x, 0.25, true)) == yv);
  // The backward multiplies by the forward's mask (drawn again, not stored).
  manual_seed(7);
  Tensor a = full({n}, 1.0, TensorOptions(DType::f64)).set_requires_grad(true);
  Tensor d = F::dropout(a, 0.25, true);
  F::sum(F::mul(d, 3.0)).backward();
  const auto dv = values(d), gv = values(a.grad());
  for (size_t i = 0; i < dv.size(); i += 997) CHECK(gv[i] == doctest::Approx(3.0 * dv[i]));
  CHECK_THROWS_AS(F::dropout(x, 1.5, true), Error);
}

TEST_CASE("cat, stack, split, chunk: values and gradients") {
  Tensor a = leaf({2, 3}), b = leaf({2, 1}), c = leaf({2, 4});
  Tensor j = F::cat({a, b, c}, 1);
  CHECK(j.shape() == Shape{2, 8});
  KILN_CHECK_OK(compare(j.narrow(1, 3, 1), b, 0, 0));
  KILN_CHECK_OK(compare(j.narrow(1, 4, 4), c, 0, 0));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::cat({in[0], in[1], in[2]}, 1); }, {a, b, c}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::cat({in[0], in[1]}, -1); }, {a, b}));
  Tensor s = F::stack({a, a}, 1);
  CHECK(s.shape() == Shape{2, 2, 3});
  KILN_CHECK_OK(compare(s.select(1, 1), a, 0, 0));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::stack({in[0], in[1]}, 0); },
                          {leaf({3}), leaf({3})}));
  Tensor x = leaf({7, 2});
  const auto parts = F::split(x, 3, 0);
  REQUIRE(parts.size() == 3);
  CHECK(parts[2].shape() == Shape{1, 2});
  KILN_CHECK_OK(compare(F::cat(parts, 0), x, 0, 0));
  const auto ch = F::chunk(x, 2, 0);
  REQUIRE(ch.size() == 2);
  CHECK(ch[0].size(0) == 4);
  CHECK(ch[1].size(0) == 3);
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::mul(F::chunk(in[0], 3, 1)[1], 2.0); },
                          {leaf({2, 6})}));
  CHECK_THROWS_AS(F::cat({a, leaf({3, 1})}, 1), Error);
  CHECK_THROWS_AS(F::stack({a, b}, 0), Error);
}

TEST_CASE("embedding: rows by index, repeated indices add, out-of-range refused") {
  Tensor w = leaf({5, 3});
  Tensor idx = from_vector<int64_t>({4, 0, 4, 2}, {2, 2}, DType::i64);
  Tensor e = F::embedding(idx, w);
  CHECK(e.shape() == Shape{2, 2, 3});
  KILN_CHECK_OK(compare(e.select(0, 0).select(0, 0), w.select(0, 4), 0, 0));
  KILN_CHECK_OK(compare(e.select(0, 1).select(0, 1), w.select(0, 2), 0, 0));
  KILN_CHECK_OK(gradcheck([&](auto& in) { return F::embedding(idx, in[0]); }, {w}));
  F::sum(F::embedding(idx, w)).backward();
  const auto g = values(w.grad());
  for (int j = 0; j < 3; ++j) {
    CHECK(g[size_t(4 * 3 + j)] == 2.0);  // index 4 twice
    CHECK(g[size_t(1 * 3 + j)] == 0.0);  // index 1 never
  }
  CHECK_THROWS_WITH_AS(F::embedding(from_vector<int64_t>({5}, {1}, DType::i64), w),
                       doctest::Contains("outside the table's 5 rows"), Error);
}

TEST_CASE("where and masked_fill: broadcasting values and gradients") {
  Tensor cond = from_vector<bool>({true, false, true}, {3}, DType::boolean);
  Tensor a = leaf({2, 3}), b = leaf({1, 3});
  Tensor o = F::where(cond, a, b);
  const auto ov = values(o), av = values(a), bv = values(b);
  for (int r = 0; r < 2; ++r)
    for (int c = 0; c < 3; ++c)
      CHECK(ov[size_t(r * 3 + c)] == (c != 1 ? av[size_t(r * 3 + c)] : bv[size_t(c)]));
  KILN_CHECK_OK(gradcheck([&](auto& in) { return F::where(cond, in[0], in[1]); }, {a, b}));
  Tensor m = F::masked_fill(a, cond, -7.0);
  CHECK(values(m)[1] == av[1]);
  CHECK(values(m)[0] == -7.0);
  KILN_CHECK_OK(gradcheck([&](auto& in) { return F::masked_fill(in[0], cond, 0.5); }, {a}));
}

namespace {

// Attention in plain loops over doubles: the textbook formula, independent of kiln's ops.
std::vector<double> naive_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    bool causal, double scale) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2), D = q.size(3);
  const auto qv = values(q), kv = values(k), vv = values(v);
  std::vector<double> out(size_t(B * H * Lq * D));
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t i = 0; i < Lq; ++i) {
      std::vector<double> s(static_cast<size_t>(Lk), 0.0);
      double mx = -INFINITY;
      for (int64_t j = 0; j < Lk; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d)
          dot += qv[size_t((bh * Lq + i) * D + d)] * kv[size_t((bh * Lk + j) * D + d)];
        s[size_t(j)] = causal && j > i + (Lk - Lq) ? -INFINITY : dot * scale;
        mx = std::max(mx, s[size_t(j)]);
      }
      double z = 0;
      for (int64_t j = 0; j < Lk; ++j) z += std::exp(s[size_t(j)] - mx);
      for (int64_t d = 0; d < D; ++d) {
        double acc = 0;
        for (int64_t j = 0; j < Lk; ++j)
          acc += std::exp(s[size_t(j)] - mx) / z * vv[size_t((bh * Lk + j) * D + d)];
        out[size_t((bh * Lq + i) * D + d)] = acc;
      }
    }
  return out;
}

}  // namespace

TEST_CASE("scaled_dot_product_attention: the formula, causal masks, gradients") {
  Generator g(11);
  for (bool causal : {false, true})
    for (auto [lq, lk] : std::vector<std::pair<int64_t, int64_t>>{{5, 5}, {3, 7}, {7, 7}}) {
      CAPTURE(causal);
      CAPTURE(lq);
      CAPTURE(lk);
      const Tensor q = randn({2, 3, lq, 4}, DType::f64, &g), k = randn({2, 3, lk, 4}, DType::f64, &g),
                   v = randn({2, 3, lk, 4}, DType::f64, &g);
      const Tensor o = F::scaled_dot_product_attention(q, k, v, causal);
      const std::vector<double> want = naive_attention(q, k, v, causal, 0.5);
      const auto got = values(o);
      REQUIRE(got.size() == want.size());
      for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-12));
      Tensor lq_ = leaf({1, 2, lq, 3}), lk_ = leaf({1, 2, lk, 3}), lv_ = leaf({1, 2, lk, 3});
      KILN_CHECK_OK(gradcheck(
          [&](auto& in) { return F::scaled_dot_product_attention(in[0], in[1], in[2], causal); },
          {lq_, lk_, lv_}));
    }
  // An explicit scale, and shapes that do not fit.
  const Tensor q = randn({1, 1, 2, 4}, DType::f64, &g);
  KILN_CHECK_OK(compare(F::scaled_dot_product_attention(q, q, q, false, 0.0, 1.0),
                        F::matmul(F::softmax(F::matmul(q, q.transpose(-2, -1)), -1), q), 1e-12,
                        1e-12));
  CHECK_THROWS_AS(F::scaled_dot_product_attention(q, randn({1, 1, 2, 3}, DType::f64, &g), q),
                  Error);
  CHECK_THROWS_AS(F::scaled_dot_product_attention(randn({1, 1, 3, 4}, DType::f64, &g), q, q, true),
                  Error);  // causal with Lq > Lk
}

TEST_CASE("packed_attention: the packed projection's attention, values and gradients") {
  Generator g(13);
  for (bool causal : {false, true}) {
    CAPTURE(causal);
    const Tensor qkv = randn({2, 5, 3, 2, 4}, DType::f64, &g);
    auto part = [&](int64_t i) { return qkv.select(2, i).transpose(1, 2); };
    const Tensor want =
        F::scaled_dot_product_attention(part(0), part(1), part(2), causal).transpose(1, 2);
    const Tensor got = F::packed_attention(qkv, causal);
    CHECK(got.shape() == Shape{2, 5, 2, 4});
    CHECK(got.is_contiguous());
    KILN_CHECK_OK(compare(got, want, 1e-14, 1e-14));
    Tensor leaf5 = leaf({1, 4, 3, 2, 3});
    KILN_CHECK_OK(
        gradcheck([&](auto& in) { return F::packed_attention(in[0], causal); }, {leaf5}));
  }
  CHECK_THROWS_AS(F::packed_attention(randn({2, 5, 2, 2, 4}, DType::f64, &g)), Error);
}
