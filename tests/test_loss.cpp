// cross_entropy: values against hand computation (with and without label smoothing, i32 and
// i64 targets), gradients, error paths.
#include <doctest/doctest.h>

#include <cmath>

#include "ops/ops.h"
#include "tests/gradcheck.h"
#include "tests/test_util.h"

using namespace kiln;
using kiln::testing::compare;
using kiln::testing::gradcheck;
using kiln::testing::leaf;

namespace {

// PyTorch's definition, by hand: per row (1-ε)·(-log p_t) + ε·mean_c(-log p_c), mean over rows.
double ref_cross_entropy(const std::vector<double>& logits, const std::vector<int64_t>& target,
                         int64_t c, double eps) {
  const int64_t n = int64_t(target.size());
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    double z = 0;
    for (int64_t j = 0; j < c; ++j) z += std::exp(logits[size_t(i * c + j)]);
    auto nlp = [&](int64_t j) { return std::log(z) - logits[size_t(i * c + j)]; };
    double smooth = 0;
    for (int64_t j = 0; j < c; ++j) smooth += nlp(j);
    total += (1 - eps) * nlp(target[size_t(i)]) + eps * smooth / double(c);
  }
  return total / double(n);
}

}  // namespace

TEST_CASE("cross_entropy hand-worked value") {
  // Two rows, two classes: row 0 logits (0, 0) target 1 -> log 2; row 1 logits (0, ln 3)
  // target 1 -> p = 3/4 -> -log(3/4). Mean = (log 2 + log 4/3) / 2 = log(8/3)/2.
  Tensor logits = from_vector<double>({0, 0, 0, std::log(3.0)}, {2, 2}, DType::f64);
  Tensor target = from_vector<int64_t>({1, 1}, {2}, DType::i64);
  CHECK(F::cross_entropy(logits, target).item() == doctest::Approx(std::log(8.0 / 3.0) / 2));
  // ε = 0.5: row 0 unchanged (uniform p); row 1: 0.5·log(4/3) + 0.5·(log 4 + log(4/3))/2.
  const double row1 = 0.5 * std::log(4.0 / 3.0) + 0.25 * (std::log(4.0) + std::log(4.0 / 3.0));
  CHECK(F::cross_entropy(logits, target, 0.5).item() ==
        doctest::Approx((std::log(2.0) + row1) / 2));
}

TEST_CASE("cross_entropy matches the reference with i64 and i32 targets, with smoothing") {
  const int64_t n = 5, c = 7;
  Tensor logits = uniform({n, c}, -4.0, 4.0, DType::f64);
  std::vector<int64_t> t{0, 6, 3, 3, 1};
  std::vector<double> lv = logits.to_vector<double>();
  for (double eps : {0.0, 0.1, 1.0}) {
    CAPTURE(eps);
    const double ref = ref_cross_entropy(lv, t, c, eps);
    Tensor l64 = F::cross_entropy(logits, from_vector<int64_t>(t, {n}, DType::i64), eps);
    Tensor l32 = F::cross_entropy(logits, from_vector<int64_t>(t, {n}, DType::i32), eps);
    CHECK(l64.dim() == 0);
    CHECK(l64.item() == doctest::Approx(ref).epsilon(1e-12));
    CHECK(l32.item() == doctest::Approx(ref).epsilon(1e-12));
    Tensor l32f = F::cross_entropy(logits.to(DType::f32), from_vector<int64_t>(t, {n}, DType::i32), eps);
    CHECK(l32f.dtype() == DType::f32);
    CHECK(l32f.item() == doctest::Approx(ref).epsilon(1e-5));
  }
  // Large logits stay finite.
  Tensor big = from_vector<double>({1000, 1001, -1000, 5000}, {2, 2}, DType::f32);
  Tensor l = F::cross_entropy(big, from_vector<int64_t>({0, 0}, {2}, DType::i64), 0.1);
  CHECK(std::isfinite(l.item()));
  // Row 0: -log p = (log(1+e), log(1+e)-1) -> log(1+e) - 0.05; row 1: (6000, 0) -> 5700.
  CHECK(l.item() == doctest::Approx((std::log1p(std::exp(1.0)) - 0.05 + 5700) / 2).epsilon(1e-6));
}

// Each row's loss is kept and the rows added in order (not an OpenMP reduction, whose order is
// the runtime's): the loss and its gradient have the same bits on any thread count.
TEST_CASE("cross_entropy: the same bits on 1 to 4 threads") {
  const int64_t n = 1000, c = 100;  // n·c past the CPU kernels' parallel grain
  const Tensor logits = randn({n, c}, DType::f64);  // f64: a reordered sum shows in the loss
  std::vector<int64_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[size_t(i)] = (i * 37) % c;
  const Tensor target = from_vector<int64_t>(t, {n}, DType::i64);
  auto run = [&] {
    Tensor x = logits.detach().set_requires_grad(true);
    Tensor loss = F::cross_entropy(x, target, 0.1);
    loss.backward();
    return std::vector<Tensor>{loss.detach(), x.grad()};
  };
  const auto one = kiln::testing::on_threads(1, run);
  for (int threads : {2, 3, 4}) {
    CAPTURE(threads);
    const auto many = kiln::testing::on_threads(threads, run);
    CHECK(kiln::testing::same_bits(many[0], one[0]));
    CHECK(kiln::testing::same_bits(many[1], one[1]));
  }
}

TEST_CASE("cross_entropy gradients") {
  for (auto [n, c] : std::vector<std::pair<int64_t, int64_t>>{{1, 2}, {4, 3}, {3, 6}}) {
    CAPTURE(n);
    CAPTURE(c);
    Tensor logits = leaf({n, c}, -2.0, 2.0);
    Tensor t64 = randint(0, c, {n}, DType::i64);
    Tensor t32 = t64.to(DType::i32);
    for (double eps : {0.0, 0.2}) {
      CAPTURE(eps);
      KILN_CHECK_OK(gradcheck([&](auto& in) { return F::cross_entropy(in[0], t64, eps); }, {logits}));
      KILN_CHECK_OK(gradcheck([&](auto& in) { return F::cross_entropy(in[0], t32, eps); }, {logits}));
    }
  }
  // Upstream gradient is applied (loss used twice, scaled), and non-contiguous logits.
  Tensor x = leaf({4, 3}, -2.0, 2.0);
  Tensor t = from_vector<int64_t>({2, 0, 1}, {3}, DType::i64);
  KILN_CHECK_OK(gradcheck([&](auto& in) {
    Tensor l = F::cross_entropy(in[0].t(), t, 0.1);
    return F::add(F::mul(l, 3.0), F::mul(l, l));
  }, {x}));
}

TEST_CASE("cross_entropy gradient is (softmax - smoothed target) / N") {
  Tensor logits = from_vector<double>({1, 2, 3, 0, 0, 0}, {2, 3}, DType::f64);
  logits.set_requires_grad(true);
  Tensor t = from_vector<int64_t>({2, 0}, {2}, DType::i64);
  F::cross_entropy(logits, t, 0.3).backward();
  Tensor p = F::softmax(logits.detach(), 1);
  Tensor q = from_vector<double>({0.1, 0.1, 0.8, 0.8, 0.1, 0.1}, {2, 3}, DType::f64);
  KILN_CHECK_OK(compare(logits.grad(), F::mul(F::sub(p, q), 0.5), 1e-12, 0));
}

TEST_CASE("cross_entropy errors") {
  Tensor logits = zeros({3, 4}, DType::f64);
  try {
    F::cross_entropy(logits, from_vector<int64_t>({0, 4, 1}, {3}, DType::i64));
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("target 4 at index 1 is out of range [0, 4)") !=
          std::string::npos);
  }
  try {
    F::cross_entropy(logits, from_vector<int64_t>({0, 1, -1}, {3}, DType::i32));
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("target -1 at index 2") != std::string::npos);
  }
  // Batch-size mismatch, wrong ranks and dtypes, bad smoothing.
  CHECK_THROWS_AS(F::cross_entropy(logits, from_vector<int64_t>({0, 1}, {2}, DType::i64)), Error);
  try {
    F::cross_entropy(logits, from_vector<int64_t>({0, 1}, {2}, DType::i64));
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("batch size mismatch") != std::string::npos);
  }
  CHECK_THROWS_AS(F::cross_entropy(zeros({3}, DType::f64), from_vector<int64_t>({0, 1, 0}, {3}, DType::i64)),
                  Error);
  CHECK_THROWS_AS(F::cross_entropy(logits, zeros({3, 1}, DType::i64)), Error);
  CHECK_THROWS_AS(F::cross_entropy(logits, zeros({3}, DType::f64)), Error);
  CHECK_THROWS_AS(F::cross_entropy(logits, zeros({3}, DType::i64), -0.1), Error);
  CHECK_THROWS_AS(F::cross_entropy(zeros({0, 4}, DType::f64), zeros({0}, DType::i64)), Error);
}

TEST_CASE("cross_entropy f16 logits: loss scale applied before the one rounding (256 x 1000)") {
  // At batch 256 x 1000 classes most unscaled gradient entries (~4e-6) are f16 subnormals;
  // rounded before the 2^16 loss scale they would be off by up to ~1.5%. Each entry of the
  // scaled f16 gradient must be the FP64 value correctly rounded (within half an f16 ulp; the
  // f32 intermediate adds ~2^-24 relative, hence the 1.001).
  const int64_t n = 256, c = 1000;
  const double scale = 65536.0;
  Generator g(3);
  Tensor logits = F::mul(randn({n, c}, DType::f32, &g), 2.0).to(DType::f16);
  logits.set_requires_grad(true);
  std::vector<int64_t> tv(static_cast<size_t>(n));
  for (auto& t : tv) t = int64_t(g.below(uint64_t(c)));
  Tensor target = from_vector<int64_t>(tv, {n}, DType::i64);
  Tensor loss = F::cross_entropy(logits, target);
  CHECK(loss.dtype() == DType::f32);
  F::mul(loss, scale).backward();
  REQUIRE(logits.grad().dtype() == DType::f16);
  const std::vector<double> x = logits.detach().to(DType::f64).to_vector<double>();
  const std::vector<double> got = logits.grad().to(DType::f64).to_vector<double>();
  double worst = 0, ref_loss = 0;
  for (int64_t i = 0; i < n; ++i) {
    double m = -INFINITY, z = 0;
    for (int64_t j = 0; j < c; ++j) m = std::max(m, x[size_t(i * c + j)]);
    for (int64_t j = 0; j < c; ++j) z += std::exp(x[size_t(i * c + j)] - m);
    ref_loss += (std::log(z) + m - x[size_t(i * c + tv[size_t(i)])]) / double(n);
    for (int64_t j = 0; j < c; ++j) {
      const double p = std::exp(x[size_t(i * c + j)] - m) / z;
      const double ref = (p - (j == tv[size_t(i)] ? 1.0 : 0.0)) / double(n) * scale;
      // Half an f16 ulp: 2^-11 relative for normals, 2^-25 absolute among subnormals.
      const double tol = std::max(std::fabs(ref) / 2048, std::ldexp(1.0, -25));
      worst = std::max(worst, std::fabs(got[size_t(i * c + j)] - ref) / tol);
    }
  }
  CHECK(loss.item() == doctest::Approx(ref_loss).epsilon(1e-5));
  CHECK(worst <= 1.001);
}
