// optim::Muon on the GPU against the CPU: the same weights, gradients and schedule give the same
// weights after several steps (Newton–Schulz in f32 on both); through the loss scaler with f16
// parameters (mixed precision); the bf16 / f16 iteration op by op against f32, and the whole
// optimizer with it against the f32 one.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/autograd.h"
#include "core/generator.h"
#include "cuda/runtime.h"
#include "optim/amp.h"
#include "optim/fused.h"
#include "optim/muon.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gradcheck.h"

using namespace kiln;
using namespace kiln::optim;

namespace {

const Device kGpu = Device::cuda(0);

struct Side {
  std::vector<Tensor> params;
  std::unique_ptr<FusedSGD> sgd;
  std::unique_ptr<Muon> muon;
  Side(const std::vector<Tensor>& host, Device dev, DType dt, const MuonOptions& o) {
    ParamGroup g;
    for (const Tensor& h : host) {
      // A copy even where dtype and device already match: the CPU side must not update `host`
      // in place (the tests below measure each side's update from it).
      Tensor p = h.to(dt).to(dev).clone().detach();
      p.set_requires_grad(true);
      g.params.push_back(p);
      params.push_back(p);
    }
    g.lr = 0.0;
    sgd = std::make_unique<FusedSGD>(std::vector<ParamGroup>{g});
    muon = std::make_unique<Muon>(*sgd, 0, o);
  }
  void step(const std::vector<Tensor>& grads, double lr, DynamicLossScaler* scaler = nullptr,
            double scale = 1.0) {
    sgd->zero_grad();
    {
      NoGradGuard ng;
      for (size_t i = 0; i < params.size(); ++i)
        params[i].grad().copy_(F::mul(grads[i], scale).to(params[i].dtype()).to(params[i].device()));
    }
    muon->lr = lr;
    if (scaler) {
      scaler->step(*sgd);
      muon->step(scaler);
      scaler->update();
    } else {
      sgd->step();
      muon->step();
    }
  }
};

// Three steps of Muon with f32 parameters, from the same weights and gradients (seed 3): a
// (64, 72) matrix and a (32, 16, 3, 3) filter, on the CPU with the f32 iteration and on the GPU
// with the iteration in `gpu_ns_dtype`.
struct ThreeSteps {
  std::vector<Tensor> host;  // the starting weights
  std::unique_ptr<Side> cpu, gpu;
  explicit ThreeSteps(DType gpu_ns_dtype) {
    manual_seed(3);
    host = {F::mul(randn({64, 72}), 0.1), F::mul(randn({32, 16, 3, 3}), 0.1)};
    MuonOptions o;
    o.lr = 0.02;
    o.momentum = 0.6;
    o.ns_steps = 3;
    o.normalize_weights = true;
    o.ns_dtype = DType::f32;
    cpu = std::make_unique<Side>(host, Device::cpu(), DType::f32, o);
    o.ns_dtype = gpu_ns_dtype;
    gpu = std::make_unique<Side>(host, kGpu, DType::f32, o);
    for (int s = 0; s < 3; ++s) {
      std::vector<Tensor> grads = {randn({64, 72}), randn({32, 16, 3, 3})};
      const double lr = 0.02 * (1.0 - s / 3.0);
      cpu->step(grads, lr);
      gpu->step(grads, lr);
    }
    cuda::synchronize();
  }
};

}  // namespace

TEST_CASE("Muon on the GPU equals the CPU (f32 iteration)") {
  const ThreeSteps run(DType::f32);
  for (size_t i = 0; i < run.host.size(); ++i) {
    CAPTURE(i);
    KILN_CHECK_OK(testing::compare(run.gpu->params[i].to(Device::cpu()), run.cpu->params[i], 1e-5,
                                   1e-4));
  }
}

TEST_CASE("Muon with f16 parameters through the loss scaler: the scale divides out; an overflow "
          "step changes nothing") {
  manual_seed(4);
  const std::vector<Tensor> host = {F::mul(randn({64, 72}), 0.1)};
  MuonOptions o;
  o.lr = 0.02;
  o.momentum = 0.6;
  o.ns_dtype = DType::f32;
  Side scaled(host, kGpu, DType::f16, o), plain(host, kGpu, DType::f16, o);
  DynamicLossScaler scaler(kGpu, {1024.0, 2.0, 0.5, 1000});
  const std::vector<Tensor> g = {F::mul(randn({64, 72}), 1e-3)};
  scaled.step(g, 0.02, &scaler, 1024.0);
  plain.step(g, 0.02);
  cuda::synchronize();
  KILN_CHECK_OK(testing::compare(scaled.params[0].to(DType::f32), plain.params[0].to(DType::f32),
                                 2e-3, 2e-3));
  const Tensor before = scaled.params[0].clone();
  std::vector<Tensor> bad = {g[0].clone()};
  {
    NoGradGuard ng;
    bad[0].narrow(0, 0, 1).fill_(std::numeric_limits<double>::infinity());
  }
  scaled.step(bad, 0.02, &scaler, 1024.0);
  cuda::synchronize();
  CHECK(scaler.scale_value() == 512.0);
  KILN_CHECK_OK(testing::compare(scaled.params[0].to(DType::f32), before.to(DType::f32), 0, 0));
}

// The Newton–Schulz iteration op by op in bf16 and f16 on the GPU against the same ops in f32
// on the CPU, from the same input (rounded to the low precision first): each product and sum
// must be finite and within the low precision's rounding of the f32 value (relative to the
// tensor's largest element, since the iteration's entries cancel). The shapes are Muon's test
// matrices: a (64, 72) weight and a (32, 16, 3, 3) filter seen as (32, 144), and its transpose.
TEST_CASE("Newton–Schulz op by op in bf16 and f16 on the GPU tracks f32 on the CPU") {
  constexpr double kA = 3.4445, kB = -4.7750, kC = 2.0315;
  for (DType dt : {DType::bf16, DType::f16}) {
    for (const Shape& shape : {Shape{64, 72}, Shape{32, 144}, Shape{144, 32}}) {
      const std::string dtype = dtype_name(dt);
      CAPTURE(dtype);
      CAPTURE(shape_str(shape));
      manual_seed(7);
      NoGradGuard ng;
      const Tensor d = randn(shape);
      Tensor xl = F::div(d, F::sqrt(F::sum(F::mul(d, d)))).to(dt).to(kGpu);
      Tensor xr = xl.to(Device::cpu()).to(DType::f32);
      if (shape[0] > shape[1]) {
        xl = xl.t();
        xr = xr.t();
      }
      const double eps = dt == DType::bf16 ? 1.0 / 128 : 1.0 / 1024;
      auto near = [&](const Tensor& low, const Tensor& ref, const char* what, int step,
                      double ulps = 8) {
        const Tensor got = low.to(Device::cpu()).to(DType::f32).contiguous();
        const std::vector<double> g = got.to_vector<double>(), r = ref.contiguous().to_vector<double>();
        double scale = 0, err = 0;
        for (size_t i = 0; i < r.size(); ++i) {
          scale = std::max(scale, std::fabs(r[i]));
          err = std::isfinite(g[i]) ? std::max(err, std::fabs(g[i] - r[i])) : INFINITY;
        }
        INFO(what, " at step ", step, ": max |low - f32| ", err, ", max |f32| ", scale);
        CHECK(std::isfinite(err));
        CHECK(err <= ulps * eps * scale + 1e-6);
      };
      for (int s = 0; s < 3; ++s) {
        const Tensor al = F::matmul(xl, xl.t()), ar = F::matmul(xr, xr.t());
        near(al, ar, "x·xᵀ", s);
        // Each later op starts from the low-precision values, so that one op's error is judged.
        const Tensor a = al.to(Device::cpu()).to(DType::f32);
        const Tensor aal = F::matmul(al, al), aar = F::matmul(a, a);
        near(aal, aar, "a·a", s);
        const Tensor bl = F::add(F::mul(al, kB), aal, kC);
        const Tensor br = F::add(F::mul(a, kB), aal.to(Device::cpu()).to(DType::f32), kC);
        near(bl, br, "b = kB·a + kC·a·a", s);
        const Tensor b = bl.to(Device::cpu()).to(DType::f32);
        const Tensor bxl = F::matmul(bl, xl), bxr = F::matmul(b, xr);
        near(bxl, bxr, "b·x", s);
        const Tensor nl = F::add(F::mul(xl, kA), bxl);
        const Tensor nr = F::add(F::mul(xr, kA), bxl.to(Device::cpu()).to(DType::f32));
        near(nl, nr, "x' = kA·x + b·x", s);
        xl = nl;
        xr = nl.to(Device::cpu()).to(DType::f32);
      }
      // And the whole iteration through Muon's own function.
      const Tensor whole = Muon::newton_schulz(d.to(kGpu), 3, dt).to(Device::cpu()).to(DType::f32);
      const Tensor ref = Muon::newton_schulz(d, 3, DType::f32);
      near(whole, ref.contiguous(), "Muon::newton_schulz", 3, 32);
    }
  }
}

// The whole optimizer with the bf16 (and f16) iteration against the f32 CPU optimizer: the
// parameters stay finite and each one's total update points the same way.
TEST_CASE("Muon with the bf16 or f16 iteration follows the f32 one") {
  for (DType dt : {DType::bf16, DType::f16}) {
    const std::string dtype = dtype_name(dt);
    CAPTURE(dtype);
    const ThreeSteps run(dt);
    const std::vector<Tensor>& host = run.host;
    for (size_t i = 0; i < host.size(); ++i) {
      CAPTURE(i);
      const Tensor got = run.gpu->params[i].to(Device::cpu()).to(DType::f64);
      const Tensor du = F::sub(got, host[i].to(DType::f64));
      const Tensor dc = F::sub(run.cpu->params[i].to(DType::f64), host[i].to(DType::f64));
      const double dot = F::sum(F::mul(du, dc)).item();
      const double cosine =
          dot / std::sqrt(F::sum(F::mul(du, du)).item() * F::sum(F::mul(dc, dc)).item());
      INFO("cosine of the updates ", cosine);
      CHECK(std::isfinite(cosine));
      CHECK(cosine > 0.99);
    }
  }
}
