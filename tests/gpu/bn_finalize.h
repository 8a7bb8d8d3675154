#pragma once
// The GPU tests' BnStatsFinalize for an f16 activation x (N, C, H, W): x's statistics summed in
// f32 here, fresh outputs, weight uniform in [0.5, 1.5), bias in [-0.5, 0.5); no running
// statistics, no counter.
#include "core/backend.h"
#include "ops/ops.h"

namespace kiln::testing {

inline BnStatsFinalize finalize_for(const Tensor& x) {
  const int64_t C = x.size(1);
  const TensorOptions opt = TensorOptions().with_device(x.device());
  Tensor x32 = x.to(DType::f32);
  BnStatsFinalize f;
  f.save_mean = empty({C}, opt);
  f.save_invstd = empty({C}, opt);
  f.scale_shift = empty({2 * C}, opt);
  f.sum = F::sum(x32, {0, 2, 3});
  f.sqsum = F::sum(F::mul(x32, x32), {0, 2, 3});
  f.weight = uniform({C}, 0.5, 1.5).to(x.device());
  f.bias = uniform({C}, -0.5, 0.5).to(x.device());
  f.count = x.numel() / C;
  return f;
}

}  // namespace kiln::testing
