#pragma once
// Helpers of the GPU suites: device tensors from host values, NaN-prefilled outputs (so an
// element a kernel forgets to write fails the comparison), and dtype-tied tolerances.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/autograd.h"
#include "core/backend.h"
#include "core/generator.h"
#include "core/tensor.h"
#include "ops/ops.h"

namespace kiln::gputest {

inline const Device kGpu = Device::cuda(0);

inline TensorOptions gpu_opts(DType t, MemoryFormat fmt = MemoryFormat::Contiguous) {
  return TensorOptions(t).with_device(kGpu).with_memory_format(fmt);
}

// Uniform values in [lo, hi) from a fixed seed.
inline std::vector<double> uniform_values(int64_t n, double lo, double hi, uint64_t seed) {
  Generator g(seed);
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = lo + (hi - lo) * g.uniform();
  return v;
}

inline Tensor gpu_tensor(const std::vector<double>& v, const Shape& shape, DType t,
                         MemoryFormat fmt = MemoryFormat::Contiguous) {
  return from_vector(v, shape, gpu_opts(t, fmt));
}

// An output to be fully overwritten, pre-filled with NaN.
inline Tensor nan_output(const Shape& shape, DType t, MemoryFormat fmt = MemoryFormat::Contiguous) {
  Tensor o = empty(shape, gpu_opts(t, fmt));
  o.fill_(std::nan(""));
  return o;
}

// The values the device really holds, widened to f64 on the host (the reference's input).
inline Tensor host_f64(const Tensor& t) { return t.to(Device::cpu()).to(DType::f64).contiguous(); }

// ‖got − want‖ / ‖want‖ over all elements, in f64 (‖got − want‖ where want is all zeros).
inline double rel_l2(const Tensor& got, const Tensor& want) {
  const auto a = host_f64(got).to_vector<double>(), b = host_f64(want).to_vector<double>();
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

struct Tol {
  double atol, rtol;
};
inline Tol tol_for(DType t) {
  switch (t) {
    case DType::f64: return {1e-12, 1e-12};
    case DType::f32: return {1e-5, 1e-5};
    case DType::f16: return {1e-3, 2e-3};
    case DType::bf16: return {1e-2, 1e-2};
    default: return {0, 0};
  }
}

// Checks |got - want| <= atol + rtol*|want| elementwise (NaN only matches NaN); reports the
// first few mismatches.
inline void check_close(const std::vector<double>& got, const std::vector<double>& want, Tol tol,
                        const std::string& what) {
  REQUIRE_MESSAGE(got.size() == want.size(), what, ": size ", got.size(), " vs ", want.size());
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    bool ok = (std::isnan(g) && std::isnan(w)) ||
              (std::isinf(w) && g == w) ||
              (!std::isnan(g) && std::fabs(g - w) <= tol.atol + tol.rtol * std::fabs(w));
    if (!ok && bad++ < 5) FAIL_CHECK(what << ": element " << i << " got " << g << " want " << w);
  }
  CHECK_MESSAGE(bad == 0, what, ": ", bad, " of ", got.size(), " elements differ");
}

inline void check_close(const Tensor& got, const Tensor& want, Tol tol, const std::string& what) {
  REQUIRE_MESSAGE(got.shape() == want.shape(), what, ": shape ", got.shape_str(), " vs ",
                  want.shape_str());
  check_close(got.to_vector<double>(), want.to_vector<double>(), tol, what);
}

// A batch norm's finalize of x ((N, C, H, W) on the GPU): fresh save_mean, save_invstd and
// scale_shift; sum and sqsum of x in f32; weight uniform in [0.5, 1.5) then bias in [-0.5, 0.5),
// drawn in that order from the global generator; count N·H·W. No running statistics or counter.
inline BnStatsFinalize bn_finalize_of(const Tensor& x) {
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

// The wiring tests' relu(bn(y)) read by a convolution alone (test_gemm_bn's 1x1 conv3,
// test_dgrad3x3's 3x3 conv2), run forward and backward from the host tensors: y and w as leaves
// in dt (their f16 values either way, channels-last), the batch norm's weight and bias in f32;
// relu(bn(y)) from y's own sums through batch_norm_from_stats (the node that may take the
// convolution's data gradient) in f16, the plain composition in f32; conv2d(·, w, stride 1,
// `padding`); then the backward of dy. The leaves hold the gradients.
struct BnReluConvRun {
  Tensor y, w, weight, bias;
};
inline BnReluConvRun bn_relu_conv_backward(const Tensor& hy, const Tensor& hw, const Tensor& hg,
                                           const Tensor& hb, const Tensor& hdy, DType dt,
                                           int64_t padding) {
  auto leaf = [&](const Tensor& h, DType t) {
    Tensor g = h.to(t).to(kGpu);
    if (h.dim() == 4) g = g.contiguous(MemoryFormat::ChannelsLast);
    g = g.detach();
    g.set_requires_grad(true);
    return g;
  };
  BnReluConvRun r{leaf(hy.to(DType::f16), dt), leaf(hw.to(DType::f16), dt), leaf(hg, DType::f32),
                  leaf(hb, DType::f32)};
  const TensorOptions opt = TensorOptions().with_device(kGpu);
  Tensor rm = zeros({hg.numel()}, opt), rv = ones({hg.numel()}, opt);
  Tensor out;
  if (dt == DType::f16) {
    Tensor y32 = r.y.detach().to(DType::f32);
    const F::ChannelStats st{F::sum(y32, {0, 2, 3}), F::sum(F::mul(y32, y32), {0, 2, 3}),
                             r.y.version()};
    out = F::batch_norm_from_stats(r.y, st, Tensor(), true, r.weight, r.bias, rm, rv, true);
  } else {
    out = F::relu(F::batch_norm(r.y, r.weight, r.bias, rm, rv, true));
  }
  const Tensor y2 = F::conv2d(out, r.w, Tensor(), /*stride=*/1, padding);
  const Tensor dy = hdy.to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast).to(dt);
  autograd::backward({y2}, {dy}, false);
  return r;
}

}  // namespace kiln::gputest
