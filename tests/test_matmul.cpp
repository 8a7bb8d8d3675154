// matmul and linear: forward against a naive triple loop (f32, f64), non-contiguous operands,
// batched with broadcast, 1-D operands, gradients and error messages.
#include <doctest/doctest.h>

#include <string>

#include "ops/cpu/kernels.h"
#include "ops/ops.h"
#include "tests/gradcheck.h"
#include "tests/test_util.h"

using namespace kiln;
using kiln::testing::compare;
using kiln::testing::error_of;
using kiln::testing::gradcheck;
using kiln::testing::leaf;

namespace {

// Naive reference for (..., n, k) x (..., k, m) with broadcast batch dims: both operands are
// expanded to the common batch (a strided view, read through to_vector) and multiplied with
// a triple loop in double.
Tensor naive_matmul(const Tensor& a, const Tensor& b) {
  const int64_t n = a.size(-2), k = a.size(-1), m = b.size(-1);
  Shape batch = F::broadcast_shapes(Shape(a.shape().begin(), a.shape().end() - 2),
                                    Shape(b.shape().begin(), b.shape().end() - 2), "test");
  Shape sa = batch, sb = batch, so = batch;
  sa.insert(sa.end(), {n, k});
  sb.insert(sb.end(), {k, m});
  so.insert(so.end(), {n, m});
  std::vector<double> av = a.detach().expand(sa).to_vector<double>();
  std::vector<double> bv = b.detach().expand(sb).to_vector<double>();
  std::vector<double> out(size_t(shape_numel(so)), 0.0);
  const int64_t nb = shape_numel(batch);
  for (int64_t p = 0; p < nb; ++p)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < m; ++j) {
        double s = 0;
        for (int64_t l = 0; l < k; ++l)
          s += av[size_t(p * n * k + i * k + l)] * bv[size_t(p * k * m + l * m + j)];
        out[size_t(p * n * m + i * m + j)] = s;
      }
  return from_vector<double>(out, so, DType::f64);
}

double tol_for(DType dt) { return dt == DType::f32 ? 1e-4 : 1e-11; }

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

// A portable build computes the same bits on every x86-64 CPU only if Eigen's GEMM blocks, which
// set the order of its sums, do not follow the CPU's cache sizes: kiln compiles Eigen without
// cpuid (EIGEN_NO_CPUID, CMakeLists.txt), so it takes its fixed defaults. (Under qemu's emulated
// CPUs, with other caches, tests/emulated_cpu.sh compares whole training steps.)
TEST_CASE("Eigen's GEMM blocking does not follow the CPU's cache sizes") {
  const cpu::GemmCacheSizes s = cpu::gemm_cache_sizes();
  CHECK(s.queried_l1 == -1);  // cpuid not asked
#if defined(__x86_64__) || defined(__i386__)
  // Eigen 3.4's defaults for x86 (GeneralBlockPanelKernel.h)
  CHECK(s.l1 == 32 * 1024);
  CHECK(s.l2 == 256 * 1024);
  CHECK(s.l3 == 2 * 1024 * 1024);
#endif
}

// Products from n·k·m = 2^21 on are split into fixed 128 × 256 tiles of the output, each one
// single-threaded Eigen GEMM (Eigen's own threads are off, EIGEN_DONT_PARALLELIZE): right at every
// tile edge and transpose, and the same bits on any thread count.
TEST_CASE("large products: tiled right, and the same bits on 1 to 4 threads") {
  // Eigen would not split a GEMM itself, even on 4 threads.
  CHECK(testing::on_threads(4, [] { return cpu::gemm_cache_sizes().threads; }) == 1);
  for (DType dt : {DType::f32, DType::f64}) {
    CAPTURE(dtype_name(dt));
    // (n, k, m): tiles that end inside a row and a column tile, one row tile, one column tile.
    for (auto [n, k, m] : std::vector<std::array<int64_t, 3>>{
             {300, 130, 600}, {64, 700, 520}, {1000, 80, 200}, {129, 400, 257}}) {
      CAPTURE(n);
      CAPTURE(k);
      CAPTURE(m);
      REQUIRE(n * k * m >= (int64_t(1) << 21));
      const Tensor a = randn({n, k}, dt), b = randn({k, m}, dt);
      const Tensor at = a.t().contiguous().t(), bt = b.t().contiguous().t();  // transposed storage
      const Tensor want = naive_matmul(a, b);
      for (auto [x, y] :
           std::vector<std::pair<Tensor, Tensor>>{{a, b}, {at, b}, {a, bt}, {at, bt}}) {
        const Tensor one = testing::on_threads(1, [&] { return F::matmul(x, y); });
        KILN_CHECK_OK(compare(one, want, tol_for(dt), tol_for(dt)));
        for (int t : {2, 3, 4}) {
          CAPTURE(t);
          CHECK(testing::same_bits(testing::on_threads(t, [&] { return F::matmul(x, y); }), one));
        }
      }
    }
    // Batched: tiles of each product spread over the threads together.
    const Tensor a3 = randn({3, 150, 96}, dt), b3 = randn({3, 96, 300}, dt);
    const Tensor one = testing::on_threads(1, [&] { return F::matmul(a3, b3); });
    KILN_CHECK_OK(compare(one, naive_matmul(a3, b3), tol_for(dt), tol_for(dt)));
    for (int t : {2, 3})
      CHECK(testing::same_bits(testing::on_threads(t, [&] { return F::matmul(a3, b3); }), one));
  }
}

TEST_CASE("matmul 2-D forward against a naive loop, f32 and f64") {
  // a hand-worked case first
  Tensor a = from_vector<double>({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = from_vector<double>({7, 8, 9, 10, 11, 12}, {3, 2});
  CHECK(F::matmul(a, b).to_vector<double>() == std::vector<double>{58, 64, 139, 154});
  for (DType dt : {DType::f32, DType::f64}) {
    CAPTURE(dtype_name(dt));
    for (auto [n, k, m] : std::vector<std::array<int64_t, 3>>{
             {1, 1, 1}, {3, 4, 5}, {17, 33, 9}, {1, 40, 70}, {130, 70, 65}}) {
      CAPTURE(n);
      CAPTURE(k);
      CAPTURE(m);
      Tensor x = randn({n, k}, dt), y = randn({k, m}, dt);
      Tensor c = F::matmul(x, y);
      CHECK(c.dtype() == dt);
      CHECK(c.shape() == Shape{n, m});
      KILN_CHECK_OK(compare(c, naive_matmul(x, y), tol_for(dt), tol_for(dt)));
    }
  }
}

TEST_CASE("matmul with non-contiguous operands") {
  for (DType dt : {DType::f32, DType::f64}) {
    CAPTURE(dtype_name(dt));
    const int64_t n = 6, k = 5, m = 7;
    Tensor a = randn({n, k}, dt), b = randn({k, m}, dt);
    Tensor at = randn({k, n}, dt).t(), bt = randn({m, k}, dt).t();  // transposed views
    Tensor as = randn({n, 2 * k}, dt).slice(1, 0, 2 * k, 2);        // strided, not transposed
    for (auto [x, y] : std::vector<std::pair<Tensor, Tensor>>{
             {at, b}, {a, bt}, {at, bt}, {as, b}, {as, bt}}) {
      CHECK_FALSE((x.is_contiguous() && y.is_contiguous()));
      KILN_CHECK_OK(compare(F::matmul(x, y), naive_matmul(x, y), tol_for(dt), tol_for(dt)));
    }
    // batched transposed view and an expanded (stride-0) operand
    Tensor bat = randn({3, m, k}, dt).transpose(1, 2);  // (3, k, m)
    Tensor a3 = randn({3, n, k}, dt);
    KILN_CHECK_OK(compare(F::matmul(a3, bat), naive_matmul(a3, bat), tol_for(dt), tol_for(dt)));
    Tensor aex = randn({1, n, k}, dt).expand({3, n, k});
    KILN_CHECK_OK(compare(F::matmul(aex, bat), naive_matmul(aex, bat), tol_for(dt), tol_for(dt)));
  }
}

TEST_CASE("batched matmul with broadcast batch dims") {
  for (DType dt : {DType::f32, DType::f64}) {
    CAPTURE(dtype_name(dt));
    struct Case {
      Shape a, b, out;
    };
    for (auto [sa, sb, so] : std::vector<Case>{
             {{2, 3, 4, 5}, {2, 3, 5, 6}, {2, 3, 4, 6}},
             {{2, 1, 4, 5}, {3, 5, 6}, {2, 3, 4, 6}},
             {{4, 5}, {2, 5, 6}, {2, 4, 6}},
             {{2, 4, 5}, {5, 6}, {2, 4, 6}},        // b shared: folded into one GEMM
             {{2, 4, 5}, {1, 5, 6}, {2, 4, 6}},
             {{3, 4, 5}, {1, 1, 5, 6}, {1, 3, 4, 6}},
             {{1, 4, 5}, {3, 5, 6}, {3, 4, 6}},
             {{0, 4, 5}, {5, 6}, {0, 4, 6}}}) {
      CAPTURE(shape_str(sa));
      CAPTURE(shape_str(sb));
      Tensor a = randn(sa, dt), b = randn(sb, dt);
      Tensor c = F::matmul(a, b);
      CHECK(c.shape() == so);
      KILN_CHECK_OK(compare(c, naive_matmul(a, b), tol_for(dt), tol_for(dt)));
    }
  }
  // empty inner dim gives zeros
  CHECK(F::matmul(ones({2, 0}), ones({0, 3})).to_vector<float>() == std::vector<float>(6, 0.f));
}

TEST_CASE("matmul with 1-D operands") {
  Tensor v = from_vector<double>({1, 2, 3}, {3}, DType::f64);
  Tensor m = from_vector<double>({1, 0, 2, 1, 0, 3}, {3, 2}, DType::f64);  // (3, 2)
  Tensor r = F::matmul(v, m);
  CHECK(r.shape() == Shape{2});
  CHECK(r.to_vector<double>() == std::vector<double>{5, 11});
  Tensor l = F::matmul(m.t(), v);
  CHECK(l.shape() == Shape{2});
  CHECK(l.to_vector<double>() == std::vector<double>{5, 11});
  Tensor d = F::matmul(v, v);
  CHECK(d.dim() == 0);
  CHECK(d.item() == 14.0);
  Tensor bat = randn({4, 2, 3}, DType::f64);
  Tensor bv = F::matmul(bat, v);
  CHECK(bv.shape() == Shape{4, 2});
  KILN_CHECK_OK(compare(bv, naive_matmul(bat, v.unsqueeze(-1)).squeeze(-1), 1e-12, 1e-12));
}

TEST_CASE("matmul gradients") {
  auto mm = [](auto& in) { return F::matmul(in[0], in[1]); };
  for (auto [sa, sb] : std::vector<std::pair<Shape, Shape>>{
           {{3, 4}, {4, 2}},
           {{1, 3}, {3, 1}},
           {{2, 3, 4}, {2, 4, 2}},
           {{2, 1, 3, 4}, {3, 4, 2}},  // both batches broadcast
           {{2, 3, 4}, {4, 5}},        // shared b (folded forward and dB)
           {{2, 3, 4}, {1, 4, 5}},
           {{3, 4}, {2, 4, 2}},        // shared a
           {{4}, {4, 3}},
           {{3, 4}, {4}},
           {{4}, {4}},
           {{2, 3, 4}, {4}}}) {
    CAPTURE(shape_str(sa));
    CAPTURE(shape_str(sb));
    KILN_CHECK_OK(gradcheck(mm, {leaf(sa), leaf(sb)}));
  }
  // transposed operands inside the graph
  Tensor a = leaf({4, 3}), b = leaf({5, 4});
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::matmul(in[0].t(), in[1].t()); }, {a, b}));
  Tensor a3 = leaf({2, 4, 3});
  KILN_CHECK_OK(
      gradcheck([](auto& in) { return F::matmul(in[0].transpose(1, 2), in[1]); }, {a3, leaf({4, 2})}));
  // one input without grad: it gets none, the other is still right
  Tensor c = leaf({3, 4});
  Tensor fixed = randn({4, 2}, DType::f64);
  KILN_CHECK_OK(gradcheck([&](auto& in) { return F::matmul(in[0], fixed); }, {c}));
  CHECK_FALSE(fixed.grad().defined());
  // x·x with the same tensor on both sides
  Tensor sq = leaf({3, 3});
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::matmul(in[0], in[0]); }, {sq}));
}

TEST_CASE("linear forward and gradients") {
  for (DType dt : {DType::f32, DType::f64}) {
    CAPTURE(dtype_name(dt));
    Tensor x = randn({5, 7}, dt), w = randn({3, 7}, dt), bias = randn({3}, dt);
    Tensor ref = naive_matmul(x, w.t());
    KILN_CHECK_OK(compare(F::linear(x, w), ref, tol_for(dt), tol_for(dt)));
    Tensor yb = F::linear(x, w, bias);
    CHECK(yb.shape() == Shape{5, 3});
    CHECK(yb.dtype() == dt);
    KILN_CHECK_OK(compare(yb, F::add(ref, bias.to(DType::f64)), tol_for(dt), tol_for(dt)));
    // non-contiguous x and weight
    Tensor xt = randn({7, 5}, dt).t(), wt = randn({7, 3}, dt).t();
    KILN_CHECK_OK(compare(F::linear(xt, wt, bias), F::add(naive_matmul(xt, wt.t()), bias.to(DType::f64)),
                          tol_for(dt), tol_for(dt)));
  }
  Tensor x = leaf({4, 5}), w = leaf({3, 5}), b = leaf({3});
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::linear(in[0], in[1], in[2]); }, {x, w, b}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::linear(in[0], in[1]); }, {x, w}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::linear(in[0], in[1], in[2]); }, {leaf({1, 1}), leaf({1, 1}), leaf({1})}));
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::linear(in[0].t(), in[1], in[2]); }, {leaf({5, 4}), w, b}));
  // only some inputs require grad
  Tensor xf = randn({4, 5}, DType::f64), bf = randn({3}, DType::f64);
  KILN_CHECK_OK(gradcheck([&](auto& in) { return F::linear(xf, in[0], bf); }, {w}));
  KILN_CHECK_OK(gradcheck([&](auto& in) { return F::linear(in[0], in[1], bf); }, {x, w}));
  CHECK_FALSE(xf.grad().defined());
  CHECK_FALSE(bf.grad().defined());
  // db = Σ_n dy exactly
  Tensor b2 = leaf({3});
  F::sum(F::linear(randn({6, 5}, DType::f64), randn({3, 5}, DType::f64), b2)).backward();
  CHECK(b2.grad().to_vector<double>() == std::vector<double>{6, 6, 6});
}

TEST_CASE("matmul and linear errors name the shapes") {
  std::string e = error_of([] { F::matmul(ones({2, 3}), ones({4, 5})); });
  CHECK(contains(e, "matmul"));
  CHECK(contains(e, "[2, 3]"));
  CHECK(contains(e, "[4, 5]"));
  e = error_of([] { F::matmul(ones({2, 3, 4}), ones({3, 4, 5})); });  // batch 2 vs 3
  CHECK(contains(e, "[2, 3, 4]"));
  CHECK(contains(e, "[3, 4, 5]"));
  e = error_of([] { F::matmul(ones({3}), ones({4})); });
  CHECK(contains(e, "[3]"));
  CHECK(contains(e, "[4]"));
  e = error_of([] { F::matmul(ones({2, 3}), ones({3, 2}, DType::f64)); });
  CHECK(contains(e, "dtype mismatch"));
  CHECK(contains(e, "f32"));
  CHECK(contains(e, "f64"));
  CHECK_THROWS_AS(F::matmul(ones({}), ones({2})), Error);
  CHECK_THROWS_AS(F::matmul(ones({2, 2}, DType::i64), ones({2, 2}, DType::i64)), Error);
  CHECK_THROWS_AS(F::matmul(Tensor(), ones({2, 2})), Error);

  e = error_of([] { F::linear(ones({4, 5}), ones({3, 6})); });
  CHECK(contains(e, "linear"));
  CHECK(contains(e, "[4, 5]"));
  CHECK(contains(e, "[3, 6]"));
  e = error_of([] { F::linear(ones({4, 5}), ones({3, 5}), ones({4})); });
  CHECK(contains(e, "bias"));
  CHECK(contains(e, "[4]"));
  e = error_of([] { F::linear(ones({4, 5}), ones({3, 5}, DType::f64)); });
  CHECK(contains(e, "dtype mismatch"));
  CHECK_THROWS_AS(F::linear(ones({4, 5}), ones({3, 5}), ones({3}, DType::f64)), Error);
  CHECK_THROWS_AS(F::linear(ones({2, 4, 5}), ones({3, 5})), Error);
  CHECK_THROWS_AS(F::linear(ones({5}), ones({3, 5})), Error);
}
