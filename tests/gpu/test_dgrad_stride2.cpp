// A stride-2 unpadded 1x1 convolution's data gradient handed compact — its input's even pixels
// alone, (N, C, ⌈H/2⌉, ⌈W/2⌉) — to the block tail's GEMM behind it (ops/dgrad_sink.h,
// wants_dgrad_stride2; cuda/kernels/gemm_bn_wgmma.cu, kSub2). The GEMM with r compact against
// the same GEMM with r scattered into x's shape, bit for bit, in every form that takes r; and the
// wiring in a graph: a downsample block's shortcut beside a 1x1 conv1 (the compact hand-off) and
// beside a 3x3 stride-2 conv1 (the scattered fallback), against the switch off and f32.
#include <doctest/doctest.h>

#include <cmath>
#include <utility>

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
Tensor f32(const Tensor& t) { return t.to(DType::f32).to(kCPU); }

// A block tail (tests/gpu/tail_case.h) and the shortcut's data gradient at the even pixels,
// compact (r_sub) and scattered into x's shape (r_full); the tail's own r is not used.
struct Tail : gputest::Tail {
  Tensor r_sub, r_full;
};

Tail make_tail(int64_t n, int64_t c, int64_t k, int64_t h, int64_t w, uint64_t seed) {
  Tail t{gputest::make_tail(n, c, k, h, w, seed), Tensor(), Tensor()};
  t.r_sub = nhwc(randn({n, c, (h + 1) / 2, (w + 1) / 2}));
  t.r_full = zeros_like(t.y3);
  t.r_full.slice(2, 0, h, 2).slice(3, 0, w, 2).copy_(t.r_sub);
  return t;
}

struct Grads {
  Tensor dx, g, dw, db, coef;
};

// The tail's GEMM and finish with r as given; coef: the fold's form (no dx pass).
Grads run(const Tail& t, const Tensor& r, bool coef) {
  const TensorOptions o32 = TensorOptions().with_device(kGpu);
  const int64_t c = t.y3.size(1);
  Grads o{coef ? Tensor() : empty_like(t.y3), empty_like(t.y3), empty({c}, o32), empty({c}, o32),
          coef ? empty({3 * c}, o32) : Tensor()};
  cuda::bn_nhwc_backward_dgrad(o.dx, o.g, o.dw, o.db, t.dy1, t.w1, r, t.mask, t.y3, t.weight,
                               t.mean, t.invstd, false, Tensor(), o.coef);
  return o;
}

void check_same(const Grads& a, const Grads& b) {
  for (auto [x, y] : {std::pair{a.dx, b.dx}, {a.g, b.g}, {a.dw, b.dw}, {a.db, b.db},
                      {a.coef, b.coef}})
    if (x.defined() || y.defined()) KILN_CHECK_OK(testing::compare(x, y, 0, 0));
}

}  // namespace

TEST_CASE("a compact stride-2 r gives the bits of r scattered into x's shape") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("the compact form is the wgmma kernel's (an sm_90 GPU, a build for sm_90a); skipped");
    return;
  }
  struct Case {
    int64_t n, c, k, h, w;
  };
  // 784 rows (6 full tiles, 16 rows); odd H and W (the last row and column even: ⌈H/2⌉ rows);
  // a 64-row round that spans three image rows (W 14) or under one (W 56); ResNet-50's three
  // shapes behind a downsample shortcut at small batches (layer 1's 256 @56, layer 2's 512 @28,
  // layer 3's 1024 @14), each over several tiles a CTA.
  const int mode = cuda::tail_gemm_mode();
  const bool tma = cuda::tail_tma_epilogue_enabled();
  for (Case cs : {Case{4, 256, 128, 14, 14}, Case{2, 128, 64, 7, 9}, Case{3, 256, 256, 13, 11},
                  Case{4, 256, 128, 56, 56}, Case{8, 512, 256, 28, 28},
                  Case{16, 1024, 512, 14, 14}}) {
    CAPTURE(cs.n);
    CAPTURE(cs.c);
    CAPTURE(cs.h);
    CAPTURE(cs.w);
    const Tail t = make_tail(cs.n, cs.c, cs.k, cs.h, cs.w, 211 + uint64_t(cs.c + cs.h));
    cuda::set_tail_gemm_mode(2);
    cuda::set_tail_tma_epilogue_enabled(true);
    REQUIRE(cuda::dgrad1x1_bn_stride2_supported(t.y3, t.mask));
    for (bool coef : {false, true}) {
      CAPTURE(coef);
      const Grads want = run(t, t.r_full, coef);
      check_same(run(t, t.r_sub, coef), want);
      // The global-memory epilogue (KILN_TAIL_TMA_EPI=0) does not read it compact: scattered
      // first, the same bits.
      cuda::set_tail_tma_epilogue_enabled(false);
      CHECK_FALSE(cuda::dgrad1x1_bn_stride2_supported(t.y3, t.mask));
      check_same(run(t, t.r_sub, coef), want);
      cuda::set_tail_tma_epilogue_enabled(true);
      // The mma.sync kernel (K 64 and 128): scattered first, its own bits either way.
      if (cs.k <= 128) {
        cuda::set_tail_gemm_mode(0);
        CHECK_FALSE(cuda::dgrad1x1_bn_stride2_supported(t.y3, t.mask));
        check_same(run(t, t.r_sub, coef), run(t, t.r_full, coef));
        cuda::set_tail_gemm_mode(2);
      }
    }
    // Run twice, the same bits.
    check_same(run(t, t.r_sub, false), run(t, t.r_sub, false));
  }
  cuda::set_tail_gemm_mode(mode);
  cuda::set_tail_tma_epilogue_enabled(tma);
}

// The wiring: relu(bn(y3) + z) read by the next block's conv1 and, as a downsample block's
// shortcut, by a stride-2 1x1 convolution. With conv1 1x1 (ResNet-50's bottleneck) the shortcut
// hands its gradient compact and the tail's GEMM reads it so; with conv1 3x3 at stride 2
// (ResNet-18's basic block) conv1's data gradient is written whole, and the tail scatters the
// compact one into it. Every gradient against the switch off (the shortcut's cuDNN data gradient
// at stride 2) and against f32 without any fusion.
TEST_CASE("a stride-2 shortcut hands the tail before it its gradient at the even pixels") {
  struct Case {
    int64_t c, k, ks, h, w;
    bool conv1_3x3;
  };
  for (Case cs : {Case{256, 64, 512, 14, 12, false}, Case{128, 128, 256, 9, 7, false},
                  Case{128, 128, 256, 10, 12, true}}) {
    CAPTURE(cs.c);
    CAPTURE(cs.h);
    CAPTURE(cs.conv1_3x3);
    manual_seed(307 + uint64_t(cs.c + cs.h));
    const int64_t n = 4, hs = (cs.h + 1) / 2, ws = (cs.w + 1) / 2;
    const Shape shape{n, cs.c, cs.h, cs.w};
    const int64_t k1 = cs.conv1_3x3 ? 3 : 1, s1 = cs.conv1_3x3 ? 2 : 1, p1 = cs.conv1_3x3 ? 1 : 0;
    const int64_t h1 = cs.conv1_3x3 ? hs : cs.h, w1 = cs.conv1_3x3 ? ws : cs.w;
    Tensor hy = F::add(F::mul(randn(shape), 1.5), 0.25), hz = randn(shape);
    Tensor hw1 = F::mul(randn({cs.k, cs.c, k1, k1}), 0.1);
    Tensor hws = F::mul(randn({cs.ks, cs.c, 1, 1}), 0.1);
    Tensor hdy1 = randn({n, cs.k, h1, w1}), hdys = randn({n, cs.ks, hs, ws});
    Tensor hg = uniform({cs.c}, 0.5, 1.5), hb = uniform({cs.c}, -0.5, 0.5);
    struct Run {
      Tensor y3, z, w1, ws, weight, bias;
    };
    auto go = [&](bool compact, DType dt) {
      const bool before = cuda::dgrad_stride2_enabled();
      cuda::set_dgrad_stride2_enabled(compact);
      auto leaf = [&](const Tensor& h, DType t, bool cl) {
        Tensor g = h.to(t).to(kGpu);
        if (cl) g = g.contiguous(MemoryFormat::ChannelsLast);
        g = g.detach();
        g.set_requires_grad(true);
        return g;
      };
      Run r{leaf(hy.to(DType::f16), dt, true),  leaf(hz.to(DType::f16), dt, true),
            leaf(hw1.to(DType::f16), dt, true), leaf(hws.to(DType::f16), dt, true),
            leaf(hg, DType::f32, false),        leaf(hb, DType::f32, false)};
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
      Tensor y1 = F::conv2d(out, r.w1, Tensor(), s1, p1);
      Tensor ys = F::conv2d(out, r.ws, Tensor(), 2);
      auto grad = [&](const Tensor& h) { return nhwc(h).to(dt); };
      autograd::backward({y1, ys}, {grad(hdy1), grad(hdys)}, false);
      cuda::set_dgrad_stride2_enabled(before);
      return r;
    };
    const uint64_t n0 = F::stride2_compact_grads(), i0 = F::stride2_inplace_adds();
    const Run a = go(true, DType::f16);
    const uint64_t n1 = F::stride2_compact_grads(), i1 = F::stride2_inplace_adds();
    const Run b = go(false, DType::f16);
    CHECK(F::stride2_compact_grads() == n1);  // the switch off: none
    CHECK(F::stride2_inplace_adds() == i1);
    const Run e = go(false, DType::f32);
    const bool wgmma = cuda::dgrad1x1_bn_wgmma_available() && cuda::tail_gemm_mode() == 2 &&
                       cuda::tail_tma_epilogue_enabled();
    // Read compact only behind a 1x1 conv1 whose gradient the tail's GEMM takes.
    CHECK(n1 == n0 + (wgmma && !cs.conv1_3x3 ? 1 : 0));
    // Beside a 3x3 conv1 the compact gradient is added into conv1's, which the engine hands the
    // node alone: in place, at the even pixels.
    CHECK(i1 == i0 + (wgmma && cs.conv1_3x3 ? 1 : 0));
    for (const Run* o : {&b, &e}) {
      const double s = o == &e ? 10.0 : 1.0;  // against f32: the f16 path's own rounding too
      KILN_CHECK_OK(testing::compare(f32(a.z.grad()), f32(o->z.grad()), 5e-3 * s, 5e-3 * s));
      KILN_CHECK_OK(testing::compare(f32(a.y3.grad()), f32(o->y3.grad()), 5e-3 * s, 5e-3 * s));
      KILN_CHECK_OK(testing::compare(f32(a.w1.grad()), f32(o->w1.grad()), 0.2 * s, 1e-2 * s));
      KILN_CHECK_OK(testing::compare(f32(a.ws.grad()), f32(o->ws.grad()), 0.2 * s, 1e-2 * s));
      for (auto [x, y] : {std::pair{a.weight, o->weight}, {a.bias, o->bias}})
        KILN_CHECK_OK(testing::compare(x.grad().to(kCPU), y.grad().to(kCPU), 0.2 * s, 1e-2 * s));
    }
  }
}
