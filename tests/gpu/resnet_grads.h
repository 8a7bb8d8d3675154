#pragma once
// ResNet-50's parameter gradients after one step, for the GPU suites that check a fused path
// against FP32 over the whole model (test_dgrad3x3.cpp, test_tail_fold.cpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "core/generator.h"
#include "tests/gpu/gpu_test_util.h"
#include "models/resnet.h"
#include "ops/ops.h"
#include "optim/amp.h"

namespace kiln::gputest {

// A batch of n images of size × size (values about N(0.1, 0.8²), seed 17) and labels 7i mod 10.
struct ResNetBatch {
  Tensor x, y;
};
inline ResNetBatch resnet_batch(int64_t n, int64_t size) {
  Generator gen(17);
  ResNetBatch b;
  b.x = F::add(F::mul(randn({n, 3, size, size}, DType::f32, &gen), 0.8), 0.1);
  std::vector<int64_t> labels(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) labels[size_t(i)] = (i * 7) % 10;
  b.y = from_vector<int64_t>(labels, {n}, DType::i64).to(Device::cuda(0));
  return b;
}

// One forward and backward of ResNet-50 (10 classes, weights from manual_seed(5)) on the batch
// at precision p, the cross-entropy scaled by `scale` in mixed precision; the parameters'
// gradients by name, f32, unscaled, on the host. Each is REQUIREd defined and finite.
inline std::map<std::string, Tensor> resnet50_grads(const ResNetBatch& b, amp::Precision p,
                                                    double scale) {
  const Device gpu = Device::cuda(0);
  const double s = p == amp::Precision::FP32 ? 1.0 : scale;
  manual_seed(5);
  auto model = models::resnet50(10);
  amp::prepare_model(*model, gpu, p);
  Tensor logits = (*model)(amp::prepare_input(b.x, gpu, p));
  F::mul(F::cross_entropy(logits, b.y), s).backward();
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : model->named_parameters()) {
    CAPTURE(name);
    REQUIRE(t.grad().defined());
    out[name] = F::mul(t.grad().to(DType::f32), 1.0 / s).contiguous().to(Device::cpu());
    const auto v = out[name].to_vector<float>();
    REQUIRE(std::all_of(v.begin(), v.end(), [](float e) { return std::isfinite(e); }));
  }
  return out;
}

// Each gradient of `on` (the fused path) and `off` (without it) against `ref` (FP32) by relative
// L2, the same tensors in each. CHECKs that none is far off where the unfused one is close:
// f16 rounding moves a tensor's error by a factor of about 1, a wrong gradient by orders of
// magnitude.
struct GradComparison {
  double worst_on = 0, worst_off = 0, rms_on = 0, rms_off = 0, worst_ratio = 0;
  std::string worst_name;  // where on / off is largest
};
inline GradComparison compare_to_reference(const std::map<std::string, Tensor>& on,
                                           const std::map<std::string, Tensor>& off,
                                           const std::map<std::string, Tensor>& ref) {
  GradComparison c;
  double sq_on = 0, sq_off = 0;
  for (const auto& [name, want] : ref) {
    CAPTURE(name);
    REQUIRE(on.count(name) == 1);
    REQUIRE(off.count(name) == 1);
    const double eon = rel_l2(on.at(name), want), eoff = rel_l2(off.at(name), want);
    c.worst_on = std::max(c.worst_on, eon);
    c.worst_off = std::max(c.worst_off, eoff);
    sq_on += eon * eon;
    sq_off += eoff * eoff;
    const double ratio = eon / std::max(eoff, 1e-4);
    if (ratio > c.worst_ratio) c.worst_ratio = ratio, c.worst_name = name;
    CHECK(eon <= 3 * eoff + 2e-3);
    if (eon > 3 * eoff + 2e-3) MESSAGE(name, ": fused ", eon, ", unfused ", eoff);
  }
  const double k = double(std::max<size_t>(ref.size(), 1));
  c.rms_on = std::sqrt(sq_on / k);
  c.rms_off = std::sqrt(sq_off / k);
  return c;
}

}  // namespace kiln::gputest
