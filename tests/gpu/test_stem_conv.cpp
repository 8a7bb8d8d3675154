// cuda::stem_conv_forward_stats, kiln's kernel for the ResNet stem's 7x7/2 convolution from 3
// channels with the batch norm's statistics: y against cuDNN's convolution and the f32 CPU
// convolution, the statistics against f64 sums of the y it wrote, bit-reproducible, either weight
// layout, the path F::conv2d takes, and the shapes it leaves to cuDNN. Its weight gradient
// (cuda::stem_conv_backward_weight) against cuDNN's and the CPU's, written and added, f16 and f32,
// either layout, bit-reproducible, and through autograd. Both kernels with their multiply on
// wgmma and on mma.sync where the GPU has both, and the two against each other.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "cuda/conv.h"
#include "cuda/kernels.h"
#include "ops/ops.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gradcheck.h"

using namespace kiln;

namespace {

const Device kGpu = Device::cuda(0);
const Device kCPU = Device::cpu();

ConvParams stem_params() {
  ConvParams p;
  p.stride_h = p.stride_w = 2;
  p.pad_h = p.pad_w = 3;
  return p;
}

struct Stem {
  Tensor x, w;  // x f16 channels-last on the GPU; w f16 (64, 3, 7, 7) on the GPU
};

Stem make_stem(int64_t n, int64_t h, int64_t w, uint64_t seed, bool w_channels_last = false) {
  manual_seed(seed);
  Stem s;
  s.x = randn({n, 3, h, w}).to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
  Tensor wt = F::mul(randn({64, 3, 7, 7}), 1.0 / std::sqrt(147.0)).to(DType::f16).to(kGpu);
  s.w = w_channels_last ? wt.contiguous(MemoryFormat::ChannelsLast) : wt;
  return s;
}

struct Out {
  Tensor y, sum, sqsum;
};

Out run_kernel(const Stem& s) {
  const int64_t oh = (s.x.size(2) - 1) / 2 + 1, ow = (s.x.size(3) - 1) / 2 + 1;
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(kGpu);
  Out o{gputest::nan_output({s.x.size(0), 64, oh, ow}, DType::f16, MemoryFormat::ChannelsLast),
        empty({64}, f32), empty({64}, f32)};
  o.sum.fill_(std::nan(""));
  o.sqsum.fill_(std::nan(""));
  REQUIRE(cuda::stem_conv_supported(o.y, s.x, s.w, stem_params()));
  cuda::stem_conv_forward_stats(o.y, o.sum, o.sqsum, s.x, s.w, stem_params());
  return o;
}

Tensor f32(const Tensor& t) { return t.to(DType::f32).to(kCPU); }

// The forward's and the weight gradient's shapes (batch, input rows, columns): one tile per image,
// 3 × 2 tiles with the image's border on every side, ResNet-50's 224 × 224 (98 tiles per image;
// 784 at batch 8, more than one wave of CTAs — 396 on an H200 — so each CTA takes several tiles,
// as in training), and an odd input size.
struct Case {
  int64_t n, h, w;
};
constexpr Case kCases[] = {{2, 32, 32}, {3, 48, 64}, {8, 224, 224}, {1, 31, 63}};

// The multiplies this GPU runs the stem's kernels on: mma.sync, and wgmma where available (sm_90,
// a build for sm_90a), its forward in both forms: the patch by 16-byte copies and A read from it
// (the default), and the patch by 2-byte loads and A from registers (KILN_STEM_A_SMEM=0; the
// weight gradient is the same kernel both ways). Restores the settings it found.
class Multiplies {
 public:
  Multiplies() : before_(cuda::stem_wgmma_mode()), a_smem_before_(cuda::stem_a_smem_enabled()) {
    cuda::set_stem_wgmma_mode(2);
    if (cuda::stem_wgmma_mode() == 2) {
      list_.push_back("wgmma");
      list_.push_back("wgmma, A from registers");
    }
    list_.push_back("mma.sync");
  }
  ~Multiplies() {
    cuda::set_stem_wgmma_mode(before_);
    cuda::set_stem_a_smem_enabled(a_smem_before_);
  }
  // Each multiply's name, for use().
  const std::vector<const char*>& each() const { return list_; }
  static void use(const char* name) {
    const std::string n(name);
    cuda::set_stem_wgmma_mode(n == "mma.sync" ? 0 : 2);
    cuda::set_stem_a_smem_enabled(n != "wgmma, A from registers");
  }

 private:
  int before_;
  bool a_smem_before_;
  std::vector<const char*> list_;
};

// A stem of case cs whose x is the last cs.n images of a batch `skip` larger: x then starts
// 6·h·w·skip bytes into its storage (off a 16-byte boundary for odd sizes) and ends where the
// storage ends.
Stem offset_stem(const Case& cs, int64_t skip, uint64_t seed) {
  Stem s = make_stem(cs.n + skip, cs.h, cs.w, seed);
  s.x = s.x.narrow(0, skip, cs.n);
  REQUIRE(s.x.is_contiguous(MemoryFormat::ChannelsLast));
  return s;
}

// The weight gradient of dy through the stem, on cuDNN (mode 0) or kiln's kernel (mode 2), into
// a fresh dw of `dtype` and layout `fmt`: written, or added onto `base` when base is defined.
Tensor wgrad(const Tensor& dy, const Tensor& x, int mode, DType dtype, MemoryFormat fmt,
             const Tensor& base = Tensor()) {
  // A fresh tensor either way: base.to(dtype).contiguous(fmt) may be base itself, which the
  // kernel would then add into.
  Tensor dw = gputest::nan_output({64, 3, 7, 7}, dtype, fmt);
  if (base.defined()) dw.copy_(base.to(dtype));
  const int before = cuda::stem_conv_mode();
  cuda::set_stem_conv_mode(mode);
  cuda::conv2d_backward_weight(dw, dy, x, stem_params(), /*accumulate=*/base.defined());
  cuda::set_stem_conv_mode(before);
  return dw;
}

}  // namespace

TEST_CASE("the stem convolution equals cuDNN's and the CPU's; its statistics are y's") {
  const Multiplies multiplies;
  for (const char* mul : multiplies.each())
    for (Case cs : kCases) {
      CAPTURE(mul);
      CAPTURE(cs.h);
      CAPTURE(cs.w);
      Multiplies::use(mul);
      const Stem s = make_stem(cs.n, cs.h, cs.w, 7 + uint64_t(cs.h));
      const Out o = run_kernel(s);
      // cuDNN: the same products, added in another order, so y may round to the neighbouring f16.
      const int mode = cuda::stem_conv_mode();
      cuda::set_stem_conv_mode(0);
      Tensor ref = F::conv2d(s.x, s.w, Tensor(), 2, 3);
      cuda::set_stem_conv_mode(mode);
      KILN_CHECK_OK(testing::compare(f32(o.y), f32(ref), 4e-3, 2e-3));
      // The f32 CPU convolution of the same f16 values.
      Tensor cpu = F::conv2d(f32(s.x), f32(s.w), Tensor(), 2, 3);
      KILN_CHECK_OK(testing::compare(f32(o.y), cpu, 1e-2, 2e-3));
      // Σy and Σy² of the y it wrote, in f64.
      Tensor yc = f32(o.y).permute({0, 2, 3, 1}).contiguous();
      const float* yp = yc.data<float>();
      const int64_t rows = yc.numel() / 64;
      std::vector<double> sum(64, 0.0), sq(64, 0.0);
      for (int64_t r = 0; r < rows; ++r)
        for (int c = 0; c < 64; ++c) {
          const double v = yp[r * 64 + c];
          sum[size_t(c)] += v;
          sq[size_t(c)] += v * v;
        }
      Tensor want_sum = from_vector(sum, {64}, TensorOptions(DType::f32));
      Tensor want_sq = from_vector(sq, {64}, TensorOptions(DType::f32));
      // f32 sums of `rows` terms: the sum's error is bounded by its scale, sqrt(rows)·|y|.
      const double tol = 1e-5 * double(rows);
      KILN_CHECK_OK(testing::compare(o.sum.to(kCPU), want_sum, tol, 1e-5));
      KILN_CHECK_OK(testing::compare(o.sqsum.to(kCPU), want_sq, tol, 1e-5));
    }
}

TEST_CASE("the stem convolution is bit-reproducible and takes either weight layout") {
  const Stem a = make_stem(4, 64, 96, 21), b = make_stem(4, 64, 96, 21, /*w_channels_last=*/true);
  REQUIRE(b.w.is_contiguous(MemoryFormat::ChannelsLast));
  const Multiplies multiplies;
  for (const char* mul : multiplies.each()) {
    CAPTURE(mul);
    Multiplies::use(mul);
    const Out o1 = run_kernel(a), o2 = run_kernel(a), o3 = run_kernel(b);
    for (const Out* o : {&o2, &o3}) {
      KILN_CHECK_OK(testing::compare(o->y, o1.y, 0, 0));
      KILN_CHECK_OK(testing::compare(o->sum, o1.sum, 0, 0));
      KILN_CHECK_OK(testing::compare(o->sqsum, o1.sqsum, 0, 0));
    }
  }
}

TEST_CASE("the stem convolution's two multiplies agree") {
  const Multiplies multiplies;
  if (multiplies.each().size() < 2) {
    MESSAGE("the wgmma multiply needs an sm_90 GPU and a build for sm_90a; skipped");
    return;
  }
  // ResNet-50's shape at batch 8 (784 tiles: several per CTA) and one with borders on all sides.
  for (Case cs : {Case{8, 224, 224}, Case{3, 48, 64}}) {
    CAPTURE(cs.h);
    const Stem s = make_stem(cs.n, cs.h, cs.w, 61 + uint64_t(cs.h));
    Multiplies::use("wgmma");
    const Out wg = run_kernel(s);
    Multiplies::use("mma.sync");
    const Out ms = run_kernel(s);
    // The same products in the same k16 steps: y at most one f16 step apart (the tensor cores'
    // order within a step may differ), the statistics of those y within their rounding.
    KILN_CHECK_OK(testing::compare(f32(wg.y), f32(ms.y), 2e-3, 1e-3));
    const double rows = double(wg.y.numel() / 64);
    KILN_CHECK_OK(testing::compare(wg.sum.to(kCPU), ms.sum.to(kCPU), 1e-5 * rows, 1e-4));
    KILN_CHECK_OK(testing::compare(wg.sqsum.to(kCPU), ms.sqsum.to(kCPU), 1e-5 * rows, 1e-4));
    const Tensor same = F::eq(wg.y, ms.y).to(DType::f32).to(kCPU);
    MESSAGE("y equal bit for bit at ", F::sum(same).item<float>(), " of ", same.numel(), " values");
    // The weight gradients, f32: the same products, the pixels added in other groups.
    const int64_t oh = (cs.h - 1) / 2 + 1, ow = (cs.w - 1) / 2 + 1;
    Tensor dy =
        randn({cs.n, 64, oh, ow}).to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
    Multiplies::use("wgmma");
    const Tensor dw_wg = wgrad(dy, s.x, 2, DType::f32, MemoryFormat::Contiguous);
    Multiplies::use("mma.sync");
    const Tensor dw_ms = wgrad(dy, s.x, 2, DType::f32, MemoryFormat::Contiguous);
    const double scale = std::sqrt(double(cs.n * oh * ow));
    KILN_CHECK_OK(testing::compare(f32(dw_wg), f32(dw_ms), 1e-4 * scale, 1e-4));
  }
}

TEST_CASE("the stem forward's patch by 16-byte copies, A read from it, gives the register "
          "form's bits") {
  const Multiplies multiplies;
  if (multiplies.each().size() < 3) {
    MESSAGE("the wgmma multiply needs an sm_90 GPU and a build for sm_90a; skipped");
    return;
  }
  // Every case of kCases (borders on every side, several tiles per CTA, an odd input size), x
  // whole and x as the last n images of a batch 1 or 2 larger: there x starts inside its
  // storage, 6·h·w bytes per image in (6 and 12 bytes past a 16-byte boundary for 31 × 63; on
  // one for the even sizes), and ends where the storage ends, so the copies meet both of x's
  // ends off a 16-byte boundary (compute-sanitizer's memcheck sees a read past x).
  for (Case cs : kCases)
    for (int64_t skip : {0, 1, 2}) {
      CAPTURE(cs.n);
      CAPTURE(cs.h);
      CAPTURE(cs.w);
      CAPTURE(skip);
      const Stem s = offset_stem(cs, skip, 131 + uint64_t(cs.h));
      Multiplies::use("wgmma, A from registers");
      const Out reg = run_kernel(s);
      Multiplies::use("wgmma");
      const Out sm = run_kernel(s);
      // The same patch, the same k16 steps in the same order into the same accumulators, and the
      // epilogue sums the same pixels in the same order: the same bits. Near first, so that a
      // layout mistake or a wrong pixel reads as one (far beyond this tolerance).
      KILN_CHECK_OK(testing::compare(f32(sm.y), f32(reg.y), 2e-3, 1e-3));
      KILN_CHECK_OK(testing::compare(sm.y, reg.y, 0, 0));
      KILN_CHECK_OK(testing::compare(sm.sum, reg.sum, 0, 0));
      KILN_CHECK_OK(testing::compare(sm.sqsum, reg.sqsum, 0, 0));
    }
}

TEST_CASE("the stem's weight gradient with A from shared memory gives the register form's bits") {
  const Multiplies multiplies;
  if (multiplies.each().size() < 3) {
    MESSAGE("the wgmma multiply needs an sm_90 GPU and a build for sm_90a; skipped");
    return;
  }
  Multiplies::use("wgmma");
  const bool before = cuda::stem_wgrad_a_smem_enabled();
  // Every case of kCases, x whole and as the last images of a batch 1 or 2 larger (x then starts
  // off a 16-byte boundary for 31 × 63, and ends where its storage does), f32 and f16 dw.
  for (Case cs : kCases)
    for (int64_t skip : {0, 1, 2}) {
      CAPTURE(cs.n);
      CAPTURE(cs.h);
      CAPTURE(cs.w);
      CAPTURE(skip);
      const Stem s = offset_stem(cs, skip, 191 + uint64_t(cs.w));
      const int64_t oh = (cs.h - 1) / 2 + 1, ow = (cs.w - 1) / 2 + 1;
      const Tensor dy =
          randn({cs.n, 64, oh, ow}).to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
      for (DType dt : {DType::f32, DType::f16}) {
        CAPTURE(dt == DType::f32);
        cuda::set_stem_wgrad_a_smem_enabled(false);
        const Tensor want = wgrad(dy, s.x, 2, dt, MemoryFormat::Contiguous);
        cuda::set_stem_wgrad_a_smem_enabled(true);
        const Tensor got = wgrad(dy, s.x, 2, dt, MemoryFormat::Contiguous);
        // The same products into the same accumulators in the same order: the same bits. Near
        // first, so that a wrong kernel position or pixel reads as one.
        const double scale = std::sqrt(double(cs.n * oh * ow));
        KILN_CHECK_OK(testing::compare(f32(got), f32(want), 1e-3 * scale, 1e-3));
        KILN_CHECK_OK(testing::compare(got, want, 0, 0));
      }
    }
  cuda::set_stem_wgrad_a_smem_enabled(before);
}

TEST_CASE("F::conv2d with statistics takes the stem kernel; other shapes stay on cuDNN") {
  const Stem s = make_stem(2, 64, 64, 31);
  F::ChannelStats stats;
  Tensor y = F::conv2d(s.x, s.w, Tensor(), 2, 3, 1, 1, &stats);
  REQUIRE(stats.defined());
  const Out o = run_kernel(s);
  KILN_CHECK_OK(testing::compare(y, o.y, 0, 0));
  KILN_CHECK_OK(testing::compare(stats.sum, o.sum, 0, 0));

  const ConvParams p = stem_params();
  auto out_like = [](const Tensor& x, int64_t c) {
    return empty({x.size(0), c, (x.size(2) - 1) / 2 + 1, (x.size(3) - 1) / 2 + 1},
                 gputest::gpu_opts(DType::f16, MemoryFormat::ChannelsLast));
  };
  // Output rows not a multiple of 8 (30 → 15), 4 input channels, stride 1, f32, NCHW x.
  const Stem odd = make_stem(1, 30, 64, 32);
  CHECK_FALSE(cuda::stem_conv_supported(out_like(odd.x, 64), odd.x, odd.w, p));
  Tensor x4 = randn({1, 4, 64, 64}).to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
  Tensor w4 = randn({64, 4, 7, 7}).to(DType::f16).to(kGpu);
  CHECK_FALSE(cuda::stem_conv_supported(out_like(x4, 64), x4, w4, p));
  ConvParams p1 = p;
  p1.stride_h = p1.stride_w = 1;
  CHECK_FALSE(cuda::stem_conv_supported(out_like(s.x, 64), s.x, s.w, p1));
  Tensor xf = s.x.to(DType::f32);
  CHECK_FALSE(cuda::stem_conv_supported(out_like(s.x, 64), xf, s.w, p));
  Tensor xn = s.x.contiguous();
  CHECK_FALSE(cuda::stem_conv_supported(out_like(s.x, 64), xn, s.w, p));
  // The kernel called on a shape it does not take says so.
  Tensor ybad = out_like(odd.x, 64), sum = empty({64}, TensorOptions(DType::f32).with_device(kGpu));
  CHECK_THROWS_WITH_AS(cuda::stem_conv_forward_stats(ybad, sum, sum.clone(), odd.x, odd.w, p),
                       doctest::Contains("output rows a multiple of 8"), Error);
}

TEST_CASE("the stem's weight gradient equals cuDNN's and the CPU's, written or added") {
  const Multiplies multiplies;
  for (const char* mul : multiplies.each())
    for (Case cs : kCases) {
      CAPTURE(mul);
      CAPTURE(cs.h);
      Multiplies::use(mul);
      CAPTURE(cs.w);
      const Stem s = make_stem(cs.n, cs.h, cs.w, 41 + uint64_t(cs.h));
      const int64_t oh = (cs.h - 1) / 2 + 1, ow = (cs.w - 1) / 2 + 1;
      Tensor dy =
          randn({cs.n, 64, oh, ow}).to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
      REQUIRE(cuda::stem_wgrad_supported(gputest::nan_output({64, 3, 7, 7}, DType::f16), dy, s.x,
                                         stem_params()));
      // The f32 CPU gradient of the same f16 values, through autograd.
      Tensor xc = f32(s.x), wc = f32(s.w).detach();
      wc.set_requires_grad(true);
      F::conv2d(xc, wc, Tensor(), 2, 3).backward(f32(dy));
      const Tensor cpu = wc.grad();
      // dW's entries add M = N·OH·OW products of size ~1: ~sqrt(M) in size, one f16 step 2^-11 of
      // that; the two GPU sums differ in order only.
      const double scale = std::sqrt(double(cs.n * oh * ow));
      for (auto fmt : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
        const Tensor mine = wgrad(dy, s.x, 2, DType::f16, fmt);
        const Tensor ref = wgrad(dy, s.x, 0, DType::f16, fmt);
        KILN_CHECK_OK(testing::compare(f32(mine), f32(ref), 2e-3 * scale, 2e-3));
        KILN_CHECK_OK(testing::compare(f32(mine), cpu, 2e-3 * scale, 2e-3));
        const Tensor mine32 = wgrad(dy, s.x, 2, DType::f32, fmt);
        KILN_CHECK_OK(testing::compare(f32(mine32), cpu, 1e-4 * scale, 1e-4));
        // Added onto a gradient already there: base + dW, rounded once.
        const Tensor base = F::mul(randn({64, 3, 7, 7}), scale).to(DType::f16).to(kGpu);
        const Tensor added = wgrad(dy, s.x, 2, DType::f16, fmt, base);
        KILN_CHECK_OK(
            testing::compare(f32(added), F::add(f32(base), f32(mine32)), 2e-3 * scale, 2e-3));
        // Bit-reproducible, and the same bits in either layout.
        KILN_CHECK_OK(testing::compare(wgrad(dy, s.x, 2, DType::f16, fmt), mine, 0, 0));
        KILN_CHECK_OK(testing::compare(
            mine.contiguous(), wgrad(dy, s.x, 2, DType::f16, MemoryFormat::Contiguous), 0, 0));
      }
    }
}

TEST_CASE("autograd through the stem: kiln's kernels give cuDNN's gradients") {
  const Stem s = make_stem(2, 64, 64, 51);
  Tensor dy = randn({2, 64, 32, 32}).to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
  auto grad_of = [&](int mode) {
    const int before = cuda::stem_conv_mode();
    cuda::set_stem_conv_mode(mode);
    Tensor w = s.w.detach().clone();
    w.set_requires_grad(true);
    F::ChannelStats stats;
    Tensor y = F::conv2d(s.x, w, Tensor(), 2, 3, 1, 1, &stats);
    if (mode >= 1) CHECK(stats.defined());
    y.backward(dy);
    cuda::set_stem_conv_mode(before);
    return w.grad();
  };
  // Deterministic convolutions, so that mode 1's weight gradient (cuDNN's) repeats mode 0's bits.
  cuda::set_conv_deterministic(true);
  const Tensor kiln2 = grad_of(2), kiln1 = grad_of(1), cudnn = grad_of(0);
  cuda::set_conv_deterministic(false);
  KILN_CHECK_OK(testing::compare(f32(kiln2), f32(cudnn), 2e-3 * 45.3, 2e-3));
  KILN_CHECK_OK(testing::compare(kiln1, cudnn, 0, 0));
}
