// batch_norm: training and eval forward against a naive f64 reference, running statistics,
// NHWC and (N, C) inputs, gradients, error paths.
#include <doctest/doctest.h>

#include <cmath>

#include "ops/ops.h"
#include "tests/gradcheck.h"

using namespace kiln;
using kiln::testing::compare;
using kiln::testing::gradcheck;
using kiln::testing::leaf;

namespace {

constexpr double kEps = 1e-5;

// Batch statistics of x (N, C, ...) computed by hand in f64, in logical order.
struct RefStats {
  std::vector<double> mean, var_biased, var_unbiased;
};

RefStats ref_stats(const Tensor& x) {
  const int64_t n = x.size(0), c = x.size(1), s = x.numel() / (n * c);
  std::vector<double> v = x.to_vector<double>();
  RefStats r;
  for (int64_t ch = 0; ch < c; ++ch) {
    double sum = 0, sq = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < s; ++k) sum += v[size_t((i * c + ch) * s + k)];
    const double m = sum / double(n * s);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < s; ++k) sq += std::pow(v[size_t((i * c + ch) * s + k)] - m, 2);
    r.mean.push_back(m);
    r.var_biased.push_back(sq / double(n * s));
    r.var_unbiased.push_back(sq / double(n * s - 1));
  }
  return r;
}

// y = (x - mean)/sqrt(var + eps)*w + b per channel, in f64, shaped like x (contiguous).
Tensor ref_normalise(const Tensor& x, const std::vector<double>& mean,
                     const std::vector<double>& var, const std::vector<double>& w,
                     const std::vector<double>& b) {
  const int64_t n = x.size(0), c = x.size(1), s = x.numel() / (n * c);
  std::vector<double> v = x.to_vector<double>(), y(v.size());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t ch = 0; ch < c; ++ch)
      for (int64_t k = 0; k < s; ++k) {
        const size_t o = size_t((i * c + ch) * s + k);
        y[o] = (v[o] - mean[size_t(ch)]) / std::sqrt(var[size_t(ch)] + kEps) * w[size_t(ch)] +
               b[size_t(ch)];
      }
  return from_vector<double>(y, x.shape(), DType::f64);
}

Tensor vec(const std::vector<double>& v, DType dt = DType::f64) {
  return from_vector<double>(v, {int64_t(v.size())}, DType::f64).to(dt);
}

}  // namespace

TEST_CASE("batch_norm training forward and running stats after two steps") {
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    const double tol = dt == DType::f64 ? 1e-10 : 1e-4;
    Generator gen(7);
    Tensor x1 = randn({3, 4, 2, 3}, dt, &gen), x2 = randn({3, 4, 2, 3}, dt, &gen);
    x2 = F::add(F::mul(x2, 2.0), 0.5);  // different statistics in step 2
    std::vector<double> w{0.5, -1.0, 2.0, 1.5}, b{0.1, 0.2, -0.3, 0.0};
    Tensor rm = zeros({4}, dt), rv = ones({4}, dt);
    Tensor y1 = F::batch_norm(x1, vec(w, dt), vec(b, dt), rm, rv, true, 0.1, kEps);
    RefStats s1 = ref_stats(x1);
    KILN_CHECK_OK(compare(y1, ref_normalise(x1, s1.mean, s1.var_biased, w, b), tol, tol));
    Tensor y2 = F::batch_norm(x2, vec(w, dt), vec(b, dt), rm, rv, true, 0.1, kEps);
    RefStats s2 = ref_stats(x2);
    KILN_CHECK_OK(compare(y2, ref_normalise(x2, s2.mean, s2.var_biased, w, b), tol, tol));
    std::vector<double> erm(4), erv(4);
    for (size_t c = 0; c < 4; ++c) {
      erm[c] = 0.9 * (0.9 * 0.0 + 0.1 * s1.mean[c]) + 0.1 * s2.mean[c];
      erv[c] = 0.9 * (0.9 * 1.0 + 0.1 * s1.var_unbiased[c]) + 0.1 * s2.var_unbiased[c];
    }
    KILN_CHECK_OK(compare(rm, vec(erm), tol, tol));
    KILN_CHECK_OK(compare(rv, vec(erv), tol, tol));
  }
}

TEST_CASE("batch_norm training without affine parameters or running stats") {
  Tensor x = uniform({4, 3, 5}, -2.0, 3.0, DType::f64);
  Tensor y = F::batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), true);
  RefStats s = ref_stats(x);
  KILN_CHECK_OK(compare(y, ref_normalise(x, s.mean, s.var_biased, {1, 1, 1}, {0, 0, 0}), 1e-10, 1e-10));
}

TEST_CASE("batch_norm eval uses the running stats and leaves them unchanged") {
  Tensor x = randn({2, 3, 3, 2}, DType::f64);
  std::vector<double> m{0.5, -0.2, 1.0}, v{2.0, 0.5, 1.3}, w{1.5, 0.7, -0.4}, b{0.0, 1.0, 2.0};
  Tensor rm = vec(m), rv = vec(v);
  Tensor y = F::batch_norm(x, vec(w), vec(b), rm, rv, false, 0.1, kEps);
  KILN_CHECK_OK(compare(y, ref_normalise(x, m, v, w, b), 1e-12, 1e-12));
  CHECK(rm.to_vector<double>() == m);
  CHECK(rv.to_vector<double>() == v);
}

TEST_CASE("batch_norm (N, C) input") {
  Tensor x = randn({6, 3}, DType::f64);
  std::vector<double> w{1.0, 2.0, 3.0}, b{-1.0, 0.0, 1.0};
  Tensor rm = zeros({3}, DType::f64), rv = ones({3}, DType::f64);
  Tensor y = F::batch_norm(x, vec(w), vec(b), rm, rv, true, 0.1, kEps);
  RefStats s = ref_stats(x);
  KILN_CHECK_OK(compare(y, ref_normalise(x, s.mean, s.var_biased, w, b), 1e-10, 1e-10));
  std::vector<double> erv(3);
  for (size_t c = 0; c < 3; ++c) erv[c] = 0.9 + 0.1 * s.var_unbiased[c];
  KILN_CHECK_OK(compare(rv, vec(erv), 1e-12, 1e-12));
  Tensor ye = F::batch_norm(x, vec(w), vec(b), rm, rv, false, 0.1, kEps);
  KILN_CHECK_OK(compare(ye, ref_normalise(x, rm.to_vector<double>(), erv, w, b), 1e-10, 1e-10));
}

TEST_CASE("batch_norm NHWC input keeps its layout and matches NCHW") {
  Tensor x = randn({2, 3, 4, 5}, DType::f64);
  Tensor xl = x.contiguous(MemoryFormat::ChannelsLast);
  REQUIRE(xl.suggest_memory_format() == MemoryFormat::ChannelsLast);
  Tensor w = vec({0.5, 1.0, -2.0}), b = vec({1.0, 0.0, 0.3});
  for (bool training : {true, false}) {
    CAPTURE(training);
    Tensor rm = vec({0.1, 0.2, 0.3}), rv = vec({1.0, 2.0, 0.5});
    Tensor rm2 = vec({0.1, 0.2, 0.3}), rv2 = vec({1.0, 2.0, 0.5});
    Tensor y = F::batch_norm(xl, w, b, rm, rv, training);
    Tensor ref = F::batch_norm(x, w, b, rm2, rv2, training);
    CHECK(y.suggest_memory_format() == MemoryFormat::ChannelsLast);
    KILN_CHECK_OK(compare(y, ref, 1e-12, 1e-12));
    KILN_CHECK_OK(compare(rv, rv2, 1e-12, 1e-12));
    // Backward with a row-major upstream gradient into the NHWC path gives the NCHW gradients.
    Tensor a = xl.detach().set_requires_grad(true), a2 = x.detach().set_requires_grad(true);
    Tensor wa = w.detach().set_requires_grad(true), wa2 = w.detach().set_requires_grad(true);
    Tensor g = randn(x.shape(), DType::f64);
    F::batch_norm(a, wa, b, rm, rv, training).backward(g);
    F::batch_norm(a2, wa2, b, rm2, rv2, training).backward(g);
    KILN_CHECK_OK(compare(a.grad(), a2.grad(), 1e-12, 1e-12));
    KILN_CHECK_OK(compare(wa.grad(), wa2.grad(), 1e-12, 1e-12));
  }
}

TEST_CASE("batch_norm training gradients") {
  for (Shape shape : std::vector<Shape>{{4, 3}, {2, 3, 2, 2}, {3, 2, 5}, {1, 2, 2, 3}}) {
    CAPTURE(shape_str(shape));
    const int64_t c = shape[1];
    Tensor x = leaf(shape, -2.0, 2.0), w = leaf({c}, 0.5, 1.5), b = leaf({c});
    KILN_CHECK_OK(gradcheck([](auto& in) {
      return F::batch_norm(in[0], in[1], in[2], Tensor(), Tensor(), true);
    }, {x, w, b}));
    // Without affine parameters, with running stats being updated (they do not affect y).
    Tensor rm = zeros({c}, DType::f64), rv = ones({c}, DType::f64);
    KILN_CHECK_OK(gradcheck([&](auto& in) {
      return F::batch_norm(in[0], Tensor(), Tensor(), rm, rv, true);
    }, {x}));
  }
  // NHWC path: the leaf is laid out channels-last inside f.
  Tensor x = leaf({2, 3, 2, 3}, -2.0, 2.0), w = leaf({3}, 0.5, 1.5), b = leaf({3});
  KILN_CHECK_OK(gradcheck([](auto& in) {
    Tensor xl = in[0].contiguous(MemoryFormat::ChannelsLast);
    return F::batch_norm(xl, in[1], in[2], Tensor(), Tensor(), true);
  }, {x, w, b}));
  // Only the weight requires grad.
  Tensor xc = randn({3, 2, 2}, DType::f64), w2 = leaf({2}, 0.5, 1.5);
  KILN_CHECK_OK(gradcheck([&](auto& in) {
    return F::batch_norm(xc, in[0], Tensor(), Tensor(), Tensor(), true);
  }, {w2}));
}

TEST_CASE("batch_norm eval gradients") {
  for (Shape shape : std::vector<Shape>{{4, 3}, {2, 3, 2, 2}, {3, 2, 5}}) {
    CAPTURE(shape_str(shape));
    const int64_t c = shape[1];
    Tensor x = leaf(shape, -2.0, 2.0), w = leaf({c}, 0.5, 1.5), b = leaf({c});
    Tensor rm = uniform({c}, -0.5, 0.5, DType::f64), rv = uniform({c}, 0.5, 2.0, DType::f64);
    KILN_CHECK_OK(gradcheck([&](auto& in) {
      return F::batch_norm(in[0], in[1], in[2], rm, rv, false);
    }, {x, w, b}));
    KILN_CHECK_OK(gradcheck([&](auto& in) {
      return F::batch_norm(in[0], Tensor(), Tensor(), rm, rv, false);
    }, {x}));
  }
  Tensor x = leaf({2, 3, 2, 2}, -2.0, 2.0), w = leaf({3}, 0.5, 1.5), b = leaf({3});
  Tensor rm = vec({0.1, -0.2, 0.3}), rv = vec({0.9, 1.1, 1.7});
  KILN_CHECK_OK(gradcheck([&](auto& in) {
    Tensor xl = in[0].contiguous(MemoryFormat::ChannelsLast);
    return F::batch_norm(xl, in[1], in[2], rm, rv, false);
  }, {x, w, b}));
}

TEST_CASE("batch_norm training dx of a constant upstream gradient is zero") {
  // Σ over the batch of dx is 0 per channel and dx ⟂ x̂: with dy = 1 everywhere, dx = 0 exactly
  // in exact arithmetic, and dbias = N·S.
  Tensor x = leaf({3, 2, 4}, -1.0, 1.0), w = leaf({2}, 0.5, 1.5), b = leaf({2});
  F::sum(F::batch_norm(x, w, b, Tensor(), Tensor(), true)).backward();
  KILN_CHECK_OK(compare(x.grad(), zeros({3, 2, 4}, DType::f64), 1e-12, 0));
  KILN_CHECK_OK(compare(b.grad(), vec({12.0, 12.0}), 1e-12, 0));
}

TEST_CASE("batch_norm errors") {
  Tensor x = randn({4, 3, 2, 2}, DType::f64);
  Tensor rm = zeros({3}, DType::f64), rv = ones({3}, DType::f64);
  CHECK_THROWS_AS(F::batch_norm(x, ones({4}, DType::f64), Tensor(), rm, rv, true), Error);
  CHECK_THROWS_AS(F::batch_norm(x, Tensor(), zeros({3, 1}, DType::f64), rm, rv, true), Error);
  CHECK_THROWS_AS(F::batch_norm(x, Tensor(), Tensor(), Tensor(), Tensor(), false), Error);
  CHECK_THROWS_AS(F::batch_norm(x, Tensor(), Tensor(), rm, Tensor(), true), Error);
  CHECK_THROWS_AS(F::batch_norm(x, ones({3}, DType::f32), Tensor(), rm, rv, true), Error);
  CHECK_THROWS_AS(F::batch_norm(randn({3}, DType::f64), Tensor(), Tensor(), Tensor(), Tensor(), true),
                  Error);
  CHECK_THROWS_AS(F::batch_norm(randn({1, 3}, DType::f64), Tensor(), Tensor(), rm, rv, true), Error);
  CHECK_THROWS_AS(F::batch_norm(ones({2, 3}, DType::i64), Tensor(), Tensor(), Tensor(), Tensor(), true),
                  Error);
  try {
    F::batch_norm(x, ones({5}, DType::f64), Tensor(), rm, rv, true);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("batch_norm: weight must be (3)") != std::string::npos);
  }
  // Running stats that require grad cannot be updated in place while recording.
  Tensor rg = zeros({3}, TensorOptions(DType::f64).with_requires_grad());
  CHECK_THROWS_AS(F::batch_norm(x, Tensor(), Tensor(), rg, rv, true), Error);
}

TEST_CASE("batch_norm_relu is relu(batch_norm(x) + residual), differentiable in every input") {
  using kiln::testing::gradcheck;
  using kiln::testing::leaf;
  for (bool with_residual : {false, true}) {
    CAPTURE(with_residual);
    Tensor x = leaf({3, 4, 3, 2}, -2, 2), z = leaf({3, 4, 3, 2}, -1, 1);
    Tensor w = leaf({4}, 0.5, 1.5), b = leaf({4}, -0.3, 0.3);
    Tensor rm = zeros({4}, DType::f64), rv = ones({4}, DType::f64);
    Tensor rm2 = zeros({4}, DType::f64), rv2 = ones({4}, DType::f64);
    Tensor residual = with_residual ? z : Tensor();
    Tensor got = F::batch_norm_relu(x, residual, w, b, rm, rv, true, 0.1, 1e-5);
    Tensor want = F::batch_norm(x, w, b, rm2, rv2, true, 0.1, 1e-5);
    if (with_residual) want = F::add(want, z);
    want = F::relu(want);
    KILN_CHECK_OK(kiln::testing::compare(got, want, 0, 0));
    KILN_CHECK_OK(kiln::testing::compare(rm, rm2, 0, 0));
    KILN_CHECK_OK(kiln::testing::compare(rv, rv2, 0, 0));
    std::vector<Tensor> inputs = {x, w, b};
    if (with_residual) inputs.push_back(z);
    KILN_CHECK_OK(gradcheck(
        [&](const std::vector<Tensor>& in) {
          Tensor r = in.size() > 3 ? in[3] : Tensor();
          return F::batch_norm_relu(in[0], r, in[1], in[2], Tensor(), Tensor(), true);
        },
        inputs));
  }
}

TEST_CASE("batch_norm_relu_max_pool is max_pool2d(relu(batch_norm(x))), differentiable") {
  using kiln::testing::gradcheck;
  using kiln::testing::leaf;
  // The stem's 3x3/2 pool with padding 1 and another pool; the CPU runs the composition.
  for (int64_t k : {3, 2}) {
    CAPTURE(k);
    const int64_t s = 2, pad = k == 3 ? 1 : 0;
    Tensor x = leaf({2, 3, 5, 6}, -2, 2), w = leaf({3}, 0.5, 1.5), b = leaf({3}, -0.3, 0.3);
    F::BatchNormParams p{w, b, zeros({3}, DType::f64), ones({3}, DType::f64), 0.1, 1e-5};
    Tensor rm2 = zeros({3}, DType::f64), rv2 = ones({3}, DType::f64);
    Tensor got = F::batch_norm_relu_max_pool(x, F::ChannelStats{}, p, true, k, s, pad);
    Tensor want = F::max_pool2d(F::relu(F::batch_norm(x, w, b, rm2, rv2, true)), k, s, pad);
    KILN_CHECK_OK(kiln::testing::compare(got, want, 0, 0));
    KILN_CHECK_OK(kiln::testing::compare(p.running_mean, rm2, 0, 0));
    KILN_CHECK_OK(kiln::testing::compare(p.running_var, rv2, 0, 0));
    KILN_CHECK_OK(gradcheck(
        [&](const std::vector<Tensor>& in) {
          return F::batch_norm_relu_max_pool(in[0], F::ChannelStats{},
                                             F::BatchNormParams{in[1], in[2], Tensor(), Tensor()},
                                             true, k, s, pad);
        },
        {x, w, b}));
  }
}

TEST_CASE("batch_norm_from_stats with GELU is gelu(batch_norm(x) [+ residual]), differentiable") {
  for (bool with_residual : {false, true}) {
    CAPTURE(with_residual);
    Tensor x = leaf({3, 4, 3, 2}, -2, 2), z = leaf({3, 4, 3, 2}, -1, 1);
    Tensor w = leaf({4}, 0.5, 1.5), b = leaf({4}, -0.3, 0.3);
    Tensor rm = zeros({4}, DType::f64), rv = ones({4}, DType::f64);
    Tensor rm2 = zeros({4}, DType::f64), rv2 = ones({4}, DType::f64);
    Tensor counter = zeros({}, DType::i64);
    Tensor residual = with_residual ? z : Tensor();
    Tensor got = F::batch_norm_from_stats(x, F::ChannelStats{}, residual, Activation::Gelu, w, b,
                                          rm, rv, true, 0.1, 1e-5, counter);
    Tensor want = F::batch_norm(x, w, b, rm2, rv2, true, 0.1, 1e-5);
    if (with_residual) want = F::add(want, z);
    want = F::gelu(want);
    KILN_CHECK_OK(compare(got, want, 0, 0));
    KILN_CHECK_OK(compare(rm, rm2, 0, 0));
    KILN_CHECK_OK(compare(rv, rv2, 0, 0));
    CHECK(counter.item() == 1.0);
    std::vector<Tensor> inputs = {x, w, b};
    if (with_residual) inputs.push_back(z);
    KILN_CHECK_OK(gradcheck(
        [&](const std::vector<Tensor>& in) {
          Tensor r = in.size() > 3 ? in[3] : Tensor();
          return F::batch_norm_from_stats(in[0], F::ChannelStats{}, r, Activation::Gelu, in[1],
                                          in[2], Tensor(), Tensor(), true);
        },
        inputs));
    // Activation::None and Relu are the bool forms.
    for (Activation act : {Activation::None, Activation::Relu}) {
      Tensor a = F::batch_norm_from_stats(x, F::ChannelStats{}, residual, act, w, b, Tensor(),
                                          Tensor(), true);
      Tensor c = F::batch_norm_from_stats(x, F::ChannelStats{}, residual, act == Activation::Relu,
                                          w, b, Tensor(), Tensor(), true);
      KILN_CHECK_OK(compare(a, c, 0, 0));
    }
  }
}

// A BatchNorm2d's num_batches_tracked handed to the F ops (nn::ConvBnRef does): +1 per training
// call, none in eval — here through the compositions the CPU runs.
TEST_CASE("the F batch-norm ops count num_batches_tracked once per training call") {
  auto params = [] {
    F::BatchNormParams p{ones({3}, DType::f64), zeros({3}, DType::f64), zeros({3}, DType::f64),
                         ones({3}, DType::f64)};
    p.num_batches_tracked = zeros({}, DType::i64);
    return p;
  };
  auto count = [](const F::BatchNormParams& p) { return p.num_batches_tracked.item(); };
  Tensor x = leaf({2, 3, 5, 6}, -2, 2), r = leaf({2, 3, 5, 6}, -2, 2);
  F::BatchNormParams p = params(), q = params();
  auto from_stats = [&](bool training) {
    return F::batch_norm_from_stats(x, F::ChannelStats{}, r, true, p.weight, p.bias,
                                    p.running_mean, p.running_var, training, p.momentum, p.eps,
                                    p.num_batches_tracked);
  };
  from_stats(true);
  CHECK(count(p) == 1.0);
  from_stats(false);
  CHECK(count(p) == 1.0);
  F::batch_norm_add_batch_norm_relu(x, F::ChannelStats{}, p, r, F::ChannelStats{}, q, true);
  CHECK(count(p) == 2.0);
  CHECK(count(q) == 1.0);
  F::batch_norm_relu_max_pool(x, F::ChannelStats{}, q, true, 3, 2, 1);
  CHECK(count(q) == 2.0);
  F::batch_norm_relu_max_pool(x, F::ChannelStats{}, q, false, 3, 2, 1);
  CHECK(count(q) == 2.0);
}

TEST_CASE("batch_norm_relu_conv1x1 is conv2d(relu(batch_norm(x)), w), differentiable") {
  using kiln::testing::gradcheck;
  using kiln::testing::leaf;
  // The CPU runs the composition; the GPU's fused path is checked against it bit for bit in
  // tests/gpu/test_wgrad1x1.cpp.
  Tensor x = leaf({2, 4, 3, 5}, -2, 2), w = leaf({4}, 0.5, 1.5), b = leaf({4}, -0.3, 0.3);
  Tensor cw = leaf({6, 4, 1, 1}, -0.5, 0.5);
  Tensor counter = zeros({}, DType::i64);
  F::BatchNormParams p{w, b, zeros({4}, DType::f64), ones({4}, DType::f64), 0.1, 1e-5, counter};
  Tensor rm2 = zeros({4}, DType::f64), rv2 = ones({4}, DType::f64);
  F::ChannelStats s;
  Tensor got = F::batch_norm_relu_conv1x1(x, F::ChannelStats{}, p, true, cw, &s);
  Tensor want = F::conv2d(F::relu(F::batch_norm(x, w, b, rm2, rv2, true, 0.1, 1e-5)), cw);
  KILN_CHECK_OK(kiln::testing::compare(got, want, 0, 0));
  KILN_CHECK_OK(kiln::testing::compare(p.running_mean, rm2, 0, 0));
  KILN_CHECK_OK(kiln::testing::compare(p.running_var, rv2, 0, 0));
  CHECK(counter.item() == 1.0);
  CHECK_FALSE(s.defined());  // the CPU's convolution gives no statistics
  KILN_CHECK_OK(gradcheck(
      [&](const std::vector<Tensor>& in) {
        return F::batch_norm_relu_conv1x1(in[0], F::ChannelStats{},
                                          F::BatchNormParams{in[1], in[2], Tensor(), Tensor()},
                                          true, in[3], nullptr);
      },
      {x, w, b, cw}));
  // A weight that does not fit x says so (the composition's convolution checks it).
  CHECK_THROWS_AS(F::batch_norm_relu_conv1x1(x, F::ChannelStats{}, p, true,
                                             leaf({6, 3, 1, 1}), nullptr),
                  Error);
}
