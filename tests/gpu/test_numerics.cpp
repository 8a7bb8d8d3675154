// Numerics that must match PyTorch's, checked against FP64 / kiln's CPU backend:
// - the f16 logits gradient of the fused softmax-cross-entropy with the device-resident loss
//   scale (2^16) at batch 256 x 1000 classes equals the FP64 value correctly rounded to f16
//   (the scale is applied in f32 before the one rounding, as PyTorch's autocast does);
// - a full ResNet-50 forward and backward at a small batch in FP32 gives the same logits, loss
//   and parameter gradients on the GPU as kiln's CPU backend (cuDNN and cuBLASLt run f32
//   without TF32, so only summation order differs). The measured errors are printed.
#include <doctest/doctest.h>

#include <cmath>
#include <map>

#include "core/autograd.h"
#include "models/resnet.h"
#include "ops/ops.h"
#include "optim/amp.h"
#include "tests/gpu/gpu_test_util.h"

using namespace kiln;
using namespace kiln::gputest;

TEST_CASE("cross_entropy f16 on the GPU: the loss scale is applied before the one rounding") {
  const int64_t n = 256, c = 1000;
  Generator g(3);
  const Tensor host = F::mul(randn({n, c}, DType::f32, &g), 2.0).to(DType::f16);
  std::vector<int64_t> tv(static_cast<size_t>(n));
  for (auto& t : tv) t = int64_t(g.below(uint64_t(c)));
  Tensor logits = host.to(kGpu);
  logits.set_requires_grad(true);
  const Tensor target = from_vector<int64_t>(tv, {n}, DType::i64).to(kGpu);
  optim::LossScalerOptions so;
  so.init_scale = 65536.0;
  optim::DynamicLossScaler scaler(kGpu, so);
  Tensor loss = F::cross_entropy(logits, target);
  scaler.scale(loss).backward();
  REQUIRE(logits.grad().dtype() == DType::f16);
  const std::vector<double> x = host.to(DType::f64).to_vector<double>();
  const std::vector<double> got = host_f64(logits.grad()).to_vector<double>();
  double worst = 0, ref_loss = 0;
  int64_t subnormal_unscaled = 0;
  for (int64_t i = 0; i < n; ++i) {
    double m = -INFINITY, z = 0;
    for (int64_t j = 0; j < c; ++j) m = std::max(m, x[size_t(i * c + j)]);
    for (int64_t j = 0; j < c; ++j) z += std::exp(x[size_t(i * c + j)] - m);
    ref_loss += (std::log(z) + m - x[size_t(i * c + tv[size_t(i)])]) / double(n);
    for (int64_t j = 0; j < c; ++j) {
      const double unscaled =
          (std::exp(x[size_t(i * c + j)] - m) / z - (j == tv[size_t(i)] ? 1.0 : 0.0)) / double(n);
      subnormal_unscaled += std::fabs(unscaled) < std::ldexp(1.0, -14);
      const double ref = unscaled * 65536.0;
      // Half an f16 ulp: 2^-11 relative for normals, 2^-25 absolute among subnormals.
      const double tol = std::max(std::fabs(ref) / 2048, std::ldexp(1.0, -25));
      worst = std::max(worst, std::fabs(got[size_t(i * c + j)] - ref) / tol);
    }
  }
  MESSAGE("worst error in half-ulps: ", worst,
          "; unscaled entries below f16's normal range: ", subnormal_unscaled, " of ", n * c);
  CHECK(subnormal_unscaled > n * c / 2);  // the case the fix is for
  CHECK(loss.to(Device::cpu()).item() == doctest::Approx(ref_loss).epsilon(1e-5));
  CHECK(worst <= 1.001);
}

namespace {

double rel_l2(const Tensor& got, const Tensor& want) {
  const auto a = host_f64(got).to_vector<double>(), b = host_f64(want).to_vector<double>();
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace

TEST_CASE("ResNet-50 forward + backward, FP32: CUDA matches kiln's CPU backend") {
  const int64_t n = 4, size = 64;
  auto cpu_model = models::resnet50(1000);
  auto gpu_model = models::resnet50(1000);  // same seed: same initial weights
  amp::prepare_model(*gpu_model, kGpu, amp::Precision::FP32);
  Generator g(11);
  const Tensor x = randn({n, 3, size, size}, DType::f32, &g);
  const Tensor y = from_vector<int64_t>({1, 500, 999, 7}, {n}, DType::i64);

  Tensor cpu_logits = (*cpu_model)(x);
  Tensor cpu_loss = F::cross_entropy(cpu_logits, y);
  cpu_loss.backward();
  Tensor gpu_logits = (*gpu_model)(amp::prepare_input(x, kGpu, amp::Precision::FP32));
  Tensor gpu_loss = F::cross_entropy(gpu_logits, y.to(kGpu));
  gpu_loss.backward();

  const double logits_err = rel_l2(gpu_logits.detach(), cpu_logits.detach());
  MESSAGE("logits relative L2 error ", logits_err, "; loss cpu ", cpu_loss.item(), " gpu ",
          gpu_loss.to(Device::cpu()).item());
  CHECK(logits_err <= 1e-4);
  CHECK(gpu_loss.to(Device::cpu()).item() == doctest::Approx(cpu_loss.item()).epsilon(1e-4));

  std::map<std::string, Tensor> gpu_params;
  for (const auto& [name, t] : gpu_model->named_parameters()) gpu_params[name] = t;
  double worst = 0;
  std::string worst_name;
  int64_t compared = 0;
  for (const auto& [name, t] : cpu_model->named_parameters()) {
    CAPTURE(name);
    REQUIRE(gpu_params.count(name) == 1);
    const Tensor& gt = gpu_params[name];
    REQUIRE(t.grad().defined());
    REQUIRE(gt.grad().defined());
    const double e = rel_l2(gt.grad().contiguous(), t.grad());
    if (e > worst) worst = e, worst_name = name;
    CHECK(e <= 1e-3);
    ++compared;
  }
  MESSAGE(compared, " parameter gradients; worst relative L2 error ", worst, " (", worst_name, ")");
  CHECK(compared == 161);
}
