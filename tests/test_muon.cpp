// optim::Muon on the CPU against a scalar re-implementation of its published update (momentum,
// Nesterov, the quintic Newton–Schulz iteration, weight normalisation), over several steps; the
// loss scaler's unscaling and skipped steps; the iteration's properties; state and errors.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/autograd.h"
#include "core/generator.h"
#include "optim/amp.h"
#include "optim/fused.h"
#include "optim/muon.h"

using namespace kiln;
using namespace kiln::optim;

namespace {

using Mat = std::vector<std::vector<double>>;

Mat matmul(const Mat& a, const Mat& b) {
  Mat c(a.size(), std::vector<double>(b[0].size(), 0.0));
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t k = 0; k < b.size(); ++k)
      for (size_t j = 0; j < b[0].size(); ++j) c[i][j] += a[i][k] * b[k][j];
  return c;
}
Mat transpose(const Mat& a) {
  Mat t(a[0].size(), std::vector<double>(a.size()));
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t j = 0; j < a[0].size(); ++j) t[j][i] = a[i][j];
  return t;
}

// The published iteration, in double: X = d/(‖d‖ + 1e-7), transposed when tall, then
// X = a·X + (b·A + c·A·A)·X with A = X·Xᵀ.
Mat newton_schulz_ref(Mat x, int steps) {
  double n = 0;
  for (const auto& r : x)
    for (double v : r) n += v * v;
  n = std::sqrt(n) + 1e-7;
  for (auto& r : x)
    for (double& v : r) v /= n;
  const bool tall = x.size() > x[0].size();
  if (tall) x = transpose(x);
  for (int s = 0; s < steps; ++s) {
    const Mat a = matmul(x, transpose(x)), aa = matmul(a, a);
    Mat b = a;
    for (size_t i = 0; i < b.size(); ++i)
      for (size_t j = 0; j < b.size(); ++j) b[i][j] = -4.7750 * a[i][j] + 2.0315 * aa[i][j];
    const Mat bx = matmul(b, x);
    for (size_t i = 0; i < x.size(); ++i)
      for (size_t j = 0; j < x[0].size(); ++j) x[i][j] = 3.4445 * x[i][j] + bx[i][j];
  }
  return tall ? transpose(x) : x;
}

Mat to_mat(const Tensor& t, int64_t rows) {
  const std::vector<double> v = t.to(DType::f64).contiguous().to_vector<double>();
  const int64_t cols = int64_t(v.size()) / rows;
  Mat m(static_cast<size_t>(rows), std::vector<double>(static_cast<size_t>(cols)));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) m[size_t(i)][size_t(j)] = v[size_t(i * cols + j)];
  return m;
}

// A 4x6 weight and a (3, 2, 2, 2) filter in Muon's group (lr 0), a bias in an SGD group.
struct Setup {
  Tensor w = (randn({4, 6}) * 0.5).set_requires_grad(true);
  Tensor f = (randn({3, 2, 2, 2}) * 0.5).set_requires_grad(true);
  Tensor b = zeros({4}).set_requires_grad(true);
  std::unique_ptr<FusedSGD> sgd;
  Setup() {
    ParamGroup muon_group, rest;
    muon_group.params = {w, f};
    muon_group.lr = 0.0;
    rest.params = {b};
    rest.lr = 0.1;
    sgd = std::make_unique<FusedSGD>(std::vector<ParamGroup>{muon_group, rest});
  }
};

}  // namespace

TEST_CASE("Muon: the update of its published formula over three steps, with and without "
          "Nesterov and weight normalisation") {
  for (bool nesterov : {true, false})
    for (bool normalize : {false, true}) {
      CAPTURE(nesterov);
      CAPTURE(normalize);
      manual_seed(5);
      Setup s;
      MuonOptions o;
      o.lr = 0.05;
      o.momentum = 0.6;
      o.nesterov = nesterov;
      o.ns_steps = 3;
      o.normalize_weights = normalize;
      Muon muon(*s.sgd, 0, o);
      CHECK(muon.num_params() == 2);
      std::vector<Tensor> params = {s.w, s.f};
      std::vector<Mat> weight, buf;
      for (const Tensor& p : params) {
        weight.push_back(to_mat(p, p.size(0)));
        buf.push_back(Mat(weight.back().size(), std::vector<double>(weight.back()[0].size(), 0)));
      }
      for (int step = 0; step < 3; ++step) {
        s.sgd->zero_grad();
        std::vector<Mat> grads;
        for (const Tensor& p : params) {
          NoGradGuard ng;
          const Tensor g = randn(p.shape());
          p.grad().copy_(g);
          grads.push_back(to_mat(g, p.size(0)));
        }
        {
          NoGradGuard ng;
          s.b.grad().fill_(1.0);
        }
        muon.lr = 0.05 * (1.0 - step / 3.0);  // a schedule
        s.sgd->step();
        muon.step();
        for (size_t k = 0; k < params.size(); ++k) {
          Mat& bk = buf[k];
          Mat d = bk;
          for (size_t i = 0; i < bk.size(); ++i)
            for (size_t j = 0; j < bk[0].size(); ++j) {
              bk[i][j] = 0.6 * bk[i][j] + grads[k][i][j];
              d[i][j] = nesterov ? grads[k][i][j] + 0.6 * bk[i][j] : bk[i][j];
            }
          const Mat x = newton_schulz_ref(d, 3);
          double n = 0;
          for (const auto& r : weight[k])
            for (double v : r) n += v * v;
          const double factor = normalize ? std::sqrt(double(bk.size())) / std::sqrt(n) : 1.0;
          for (size_t i = 0; i < bk.size(); ++i)
            for (size_t j = 0; j < bk[0].size(); ++j)
              weight[k][i][j] = weight[k][i][j] * factor - muon.lr * x[i][j];
          const Mat got = to_mat(params[k], params[k].size(0));
          for (size_t i = 0; i < bk.size(); ++i)
            for (size_t j = 0; j < bk[0].size(); ++j)
              CHECK(got[i][j] == doctest::Approx(weight[k][i][j]).epsilon(1e-4));
          // The fused optimizer's master is Muon's result (what checkpoints save).
          CHECK(to_mat(s.sgd->master(k), params[k].size(0)) == got);
        }
      }
      // The SGD group moved as SGD moves it; its lr-0 group only through Muon.
      CHECK(s.b.to_vector<double>() != std::vector<double>(4, 0.0));
    }
}

TEST_CASE("Muon: Newton-Schulz pushes singular values towards 1; a tall matrix is its transpose's "
          "transpose") {
  manual_seed(7);
  const Tensor d = randn({8, 20});
  const Tensor x = Muon::newton_schulz(d, 5, DType::f32);
  // X·Xᵀ near the identity (the quintic leaves singular values in about [0.7, 1.2]).
  const Mat a = to_mat(x, 8), xx = matmul(a, transpose(a));
  for (size_t i = 0; i < 8; ++i) {
    CHECK(xx[i][i] > 0.3);
    CHECK(xx[i][i] < 1.6);
  }
  const Tensor xt = Muon::newton_schulz(d.t().contiguous(), 5, DType::f32);
  CHECK(xt.shape() == Shape{20, 8});
  const Mat back = to_mat(xt.t().contiguous(), 8);
  for (size_t i = 0; i < 8; ++i)
    for (size_t j = 0; j < 20; ++j) CHECK(back[i][j] == doctest::Approx(a[i][j]).epsilon(1e-4));
  // Scale-free: 1000·d gives the same direction.
  const Tensor xs = Muon::newton_schulz(d * 1000.0, 5, DType::f32);
  const Mat s = to_mat(xs, 8);
  for (size_t i = 0; i < 8; ++i)
    for (size_t j = 0; j < 20; ++j) CHECK(s[i][j] == doctest::Approx(a[i][j]).epsilon(1e-3));
}

TEST_CASE("Muon through the loss scaler: unscaled gradients, and an overflow step changes nothing") {
  manual_seed(9);
  Setup s;
  MuonOptions o;
  o.lr = 0.1;
  o.momentum = 0.5;
  Muon muon(*s.sgd, 0, o);
  DynamicLossScaler scaler(Device::cpu(), {1024.0, 2.0, 0.5, 1000});
  Setup plain_setup;  // the same weights, no scaler
  {
    NoGradGuard ng;
    plain_setup.w.copy_(s.w);
    plain_setup.f.copy_(s.f);
    for (size_t i = 0; i < 2; ++i) plain_setup.sgd->master(i).copy_(s.sgd->master(i));
  }
  Muon plain(*plain_setup.sgd, 0, o);
  const Tensor g = randn({4, 6});
  {
    NoGradGuard ng;
    s.sgd->zero_grad();
    s.w.grad().copy_(g * 1024.0);
    plain_setup.sgd->zero_grad();
    plain_setup.w.grad().copy_(g);
  }
  scaler.step(*s.sgd);
  muon.step(&scaler);
  scaler.update();
  plain_setup.sgd->step();
  plain.step();
  CHECK(s.w.to_vector<double>() == plain_setup.w.to_vector<double>());
  // The momentum holds the unscaled gradient.
  const std::vector<double> mb = muon.state_dict().at("muon.0.momentum_buffer").to_vector<double>();
  const std::vector<double> gv = g.to_vector<double>();
  for (size_t i = 0; i < gv.size(); ++i) CHECK(mb[i] == doctest::Approx(gv[i]).epsilon(1e-6));
  // An inf in the group: the scaler skips, and Muon leaves weights, masters and momentum alone.
  const Tensor w0 = s.w.clone(), m0 = s.sgd->master(0).clone(),
               b0 = muon.state_dict().at("muon.0.momentum_buffer").clone();
  {
    NoGradGuard ng;
    s.sgd->zero_grad();
    s.w.grad().copy_(g * 1024.0);
    s.f.grad().fill_(std::numeric_limits<double>::infinity());
  }
  scaler.step(*s.sgd);
  muon.step(&scaler);
  scaler.update();
  CHECK(scaler.scale_value() == 512.0);
  CHECK(s.w.to_vector<double>() == w0.to_vector<double>());
  CHECK(s.sgd->master(0).to_vector<double>() == m0.to_vector<double>());
  CHECK(muon.state_dict().at("muon.0.momentum_buffer").to_vector<double>() ==
        b0.to_vector<double>());
}

TEST_CASE("Muon: state round trip, reset, and its errors") {
  manual_seed(11);
  Setup s;
  Muon muon(*s.sgd, 0, MuonOptions{});
  {
    NoGradGuard ng;
    s.w.grad().copy_(randn({4, 6}));
  }
  muon.step();
  auto sd = muon.state_dict();
  REQUIRE(sd.size() == 2);
  const std::vector<double> saved = sd.at("muon.0.momentum_buffer").to_vector<double>();
  muon.reset_state();
  CHECK(muon.state_dict().at("muon.0.momentum_buffer").to_vector<double>() ==
        std::vector<double>(24, 0.0));
  std::map<std::string, Tensor> back;
  back["muon.0.momentum_buffer"] = from_vector(saved, {4, 6});
  back["muon.1.momentum_buffer"] = zeros({3, 2, 2, 2});
  muon.load_state_dict(back);
  CHECK(muon.state_dict().at("muon.0.momentum_buffer").to_vector<double>() == saved);
  back.erase("muon.1.momentum_buffer");
  CHECK_THROWS_AS(muon.load_state_dict(back), Error);
  back["muon.1.momentum_buffer"] = zeros({3, 8});
  CHECK_THROWS_WITH_AS(muon.load_state_dict(back), doctest::Contains("expected shape"), Error);
  // The group must leave its parameters to Muon; matrices only.
  CHECK_THROWS_WITH_AS(Muon(*s.sgd, 1, MuonOptions{}), doctest::Contains("lr 0"), Error);
  {
    ParamGroup vec;
    vec.params = {zeros({5}).set_requires_grad(true)};
    vec.lr = 0.0;
    FusedSGD other(std::vector<ParamGroup>{vec});
    CHECK_THROWS_WITH_AS(Muon(other, 0, MuonOptions{}), doctest::Contains("2-D or more"), Error);
  }
  s.sgd->param_groups[0].lr = 0.1;
  CHECK_THROWS_WITH_AS(Muon(*s.sgd, 0, MuonOptions{}), doctest::Contains("lr 0"), Error);
  CHECK_THROWS_AS(Muon(*s.sgd, 5, MuonOptions{}), Error);
}
