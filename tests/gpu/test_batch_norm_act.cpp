// F::batch_norm_relu on the GPU: the fused cuDNN path (f16 NHWC, training) against the unfused
// composition batch_norm -> add -> relu computed in f32 on the GPU, forward, running statistics
// and every gradient, with and without the residual.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "core/switches.h"
#include "cuda/conv.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"
#include "models/nn.h"
#include "ops/ops.h"
#include "optim/amp.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gradcheck.h"

using namespace kiln;

namespace {

const Device kGpu = Device::cuda(0);
const Device kCPU = Device::cpu();

Tensor gpu_leaf(const Tensor& host, DType t, bool nhwc) {
  Tensor g = host.to(t).to(kGpu);
  if (nhwc) g = g.contiguous(MemoryFormat::ChannelsLast);
  g = g.detach();
  g.set_requires_grad(true);
  return g;
}

// The fused result y and its gradients against the f32 reference ry (already backward-ed)
// and its leaves: forward, running statistics, dx, dweight, dbias, and dz with a residual.
void check_against_reference(const Tensor& y, const Tensor& rm, const Tensor& rv, const Tensor& x,
                             const Tensor& w, const Tensor& b, const Tensor& z, const Tensor& ry,
                             const Tensor& rrm, const Tensor& rrv, const Tensor& rx,
                             const Tensor& rw, const Tensor& rb, const Tensor& rz) {
  KILN_CHECK_OK(testing::compare(y.to(DType::f32), ry, 2e-2, 1e-2));
  KILN_CHECK_OK(testing::compare(rm, rrm, 1e-4, 1e-3));
  KILN_CHECK_OK(testing::compare(rv, rrv, 1e-4, 1e-3));
  KILN_CHECK_OK(testing::compare(x.grad().to(DType::f32), rx.grad(), 3e-2, 2e-2));
  KILN_CHECK_OK(testing::compare(w.grad(), rw.grad(), 5e-2, 1e-2));
  KILN_CHECK_OK(testing::compare(b.grad(), rb.grad(), 5e-2, 1e-2));
  if (z.defined()) KILN_CHECK_OK(testing::compare(z.grad().to(DType::f32), rz.grad(), 3e-2, 2e-2));
}

}  // namespace

TEST_CASE("fused batch_norm_relu (and + residual) equals the unfused ops") {
  for (bool with_residual : {false, true}) {
    CAPTURE(with_residual);
    const Shape shape{8, 64, 7, 9};
    Tensor hx = randn(shape), hz = randn(shape), hdy = randn(shape);
    Tensor hw = uniform({64}, 0.5, 1.5), hb = uniform({64}, -0.5, 0.5);
    // Fused: f16 NHWC activations, f32 parameters.
    Tensor x = gpu_leaf(hx, DType::f16, true), z = gpu_leaf(hz, DType::f16, true);
    Tensor w = gpu_leaf(hw, DType::f32, false), b = gpu_leaf(hb, DType::f32, false);
    Tensor rm = zeros({64}, TensorOptions().with_device(kGpu)), rv = ones({64}, TensorOptions().with_device(kGpu));
    Tensor y = F::batch_norm_relu(x, with_residual ? z : Tensor(), w, b, rm, rv, true);
    CHECK(y.dtype() == DType::f16);
    CHECK(y.is_contiguous(MemoryFormat::ChannelsLast));
    if (y.grad_fn()) CHECK(y.grad_fn()->name().find("BatchNorm") != std::string::npos);
    y.backward(hdy.to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast));
    // Reference: the same f16-rounded inputs in f32, unfused.
    Tensor rx = gpu_leaf(hx.to(DType::f16), DType::f32, false);
    Tensor rz = gpu_leaf(hz.to(DType::f16), DType::f32, false);
    Tensor rw = gpu_leaf(hw, DType::f32, false), rb = gpu_leaf(hb, DType::f32, false);
    Tensor rrm = zeros({64}, TensorOptions().with_device(kGpu)), rrv = ones({64}, TensorOptions().with_device(kGpu));
    Tensor ry = F::batch_norm(rx, rw, rb, rrm, rrv, true);
    if (with_residual) ry = F::add(ry, rz);
    ry = F::relu(ry);
    ry.backward(hdy.to(DType::f16).to(DType::f32).to(kGpu));
    check_against_reference(y, rm, rv, x, w, b, with_residual ? z : Tensor(), ry, rrm, rrv, rx, rw,
                            rb, rz);
  }
}

TEST_CASE("batch_norm_relu falls back to the composition for f32 and NCHW inputs") {
  Tensor x = randn({4, 8, 5, 5}, TensorOptions().with_device(kGpu));
  Tensor w = ones({8}, TensorOptions().with_device(kGpu)), b = zeros({8}, TensorOptions().with_device(kGpu));
  Tensor rm = zeros({8}, TensorOptions().with_device(kGpu)), rv = ones({8}, TensorOptions().with_device(kGpu));
  Tensor y = F::batch_norm_relu(x, x, w, b, rm, rv, true);
  Tensor want = F::relu(F::add(F::batch_norm(x, w, b, zeros_like(rm), ones_like(rv), true), x));
  KILN_CHECK_OK(testing::compare(y, want, 1e-5, 1e-5));
}

// ---- statistics from the convolution (F::conv2d's stats, F::batch_norm_from_stats) ----

namespace {

// x (8, 32, 14, 12) f16 NHWC through a 3x3 convolution to 64 channels, with its statistics.
struct ConvOut {
  Tensor x, w, y;
  F::ChannelStats stats;
};
// The backend API forced: at this size the epilogue's gain is within timing noise, and the
// tuner would be free to keep the plain convolution.
ConvOut conv_with_stats(uint64_t seed) {
  manual_seed(seed);
  ConvOut o;
  o.x = gpu_leaf(randn({8, 32, 14, 12}), DType::f16, true);
  o.w = gpu_leaf(F::mul(randn({64, 32, 3, 3}), 0.1), DType::f16, true);
  const cuda::ConvBackend before = cuda::conv_backend();
  cuda::set_conv_backend(cuda::ConvBackend::Force);
  o.y = F::conv2d(o.x, o.w, Tensor(), 1, 1, 1, 1, &o.stats);
  cuda::set_conv_backend(before);
  return o;
}

}  // namespace

TEST_CASE("conv2d's statistics epilogue: y unchanged, sums of y") {
  ConvOut o = conv_with_stats(11);
  REQUIRE_MESSAGE(o.stats.defined(), "no cuDNN plan for the statistics epilogue of a ResNet-like "
                                     "f16 NHWC 3x3 convolution");
  CHECK(o.stats.version == o.y.version());
  Tensor plain = F::conv2d(o.x.detach(), o.w.detach(), Tensor(), 1, 1);
  KILN_CHECK_OK(testing::compare(o.y.to(DType::f32), plain.to(DType::f32), 1e-3, 1e-3));
  // cuDNN sums the f32 results before they are rounded to f16 (each off by up to 2^-11
  // relative), so the sums of the stored y agree to about that.
  Tensor y32 = o.y.detach().to(DType::f32);
  Tensor want_sum = F::sum(y32, {0, 2, 3}), want_sq = F::sum(F::mul(y32, y32), {0, 2, 3});
  Tensor abs_sum = F::add(F::sum(F::relu(y32), {0, 2, 3}), F::sum(F::relu(F::neg(y32)), {0, 2, 3}));
  Tensor got = o.stats.sum.to(kCPU), want = want_sum.to(kCPU), bound = abs_sum.to(kCPU);
  for (int64_t c = 0; c < 64; ++c) {
    CAPTURE(c);
    CHECK(std::fabs(got.data<float>()[c] - want.data<float>()[c]) <=
          bound.data<float>()[c] / 1024 + 1e-3f);
  }
  KILN_CHECK_OK(testing::compare(o.stats.sqsum, want_sq, 1e-2, 2e-3));
  // The statistics path keeps the gradients of an ordinary convolution.
  Tensor dy = randn({8, 64, 14, 12}).to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
  o.y.backward(dy);
  Tensor rx = gpu_leaf(o.x.detach().to(kCPU), DType::f16, true);
  Tensor rw = gpu_leaf(o.w.detach().to(kCPU), DType::f16, true);
  F::conv2d(rx, rw, Tensor(), 1, 1).backward(dy);
  KILN_CHECK_OK(testing::compare(o.x.grad().to(DType::f32), rx.grad().to(DType::f32), 1e-3, 1e-3));
  KILN_CHECK_OK(testing::compare(o.w.grad().to(DType::f32), rw.grad().to(DType::f32), 1e-3, 1e-3));
}

TEST_CASE("batch_norm_from_stats equals the unfused ops, forward and gradients") {
  struct Case {
    bool relu, residual;
  };
  for (Case cs : {Case{true, false}, Case{true, true}, Case{false, false}, Case{false, true}}) {
    CAPTURE(cs.relu);
    CAPTURE(cs.residual);
    ConvOut o = conv_with_stats(21);
    // The batch norm's input as a leaf, and its statistics summed here from the f16 values the
    // reference sees too: the ReLU masks then agree (with the conv's f32 sums, an element within
    // rounding of the ReLU's threshold can fall on the other side and move its gradients).
    Tensor x = o.y.detach();
    x.set_requires_grad(true);
    {
      Tensor x32 = x.detach().to(DType::f32);
      o.stats = F::ChannelStats{F::sum(x32, {0, 2, 3}), F::sum(F::mul(x32, x32), {0, 2, 3}),
                                x.version()};
    }
    const Shape shape = x.shape();
    Tensor hz = randn(shape), hdy = randn(shape);
    Tensor hw = uniform({64}, 0.5, 1.5), hb = uniform({64}, -0.5, 0.5);
    Tensor z = gpu_leaf(hz, DType::f16, true);
    Tensor w = gpu_leaf(hw, DType::f32, false), b = gpu_leaf(hb, DType::f32, false);
    const TensorOptions opt = TensorOptions().with_device(kGpu);
    Tensor rm = zeros({64}, opt), rv = ones({64}, opt);
    Tensor y = F::batch_norm_from_stats(x, o.stats, cs.residual ? z : Tensor(), cs.relu, w, b,
                                        rm, rv, true);
    CHECK(y.dtype() == DType::f16);
    CHECK(y.is_contiguous(MemoryFormat::ChannelsLast));
    REQUIRE(y.grad_fn());
    CHECK(y.grad_fn()->name().find("BatchNorm") != std::string::npos);
    y.backward(hdy.to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast));
    // Reference: the same f16 input in f32, unfused.
    Tensor rx = gpu_leaf(x.detach().to(kCPU), DType::f32, false);
    Tensor rz = gpu_leaf(hz.to(DType::f16), DType::f32, false);
    Tensor rw = gpu_leaf(hw, DType::f32, false), rb = gpu_leaf(hb, DType::f32, false);
    Tensor rrm = zeros({64}, opt), rrv = ones({64}, opt);
    Tensor ry = F::batch_norm(rx, rw, rb, rrm, rrv, true);
    if (cs.residual) ry = F::add(ry, rz);
    if (cs.relu) ry = F::relu(ry);
    ry.backward(hdy.to(DType::f16).to(DType::f32).to(kGpu));
    check_against_reference(y, rm, rv, x, w, b, cs.residual ? z : Tensor(), ry, rrm, rrv, rx, rw,
                            rb, rz);
  }
}

TEST_CASE("batch_norm_from_stats: stale statistics and eval mode take the unfused path") {
  ConvOut o = conv_with_stats(31);
  REQUIRE(o.stats.defined());
  const TensorOptions opt = TensorOptions().with_device(kGpu);
  Tensor w = ones({64}, opt), b = zeros({64}, opt);
  Tensor x = o.y.detach();
  {
    NoGradGuard no_grad;
    x.mul_(2.0);  // the statistics now describe the old values
  }
  CHECK(o.stats.version != x.version());
  Tensor rm = zeros({64}, opt), rv = ones({64}, opt);
  Tensor y = F::batch_norm_from_stats(x, o.stats, Tensor(), true, w, b, rm, rv, true);
  Tensor rm2 = zeros({64}, opt), rv2 = ones({64}, opt);
  Tensor want = F::batch_norm_relu(x, Tensor(), w, b, rm2, rv2, true);
  KILN_CHECK_OK(testing::compare(y.to(DType::f32), want.to(DType::f32), 1e-3, 1e-3));
  KILN_CHECK_OK(testing::compare(rm, rm2, 1e-5, 1e-5));
  // Eval: the running statistics, whatever the batch's.
  Tensor ye = F::batch_norm_from_stats(x, o.stats, Tensor(), false, w, b, rm, rv, false);
  Tensor we = F::batch_norm(x, w, b, rm, rv, false);
  KILN_CHECK_OK(testing::compare(ye.to(DType::f32), we.to(DType::f32), 1e-3, 1e-3));
}

TEST_CASE("deterministic convolutions: the statistics come from kiln's bit-reproducible pass") {
  cuda::set_conv_deterministic(true);
  ConvOut a = conv_with_stats(41), b = conv_with_stats(41);
  cuda::set_conv_deterministic(false);
  REQUIRE(a.stats.defined());
  REQUIRE(b.stats.defined());
  KILN_CHECK_OK(testing::compare(a.stats.sum, b.stats.sum, 0, 0));
  KILN_CHECK_OK(testing::compare(a.stats.sqsum, b.stats.sqsum, 0, 0));
  Tensor y32 = a.y.detach().to(DType::f32);
  KILN_CHECK_OK(testing::compare(a.stats.sum, F::sum(y32, {0, 2, 3}), 1e-3, 1e-4));
}

TEST_CASE("batch_norm_add_batch_norm_relu equals the unfused ops, forward and gradients") {
  manual_seed(51);
  const Shape shape{8, 64, 14, 12};
  const TensorOptions opt = TensorOptions().with_device(kGpu);
  Tensor hx = randn(shape), hr = F::add(F::mul(randn(shape), 2.0), 0.5), hdy = randn(shape);
  Tensor x = gpu_leaf(hx, DType::f16, true), r = gpu_leaf(hr, DType::f16, true);
  auto stats_of = [](const Tensor& t) {
    Tensor t32 = t.detach().to(DType::f32);
    return F::ChannelStats{F::sum(t32, {0, 2, 3}), F::sum(F::mul(t32, t32), {0, 2, 3}),
                           t.version()};
  };
  Tensor hwx = uniform({64}, 0.5, 1.5), hbx = uniform({64}, -0.5, 0.5);
  Tensor hwr = uniform({64}, 0.5, 1.5), hbr = uniform({64}, -0.5, 0.5);
  F::BatchNormParams px{gpu_leaf(hwx, DType::f32, false), gpu_leaf(hbx, DType::f32, false),
                        zeros({64}, opt), ones({64}, opt)};
  F::BatchNormParams pr{gpu_leaf(hwr, DType::f32, false), gpu_leaf(hbr, DType::f32, false),
                        zeros({64}, opt), ones({64}, opt), 0.2, 1e-3};
  Tensor y = F::batch_norm_add_batch_norm_relu(x, stats_of(x), px, r, stats_of(r), pr, true);
  REQUIRE(y.grad_fn());
  CHECK(y.grad_fn()->name() == "BatchNormAddBatchNormReluBackward");
  y.backward(hdy.to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast));
  // Reference: f32, unfused.
  Tensor rx = gpu_leaf(hx.to(DType::f16), DType::f32, false);
  Tensor rr = gpu_leaf(hr.to(DType::f16), DType::f32, false);
  Tensor rwx = gpu_leaf(hwx, DType::f32, false), rbx = gpu_leaf(hbx, DType::f32, false);
  Tensor rwr = gpu_leaf(hwr, DType::f32, false), rbr = gpu_leaf(hbr, DType::f32, false);
  Tensor rmx = zeros({64}, opt), rvx = ones({64}, opt), rmr = zeros({64}, opt), rvr = ones({64}, opt);
  Tensor ry = F::relu(F::add(F::batch_norm(rx, rwx, rbx, rmx, rvx, true),
                             F::batch_norm(rr, rwr, rbr, rmr, rvr, true, 0.2, 1e-3)));
  ry.backward(hdy.to(DType::f16).to(DType::f32).to(kGpu));
  KILN_CHECK_OK(testing::compare(y.to(DType::f32), ry, 2e-2, 1e-2));
  KILN_CHECK_OK(testing::compare(px.running_mean, rmx, 1e-4, 1e-3));
  KILN_CHECK_OK(testing::compare(px.running_var, rvx, 1e-4, 1e-3));
  KILN_CHECK_OK(testing::compare(pr.running_mean, rmr, 1e-4, 1e-3));
  KILN_CHECK_OK(testing::compare(pr.running_var, rvr, 1e-4, 1e-3));
  KILN_CHECK_OK(testing::compare(x.grad().to(DType::f32), rx.grad(), 3e-2, 2e-2));
  KILN_CHECK_OK(testing::compare(r.grad().to(DType::f32), rr.grad(), 3e-2, 2e-2));
  KILN_CHECK_OK(testing::compare(px.weight.grad(), rwx.grad(), 5e-2, 1e-2));
  KILN_CHECK_OK(testing::compare(px.bias.grad(), rbx.grad(), 5e-2, 1e-2));
  KILN_CHECK_OK(testing::compare(pr.weight.grad(), rwr.grad(), 5e-2, 1e-2));
  KILN_CHECK_OK(testing::compare(pr.bias.grad(), rbr.grad(), 5e-2, 1e-2));
}

TEST_CASE("fused batch norms add their parameter gradients into an existing .grad") {
  manual_seed(61);
  autograd::reset_accumulate_stats();
  const Shape shape{4, 32, 6, 10};
  const TensorOptions opt = TensorOptions().with_device(kGpu);
  Tensor x = gpu_leaf(randn(shape), DType::f16, true), r = gpu_leaf(randn(shape), DType::f16, true);
  Tensor dy = randn(shape).to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
  auto stats_of = [](const Tensor& t) {
    Tensor t32 = t.detach().to(DType::f32);
    return F::ChannelStats{F::sum(t32, {0, 2, 3}), F::sum(F::mul(t32, t32), {0, 2, 3}),
                           t.version()};
  };
  F::BatchNormParams px{gpu_leaf(uniform({32}, 0.5, 1.5), DType::f32, false),
                        gpu_leaf(uniform({32}, -0.5, 0.5), DType::f32, false), zeros({32}, opt),
                        ones({32}, opt)};
  F::BatchNormParams pr{gpu_leaf(uniform({32}, 0.5, 1.5), DType::f32, false),
                        gpu_leaf(uniform({32}, -0.5, 0.5), DType::f32, false), zeros({32}, opt),
                        ones({32}, opt)};
  auto single = [&] {
    return F::batch_norm_from_stats(x, stats_of(x), r, true, px.weight, px.bias, px.running_mean,
                                    px.running_var, true);
  };
  auto dual = [&] {
    return F::batch_norm_add_batch_norm_relu(x, stats_of(x), px, r, stats_of(r), pr, true);
  };
  for (bool is_dual : {false, true}) {
    CAPTURE(is_dual);
    for (const Tensor* p : {&px.weight, &px.bias, &pr.weight, &pr.bias}) p->set_grad(Tensor());
    (is_dual ? dual() : single()).backward(dy);
    Tensor once_w = px.weight.grad().clone(), once_b = px.bias.grad().clone();
    Tensor once_rw = is_dual ? pr.weight.grad().clone() : Tensor();
    (is_dual ? dual() : single()).backward(dy);  // .grad exists now: accumulated into
    KILN_CHECK_OK(testing::compare(px.weight.grad(), F::mul(once_w, 2.0), 1e-5, 1e-5));
    KILN_CHECK_OK(testing::compare(px.bias.grad(), F::mul(once_b, 2.0), 1e-5, 1e-5));
    if (is_dual) KILN_CHECK_OK(testing::compare(pr.weight.grad(), F::mul(once_rw, 2.0), 1e-5, 1e-5));
  }
  // Only the batch norms' parameter gradients can have been accumulated into here.
  CHECK(autograd::accumulate_stats().used > 0);
}

TEST_CASE("bn_nhwc_stats: per-channel sum and sum of squares, in a fixed order") {
  struct Case {
    int64_t n, c, h, w;
  };
  for (Case cs :
       {Case{3, 8, 5, 7}, Case{16, 256, 14, 14}, Case{4, 2048, 7, 7}, Case{1, 64, 1, 1}}) {
    CAPTURE(cs.c);
    CAPTURE(cs.n * cs.h * cs.w);
    manual_seed(uint64_t(cs.c + cs.h));
    // Mean away from zero, as a convolution's output can be: Σx² is then far from the variance.
    Tensor host = F::add(randn({cs.n, cs.c, cs.h, cs.w}), 0.5).to(DType::f16);
    Tensor x = host.to(kGpu).contiguous(MemoryFormat::ChannelsLast);
    const TensorOptions f32 = TensorOptions(DType::f32).with_device(kGpu);
    Tensor sum = empty({cs.c}, f32), sqsum = empty({cs.c}, f32);
    cuda::bn_nhwc_stats(sum, sqsum, x);
    // Reference in f64 on the f16 values themselves.
    Tensor h64 = host.to(DType::f64);
    Tensor want = F::sum(h64, {0, 2, 3}), want_sq = F::sum(F::mul(h64, h64), {0, 2, 3});
    Tensor abs = F::sum(F::add(F::relu(h64), F::relu(F::neg(h64))), {0, 2, 3});
    Tensor got = sum.to(kCPU), got_sq = sqsum.to(kCPU);
    for (int64_t c = 0; c < cs.c; ++c) {
      CAPTURE(c);
      // f32 partial sums: relative error ~1e-6 of the sum of magnitudes.
      CHECK(std::fabs(got.data<float>()[c] - want.data<double>()[c]) <=
            1e-5 * abs.data<double>()[c] + 1e-6);
      CHECK(std::fabs(got_sq.data<float>()[c] - want_sq.data<double>()[c]) <=
            1e-5 * want_sq.data<double>()[c] + 1e-6);
    }
    // Bit-reproducible: the split of the rows depends only on the shape and the device.
    Tensor sum2 = empty({cs.c}, f32), sqsum2 = empty({cs.c}, f32);
    cuda::bn_nhwc_stats(sum2, sqsum2, x);
    KILN_CHECK_OK(testing::compare(sum2, sum, 0, 0));
    KILN_CHECK_OK(testing::compare(sqsum2, sqsum, 0, 0));
  }
  // Inputs the kernels do not take: a clear error, not a wrong answer.
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(kGpu);
  Tensor s12 = empty({12}, f32), q12 = empty({12}, f32);
  Tensor c12 = randn({2, 12, 3, 3}).to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
  CHECK_THROWS_AS(cuda::bn_nhwc_stats(s12, q12, c12), Error);
  Tensor s8 = empty({8}, f32), q8 = empty({8}, f32);
  Tensor nchw = randn({2, 8, 3, 3}).to(DType::f16).to(kGpu);
  CHECK_THROWS_AS(cuda::bn_nhwc_stats(s8, q8, nchw), Error);
  Tensor x8 = randn({2, 8, 3, 3}).to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
  CHECK_THROWS_AS(cuda::bn_nhwc_stats(s12, q8, x8), Error);
}

TEST_CASE("conv2d without the epilogue: kiln's statistics pass from KILN_STATS_MIN_C channels up") {
  // The legacy API has no epilogue, so the statistics come from kiln's pass or not at all.
  const cuda::ConvBackend before = cuda::conv_backend();
  cuda::set_conv_backend(cuda::ConvBackend::Off);
  for (int64_t c_out : {64, 128, 256}) {
    CAPTURE(c_out);
    manual_seed(uint64_t(c_out));
    Tensor x = gpu_leaf(randn({8, 32, 7, 6}), DType::f16, true);
    Tensor w = gpu_leaf(F::mul(randn({c_out, 32, 1, 1}), 0.2), DType::f16, true);
    F::ChannelStats stats;
    Tensor y = F::conv2d(x, w, Tensor(), 1, 0, 1, 1, &stats);
    // (on first sight the tuner's timing runs may leave another algorithm's result in y)
    Tensor plain = F::conv2d(x.detach(), w.detach(), Tensor(), 1, 0);
    KILN_CHECK_OK(testing::compare(y.to(DType::f32), plain.to(DType::f32), 1e-3, 1e-3));
    if (c_out < switches().stats_min_channels) {
      CHECK_FALSE(stats.defined());  // cuDNN's fused batch norm runs instead
      continue;
    }
    REQUIRE(stats.defined());
    CHECK(stats.version == y.version());
    Tensor y32 = y.detach().to(DType::f32);
    KILN_CHECK_OK(testing::compare(stats.sum, F::sum(y32, {0, 2, 3}), 1e-4, 1e-4));
    KILN_CHECK_OK(testing::compare(stats.sqsum, F::sum(F::mul(y32, y32), {0, 2, 3}), 1e-4, 1e-4));
    // and the gradients of an ordinary convolution
    Tensor dy =
        randn({8, c_out, 7, 6}).to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
    y.backward(dy);
    Tensor rx = gpu_leaf(x.detach().to(kCPU), DType::f16, true);
    Tensor rw = gpu_leaf(w.detach().to(kCPU), DType::f16, true);
    F::conv2d(rx, rw, Tensor(), 1, 0).backward(dy);
    // (the legacy API's algorithms for the two calls may differ: on the H200 up to ~0.03 apart
    // on values of ~1 in dx, f16 outputs)
    KILN_CHECK_OK(testing::compare(x.grad().to(DType::f32), rx.grad().to(DType::f32), 5e-2, 2e-2));
    KILN_CHECK_OK(testing::compare(w.grad().to(DType::f32), rw.grad().to(DType::f32), 5e-2, 2e-2));
  }
  cuda::set_conv_backend(before);
}

// ---- the ResNet stem's batch norm + ReLU + max pool (F::batch_norm_relu_max_pool) ----

namespace {

// Relative L2 distance ||a - b|| / ||b|| of two f32 tensors.
double rel_l2(const Tensor& a, const Tensor& b) {
  Tensor d = F::sub(a, b);
  const double num = F::sum(F::mul(d, d)).to(kCPU).item<float>();
  const double den = F::sum(F::mul(b, b)).to(kCPU).item<float>();
  return std::sqrt(num / den);
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  Tensor x = a.detach().to(kCPU).contiguous(), y = b.detach().to(kCPU).contiguous();
  return x.shape() == y.shape() && x.dtype() == y.dtype() &&
         std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) == 0;
}

// How many of at_max's values (N, C, OH, OW) differ from x (N, C, H, W) at the window position
// idx gives (3x3, stride 2, padding 1): the same value, or both NaN; ±0 told apart.
int64_t at_max_mismatches(const Tensor& at_max, const Tensor& idx, const Tensor& x) {
  auto host = [](const Tensor& t) {
    return t.detach().to(DType::f32).to(kCPU).contiguous().to_vector<float>();
  };
  const std::vector<float> am = host(at_max), pos = host(idx), xv = host(x);
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t OH = at_max.size(2), OW = at_max.size(3);
  int64_t bad = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          const size_t o = size_t(((n * C + c) * OH + oh) * OW + ow);
          const int k = int(pos[o]);
          const int64_t h = 2 * oh - 1 + k / 3, w = 2 * ow - 1 + k % 3;
          if (k > 8 || h < 0 || h >= H || w < 0 || w >= W) {
            ++bad;
            continue;
          }
          const float want = xv[size_t(((n * C + c) * H + h) * W + w)], got = am[o];
          const bool same = (std::isnan(want) && std::isnan(got)) ||
                            (want == got && std::signbit(want) == std::signbit(got));
          if (!same) ++bad;
        }
  return bad;
}

// The stem pool's dweight and dbias (dw, db) against another path's (dw0, db0) for the f16 input
// hx (N, C, H, W) and the pool's output gradient hdy (host f32). With KILN_STEM_POOL_AT_MAX the
// sums run over the pool's outputs and skip the composition's rounding of each pixel's gradient
// (the sum over the windows whose maximum it is) to f16: at most 2^-11 of it
// (docs/lab/stem/pool_sums_emu.py measures ~3e-4 of the largest sum). So per channel
// |Δdbias| ≤ 2^-11·Σ|dy| and |Δdweight| ≤ invstd·2^-11·Σ|dy|·max|x − mean| — rigorous, if ~20x
// loose — beside f32's rounding (the 1e-3 + 1e-4·|value| of the paths' other comparisons).
void check_pool_param_grads(const Tensor& dw, const Tensor& db, const Tensor& dw0,
                            const Tensor& db0, const Tensor& hx, const Tensor& hdy) {
  auto host = [](const Tensor& t) {
    return t.detach().to(DType::f32).to(kCPU).contiguous().to_vector<float>();
  };
  const std::vector<float> x = host(hx.to(DType::f16)), d = host(hdy.to(DType::f16));
  const std::vector<float> w = host(dw), b = host(db), w0 = host(dw0), b0 = host(db0);
  const int64_t N = hx.size(0), C = hx.size(1), HW = hx.size(2) * hx.size(3);
  const int64_t OHW = hdy.size(2) * hdy.size(3);
  for (int64_t c = 0; c < C; ++c) {
    double s = 0, sq = 0, dabs = 0, xdev = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < HW; ++i) {
        const double v = x[size_t((n * C + c) * HW + i)];
        s += v;
        sq += v * v;
      }
    const double cnt = double(N * HW), mean = s / cnt;
    const double invstd = 1.0 / std::sqrt(std::max(sq / cnt - mean * mean, 0.0) + 1e-5);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t i = 0; i < HW; ++i)
        xdev = std::max(xdev, std::fabs(double(x[size_t((n * C + c) * HW + i)]) - mean));
      for (int64_t i = 0; i < OHW; ++i) dabs += std::fabs(d[size_t((n * C + c) * OHW + i)]);
    }
    const double u = std::ldexp(1.0, -11);
    const size_t k = size_t(c);
    CAPTURE(c);
    CHECK(std::fabs(b[k] - b0[k]) <= u * dabs + 1e-3 + 1e-4 * std::fabs(b0[k]));
    CHECK(std::fabs(w[k] - w0[k]) <=
          1.01 * invstd * u * dabs * xdev + 1e-3 + 1e-4 * std::fabs(w0[k]));
  }
}

}  // namespace

TEST_CASE("batch_norm_relu_max_pool: bit for bit the composition, and the f32 reference") {
  // Odd and even sizes put windows on every border; ReLU's zeros make ties, whose first
  // position must win as in max_pool2d.
  for (Shape shape : {Shape{8, 64, 15, 14}, Shape{4, 24, 8, 9}}) {
    CAPTURE(shape_str(shape));
    const int64_t C = shape[1];
    const TensorOptions opt = TensorOptions().with_device(kGpu);
    Tensor hx = F::add(randn(shape), 0.3), hw = uniform({C}, 0.5, 1.5);
    Tensor hb = uniform({C}, -0.5, 0.5);
    const Shape out{shape[0], C, (shape[2] - 1) / 2 + 1, (shape[3] - 1) / 2 + 1};
    Tensor hdy = randn(out);
    Tensor dy = hdy.to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
    auto params = [&](double momentum) {
      return F::BatchNormParams{gpu_leaf(hw, DType::f32, false), gpu_leaf(hb, DType::f32, false),
                                zeros({C}, opt), ones({C}, opt), momentum, 1e-5};
    };
    Tensor x = gpu_leaf(hx, DType::f16, true);
    Tensor x32 = x.detach().to(DType::f32);
    const F::ChannelStats stats{F::sum(x32, {0, 2, 3}), F::sum(F::mul(x32, x32), {0, 2, 3}),
                                x.version()};
    // Fused, with the given statistics.
    F::BatchNormParams p = params(0.1);
    Tensor y = F::batch_norm_relu_max_pool(x, stats, p, true, 3, 2, 1);
    REQUIRE(y.grad_fn());
    CHECK(y.grad_fn()->name() == "BatchNormReluMaxPoolBackward");
    CHECK(y.shape() == out);
    CHECK(y.is_contiguous(MemoryFormat::ChannelsLast));
    y.backward(dy);
    // The composition on the same statistics: batch_norm_from_stats's pass, then max_pool2d.
    Tensor x2 = gpu_leaf(hx, DType::f16, true);
    F::BatchNormParams p2 = params(0.1);
    Tensor y2 = F::max_pool2d(F::batch_norm_from_stats(x2, {stats.sum, stats.sqsum, x2.version()},
                                                       Tensor(), true, p2.weight, p2.bias,
                                                       p2.running_mean, p2.running_var, true),
                              3, 2, 1);
    y2.backward(dy);
    CHECK(bitwise_equal(y, y2));
    CHECK(bitwise_equal(p.running_mean, p2.running_mean));
    CHECK(bitwise_equal(p.running_var, p2.running_var));
    // The backward adds the per-channel sums in another order than the composition's two
    // kernels (C = 64; C = 24 runs the composition's kernels and is bitwise equal), and by
    // default over the pool's outputs (check_pool_param_grads): the same pooled gradients,
    // coefficients within rounding.
    KILN_CHECK_OK(testing::compare(x.grad().to(DType::f32), x2.grad().to(DType::f32), 2e-3, 2e-3));
    check_pool_param_grads(p.weight.grad(), p.bias.grad(), p2.weight.grad(), p2.bias.grad(), hx,
                           hdy);
    if (C % 8 == 0 && 256 % (C / 8) != 0) CHECK(bitwise_equal(x.grad(), x2.grad()));
    // Repeatable bit for bit (a fixed summation order); a second backward adds its parameter
    // gradients into the existing .grad (autograd's accumulate-into targets).
    Tensor xr = gpu_leaf(hx, DType::f16, true);
    F::BatchNormParams pr = params(0.1);
    auto run = [&] {
      F::batch_norm_relu_max_pool(xr, {stats.sum, stats.sqsum, xr.version()}, pr, true, 3, 2, 1)
          .backward(dy);
    };
    run();
    CHECK(bitwise_equal(x.grad(), xr.grad()));
    const Tensor once_w = pr.weight.grad().clone(), once_b = pr.bias.grad().clone();
    run();
    CHECK(bitwise_equal(pr.weight.grad(), F::mul(once_w, 2.0)));
    CHECK(bitwise_equal(pr.bias.grad(), F::mul(once_b, 2.0)));

    // Without statistics the op sums them itself; against the f32 reference on the CPU.
    Tensor x3 = gpu_leaf(hx, DType::f16, true);
    F::BatchNormParams p3 = params(0.2);
    Tensor y3 = F::batch_norm_relu_max_pool(x3, F::ChannelStats{}, p3, true, 3, 2, 1);
    REQUIRE(y3.grad_fn());
    CHECK(y3.grad_fn()->name() == "BatchNormReluMaxPoolBackward");
    y3.backward(dy);
    Tensor rx = hx.to(DType::f16).to(DType::f32).detach();
    rx.set_requires_grad(true);
    Tensor rw = hw.detach(), rb = hb.detach();
    rw.set_requires_grad(true);
    rb.set_requires_grad(true);
    Tensor rm = zeros({C}), rv = ones({C});
    Tensor ry = F::max_pool2d(F::relu(F::batch_norm(rx, rw, rb, rm, rv, true, 0.2)), 3, 2, 1);
    ry.backward(hdy.to(DType::f16).to(DType::f32));
    KILN_CHECK_OK(testing::compare(y3.to(DType::f32).to(kCPU), ry, 2e-2, 1e-2));
    KILN_CHECK_OK(testing::compare(p3.running_mean.to(kCPU), rm, 1e-4, 1e-3));
    KILN_CHECK_OK(testing::compare(p3.running_var.to(kCPU), rv, 1e-4, 1e-3));
    KILN_CHECK_OK(testing::compare(p3.weight.grad().to(kCPU), rw.grad(), 5e-2, 1e-2));
    KILN_CHECK_OK(testing::compare(p3.bias.grad().to(kCPU), rb.grad(), 5e-2, 1e-2));
    // dx in L2: where two window values are within f16 rounding of each other, the two
    // precisions may route a gradient to different (neighbouring, equally valid) positions.
    CHECK(rel_l2(x3.grad().to(DType::f32).to(kCPU), rx.grad()) < 2e-2);
  }
}

// The stem pool's two kernels (cuda::set_stem_pool_tile_enabled): the 8 × 8-output tiles in
// shared memory against one output per thread, y and the window positions byte for byte. Values
// from a small set (ties everywhere, and ReLU's zeros), ±0, ±inf and NaN in x; negative, zero and
// positive scales; shapes with partial tiles on both edges, odd and even sizes, and C / 8 of 16,
// 8, 6 and 3 (channel vectors per block 8, 8, 2 and 1).
TEST_CASE("batch_norm_relu_max_pool: the tiled kernel gives the per-output kernel's bytes") {
  const bool before = cuda::stem_pool_tile_enabled();
  for (Shape shape : {Shape{2, 128, 20, 21}, Shape{3, 64, 33, 30}, Shape{2, 48, 9, 12},
                      Shape{1, 24, 15, 15}, Shape{1, 64, 1, 1}, Shape{2, 64, 2, 17}}) {
    CAPTURE(shape_str(shape));
    const int64_t N = shape[0], C = shape[1], H = shape[2], W = shape[3];
    std::vector<float> hx(size_t(N * C * H * W));
    uint32_t state = 12345;
    auto next = [&] {
      state = state * 1664525u + 1013904223u;
      return state >> 8;
    };
    const float special[] = {0.f, -0.f, INFINITY, -INFINITY, NAN, 1.f, -1.f, 0.5f};
    for (float& v : hx) {
      const uint32_t r = next();
      v = r % 16 == 0 ? special[(r / 16) % 8] : float(int(r % 9) - 4) * 0.25f;
    }
    std::vector<float> hss(size_t(2 * C));
    for (int64_t c = 0; c < C; ++c) {
      const uint32_t r = next();
      hss[size_t(c)] = c % 5 == 0 ? 0.f : (c % 3 == 0 ? -1.f : 1.f) * (0.5f + float(r % 7) / 4);
      hss[size_t(C + c)] = float(int(r % 5) - 2) * 0.125f;
    }
    const Tensor x = from_vector<float>(hx, {N, C, H, W})
                         .to(DType::f16)
                         .to(kGpu)
                         .contiguous(MemoryFormat::ChannelsLast);
    const Tensor ss = from_vector<float>(hss, {2 * C}).to(kGpu);
    const Shape out{N, C, (H - 1) / 2 + 1, (W - 1) / 2 + 1};
    const TensorOptions cl =
        TensorOptions().with_device(kGpu).with_memory_format(MemoryFormat::ChannelsLast);
    auto run = [&](bool tiled, bool with_at_max) {
      cuda::set_stem_pool_tile_enabled(tiled);
      Tensor y = empty(out, cl.with_dtype(DType::f16)), idx = empty(out, cl.with_dtype(DType::u8));
      Tensor am = with_at_max ? empty(out, cl.with_dtype(DType::f16)) : Tensor();
      cuda::bn_nhwc_relu_max_pool(y, idx, am, x, ss);
      return std::tuple{y, idx, am};
    };
    const bool raw_before = cuda::stem_pool_raw_tile_enabled();
    const auto [y0, i0, a0] = run(false, true);
    const auto [y1, i1, a1] = run(true, true);
    CHECK(bitwise_equal(y1, y0));
    CHECK(bitwise_equal(i1, i0));
    // x at each maximum (the backward's sums read it): both kernels, against x on the host; the
    // tiled kernel's from its raw tile (KILN_STEM_POOL_RAW_TILE) and from global memory alike.
    CHECK(bitwise_equal(a1, a0));
    CHECK(at_max_mismatches(a1, i1, x) == 0);
    CHECK(at_max_mismatches(a0, i0, x) == 0);
    for (bool raw : {false, true}) {
      CAPTURE(raw);
      cuda::set_stem_pool_raw_tile_enabled(raw);
      const auto [y3, i3, a3] = run(true, true);
      CHECK(bitwise_equal(y3, y0));
      CHECK(bitwise_equal(i3, i0));
      CHECK(bitwise_equal(a3, a0));
    }
    cuda::set_stem_pool_raw_tile_enabled(raw_before);
    // Without at_max, y and the positions are the same bytes.
    for (bool tiled : {false, true}) {
      const auto [y2, i2, a2] = run(tiled, false);
      CHECK(bitwise_equal(y2, y0));
      CHECK(bitwise_equal(i2, i0));
    }
  }
  cuda::set_stem_pool_tile_enabled(before);
}

// The backward's batch-norm sums over the pool's outputs from x at each maximum
// (KILN_STEM_POOL_AT_MAX, on) against the sums over every input pixel (off): dweight and dbias
// within the bound of check_pool_param_grads (a pixel that is the maximum of several windows
// rounds their gradients' sum to f16 on the old path only), dx to f16 rounding; and the sums
// themselves against the pooled form in double on the host.
TEST_CASE("batch_norm_relu_max_pool: the backward's sums over the pool's outputs") {
  const bool before = cuda::stem_pool_at_max_enabled();
  // at_max is asked for only where the backward's own kernels would read it: not with the switch
  // off, nor for a channel count whose backward is the composition (C / 8 = 3 does not divide 256).
  {
    const TensorOptions cl =
        TensorOptions(DType::f16).with_device(kGpu).with_memory_format(MemoryFormat::ChannelsLast);
    const Tensor x64 = empty({2, 64, 9, 9}, cl), x24 = empty({2, 24, 9, 9}, cl);
    cuda::set_stem_pool_at_max_enabled(true);
    CHECK(cuda::relu_max_pool_backward_uses_at_max(x64));
    CHECK_FALSE(cuda::relu_max_pool_backward_uses_at_max(x24));
    cuda::set_stem_pool_at_max_enabled(false);
    CHECK_FALSE(cuda::relu_max_pool_backward_uses_at_max(x64));
  }
  for (Shape shape : {Shape{4, 64, 15, 14}, Shape{2, 128, 9, 12}, Shape{3, 64, 16, 16}}) {
    CAPTURE(shape_str(shape));
    const int64_t C = shape[1];
    const Shape out{shape[0], C, (shape[2] - 1) / 2 + 1, (shape[3] - 1) / 2 + 1};
    Tensor hx = F::add(randn(shape), 0.3), hw = uniform({C}, 0.5, 1.5);
    Tensor hb = uniform({C}, -0.5, 0.5), hdy = randn(out);
    const Tensor dy = hdy.to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
    const TensorOptions opt = TensorOptions().with_device(kGpu);
    auto run = [&](bool at_max) {
      cuda::set_stem_pool_at_max_enabled(at_max);
      Tensor x = gpu_leaf(hx, DType::f16, true);
      F::BatchNormParams p{gpu_leaf(hw, DType::f32, false),
                           gpu_leaf(hb, DType::f32, false),
                           zeros({C}, opt),
                           ones({C}, opt),
                           0.1,
                           1e-5};
      F::batch_norm_relu_max_pool(x, F::ChannelStats{}, p, true, 3, 2, 1).backward(dy);
      return std::tuple{x.grad(), p.weight.grad(), p.bias.grad()};
    };
    const auto [dx0, dw0, db0] = run(false);
    const auto [dx1, dw1, db1] = run(true);
    check_pool_param_grads(dw1, db1, dw0, db0, hx, hdy);
    KILN_CHECK_OK(testing::compare(dx1.to(DType::f32), dx0.to(DType::f32), 2e-3, 2e-3));
    const auto [dx2, dw2, db2] = run(true);  // a fixed summation order: repeatable
    CHECK(bitwise_equal(dx2, dx1));
    CHECK(bitwise_equal(dw2, dw1));
    CHECK(bitwise_equal(db2, db1));

    // The kernels alone, against Σ over outputs of g = dy·[x·scale + shift > 0] at x = at_max
    // (f32 fma, as the kernel decides) in double: dbias = Σg, dweight = invstd·Σg·(at_max − mean).
    const Tensor x = hx.to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
    const Tensor mean = uniform({C}, -0.2, 0.2).to(kGpu), invstd = uniform({C}, 0.5, 2.0).to(kGpu);
    const Tensor ss = F::cat({uniform({C}, 0.5, 1.5), uniform({C}, -0.5, 0.5)}, 0).to(kGpu);
    const TensorOptions cl = opt.with_memory_format(MemoryFormat::ChannelsLast);
    Tensor y = empty(out, cl.with_dtype(DType::f16)), idx = empty(out, cl.with_dtype(DType::u8));
    Tensor am = empty(out, cl.with_dtype(DType::f16));
    cuda::bn_nhwc_relu_max_pool(y, idx, am, x, ss);
    Tensor dx = empty_like(x), dw = empty({C}, opt), db = empty({C}, opt);
    cuda::bn_nhwc_relu_max_pool_backward(dx, dw, db, dy, idx, am, x, Tensor(), mean, invstd, ss);
    auto host = [](const Tensor& t) {
      return t.detach().to(DType::f32).to(kCPU).contiguous().to_vector<float>();
    };
    const std::vector<float> a = host(am), d = host(dy), m = host(mean), k = host(invstd),
                             f = host(ss), gw = host(dw), gb = host(db);
    const int64_t per = out[0] * out[2] * out[3], hw2 = out[2] * out[3];
    for (int64_t c = 0; c < C; ++c) {
      double s1 = 0, s2 = 0, abs1 = 0, abs2 = 0;
      for (int64_t i = 0; i < per; ++i) {
        const size_t o = size_t(((i / hw2) * C + c) * hw2 + i % hw2);
        if (!(std::fma(a[o], f[size_t(c)], f[size_t(C + c)]) > 0.f)) continue;
        const double t2 = double(d[o]) * (double(a[o]) - double(m[size_t(c)]));
        s1 += d[o];
        s2 += t2;
        abs1 += std::fabs(d[o]);
        abs2 += std::fabs(t2);
      }
      CAPTURE(c);
      CHECK(std::fabs(gb[size_t(c)] - s1) <= 1e-5 * abs1 + 1e-6);
      CHECK(std::fabs(gw[size_t(c)] - s2 * k[size_t(c)]) <= 1e-5 * abs2 * k[size_t(c)] + 1e-6);
    }
  }
  cuda::set_stem_pool_at_max_enabled(before);
}

TEST_CASE("batch_norm_relu_max_pool: other pools, eval mode and NCHW take the composition") {
  manual_seed(71);
  const TensorOptions opt = TensorOptions().with_device(kGpu);
  Tensor x = randn({4, 16, 10, 10}).to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
  auto bn = [&] {
    return F::BatchNormParams{uniform({16}, 0.5, 1.5).to(kGpu), uniform({16}, -0.5, 0.5).to(kGpu),
                              zeros({16}, opt), ones({16}, opt)};
  };
  struct Case {
    int64_t k, s, pad;
    bool training, nchw;
  };
  for (Case c : {Case{2, 2, 0, true, false}, Case{3, 1, 1, true, false}, Case{3, 2, 1, false, false},
                 Case{3, 2, 1, true, true}}) {
    CAPTURE(c.k);
    CAPTURE(c.s);
    CAPTURE(c.training);
    CAPTURE(c.nchw);
    Tensor xi = c.nchw ? x.contiguous() : x;
    F::BatchNormParams a = bn(), b = a;
    b.running_mean = a.running_mean.clone();
    b.running_var = a.running_var.clone();
    Tensor y = F::batch_norm_relu_max_pool(xi, F::ChannelStats{}, a, c.training, c.k, c.s, c.pad);
    Tensor want = F::max_pool2d(F::batch_norm_relu(xi, Tensor(), b.weight, b.bias, b.running_mean,
                                                   b.running_var, c.training),
                                c.k, c.s, c.pad);
    KILN_CHECK_OK(testing::compare(y.to(DType::f32), want.to(DType::f32), 1e-3, 1e-3));
    KILN_CHECK_OK(testing::compare(a.running_mean, b.running_mean, 1e-6, 1e-5));
  }
}

namespace {

// A finalize of x's statistics with fresh outputs and running statistics (mean 0.5, var 2, so
// the update is visible) and a counter at 7.
BnStatsFinalize finalize_of(const Tensor& x, double momentum) {
  const int64_t C = x.size(1);
  BnStatsFinalize f = gputest::bn_finalize_of(x);
  f.running_mean = full({C}, 0.5).to(kGpu);
  f.running_var = full({C}, 2.0).to(kGpu);
  f.counter = full({}, 7.0, TensorOptions(DType::i64)).to(kGpu);
  f.momentum = momentum;
  return f;
}

// The same finalize on fresh copies of its in-place tensors (running statistics, counter).
BnStatsFinalize copy_of(const BnStatsFinalize& f) {
  BnStatsFinalize g = f;
  g.save_mean = empty_like(f.save_mean);
  g.save_invstd = empty_like(f.save_invstd);
  g.scale_shift = empty_like(f.scale_shift);
  g.running_mean = f.running_mean.clone();
  g.running_var = f.running_var.clone();
  g.counter = f.counter.clone();
  return g;
}

// Only the scale_shift of f: what the apply kernels take as given.
BnStatsFinalize given(const BnStatsFinalize& f) {
  BnStatsFinalize g;
  g.scale_shift = f.scale_shift;
  return g;
}

void check_same_finalize(const BnStatsFinalize& a, const BnStatsFinalize& b) {
  for (auto [ta, tb] : {std::pair{a.save_mean, b.save_mean}, {a.save_invstd, b.save_invstd},
                        {a.scale_shift, b.scale_shift}, {a.running_mean, b.running_mean},
                        {a.running_var, b.running_var}})
    KILN_CHECK_OK(testing::compare(ta, tb, 0, 0));
  CHECK(a.counter.to(kCPU).data<int64_t>()[0] == 8);
  CHECK(b.counter.to(kCPU).data<int64_t>()[0] == 8);
}

}  // namespace

// bn_nhwc_apply and bn_nhwc_dual_apply handed a finalize with statistics: every output equals
// bn_nhwc_finalize followed by the apply with the scale_shift given, bit for bit, and the
// counter goes up once (C = 24: a thread's channels change along its grid-stride loop).
TEST_CASE("the apply entries finalize first: the finalize kernel's floats, one count") {
  manual_seed(61);
  for (int64_t C : {64, 24}) {
    CAPTURE(C);
    const Shape shape{8, C, 14, 12};
    Tensor x = F::add(F::mul(randn(shape), 1.5), 0.25).to(DType::f16).to(kGpu)
                   .contiguous(MemoryFormat::ChannelsLast);
    Tensor z = randn(shape).to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
    const TensorOptions u8 = TensorOptions(DType::u8).with_device(kGpu);
    const BnStatsFinalize fa = finalize_of(x, 0.1), fb = copy_of(fa);
    Tensor ya = empty_like(x), yb = empty_like(x);
    Tensor ma = empty({x.numel() / 8}, u8), mb = empty({x.numel() / 8}, u8);
    cuda::bn_nhwc_finalize(fa);
    cuda::bn_nhwc_apply(ya, x, z, given(fa), Activation::Relu, ma);
    cuda::bn_nhwc_apply(yb, x, z, fb, Activation::Relu, mb);
    check_same_finalize(fa, fb);
    KILN_CHECK_OK(testing::compare(ya, yb, 0, 0));
    KILN_CHECK_OK(testing::compare(ma, mb, 0, 0));
    // And with the two batch norms of a downsampling block's tail.
    const BnStatsFinalize fx = finalize_of(x, 0.1), fr = finalize_of(z, 0.3);
    const BnStatsFinalize gx = copy_of(fx), gr = copy_of(fr);
    cuda::bn_nhwc_finalize(fx);
    cuda::bn_nhwc_finalize(fr);
    cuda::bn_nhwc_dual_apply(ya, x, given(fx), z, given(fr), ma);
    cuda::bn_nhwc_dual_apply(yb, x, gx, z, gr, mb);
    check_same_finalize(fx, gx);
    check_same_finalize(fr, gr);
    KILN_CHECK_OK(testing::compare(ya, yb, 0, 0));
    KILN_CHECK_OK(testing::compare(ma, mb, 0, 0));
  }
}

// num_batches_tracked handed to the F ops: counted once per training call, fused or not, never
// in eval.
TEST_CASE("batch_norm_from_stats and friends count the batch once") {
  ConvOut o = conv_with_stats(71);
  REQUIRE(o.stats.defined());
  const TensorOptions opt = TensorOptions().with_device(kGpu);
  auto count = [](const Tensor& t) { return t.to(kCPU).data<int64_t>()[0]; };
  F::BatchNormParams p{ones({64}, opt), zeros({64}, opt), zeros({64}, opt), ones({64}, opt)};
  p.num_batches_tracked = zeros({}, TensorOptions(DType::i64).with_device(kGpu));
  Tensor x = o.y.detach();
  auto run = [&](const F::ChannelStats& st, bool training) {
    return F::batch_norm_from_stats(x, st, Tensor(), true, p.weight, p.bias, p.running_mean,
                                    p.running_var, training, p.momentum, p.eps,
                                    p.num_batches_tracked);
  };
  run(o.stats, true);  // fused
  CHECK(count(p.num_batches_tracked) == 1);
  run(F::ChannelStats{}, true);  // no statistics: the composition
  CHECK(count(p.num_batches_tracked) == 2);
  run(o.stats, false);  // eval
  CHECK(count(p.num_batches_tracked) == 2);
  F::BatchNormParams q{ones({64}, opt), zeros({64}, opt), zeros({64}, opt), ones({64}, opt)};
  q.num_batches_tracked = zeros({}, TensorOptions(DType::i64).with_device(kGpu));
  F::batch_norm_add_batch_norm_relu(x, o.stats, p, x, o.stats, q, true);
  CHECK(count(p.num_batches_tracked) == 3);
  CHECK(count(q.num_batches_tracked) == 1);
  F::batch_norm_relu_max_pool(x, o.stats, q, true, 3, 2, 1, 1);
  CHECK(count(q.num_batches_tracked) == 2);
}

// Programmatic dependent launch (cuda::launch, sm_90+) changes when kiln's kernels are placed,
// never what they compute: a chain of fused batch norms forward and backward, on tensors of
// several waves, gives the same bits with it on and off.
TEST_CASE("the fused batch norms give the same bits with programmatic dependent launch on and off") {
  const bool was = cuda::pdl_enabled();
  const Shape shape{32, 256, 28, 28};
  const TensorOptions opt = TensorOptions().with_device(kGpu);
  manual_seed(81);
  Tensor hx = randn(shape), hr = randn(shape), hdy = randn(shape);
  Tensor hw = uniform({256}, 0.5, 1.5), hb = uniform({256}, -0.5, 0.5);
  auto stats_of = [](const Tensor& t) {
    Tensor t32 = t.detach().to(DType::f32);
    return F::ChannelStats{F::sum(t32, {0, 2, 3}), F::sum(F::mul(t32, t32), {0, 2, 3}),
                           t.version()};
  };
  struct Run {
    Tensor y, dx, dr, dw, db, rm, count;
  };
  auto run = [&](bool pdl) {
    cuda::set_pdl_enabled(pdl);
    Tensor x = gpu_leaf(hx, DType::f16, true), r = gpu_leaf(hr, DType::f16, true);
    F::BatchNormParams px{gpu_leaf(hw, DType::f32, false), gpu_leaf(hb, DType::f32, false),
                          zeros({256}, opt), ones({256}, opt)};
    F::BatchNormParams pr{gpu_leaf(hw, DType::f32, false), gpu_leaf(hb, DType::f32, false),
                          zeros({256}, opt), ones({256}, opt)};
    px.num_batches_tracked = zeros({}, TensorOptions(DType::i64).with_device(kGpu));
    Tensor h = F::batch_norm_add_batch_norm_relu(x, stats_of(x), px, r, stats_of(r), pr, true);
    Tensor y = F::batch_norm_from_stats(h, stats_of(h), x, true, px.weight, px.bias,
                                        px.running_mean, px.running_var, true, px.momentum,
                                        px.eps, px.num_batches_tracked);
    y.backward(hdy.to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast));
    cuda::synchronize();
    return Run{y, x.grad(), r.grad(), px.weight.grad(), pr.bias.grad(), px.running_mean,
               px.num_batches_tracked};
  };
  const Run on = run(true), off = run(false);
  cuda::set_pdl_enabled(was);
  CHECK(bitwise_equal(on.y, off.y));
  CHECK(bitwise_equal(on.dx, off.dx));
  CHECK(bitwise_equal(on.dr, off.dr));
  CHECK(bitwise_equal(on.dw, off.dw));
  CHECK(bitwise_equal(on.db, off.db));
  CHECK(bitwise_equal(on.rm, off.rm));
  CHECK(on.count.to(kCPU).data<int64_t>()[0] == 2);
  CHECK(bitwise_equal(on.count, off.count));
}

// ---- batch norm + GELU (F::batch_norm_from_stats with Activation::Gelu) ----

// The fused GELU path against gelu(batch_norm(x)) computed unfused in f32 on the same f16 input:
// forward, running statistics, dx and dbias (dweight too when the scale trains), with the
// statistics given (a convolution's) and computed by the op itself (a batch norm after a pool);
// a second run gives the same bits.
TEST_CASE("batch_norm_from_stats with GELU equals the unfused ops, forward and gradients") {
  for (bool given : {true, false}) {
    for (bool frozen_scale : {false, true}) {
      CAPTURE(given);
      CAPTURE(frozen_scale);
      ConvOut o = conv_with_stats(91);
      Tensor x = o.y.detach();
      x.set_requires_grad(true);
      F::ChannelStats st;
      if (given) {
        Tensor x32 = x.detach().to(DType::f32);
        st = F::ChannelStats{F::sum(x32, {0, 2, 3}), F::sum(F::mul(x32, x32), {0, 2, 3}),
                             x.version()};
      }
      const Shape shape = x.shape();
      Tensor hdy = randn(shape), hw = uniform({64}, 0.5, 1.5), hb = uniform({64}, -0.5, 0.5);
      const TensorOptions opt = TensorOptions().with_device(kGpu);
      auto run = [&](Tensor& w, Tensor& b, Tensor& rm, Tensor& rv, Tensor& counter) {
        w = gpu_leaf(hw, DType::f32, false);
        if (frozen_scale) w.set_requires_grad(false);
        b = gpu_leaf(hb, DType::f32, false);
        rm = zeros({64}, opt);
        rv = ones({64}, opt);
        counter = zeros({}, TensorOptions(DType::i64).with_device(kGpu));
        x.set_grad(Tensor());
        Tensor y = F::batch_norm_from_stats(x, st, Tensor(), Activation::Gelu, w, b, rm, rv, true,
                                            0.1, 1e-5, counter);
        y.backward(hdy.to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast));
        cuda::synchronize();
        return y;
      };
      Tensor w, b, rm, rv, counter;
      Tensor y = run(w, b, rm, rv, counter);
      CHECK(y.dtype() == DType::f16);
      CHECK(y.is_contiguous(MemoryFormat::ChannelsLast));
      REQUIRE(y.grad_fn());
      CHECK(y.grad_fn()->name() == "BatchNormGeluBackward");
      CHECK(counter.to(kCPU).data<int64_t>()[0] == 1);
      CHECK(frozen_scale == !w.grad().defined());
      // Reference: the same f16 input in f32, unfused.
      Tensor rx = gpu_leaf(x.detach().to(kCPU), DType::f32, false);
      Tensor rw = gpu_leaf(hw, DType::f32, false), rb = gpu_leaf(hb, DType::f32, false);
      Tensor rrm = zeros({64}, opt), rrv = ones({64}, opt);
      Tensor ry = F::gelu(F::batch_norm(rx, rw, rb, rrm, rrv, true));
      ry.backward(hdy.to(DType::f16).to(DType::f32).to(kGpu));
      KILN_CHECK_OK(testing::compare(y.to(DType::f32), ry, 2e-2, 1e-2));
      KILN_CHECK_OK(testing::compare(rm, rrm, 1e-4, 1e-3));
      KILN_CHECK_OK(testing::compare(rv, rrv, 1e-4, 1e-3));
      KILN_CHECK_OK(testing::compare(x.grad().to(DType::f32), rx.grad(), 3e-2, 2e-2));
      KILN_CHECK_OK(testing::compare(b.grad(), rb.grad(), 5e-2, 1e-2));
      if (!frozen_scale) KILN_CHECK_OK(testing::compare(w.grad(), rw.grad(), 5e-2, 1e-2));
      // Bit-reproducible: the statistics and the gradient sums in a fixed order.
      const Tensor dx1 = x.grad().clone(), db1 = b.grad().clone();
      Tensor w2, b2, rm2, rv2, counter2;
      Tensor y2 = run(w2, b2, rm2, rv2, counter2);
      CHECK(bitwise_equal(y, y2));
      CHECK(bitwise_equal(dx1, x.grad()));
      CHECK(bitwise_equal(db1, b2.grad()));
      CHECK(bitwise_equal(rv, rv2));
    }
  }
}

TEST_CASE("batch_norm_from_stats with GELU: a residual, eval mode and f32 take the composition") {
  const TensorOptions opt = TensorOptions().with_device(kGpu);
  manual_seed(93);
  Tensor hx = randn({4, 16, 6, 6}), hr = randn({4, 16, 6, 6});
  Tensor w = uniform({16}, 0.5, 1.5).to(kGpu), b = uniform({16}, -0.5, 0.5).to(kGpu);
  auto check_case = [&](const Tensor& x, const Tensor& r, bool training) {
    Tensor rm = zeros({16}, opt), rv = ones({16}, opt), rm2 = zeros({16}, opt), rv2 = ones({16}, opt);
    Tensor y = F::batch_norm_from_stats(x, F::ChannelStats{}, r, Activation::Gelu, w, b, rm, rv,
                                        training);
    Tensor want = F::batch_norm(x, w, b, rm2, rv2, training);
    if (r.defined()) want = F::add(want, r);
    want = F::gelu(want);
    KILN_CHECK_OK(testing::compare(y.to(DType::f32), want.to(DType::f32), 1e-3, 1e-3));
    KILN_CHECK_OK(testing::compare(rm, rm2, 1e-6, 1e-6));
  };
  Tensor x16 = hx.to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
  Tensor r16 = hr.to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
  check_case(x16, r16, true);
  check_case(x16, Tensor(), false);
  check_case(hx.to(kGpu), Tensor(), true);
}

// The modules: nn::BatchNormAct2d after a pool and nn::ConvBn(…, Gelu) take the fused path and
// agree with BatchNorm2d then GELU.
TEST_CASE("nn::BatchNormAct2d and nn::ConvBn with GELU equal BatchNorm2d then GELU") {
  manual_seed(95);
  Generator g(7);
  auto conv = std::make_shared<nn::Conv2d>(32, 64, 3, 1, 1, 1, 1, false, &g);
  auto bn = std::make_shared<nn::BatchNorm2d>(64);
  nn::ConvBn fused(conv, bn, Activation::Gelu);
  nn::BatchNormAct2d bna(64, Activation::Gelu);
  for (nn::Module* m : {static_cast<nn::Module*>(&fused), static_cast<nn::Module*>(&bna)})
    amp::prepare_model(*m, kGpu, amp::Precision::Mixed16);
  Tensor x = randn({8, 32, 14, 12}).to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
  Tensor y = fused.forward(x);
  REQUIRE(y.grad_fn());
  CHECK(y.grad_fn()->name() == "BatchNormGeluBackward");
  Tensor z = bna.forward(F::max_pool2d(y, 2));
  REQUIRE(z.grad_fn());
  CHECK(z.grad_fn()->name() == "BatchNormGeluBackward");
  CHECK(bna.num_batches_tracked().to(kCPU).data<int64_t>()[0] == 1);
  CHECK(bn->num_batches_tracked().to(kCPU).data<int64_t>()[0] == 1);
  // The unfused modules on the same weights.
  nn::BatchNorm2d bn_ref(64), bna_ref(64);
  for (nn::Module* m : {static_cast<nn::Module*>(&bn_ref), static_cast<nn::Module*>(&bna_ref)})
    amp::prepare_model(*m, kGpu, amp::Precision::Mixed16);
  Tensor yr = F::gelu(bn_ref.forward(F::conv2d(x, conv->weight(), Tensor(), 1, 1)));
  Tensor zr = F::gelu(bna_ref.forward(F::max_pool2d(yr, 2)));
  KILN_CHECK_OK(testing::compare(z.to(DType::f32), zr.to(DType::f32), 3e-2, 2e-2));
  KILN_CHECK_OK(testing::compare(bna.running_var(), bna_ref.running_var(), 1e-3, 1e-3));
  CHECK(bna.describe() == "BatchNormAct2d(64, eps=1e-05, momentum=0.1, act=gelu)");
}
