#pragma once
// A block tail's saved state for the suites that run its data-gradient GEMM directly
// (test_gemm_bn.cpp, test_dgrad_stride2.cpp): y3 (the batch norm's input) with its statistics,
// the forward's ReLU bitmask of relu(bn(y3) + z), and the next block's conv1 (w1: K × C) with its
// output gradient dy1 and the shortcut's gradient r.
#include <cmath>

#include "cuda/kernels.h"
#include "ops/ops.h"
#include "tests/gpu/gpu_test_util.h"

namespace kiln::gputest {

// f16, on the GPU, channels-last.
inline Tensor nhwc_f16(const Tensor& host) {
  return host.to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
}

struct Tail {
  Tensor y3, mask, weight, mean, invstd, scale_shift, dy1, w1, r;
};

// Values from `seed`: y3 ~ N(0.25, 1.5²), z, dy1 and r ~ N(0, 1), w1 ~ N(0, 1/K).
inline Tail make_tail(int64_t n, int64_t c, int64_t k, int64_t h, int64_t w, uint64_t seed) {
  manual_seed(seed);
  Tail t;
  const Shape shape{n, c, h, w};
  t.y3 = nhwc_f16(F::add(F::mul(randn(shape), 1.5), 0.25));
  Tensor z = nhwc_f16(randn(shape));
  t.dy1 = nhwc_f16(randn({n, k, h, w}));
  t.w1 = F::mul(randn({k, c, 1, 1}), 1.0 / std::sqrt(double(k))).to(DType::f16).to(kGpu);
  t.r = nhwc_f16(randn(shape));
  BnStatsFinalize f = bn_finalize_of(t.y3);
  t.mask = empty({t.y3.numel() / 8}, TensorOptions(DType::u8).with_device(kGpu));
  Tensor out = empty_like(t.y3);
  cuda::bn_nhwc_apply(out, t.y3, z, f, Activation::Relu, t.mask);
  t.weight = f.weight;
  t.mean = f.save_mean;
  t.invstd = f.save_invstd;
  t.scale_shift = f.scale_shift;
  return t;
}

}  // namespace kiln::gputest
