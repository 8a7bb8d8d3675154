// optim::Muon on the GPU against the CPU: the same weights, gradients and schedule give the same
// weights after several steps (Newton–Schulz in f32 on both); through the loss scaler with f16
// parameters (mixed precision). (The bf16 iteration is not tested here: on these matrices it
// gave NaN on the H200, docs/lab/cifar10.md.)
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

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
      Tensor p = h.to(dt).to(dev).detach();
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

}  // namespace

TEST_CASE("Muon on the GPU equals the CPU (f32 iteration)") {
  manual_seed(3);
  const std::vector<Tensor> host = {F::mul(randn({64, 72}), 0.1), F::mul(randn({32, 16, 3, 3}), 0.1)};
  MuonOptions o;
  o.lr = 0.02;
  o.momentum = 0.6;
  o.ns_steps = 3;
  o.normalize_weights = true;
  o.ns_dtype = DType::f32;
  Side cpu(host, Device::cpu(), DType::f32, o), gpu(host, kGpu, DType::f32, o);
  for (int s = 0; s < 3; ++s) {
    std::vector<Tensor> grads = {randn({64, 72}), randn({32, 16, 3, 3})};
    const double lr = 0.02 * (1.0 - s / 3.0);
    cpu.step(grads, lr);
    gpu.step(grads, lr);
  }
  cuda::synchronize();
  for (size_t i = 0; i < host.size(); ++i) {
    CAPTURE(i);
    KILN_CHECK_OK(testing::compare(gpu.params[i].to(Device::cpu()), cpu.params[i], 1e-5, 1e-4));
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

