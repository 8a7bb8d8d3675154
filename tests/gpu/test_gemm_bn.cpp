// cuda::bn_nhwc_backward_dgrad: a 1x1 convolution's data gradient with the block tail's
// batch-norm backward in its epilogue, against the unfused composition it replaces (cuDNN's
// dgrad with beta = 1, then bn_nhwc_backward with the ReLU bitmask) and against an f32 CPU
// reference; bit-reproducible; unsupported shapes refused with a message.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "core/autograd.h"
#include "cuda/backend.h"
#include "cuda/kernels.h"
#include "cuda/kernels/gemm_bn_wgmma.h"
#include "ops/ops.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/tail_case.h"
#include "tests/gradcheck.h"

using namespace kiln;

namespace {

const Device kGpu = Device::cuda(0);
const Device kCPU = Device::cpu();

Tensor nhwc(const Tensor& host) { return gputest::nhwc_f16(host); }

using gputest::make_tail;
using gputest::Tail;

struct Grads {
  Tensor dx, g, dw, db;
};

Grads run_fused(const Tail& t) {
  const TensorOptions f32 = TensorOptions().with_device(kGpu);
  const int64_t c = t.y3.size(1);
  Grads o{empty_like(t.y3), empty_like(t.y3), empty({c}, f32), empty({c}, f32)};
  cuda::bn_nhwc_backward_dgrad(o.dx, o.g, o.dw, o.db, t.dy1, t.w1, t.r, t.mask, t.y3, t.weight,
                               t.mean, t.invstd);
  return o;
}

// Today's path: cuDNN's dgrad added onto r, then kiln's two passes.
Grads run_unfused(const Tail& t) {
  const TensorOptions f32 = TensorOptions().with_device(kGpu);
  const int64_t c = t.y3.size(1);
  Tensor grad = t.r.clone();
  cuda::conv2d_backward_data(grad, t.dy1, t.w1, ConvParams{}, /*accumulate=*/true);
  Grads o{empty_like(t.y3), empty_like(t.y3), empty({c}, f32), empty({c}, f32)};
  cuda::bn_nhwc_backward(o.dx, o.g, o.dw, o.db, grad, t.y3, t.mask, t.weight, t.mean, t.invstd,
                         t.scale_shift, Activation::Relu);
  return o;
}

Tensor f32(const Tensor& t) { return t.to(DType::f32).to(kCPU); }

}  // namespace

TEST_CASE("bn_nhwc_backward_dgrad equals cuDNN's dgrad then bn_nhwc_backward") {
  struct Case {
    int64_t n, c, k, h, w;
  };
  // 784 rows (6 full tiles and 16 rows), 105 rows (one partial tile), 162 rows; K 64 and 128 on
  // both kernels (mode 2 takes the wgmma kernel where C % 128 == 0 on sm_90, mode 0 the mma.sync
  // kernel). The wgmma kernel only: K 256 and 512, 784 rows over 2 column tiles, 84 rows (one
  // partial tile), 98 rows over 8 and 16 column tiles (ResNet-50's layers 3 and 4), and layer 3
  // at batch 64 (12,544 rows: 98 tiles over 16 CTAs, several each).
  const int mode = cuda::tail_gemm_mode();
  for (Case cs : {Case{4, 256, 64, 14, 14}, Case{3, 128, 128, 7, 5}, Case{2, 64, 64, 9, 9},
                  Case{4, 256, 256, 14, 14}, Case{2, 128, 256, 6, 7}, Case{2, 1024, 256, 7, 7},
                  Case{2, 2048, 512, 7, 7}, Case{64, 1024, 256, 14, 14}}) {
    CAPTURE(cs.c);
    CAPTURE(cs.k);
    if (cs.k > 128 && !cuda::dgrad1x1_bn_wgmma_available()) {
      MESSAGE("K ", cs.k, ": the wgmma kernel needs an sm_90 GPU and a build for sm_90a; skipped");
      continue;
    }
    const Tail t = make_tail(cs.n, cs.c, cs.k, cs.h, cs.w, 81 + uint64_t(cs.c));
    const Grads b = run_unfused(t);
    // The CPU's f32 reference: G = dy1·w1 + r, masked by the forward's ReLU.
    const int64_t M = cs.n * cs.h * cs.w;
    Tensor dy = f32(t.dy1).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.k});
    Tensor w = f32(t.w1).reshape({cs.k, cs.c});
    Tensor r = f32(t.r).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.c});
    Tensor want = F::add(F::matmul(dy, w), r);
    Tensor mask_bytes = t.mask.to(kCPU);
    float* wp = want.data<float>();
    const uint8_t* mp = mask_bytes.data<uint8_t>();
    for (int64_t i = 0; i < M * cs.c; ++i)
      if (!((mp[i / 8] >> (i % 8)) & 1u)) wp[i] = 0.f;
    // dweight and dbias add M terms, each of which may be one f16 rounding step of G apart
    // (about 2^-11 relative): about sqrt(M)·2^-11·|g·x̂| of noise, 0.03 at M = 784; the bound
    // grows with sqrt(M) from there.
    const double atol = 6e-2 * std::max(1.0, std::sqrt(double(M) / 784.0));
    for (int m : {2, 0}) {
      if (m == 0 && cs.k > 128) continue;
      CAPTURE(m);
      cuda::set_tail_gemm_mode(m);
      REQUIRE(cuda::dgrad1x1_bn_supported(t.dy1, t.w1, t.y3));
      const Grads a = run_fused(t);
      // g: the GEMM adds in another order than cuDNN, so G may round to the neighbouring f16.
      KILN_CHECK_OK(testing::compare(f32(a.g), f32(b.g), 2e-3, 2e-3));
      KILN_CHECK_OK(testing::compare(f32(a.dx), f32(b.dx), 5e-3, 5e-3));
      KILN_CHECK_OK(testing::compare(a.dw.to(kCPU), b.dw.to(kCPU), atol, 1e-2));
      KILN_CHECK_OK(testing::compare(a.db.to(kCPU), b.db.to(kCPU), atol, 1e-2));
      Tensor got = f32(a.g).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.c});
      KILN_CHECK_OK(testing::compare(got, want, 1e-2, 2e-3));
    }
  }
  cuda::set_tail_gemm_mode(mode);
}

TEST_CASE("bn_nhwc_backward_dgrad is bit-reproducible and adds into .grad") {
  const bool wgmma = cuda::dgrad1x1_bn_wgmma_available();
  const int mode = cuda::tail_gemm_mode();
  // The mma.sync kernel (mode 0, K 64), and on sm_90 the wgmma kernel too (mode 2, K 64 and 256).
  const Tail t = make_tail(4, 128, 64, 12, 10, 91);
  if (wgmma) {
    cuda::set_tail_gemm_mode(2);
    const Tail t2 = make_tail(4, 256, 256, 12, 10, 92);
    for (const Tail* p : {&t, &t2}) {
      const Grads a = run_fused(*p), b = run_fused(*p);
      for (auto [x, y] : {std::pair{a.dx, b.dx}, {a.g, b.g}, {a.dw, b.dw}, {a.db, b.db}})
        KILN_CHECK_OK(testing::compare(x, y, 0, 0));
    }
  }
  cuda::set_tail_gemm_mode(0);
  const Grads a = run_fused(t), b = run_fused(t);
  for (auto [x, y] : {std::pair{a.dx, b.dx}, {a.g, b.g}, {a.dw, b.dw}, {a.db, b.db}})
    KILN_CHECK_OK(testing::compare(x, y, 0, 0));
  // accumulate_params: dweight and dbias added onto what is there.
  Tensor dw = a.dw.clone(), db = a.db.clone();
  Tensor dx = empty_like(t.y3), g = empty_like(t.y3);
  cuda::bn_nhwc_backward_dgrad(dx, g, dw, db, t.dy1, t.w1, t.r, t.mask, t.y3, t.weight, t.mean,
                               t.invstd, /*accumulate_params=*/true);
  KILN_CHECK_OK(testing::compare(dw, F::mul(a.dw, 2.0), 0, 1e-6));
  KILN_CHECK_OK(testing::compare(db, F::mul(a.db, 2.0), 0, 1e-6));
  cuda::set_tail_gemm_mode(mode);
}

TEST_CASE("the wgmma kernel's TMA epilogue equals its global-memory epilogue bit for bit") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("the wgmma kernel needs an sm_90 GPU and a build for sm_90a; skipped");
    return;
  }
  struct Case {
    int64_t n, c, k, h, w;
  };
  // Every K on the wgmma kernel: 784 rows (6 full tiles, 16 rows), 84 rows (one partial tile),
  // ResNet-50's layers 3 and 4; K 64 at 392 and 50,176 rows (layer 1's shape at batch 16: 392
  // tiles over 66 CTAs, 5–6 each, so each buffer turns over several times), K 128 at 105 rows;
  // K 256 at 12,544 rows (98 tiles over 16 CTAs).
  const int mode = cuda::tail_gemm_mode();
  cuda::set_tail_gemm_mode(2);
  for (Case cs : {Case{4, 256, 256, 14, 14}, Case{2, 128, 256, 6, 7}, Case{2, 1024, 256, 7, 7},
                  Case{2, 2048, 512, 7, 7}, Case{2, 256, 64, 14, 14}, Case{16, 256, 64, 56, 56},
                  Case{3, 512, 128, 7, 5}, Case{64, 1024, 256, 14, 14}}) {
    CAPTURE(cs.n);
    CAPTURE(cs.c);
    CAPTURE(cs.k);
    const Tail t = make_tail(cs.n, cs.c, cs.k, cs.h, cs.w, 101 + uint64_t(cs.c));
    const bool before = cuda::tail_tma_epilogue_enabled();
    cuda::set_tail_tma_epilogue_enabled(true);
    const Grads a = run_fused(t);
    cuda::set_tail_tma_epilogue_enabled(false);
    const Grads b = run_fused(t);
    cuda::set_tail_tma_epilogue_enabled(before);
    for (auto [x, y] : {std::pair{a.dx, b.dx}, {a.g, b.g}, {a.dw, b.dw}, {a.db, b.db}})
      KILN_CHECK_OK(testing::compare(x, y, 0, 0));
  }
  cuda::set_tail_gemm_mode(mode);
}

TEST_CASE("bn_nhwc_backward_dgrad refuses what its GEMM does not take") {
  const Tail t = make_tail(2, 64, 64, 4, 4, 95);
  // K other than 64 or 128 (and not a multiple of 64 for the wgmma kernel), C not a multiple of
  // 64, a 3x3 weight; K 256 with C 64 (not a multiple of the wgmma kernel's 128 columns).
  Tensor dy256 = nhwc(randn({2, 256, 4, 4}));
  Tensor w256 = randn({256, 64, 1, 1}).to(DType::f16).to(kGpu);
  CHECK_FALSE(cuda::dgrad1x1_bn_supported(dy256, w256, t.y3));
  Tensor dy24 = nhwc(randn({2, 24, 4, 4}));
  Tensor w24 = randn({24, 64, 1, 1}).to(DType::f16).to(kGpu);
  CHECK_FALSE(cuda::dgrad1x1_bn_supported(dy24, w24, t.y3));
  Tensor x96 = nhwc(randn({2, 96, 4, 4}));
  Tensor w96 = randn({64, 96, 1, 1}).to(DType::f16).to(kGpu);
  CHECK_FALSE(cuda::dgrad1x1_bn_supported(t.dy1, w96, x96));
  Tensor w3 = randn({64, 64, 3, 3}).to(DType::f16).to(kGpu);
  CHECK_FALSE(cuda::dgrad1x1_bn_supported(t.dy1, w3, t.y3));
  Tensor dx = empty_like(t.y3), g = empty_like(t.y3);
  try {
    cuda::bn_nhwc_backward_dgrad(dx, g, Tensor(), Tensor(), dy24, w24, t.r, t.mask, t.y3, t.weight,
                                 t.mean, t.invstd);
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("K 64 or 128") != std::string::npos);
  }
}

// The wiring: a block tail relu(bn(y3) + z) whose output feeds a 1x1 convolution and one more
// consumer (the next block's shortcut; here a product with a fixed tensor). With the fusion the
// tail's node takes the convolution's data gradient into its GEMM (counted by dgrad_fusions);
// every gradient matches the unfused run, and the f32 composition.
TEST_CASE("a block tail takes the next 1x1 convolution's data gradient: gradients unchanged") {
  struct Case {
    int64_t c, k;
    bool shortcut;  // a second consumer of the tail's output
  };
  for (Case cs : {Case{256, 64, true}, Case{128, 128, true}, Case{64, 64, false}}) {
    CAPTURE(cs.c);
    CAPTURE(cs.shortcut);
    manual_seed(101 + uint64_t(cs.c));
    const Shape shape{4, cs.c, 10, 12};
    Tensor hy = F::add(F::mul(randn(shape), 1.5), 0.25), hz = randn(shape), hs = randn(shape);
    Tensor hw1 = F::mul(randn({cs.k, cs.c, 1, 1}), 0.1), hdy = randn({4, cs.k, 10, 12});
    Tensor hg = uniform({cs.c}, 0.5, 1.5), hb = uniform({cs.c}, -0.5, 0.5);
    struct Run {
      Tensor y3, z, w1, weight, bias;
    };
    auto run = [&](bool fused, DType dt) {
      const bool before = cuda::dgrad_fusion_enabled();
      cuda::set_dgrad_fusion_enabled(fused);
      auto leaf = [&](const Tensor& h, DType t, bool act) {
        Tensor g = h.to(t).to(kGpu);
        if (act || (h.dim() == 4 && h.size(2) == 1)) g = g.contiguous(MemoryFormat::ChannelsLast);
        g = g.detach();
        g.set_requires_grad(true);
        return g;
      };
      Run r{leaf(hy.to(DType::f16), dt, true), leaf(hz.to(DType::f16), dt, true),
            leaf(hw1.to(DType::f16), dt, false), leaf(hg, DType::f32, false),
            leaf(hb, DType::f32, false)};
      const TensorOptions opt = TensorOptions().with_device(kGpu);
      Tensor rm = zeros({cs.c}, opt), rv = ones({cs.c}, opt);
      Tensor out;
      if (dt == DType::f16) {
        Tensor y32 = r.y3.detach().to(DType::f32);
        const F::ChannelStats st{F::sum(y32, {0, 2, 3}), F::sum(F::mul(y32, y32), {0, 2, 3}),
                                 r.y3.version()};
        out = F::batch_norm_from_stats(r.y3, st, r.z, true, r.weight, r.bias, rm, rv, true);
      } else {
        out = F::relu(F::add(F::batch_norm(r.y3, r.weight, r.bias, rm, rv, true), r.z));
      }
      Tensor y1 = F::conv2d(out, r.w1);
      // The gradients arrive channels-last, as in a ResNet (the fusion takes only those).
      auto grad = [&](const Tensor& h) { return nhwc(h).to(dt); };
      if (cs.shortcut)
        autograd::backward({y1, out}, {grad(hdy), grad(hs)}, false);
      else
        autograd::backward({y1}, {grad(hdy)}, false);
      cuda::set_dgrad_fusion_enabled(before);
      return r;
    };
    const uint64_t n0 = F::dgrad_fusions();
    const Run a = run(true, DType::f16);
    CHECK(F::dgrad_fusions() == n0 + 1);
    const Run b = run(false, DType::f16);
    CHECK(F::dgrad_fusions() == n0 + 1);
    const Run c = run(false, DType::f32);  // the composition in f32
    KILN_CHECK_OK(testing::compare(f32(a.z.grad()), f32(b.z.grad()), 2e-3, 2e-3));
    KILN_CHECK_OK(testing::compare(f32(a.y3.grad()), f32(b.y3.grad()), 5e-3, 5e-3));
    KILN_CHECK_OK(testing::compare(a.weight.grad().to(kCPU), b.weight.grad().to(kCPU), 0.2, 1e-2));
    KILN_CHECK_OK(testing::compare(a.bias.grad().to(kCPU), b.bias.grad().to(kCPU), 0.2, 1e-2));
    KILN_CHECK_OK(testing::compare(f32(a.w1.grad()), f32(b.w1.grad()), 0.2, 1e-2));
    KILN_CHECK_OK(testing::compare(f32(a.z.grad()), f32(c.z.grad()), 2e-2, 1e-2));
    KILN_CHECK_OK(testing::compare(f32(a.y3.grad()), f32(c.y3.grad()), 5e-2, 2e-2));
    KILN_CHECK_OK(testing::compare(a.weight.grad().to(kCPU), c.weight.grad().to(kCPU), 1.0, 2e-2));
    KILN_CHECK_OK(testing::compare(a.bias.grad().to(kCPU), c.bias.grad().to(kCPU), 1.0, 2e-2));
  }
}

// ---- a block's inner relu(bn2(y2)), read by conv3 alone: the ReLU mask recomputed from x ----

namespace {

// relu(bn(y)) and the 1x1 convolution after it (w: K × C), its output gradient dy, and an
// optional other gradient r of the ReLU's output.
struct Inner {
  Tensor y, weight, mean, invstd, scale_shift, dy, w, r;
};

Inner make_inner(int64_t n, int64_t c, int64_t k, int64_t h, int64_t w, bool residual,
                 uint64_t seed) {
  manual_seed(seed);
  Inner t;
  const Shape shape{n, c, h, w};
  t.y = nhwc(F::add(F::mul(randn(shape), 1.5), 0.25));
  t.dy = nhwc(randn({n, k, h, w}));
  t.w = F::mul(randn({k, c, 1, 1}), 1.0 / std::sqrt(double(k))).to(DType::f16).to(kGpu);
  if (residual) t.r = nhwc(randn(shape));
  BnStatsFinalize f = gputest::bn_finalize_of(t.y);
  Tensor out = empty_like(t.y);
  cuda::bn_nhwc_apply(out, t.y, Tensor(), f, Activation::Relu, Tensor());  // fills scale_shift
  t.weight = f.weight;
  t.mean = f.save_mean;
  t.invstd = f.save_invstd;
  t.scale_shift = f.scale_shift;
  return t;
}

Grads run_inner_fused(const Inner& t) {
  const TensorOptions f32 = TensorOptions().with_device(kGpu);
  const int64_t c = t.y.size(1);
  Grads o{empty_like(t.y), empty_like(t.y), empty({c}, f32), empty({c}, f32)};
  cuda::bn_nhwc_backward_dgrad(o.dx, o.g, o.dw, o.db, t.dy, t.w, t.r, Tensor(), t.y, t.weight,
                               t.mean, t.invstd, false, t.scale_shift);
  return o;
}

}  // namespace

TEST_CASE(
    "bn_nhwc_backward_dgrad with the mask from x equals cuDNN's dgrad then "
    "bn_nhwc_backward(relu)") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("the mask-from-x form runs on the wgmma kernel: it needs an sm_90 GPU and a build for "
            "sm_90a; skipped");
    return;
  }
  struct Case {
    int64_t n, c, k, h, w;
    bool residual;
  };
  // ResNet-50's conv3 (K = 4C) of layers 2-4: 392 rows (3 full tiles, 8 rows), 98 rows (one
  // partial tile), 196 rows over 4 column tiles at K 2,048; layer 2 at batch 32 (25,088 rows:
  // 196 tiles over 132 CTAs, some take two) and layer 3 at batch 64 (98 tiles over 66 CTAs per
  // column tile). K 256 with C 128, and with another gradient r added.
  for (Case cs : {Case{2, 128, 512, 14, 14, false}, Case{2, 256, 1024, 7, 7, false},
                  Case{4, 512, 2048, 7, 7, false}, Case{32, 128, 512, 28, 28, false},
                  Case{64, 256, 1024, 14, 14, false}, Case{3, 128, 256, 7, 5, true}}) {
    CAPTURE(cs.n);
    CAPTURE(cs.c);
    CAPTURE(cs.k);
    CAPTURE(cs.residual);
    const Inner t = make_inner(cs.n, cs.c, cs.k, cs.h, cs.w, cs.residual, 121 + uint64_t(cs.c));
    REQUIRE(cuda::dgrad1x1_bn_supported(t.dy, t.w, t.y, /*mask_bits=*/false));
    const Grads a = run_inner_fused(t);
    // Today's path: cuDNN's dgrad (onto r), then kiln's two passes with the mask from x.
    const TensorOptions f32o = TensorOptions().with_device(kGpu);
    Tensor grad = cs.residual ? t.r.clone() : empty_like(t.y);
    cuda::conv2d_backward_data(grad, t.dy, t.w, ConvParams{}, /*accumulate=*/cs.residual);
    Grads b{empty_like(t.y), Tensor(), empty({cs.c}, f32o), empty({cs.c}, f32o)};
    cuda::bn_nhwc_backward(b.dx, Tensor(), b.dw, b.db, grad, t.y, Tensor(), t.weight, t.mean,
                           t.invstd, t.scale_shift, Activation::Relu);
    // The CPU's f32 reference of g: G (+ r) masked where y·scale + shift is not positive.
    const int64_t M = cs.n * cs.h * cs.w;
    Tensor dy = f32(t.dy).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.k});
    Tensor w = f32(t.w).reshape({cs.k, cs.c});
    Tensor want = F::matmul(dy, w);
    if (cs.residual)
      want = F::add(want, f32(t.r).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.c}));
    want = want.contiguous();
    Tensor yv = f32(t.y).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.c});
    Tensor ss = t.scale_shift.to(kCPU);
    const float* yp = yv.data<float>();
    const float* sp = ss.data<float>();
    float* wp = want.data<float>();
    int64_t kept = 0;
    for (int64_t i = 0; i < M * cs.c; ++i) {
      const int64_t ch = i % cs.c;
      if (!(std::fma(yp[i], sp[ch], sp[cs.c + ch]) > 0.f))
        wp[i] = 0.f;
      else
        ++kept;
    }
    CHECK(kept > M * cs.c / 8);  // the mask keeps some and drops some
    CHECK(kept < M * cs.c);
    Tensor got = f32(a.g).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.c});
    KILN_CHECK_OK(testing::compare(got, want, 1e-2, 2e-3));
    const double atol = 6e-2 * std::max(1.0, std::sqrt(double(M) / 784.0));
    KILN_CHECK_OK(testing::compare(f32(a.dx), f32(b.dx), 5e-3, 5e-3));
    KILN_CHECK_OK(testing::compare(a.dw.to(kCPU), b.dw.to(kCPU), atol, 1e-2));
    KILN_CHECK_OK(testing::compare(a.db.to(kCPU), b.db.to(kCPU), atol, 1e-2));
    // Bit-reproducible: a second run gives the same bits.
    const Grads c = run_inner_fused(t);
    for (auto [x, y] : {std::pair{a.dx, c.dx}, {a.g, c.g}, {a.dw, c.dw}, {a.db, c.db}})
      KILN_CHECK_OK(testing::compare(x, y, 0, 0));
  }
}

TEST_CASE("bn_nhwc_backward_dgrad with x2 · w2ᵀ + b2 in the GEMM: t never written (KILN_TAIL_FOLD_T)") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("the linear form runs on the wgmma kernel: it needs an sm_90 GPU and a build for "
            "sm_90a; skipped");
    return;
  }
  const bool before = cuda::tail_fold_t_enabled();
  cuda::set_tail_fold_t_enabled(true);
  struct Case {
    int64_t n, c, k, h, w, c2;
  };
  // The tail fold's layer 2 (C = C2 = 128, K = 512) at batch 2 and 32, layer 3's shape with rows
  // ending inside a tile, and x2 narrower than x (C2 = 64: one k-step of x2).
  for (Case cs : {Case{2, 128, 512, 14, 14, 128}, Case{32, 128, 512, 28, 28, 128},
                  Case{3, 256, 1024, 7, 5, 256}, Case{2, 128, 256, 7, 7, 64}}) {
    CAPTURE(cs.n);
    CAPTURE(cs.c);
    CAPTURE(cs.k);
    CAPTURE(cs.c2);
    const Inner t = make_inner(cs.n, cs.c, cs.k, cs.h, cs.w, false, 141 + uint64_t(cs.c + cs.c2));
    const int64_t M = cs.n * cs.h * cs.w;
    const Tensor x2 = nhwc(F::relu(randn({cs.n, cs.c2, cs.h, cs.w})));
    const Tensor w2 = F::mul(randn({cs.c, cs.c2}), 1.0 / std::sqrt(double(cs.c2)))
                          .to(DType::f16)
                          .to(kGpu);
    const Tensor b2 = F::mul(randn({cs.c}), 0.5).to(DType::f16).to(kGpu);
    REQUIRE(cuda::dgrad1x1_bn_linear_supported(t.dy, t.w, t.y, x2, w2, b2));
    const TensorOptions f32o = TensorOptions().with_device(kGpu);
    auto run = [&]() {
      Grads o{empty_like(t.y), empty_like(t.y), empty({cs.c}, f32o), empty({cs.c}, f32o)};
      cuda::bn_nhwc_backward_dgrad(o.dx, o.g, o.dw, o.db, t.dy, t.w, Tensor(), Tensor(), t.y,
                                   t.weight, t.mean, t.invstd, false, t.scale_shift, Tensor(), x2,
                                   w2, b2);
      return o;
    };
    const Grads a = run();
    // The fold's form before it: t = x2 · w2ᵀ + b2 written in f16, then added as r.
    const Tensor rows2 = x2.permute({0, 2, 3, 1}).reshape({M, cs.c2});
    const Tensor tt = F::linear(rows2, w2, b2)
                          .view({cs.n, cs.h, cs.w, cs.c})
                          .permute({0, 3, 1, 2})
                          .contiguous(MemoryFormat::ChannelsLast);
    Grads b{empty_like(t.y), empty_like(t.y), empty({cs.c}, f32o), empty({cs.c}, f32o)};
    cuda::bn_nhwc_backward_dgrad(b.dx, b.g, b.dw, b.db, t.dy, t.w, tt, Tensor(), t.y, t.weight,
                                 t.mean, t.invstd, false, t.scale_shift);
    // g against f32 on the CPU: dy · w + x2 · w2ᵀ + b2, masked where y·scale + shift ≤ 0.
    Tensor want = F::add(
        F::add(F::matmul(f32(t.dy).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.k}),
                         f32(t.w).reshape({cs.k, cs.c})),
               F::matmul(f32(x2).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.c2}),
                         f32(w2).t())),
        f32(b2).reshape({1, cs.c}));
    want = want.contiguous();
    const Tensor yv = f32(t.y).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.c});
    const Tensor ss = t.scale_shift.to(kCPU);
    const float* yp = yv.data<float>();
    const float* sp = ss.data<float>();
    float* wp = want.data<float>();
    for (int64_t i = 0; i < M * cs.c; ++i) {
      const int64_t ch = i % cs.c;
      if (!(std::fma(yp[i], sp[ch], sp[cs.c + ch]) > 0.f)) wp[i] = 0.f;
    }
    const Tensor got = f32(a.g).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.c});
    KILN_CHECK_OK(testing::compare(got, want, 1e-2, 2e-3));
    // Against t written: one rounding of t apart.
    const double atol = 6e-2 * std::max(1.0, std::sqrt(double(M) / 784.0));
    KILN_CHECK_OK(testing::compare(f32(a.g), f32(b.g), 1e-2, 5e-3));
    KILN_CHECK_OK(testing::compare(f32(a.dx), f32(b.dx), 1e-2, 5e-3));
    KILN_CHECK_OK(testing::compare(a.dw.to(kCPU), b.dw.to(kCPU), atol, 1e-2));
    KILN_CHECK_OK(testing::compare(a.db.to(kCPU), b.db.to(kCPU), atol, 1e-2));
    // Bit-reproducible.
    const Grads c = run();
    for (auto [x, y] : {std::pair{a.dx, c.dx}, {a.g, c.g}, {a.dw, c.dw}, {a.db, c.db}})
      KILN_CHECK_OK(testing::compare(x, y, 0, 0));
  }
  // Refused: x2 of 32 channels (K + C2 not a multiple of 64), w2 of the wrong shape, the switch
  // off; and bn_nhwc_backward_dgrad names the operands.
  const Inner t = make_inner(2, 128, 512, 4, 4, false, 151);
  const Tensor x2 = nhwc(randn({2, 128, 4, 4})), x32 = nhwc(randn({2, 32, 4, 4}));
  const Tensor w2 = randn({128, 128}).to(DType::f16).to(kGpu);
  const Tensor b2 = randn({128}).to(DType::f16).to(kGpu);
  CHECK(cuda::dgrad1x1_bn_linear_supported(t.dy, t.w, t.y, x2, w2, b2));
  CHECK_FALSE(cuda::dgrad1x1_bn_linear_supported(
      t.dy, t.w, t.y, x32, randn({128, 32}).to(DType::f16).to(kGpu), b2));
  CHECK_FALSE(cuda::dgrad1x1_bn_linear_supported(
      t.dy, t.w, t.y, x2, randn({128, 64}).to(DType::f16).to(kGpu), b2));
  Tensor dx = empty_like(t.y), g = empty_like(t.y);
  try {
    cuda::bn_nhwc_backward_dgrad(dx, g, Tensor(), Tensor(), t.dy, t.w, Tensor(), Tensor(), t.y,
                                 t.weight, t.mean, t.invstd, false, t.scale_shift, Tensor(), x32,
                                 w2, b2);
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("x2") != std::string::npos);
  }
  cuda::set_tail_fold_t_enabled(false);
  CHECK_FALSE(cuda::dgrad1x1_bn_linear_supported(t.dy, t.w, t.y, x2, w2, b2));
  cuda::set_tail_fold_t_enabled(before);
}

TEST_CASE("64 channels with the mask from x: the GEMM on row pairs (KILN_DGRAD_PAIR64)") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("the pair form runs on the wgmma kernel: it needs an sm_90 GPU and a build for "
            "sm_90a; skipped");
    return;
  }
  const bool before = cuda::dgrad_pair64_enabled(), t_before = cuda::tail_fold_t_enabled();
  cuda::set_dgrad_pair64_enabled(true);
  cuda::set_tail_fold_t_enabled(true);
  struct Case {
    int64_t n, k, h, w;
    int form;  // 0: dgrad alone, 1: with another gradient r, 2: with x2 · w2ᵀ + b2
  };
  // ResNet-50's layer 1 (K = 256) at 14 × 14 and 56 × 56 (batch 2: 6,272 rows, 3,136 pairs over
  // 25 tiles), with r, with the fold's linear map (C2 = 64), and K = 128.
  for (Case cs : {Case{2, 256, 14, 14, 0}, Case{2, 256, 56, 56, 0}, Case{3, 256, 14, 14, 1},
                  Case{2, 256, 14, 14, 2}, Case{2, 256, 56, 56, 2}, Case{4, 128, 7, 8, 0}}) {
    CAPTURE(cs.n);
    CAPTURE(cs.k);
    CAPTURE(cs.h);
    CAPTURE(cs.form);
    const int64_t c = 64, M = cs.n * cs.h * cs.w;
    const Inner t = make_inner(cs.n, c, cs.k, cs.h, cs.w, cs.form == 1, 161 + uint64_t(cs.form));
    REQUIRE(cuda::dgrad1x1_bn_supported(t.dy, t.w, t.y, /*mask_bits=*/false));
    Tensor x2, w2, b2;
    if (cs.form == 2) {
      x2 = nhwc(F::relu(randn({cs.n, c, cs.h, cs.w})));
      w2 = F::mul(randn({c, c}), 0.125).to(DType::f16).to(kGpu);
      b2 = F::mul(randn({c}), 0.5).to(DType::f16).to(kGpu);
      REQUIRE(cuda::dgrad1x1_bn_linear_supported(t.dy, t.w, t.y, x2, w2, b2));
    }
    const TensorOptions f32o = TensorOptions().with_device(kGpu);
    auto run = [&]() {
      Grads o{empty_like(t.y), empty_like(t.y), empty({c}, f32o), empty({c}, f32o)};
      cuda::bn_nhwc_backward_dgrad(o.dx, o.g, o.dw, o.db, t.dy, t.w, t.r, Tensor(), t.y, t.weight,
                                   t.mean, t.invstd, false, t.scale_shift, Tensor(), x2, w2, b2);
      return o;
    };
    const Grads a = run();
    // The composition: cuDNN's dgrad onto r (and t = x2 · w2ᵀ + b2), then kiln's two passes.
    Tensor grad = t.r.defined() ? t.r.clone() : empty_like(t.y);
    if (cs.form == 2)
      grad = F::linear(x2.permute({0, 2, 3, 1}).reshape({M, c}), w2, b2)
                 .view({cs.n, cs.h, cs.w, c})
                 .permute({0, 3, 1, 2})
                 .contiguous(MemoryFormat::ChannelsLast);
    cuda::conv2d_backward_data(grad, t.dy, t.w, ConvParams{}, /*accumulate=*/cs.form != 0);
    Grads b{empty_like(t.y), Tensor(), empty({c}, f32o), empty({c}, f32o)};
    cuda::bn_nhwc_backward(b.dx, Tensor(), b.dw, b.db, grad, t.y, Tensor(), t.weight, t.mean,
                           t.invstd, t.scale_shift, Activation::Relu);
    const double atol = 6e-2 * std::max(1.0, std::sqrt(double(M) / 784.0));
    KILN_CHECK_OK(testing::compare(f32(a.dx), f32(b.dx), 1e-2, 5e-3));
    KILN_CHECK_OK(testing::compare(a.dw.to(kCPU), b.dw.to(kCPU), atol, 1e-2));
    KILN_CHECK_OK(testing::compare(a.db.to(kCPU), b.db.to(kCPU), atol, 1e-2));
    const Grads d = run();
    for (auto [x, y] : {std::pair{a.dx, d.dx}, {a.g, d.g}, {a.dw, d.dw}, {a.db, d.db}})
      KILN_CHECK_OK(testing::compare(x, y, 0, 0));
  }
  // Refused: an odd number of rows; the switch off.
  const Inner odd = make_inner(1, 64, 256, 7, 7, false, 171);
  CHECK_FALSE(cuda::dgrad1x1_bn_supported(odd.dy, odd.w, odd.y, false));
  const Inner even = make_inner(2, 64, 256, 7, 7, false, 172);
  CHECK(cuda::dgrad1x1_bn_supported(even.dy, even.w, even.y, false));
  cuda::set_dgrad_pair64_enabled(false);
  CHECK_FALSE(cuda::dgrad1x1_bn_supported(even.dy, even.w, even.y, false));
  cuda::set_dgrad_pair64_enabled(before);
  cuda::set_tail_fold_t_enabled(t_before);
}

TEST_CASE("the mask-from-x form refuses what the wgmma kernel does not take") {
  // C 64 (ResNet-50's layer 1: not a multiple of the kernel's 128 columns), K 64 (the mma.sync
  // kernel's shape, which only reads mask bits), K past 2,048; and a message without scale_shift.
  const Inner a = make_inner(2, 64, 256, 4, 4, false, 131);
  const bool pair64 = cuda::dgrad_pair64_enabled();  // C 64 on row pairs: the case above
  cuda::set_dgrad_pair64_enabled(false);
  CHECK_FALSE(cuda::dgrad1x1_bn_supported(a.dy, a.w, a.y, false));
  cuda::set_dgrad_pair64_enabled(pair64);
  const Inner b = make_inner(2, 128, 64, 4, 4, false, 132);
  CHECK(cuda::dgrad1x1_bn_supported(b.dy, b.w, b.y, true) == true);
  CHECK(cuda::dgrad1x1_bn_supported(b.dy, b.w, b.y, false) ==
        (cuda::dgrad1x1_bn_wgmma_available() && cuda::tail_gemm_mode() == 2));
  const Inner c = make_inner(1, 128, 4096, 2, 2, false, 133);
  CHECK_FALSE(cuda::dgrad1x1_bn_supported(c.dy, c.w, c.y, false));
  if (!cuda::dgrad1x1_bn_wgmma_available()) return;
  const Inner d = make_inner(2, 128, 512, 4, 4, false, 134);
  Tensor dx = empty_like(d.y), g = empty_like(d.y);
  try {
    cuda::bn_nhwc_backward_dgrad(dx, g, Tensor(), Tensor(), d.dy, d.w, Tensor(), Tensor(), d.y,
                                 d.weight, d.mean, d.invstd);
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("scale_shift") != std::string::npos);
  }
}

// The wiring: relu(bn(y)) read by a 1x1 convolution alone (a bottleneck's bn2 and conv3). With
// the fusion the batch norm's node takes the convolution's data gradient (dgrad_fusions counts
// it); every gradient matches the unfused run and the f32 composition.
TEST_CASE("a block's inner relu(bn(y)) takes conv3's data gradient: gradients unchanged") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("the mask-from-x form runs on the wgmma kernel: it needs an sm_90 GPU and a build for "
            "sm_90a; skipped");
    return;
  }
  for (int64_t c : {128, 256}) {
    CAPTURE(c);
    const int64_t k = 4 * c;
    manual_seed(141 + uint64_t(c));
    const Shape shape{4, c, 10, 12};
    Tensor hy = F::add(F::mul(randn(shape), 1.5), 0.25);
    Tensor hw = F::mul(randn({k, c, 1, 1}), 0.1), hdy = randn({4, k, 10, 12});
    Tensor hg = uniform({c}, 0.5, 1.5), hb = uniform({c}, -0.5, 0.5);
    using Run = gputest::BnReluConvRun;
    auto run = [&](bool fused, DType dt) {
      const bool before = cuda::dgrad_fusion_enabled();
      cuda::set_dgrad_fusion_enabled(fused);
      const Run r = gputest::bn_relu_conv_backward(hy, hw, hg, hb, hdy, dt, /*padding=*/0);
      cuda::set_dgrad_fusion_enabled(before);
      return r;
    };
    const uint64_t n0 = F::dgrad_fusions();
    const Run a = run(true, DType::f16);
    CHECK(F::dgrad_fusions() == n0 + 1);
    const Run b = run(false, DType::f16);
    CHECK(F::dgrad_fusions() == n0 + 1);
    const Run f = run(false, DType::f32);  // the composition in f32
    KILN_CHECK_OK(testing::compare(f32(a.y.grad()), f32(b.y.grad()), 5e-3, 5e-3));
    KILN_CHECK_OK(testing::compare(a.weight.grad().to(kCPU), b.weight.grad().to(kCPU), 0.2, 1e-2));
    KILN_CHECK_OK(testing::compare(a.bias.grad().to(kCPU), b.bias.grad().to(kCPU), 0.2, 1e-2));
    KILN_CHECK_OK(testing::compare(f32(a.w.grad()), f32(b.w.grad()), 0.2, 1e-2));
    KILN_CHECK_OK(testing::compare(f32(a.y.grad()), f32(f.y.grad()), 5e-2, 2e-2));
    KILN_CHECK_OK(testing::compare(a.weight.grad().to(kCPU), f.weight.grad().to(kCPU), 1.0, 2e-2));
    KILN_CHECK_OK(testing::compare(a.bias.grad().to(kCPU), f.bias.grad().to(kCPU), 1.0, 2e-2));
  }
}

// ---- a 1x1 convolution's forward with its output's statistics (conv1x1_forward_stats) ----

TEST_CASE("conv1x1_forward_stats equals cuDNN's convolution and the statistics pass") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("conv1x1_forward_stats runs on the wgmma kernel: it needs an sm_90 GPU and a build "
            "for sm_90a; skipped");
    return;
  }
  struct Case {
    int64_t n, k, c, h, w;  // x (n, k, h, w), y (n, c, h, w)
  };
  // ResNet-50's expanding 1x1 convolutions (64 → 256 ... 512 → 2,048): 392 rows (3 full tiles,
  // 8 rows), 98 rows (one partial tile), 784 and 98 rows over 8 and 16 column tiles; layer 1 at
  // batch 16 (50,176 rows: 392 tiles over 66 CTAs per column tile, 5-6 each); K 2,048 with C 128.
  for (Case cs : {Case{2, 64, 256, 14, 14}, Case{2, 128, 512, 7, 7}, Case{4, 256, 1024, 14, 14},
                  Case{2, 512, 2048, 7, 7}, Case{16, 64, 256, 56, 56}, Case{3, 2048, 128, 5, 7}}) {
    CAPTURE(cs.n);
    CAPTURE(cs.k);
    CAPTURE(cs.c);
    manual_seed(151 + uint64_t(cs.k + cs.c));
    const Tensor x = nhwc(F::add(randn({cs.n, cs.k, cs.h, cs.w}), 0.5));
    const Tensor w =
        F::mul(randn({cs.c, cs.k, 1, 1}), 1.0 / std::sqrt(double(cs.k))).to(DType::f16).to(kGpu);
    const Tensor y = nhwc(zeros({cs.n, cs.c, cs.h, cs.w}));
    REQUIRE(cuda::conv1x1_stats_supported(y, x, w, ConvParams{}));
    const TensorOptions f32o = TensorOptions().with_device(kGpu);
    Tensor sum = empty({cs.c}, f32o), sqsum = empty({cs.c}, f32o);
    cuda::conv1x1_forward_stats(y, sum, sqsum, x, w, ConvParams{});
    // cuDNN's convolution: the GEMM adds in another order, so y may round to the neighbouring f16.
    Tensor y_ref = empty_like(y);
    cuda::conv2d_forward(y_ref, x, w, Tensor(), ConvParams{});
    KILN_CHECK_OK(testing::compare(f32(y), f32(y_ref), 2e-3, 2e-3));
    // The f32 CPU product.
    const int64_t M = cs.n * cs.h * cs.w;
    Tensor xm = f32(x).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.k});
    Tensor want = F::matmul(xm, f32(w).reshape({cs.c, cs.k}).t());
    Tensor got = f32(y).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.c});
    KILN_CHECK_OK(testing::compare(got, want, 1e-2, 2e-3));
    // The statistics are those of y as stored: kiln's statistics pass over the same y adds the
    // same values in another order.
    Tensor s_ref = empty({cs.c}, f32o), q_ref = empty({cs.c}, f32o);
    cuda::bn_nhwc_stats(s_ref, q_ref, y);
    const double tol = 2e-5 * std::sqrt(double(M));
    KILN_CHECK_OK(testing::compare(sum.to(kCPU), s_ref.to(kCPU), tol, 1e-4));
    KILN_CHECK_OK(testing::compare(sqsum.to(kCPU), q_ref.to(kCPU), tol, 1e-4));
    // Bit-reproducible: a second run gives the same bits.
    const Tensor y2 = empty_like(y);
    Tensor sum2 = empty({cs.c}, f32o), sqsum2 = empty({cs.c}, f32o);
    cuda::conv1x1_forward_stats(y2, sum2, sqsum2, x, w, ConvParams{});
    KILN_CHECK_OK(testing::compare(y2, y, 0, 0));
    KILN_CHECK_OK(testing::compare(sum2, sum, 0, 0));
    KILN_CHECK_OK(testing::compare(sqsum2, sqsum, 0, 0));
  }
}

TEST_CASE("conv1x1_forward_stats refuses what its kernel does not take") {
  const Tensor x = nhwc(randn({2, 64, 4, 4}));
  const Tensor w = randn({256, 64, 1, 1}).to(DType::f16).to(kGpu);
  const Tensor y = nhwc(zeros({2, 256, 4, 4}));
  CHECK(cuda::conv1x1_stats_supported(y, x, w, ConvParams{}) ==
        cuda::dgrad1x1_bn_wgmma_available());
  ConvParams strided;
  strided.stride_h = strided.stride_w = 2;
  CHECK_FALSE(cuda::conv1x1_stats_supported(nhwc(zeros({2, 256, 2, 2})), x, w, strided));
  // C 64 (not a multiple of 128), K 24 (not a multiple of 64), a 3x3 weight.
  CHECK_FALSE(cuda::conv1x1_stats_supported(nhwc(zeros({2, 64, 4, 4})), x,
                                            randn({64, 64, 1, 1}).to(DType::f16).to(kGpu),
                                            ConvParams{}));
  CHECK_FALSE(cuda::conv1x1_stats_supported(y, nhwc(randn({2, 24, 4, 4})),
                                            randn({256, 24, 1, 1}).to(DType::f16).to(kGpu),
                                            ConvParams{}));
  CHECK_FALSE(cuda::conv1x1_stats_supported(y, x, randn({256, 64, 3, 3}).to(DType::f16).to(kGpu),
                                            ConvParams{}));
  const TensorOptions f32o = TensorOptions().with_device(kGpu);
  Tensor s = empty({64}, f32o), q = empty({64}, f32o);
  try {
    cuda::conv1x1_forward_stats(nhwc(zeros({2, 64, 4, 4})), s, q, x,
                                randn({64, 64, 1, 1}).to(DType::f16).to(kGpu), ConvParams{});
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("C a multiple of 128") != std::string::npos);
  }
}

// run() with a switch set on (`set(true)`) and then off: the same bits in every output.
template <class Run>
void same_bits_both_ways(void (*set)(bool), Run&& run) {
  set(true);
  const Grads a = run();
  set(false);
  const Grads b = run();
  for (auto [x, y] : {std::pair{a.dx, b.dx}, {a.g, b.g}, {a.dw, b.dw}, {a.db, b.db}})
    KILN_CHECK_OK(testing::compare(x, y, 0, 0));
}

TEST_CASE("the wgmma kernel's B read N-major from w equals B from the transposed weight bit for "
          "bit") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("the wgmma kernel needs an sm_90 GPU and a build for sm_90a; skipped");
    return;
  }
  const int mode = cuda::tail_gemm_mode();
  cuda::set_tail_gemm_mode(2);
  const bool before = cuda::tail_w_direct_enabled();
  // Block tails at K 64, 256 and 512 (one and several column tiles, a partial row tile), and the
  // inner form at K 512, 1,024 and 2,048.
  struct Case {
    int64_t n, c, k, h, w;
  };
  for (Case cs : {Case{2, 256, 64, 14, 14}, Case{2, 1024, 256, 7, 7}, Case{3, 2048, 512, 7, 5}}) {
    CAPTURE(cs.c);
    CAPTURE(cs.k);
    const Tail t = make_tail(cs.n, cs.c, cs.k, cs.h, cs.w, 161 + uint64_t(cs.c));
    same_bits_both_ways(cuda::set_tail_w_direct_enabled, [&] { return run_fused(t); });
  }
  for (Case cs : {Case{2, 128, 512, 14, 14}, Case{2, 256, 1024, 7, 7}, Case{4, 512, 2048, 7, 7}}) {
    CAPTURE(cs.c);
    CAPTURE(cs.k);
    const Inner t = make_inner(cs.n, cs.c, cs.k, cs.h, cs.w, false, 171 + uint64_t(cs.c));
    same_bits_both_ways(cuda::set_tail_w_direct_enabled, [&] { return run_inner_fused(t); });
  }
  cuda::set_tail_w_direct_enabled(before);
  cuda::set_tail_gemm_mode(mode);
}

TEST_CASE("the wgmma kernel with one wgmma group in flight gives the same bits as without") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("the wgmma kernel needs an sm_90 GPU and a build for sm_90a; skipped");
    return;
  }
  const int mode = cuda::tail_gemm_mode();
  cuda::set_tail_gemm_mode(2);
  const bool before = cuda::wgmma_pipeline_enabled(),
             tma_before = cuda::tail_tma_epilogue_enabled();
  struct Case {
    int64_t n, c, k, h, w;
  };
  // Several row tiles per CTA: K 64 (1 k-step), 256 (4, all the slots) and 512 (8, more than
  // the slots); the last row tile partial where M % 128 != 0.
  // Block tails, with the TMA epilogue and with the global-memory one.
  for (bool tma : {true, false}) {
    cuda::set_tail_tma_epilogue_enabled(tma);
    for (Case cs : {Case{16, 256, 64, 28, 28}, Case{64, 1024, 256, 13, 13},
                    Case{64, 2048, 512, 7, 7}}) {
      CAPTURE(tma);
      CAPTURE(cs.c);
      CAPTURE(cs.k);
      const Tail t = make_tail(cs.n, cs.c, cs.k, cs.h, cs.w, 181 + uint64_t(cs.c));
      same_bits_both_ways(cuda::set_wgmma_pipeline_enabled, [&] { return run_fused(t); });
    }
  }
  cuda::set_tail_tma_epilogue_enabled(tma_before);
  // The inner relu(bn(y)) form, without and with another gradient r of its output.
  for (bool residual : {false, true}) {
    CAPTURE(residual);
    const Inner t = make_inner(32, 128, 512, 28, 27, residual, 191);
    same_bits_both_ways(cuda::set_wgmma_pipeline_enabled, [&] { return run_inner_fused(t); });
  }
  // The 1x1 forward with statistics: K 64, 256 and 1,024 (16 k-steps).
  for (Case cs : {Case{16, 256, 64, 56, 56}, Case{64, 1024, 256, 14, 14},
                  Case{64, 256, 1024, 14, 13}}) {
    CAPTURE(cs.c);
    CAPTURE(cs.k);
    manual_seed(201 + uint64_t(cs.k));
    const Tensor x = nhwc(randn({cs.n, cs.k, cs.h, cs.w}));
    const Tensor w =
        F::mul(randn({cs.c, cs.k, 1, 1}), 1.0 / std::sqrt(double(cs.k))).to(DType::f16).to(kGpu);
    const TensorOptions f32o = TensorOptions().with_device(kGpu);
    Tensor y[2], sum[2], sqsum[2];
    for (int i = 0; i < 2; ++i) {
      cuda::set_wgmma_pipeline_enabled(i == 0);
      y[i] = nhwc(zeros({cs.n, cs.c, cs.h, cs.w}));
      sum[i] = empty({cs.c}, f32o);
      sqsum[i] = empty({cs.c}, f32o);
      cuda::conv1x1_forward_stats(y[i], sum[i], sqsum[i], x, w, ConvParams{});
    }
    KILN_CHECK_OK(testing::compare(y[0], y[1], 0, 0));
    KILN_CHECK_OK(testing::compare(sum[0], sum[1], 0, 0));
    KILN_CHECK_OK(testing::compare(sqsum[0], sqsum[1], 0, 0));
  }
  cuda::set_wgmma_pipeline_enabled(before);
  cuda::set_tail_gemm_mode(mode);
}

TEST_CASE("the wgmma kernel with B resident gives the same bits as with B loaded per tile") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("the wgmma kernel needs an sm_90 GPU and a build for sm_90a; skipped");
    return;
  }
  const int mode = cuda::tail_gemm_mode();
  cuda::set_tail_gemm_mode(2);
  const bool before = cuda::gemm_b_resident_enabled(), pipe_before = cuda::wgmma_pipeline_enabled(),
             tma_before = cuda::tail_tma_epilogue_enabled();
  struct Case {
    int64_t n, c, k, h, w;
  };
  // K 64 to 256 (1 to 4 k-steps: 7 to 4 slots of A beside B), many row tiles per CTA, the last
  // partial; K 512 does not take it (the same kernel, to show the switch leaves it alone).
  for (bool pipeline : {true, false}) {
    cuda::set_wgmma_pipeline_enabled(pipeline);
    for (bool tma : {true, false}) {
      cuda::set_tail_tma_epilogue_enabled(tma);
      for (Case cs :
           {Case{16, 256, 64, 28, 28}, Case{32, 512, 128, 14, 13}, Case{8, 256, 192, 15, 15},
            Case{64, 1024, 256, 13, 13}, Case{8, 2048, 512, 7, 7}}) {
        CAPTURE(pipeline);
        CAPTURE(tma);
        CAPTURE(cs.c);
        CAPTURE(cs.k);
        const Tail t = make_tail(cs.n, cs.c, cs.k, cs.h, cs.w, 211 + uint64_t(cs.k));
        same_bits_both_ways(cuda::set_gemm_b_resident_enabled, [&] { return run_fused(t); });
      }
    }
    cuda::set_tail_tma_epilogue_enabled(tma_before);
    // The inner relu(bn(y)) form at K 256, without and with another gradient r of its output.
    for (bool residual : {false, true}) {
      CAPTURE(residual);
      const Inner t = make_inner(32, 128, 256, 28, 27, residual, 221);
      same_bits_both_ways(cuda::set_gemm_b_resident_enabled, [&] { return run_inner_fused(t); });
    }
    // The 1x1 forward with statistics at K 64, 128 and 256, and with bn + ReLU as its prologue
    // (K 128 and 256: the register-A form reads B from the resident boxes too).
    for (Case cs :
         {Case{16, 256, 64, 56, 56}, Case{32, 512, 128, 28, 27}, Case{64, 1024, 256, 14, 14}}) {
      CAPTURE(cs.c);
      CAPTURE(cs.k);
      manual_seed(231 + uint64_t(cs.k));
      const Tensor x = nhwc(F::add(randn({cs.n, cs.k, cs.h, cs.w}), 0.3));
      const Tensor w =
          F::mul(randn({cs.c, cs.k, 1, 1}), 1.0 / std::sqrt(double(cs.k))).to(DType::f16).to(kGpu);
      const BnStatsFinalize f = gputest::bn_finalize_of(x);
      const TensorOptions f32o = TensorOptions().with_device(kGpu);
      for (bool prologue : {false, true}) {
        if (prologue && cs.k % 128 != 0) continue;
        CAPTURE(prologue);
        Tensor y[2], sum[2], sqsum[2];
        for (int i = 0; i < 2; ++i) {
          cuda::set_gemm_b_resident_enabled(i == 0);
          y[i] = nhwc(zeros({cs.n, cs.c, cs.h, cs.w}));
          sum[i] = empty({cs.c}, f32o);
          sqsum[i] = empty({cs.c}, f32o);
          if (prologue)
            cuda::conv1x1_bn_relu_forward_stats(y[i], sum[i], sqsum[i], x, f.scale_shift, w,
                                                ConvParams{});
          else
            cuda::conv1x1_forward_stats(y[i], sum[i], sqsum[i], x, w, ConvParams{});
        }
        KILN_CHECK_OK(testing::compare(y[0], y[1], 0, 0));
        KILN_CHECK_OK(testing::compare(sum[0], sum[1], 0, 0));
        KILN_CHECK_OK(testing::compare(sqsum[0], sqsum[1], 0, 0));
      }
    }
  }
  cuda::set_gemm_b_resident_enabled(before);
  cuda::set_wgmma_pipeline_enabled(pipe_before);
  cuda::set_tail_gemm_mode(mode);
}

// ---- a downsample block's tail: two batch norms at the residual add (the dual form) ----

namespace {

// The dual tail's saved state: x (bn3's input) and r (the shortcut's bn input), each with its
// statistics, the forward's ReLU bits of relu(bn(x) + bn(r)), and the next block's conv1 (w1:
// K × C) with its output gradient dy1, and the other consumers' gradient rest.
struct DualTail {
  Tensor x, r, mask, wx, mx, ix, wr, mr, ir, dy1, w1, rest;
};

DualTail make_dual(int64_t n, int64_t c, int64_t k, int64_t h, int64_t w, uint64_t seed) {
  manual_seed(seed);
  DualTail t;
  const Shape shape{n, c, h, w};
  t.x = nhwc(F::add(F::mul(randn(shape), 1.5), 0.25));
  t.r = nhwc(F::add(F::mul(randn(shape), 0.75), -0.5));
  t.dy1 = nhwc(randn({n, k, h, w}));
  t.w1 = F::mul(randn({k, c, 1, 1}), 1.0 / std::sqrt(double(k))).to(DType::f16).to(kGpu);
  t.rest = nhwc(randn(shape));
  BnStatsFinalize fx = gputest::bn_finalize_of(t.x), fr = gputest::bn_finalize_of(t.r);
  t.mask = empty({t.x.numel() / 8}, TensorOptions(DType::u8).with_device(kGpu));
  Tensor out = empty_like(t.x);
  cuda::bn_nhwc_dual_apply(out, t.x, fx, t.r, fr, t.mask);
  t.wx = fx.weight;
  t.mx = fx.save_mean;
  t.ix = fx.save_invstd;
  t.wr = fr.weight;
  t.mr = fr.save_mean;
  t.ir = fr.save_invstd;
  return t;
}

struct DualGrads {
  Tensor dx, dr, dwx, dbx, dwr, dbr;
};

DualGrads dual_outputs(const DualTail& t) {
  const TensorOptions f32 = TensorOptions().with_device(kGpu);
  const int64_t c = t.x.size(1);
  return {empty_like(t.x), empty_like(t.r), empty({c}, f32),
          empty({c}, f32), empty({c}, f32), empty({c}, f32)};
}

DualGrads run_dual_fused(const DualTail& t, const Tensor& rest) {
  DualGrads o = dual_outputs(t);
  cuda::bn_nhwc_dual_backward_dgrad(o.dx, o.dr, o.dwx, o.dbx, o.dwr, o.dbr, t.dy1, t.w1, rest,
                                    t.mask, t.x, t.wx, t.mx, t.ix, t.r, t.wr, t.mr, t.ir);
  return o;
}

// The path it replaces: cuDNN's dgrad added onto rest, then the dual backward's two passes.
DualGrads run_dual_unfused(const DualTail& t) {
  Tensor grad = t.rest.clone();
  cuda::conv2d_backward_data(grad, t.dy1, t.w1, ConvParams{}, /*accumulate=*/true);
  DualGrads o = dual_outputs(t);
  cuda::bn_nhwc_dual_backward(o.dx, o.dr, o.dwx, o.dbx, o.dwr, o.dbr, grad, t.mask, t.x, t.wx,
                              t.mx, t.ix, t.r, t.wr, t.mr, t.ir);
  return o;
}

struct DualCase {
  int64_t n, c, k, h, w;
};
// ResNet-50's four downsample tails and the next conv1 (C, K): layer 1 (256, 64), 2 (512, 128),
// 3 (1024, 256), 4 (2048, 512) at small batches; 784 rows (6 tiles and 16 rows), 98 and 162
// rows (one partial tile per column), and layer 3 at batch 16 (3,136 rows, several tiles a CTA).
const DualCase kDualCases[] = {{4, 256, 64, 14, 14},  {2, 512, 128, 7, 7},  {2, 1024, 256, 9, 9},
                               {2, 2048, 512, 7, 7},  {16, 1024, 256, 14, 14}};

}  // namespace

TEST_CASE("the GEMM's dual form: g and Σg, Σg·x̂ are the tail form's bits; Σg·(r − mean_r) right") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("the wgmma kernel needs an sm_90 GPU and a build for sm_90a; skipped");
    return;
  }
  for (const DualCase& cs : kDualCases) {
    CAPTURE(cs.c);
    CAPTURE(cs.n);
    const DualTail t = make_dual(cs.n, cs.c, cs.k, cs.h, cs.w, 131 + uint64_t(cs.c));
    const int64_t M = cs.n * cs.h * cs.w;
    const int parts = cuda::dgrad1x1_bn_wgmma_parts(M, cs.c);
    const TensorOptions opt = TensorOptions().with_device(kGpu);
    for (bool resident : {true, false}) {
      CAPTURE(resident);
      const bool before = cuda::gemm_b_resident_enabled();
      cuda::set_gemm_b_resident_enabled(resident);
      Tensor g2 = empty_like(t.x), g3 = empty_like(t.x);
      Tensor p2 = empty({int64_t(parts) * 2 * cs.c}, opt);
      Tensor p3 = empty({int64_t(parts) * 3 * cs.c}, opt);
      cuda::dgrad1x1_bn_sums_wgmma(g2, p2, t.dy1, t.w1, t.rest, t.mask, t.x, t.mx, Tensor(), parts);
      cuda::dgrad1x1_bn_sums_wgmma(g3, p3, t.dy1, t.w1, t.rest, t.mask, t.x, t.mx, Tensor(), parts,
                                   t.r, t.mr);
      cuda::set_gemm_b_resident_enabled(before);
      KILN_CHECK_OK(testing::compare(g3, g2, 0, 0));
      const Tensor q2 = p2.to(kCPU).reshape({parts, 2, cs.c});
      const Tensor q3 = p3.to(kCPU).reshape({parts, 3, cs.c});
      KILN_CHECK_OK(testing::compare(q3.narrow(1, 0, 2).contiguous(), q2, 0, 0));
      // Σg·(r − mean_r) per channel in double on the CPU, from the g the kernel wrote.
      const Tensor gh = f32(g3).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.c});
      const Tensor rh = f32(t.r).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.c});
      const Tensor mh = t.mr.to(kCPU);
      std::vector<double> want(size_t(cs.c), 0.0), scale(size_t(cs.c), 0.0);
      const float *gp = gh.data<float>(), *rp = rh.data<float>(), *mp = mh.data<float>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t ch = 0; ch < cs.c; ++ch) {
          const double v = double(gp[m * cs.c + ch]) * (double(rp[m * cs.c + ch]) - mp[ch]);
          want[size_t(ch)] += v;
          scale[size_t(ch)] += std::abs(v);
        }
      const Tensor got = F::sum(q3.narrow(1, 2, 1), {0, 1});
      const float* gotp = got.data<float>();
      size_t bad = 0;
      // f32 sums of M terms in chains of up to ~M / (16 · parts) plus 16 + parts: within
      // 3e-5 of Σ|terms| (a wrong operand or row would be off by the order of the sum itself).
      for (int64_t ch = 0; ch < cs.c; ++ch)
        bad += std::abs(double(gotp[ch]) - want[size_t(ch)]) > 3e-5 * scale[size_t(ch)] + 1e-6;
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("bn_nhwc_dual_backward_dgrad equals cuDNN's dgrad then bn_nhwc_dual_backward") {
  const bool before = cuda::dual_dgrad_enabled();
  cuda::set_dual_dgrad_enabled(true);  // KILN_DUAL_DGRAD (on by default; =0 turns it off)
  for (const DualCase& cs : kDualCases) {
    CAPTURE(cs.c);
    CAPTURE(cs.n);
    const DualTail t = make_dual(cs.n, cs.c, cs.k, cs.h, cs.w, 151 + uint64_t(cs.c));
    if (!cuda::dgrad1x1_bn_wgmma_available()) {
      MESSAGE("the dual form needs an sm_90 GPU and a build for sm_90a; skipped");
      break;
    }
    const bool supported = cuda::dual_dgrad_supported(t.dy1, t.w1, t.x);
    CHECK(supported);
    if (!supported) continue;
    const int64_t M = cs.n * cs.h * cs.w;
    const DualGrads b = run_dual_unfused(t);
    const DualGrads a = run_dual_fused(t, t.rest);
    // As the tail test: G may round to the neighbouring f16 (another order of adds than
    // cuDNN's), and the parameter gradients add M such terms.
    const double atol = 6e-2 * std::max(1.0, std::sqrt(double(M) / 784.0));
    KILN_CHECK_OK(testing::compare(f32(a.dx), f32(b.dx), 5e-3, 5e-3));
    KILN_CHECK_OK(testing::compare(f32(a.dr), f32(b.dr), 5e-3, 5e-3));
    for (auto [x, y] : {std::pair{a.dwx, b.dwx}, {a.dbx, b.dbx}, {a.dwr, b.dwr}, {a.dbr, b.dbr}})
      KILN_CHECK_OK(testing::compare(x.to(kCPU), y.to(kCPU), atol, 1e-2));
    // Nothing else reached dy: undefined rest is zero.
    DualTail z = t;
    z.rest = zeros_like(t.x);
    const DualGrads c = run_dual_unfused(z);
    const DualGrads d = run_dual_fused(t, Tensor());
    KILN_CHECK_OK(testing::compare(f32(d.dx), f32(c.dx), 5e-3, 5e-3));
    KILN_CHECK_OK(testing::compare(f32(d.dr), f32(c.dr), 5e-3, 5e-3));
    KILN_CHECK_OK(testing::compare(d.dwr.to(kCPU), c.dwr.to(kCPU), atol, 1e-2));
    // Bit-reproducible.
    const DualGrads e = run_dual_fused(t, t.rest);
    for (auto [x, y] : {std::pair{a.dx, e.dx}, {a.dr, e.dr}, {a.dwx, e.dwx}, {a.dwr, e.dwr}})
      KILN_CHECK_OK(testing::compare(x, y, 0, 0));
  }
  cuda::set_dual_dgrad_enabled(before);
}

TEST_CASE("a downsample block's tail takes the next 1x1 convolution's data gradient") {
  // relu(bn(x) + bn(r)) read by a 1x1 convolution and (as the next block's identity shortcut)
  // by the loss directly: the gradients of x, r, both batch norms' parameters and w1, with the
  // dual form and without it (KILN_DUAL_DGRAD off), and in f32 without any fusion.
  const int64_t c = 256, k = 64;
  manual_seed(171);
  const Shape shape{4, c, 10, 12};
  Tensor hx = F::add(F::mul(randn(shape), 1.5), 0.25), hr = F::mul(randn(shape), 0.75);
  Tensor hw1 = F::mul(randn({k, c, 1, 1}), 0.1), hdy = randn({4, k, 10, 12}), hs = randn(shape);
  Tensor hgx = uniform({c}, 0.5, 1.5), hbx = uniform({c}, -0.5, 0.5);
  Tensor hgr = uniform({c}, 0.5, 1.5), hbr = uniform({c}, -0.5, 0.5);
  struct Run {
    Tensor x, r, w1, gx, bx, gr, br;
  };
  auto run = [&](bool dual, DType dt) {
    const bool before = cuda::dual_dgrad_enabled();
    cuda::set_dual_dgrad_enabled(dual);
    auto leaf = [&](const Tensor& h, DType t, bool nhwc_layout) {
      Tensor g = h.to(t).to(kGpu);
      if (nhwc_layout) g = g.contiguous(MemoryFormat::ChannelsLast);
      g = g.detach();
      g.set_requires_grad(true);
      return g;
    };
    Run q{leaf(hx.to(DType::f16), dt, true), leaf(hr.to(DType::f16), dt, true),
          leaf(hw1.to(DType::f16), dt, true), leaf(hgx, DType::f32, false),
          leaf(hbx, DType::f32, false),       leaf(hgr, DType::f32, false),
          leaf(hbr, DType::f32, false)};
    const TensorOptions opt = TensorOptions().with_device(kGpu);
    F::BatchNormParams px{q.gx, q.bx, zeros({c}, opt), ones({c}, opt)};
    F::BatchNormParams pr{q.gr, q.br, zeros({c}, opt), ones({c}, opt)};
    auto stats = [](const Tensor& v) {
      Tensor v32 = v.detach().to(DType::f32);
      return F::ChannelStats{F::sum(v32, {0, 2, 3}), F::sum(F::mul(v32, v32), {0, 2, 3}),
                             v.version()};
    };
    Tensor out;
    if (dt == DType::f16) {
      out = F::batch_norm_add_batch_norm_relu(q.x, stats(q.x), px, q.r, stats(q.r), pr, true);
    } else {
      out = F::relu(F::add(
          F::batch_norm(q.x, q.gx, q.bx, px.running_mean, px.running_var, true),
          F::batch_norm(q.r, q.gr, q.br, pr.running_mean, pr.running_var, true)));
    }
    Tensor y1 = F::conv2d(out, q.w1);
    auto grad = [&](const Tensor& h) { return nhwc(h).to(dt); };
    autograd::backward({y1, out}, {grad(hdy), grad(hs)}, false);
    cuda::set_dual_dgrad_enabled(before);
    return q;
  };
  const uint64_t n0 = F::dgrad_fusions();
  const Run a = run(true, DType::f16);
  const uint64_t n1 = F::dgrad_fusions();
  const Run b = run(false, DType::f16);
  const Run e = run(false, DType::f32);
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("the dual form needs an sm_90 GPU and a build for sm_90a; only the unfused runs");
    CHECK(n1 == n0);
  } else {
    CHECK(n1 == n0 + 1);  // the dual form took conv1's data gradient
  }
  CHECK(F::dgrad_fusions() == n1);  // the unfused runs took none
  for (const Run* o : {&b, &e}) {
    const double s = o == &e ? 10.0 : 1.0;  // against f32: the f16 path's own rounding too
    KILN_CHECK_OK(testing::compare(f32(a.x.grad()), f32(o->x.grad()), 5e-3 * s, 5e-3 * s));
    KILN_CHECK_OK(testing::compare(f32(a.r.grad()), f32(o->r.grad()), 5e-3 * s, 5e-3 * s));
    KILN_CHECK_OK(testing::compare(f32(a.w1.grad()), f32(o->w1.grad()), 0.2 * s, 1e-2 * s));
    for (auto [x, y] : {std::pair{a.gx, o->gx}, {a.bx, o->bx}, {a.gr, o->gr}, {a.br, o->br}})
      KILN_CHECK_OK(testing::compare(x.grad().to(kCPU), y.grad().to(kCPU), 0.2 * s, 1e-2 * s));
  }
}
