// cuda::conv3x3_forward_stats, kiln's 3x3 stride-1 padding-1 convolution with its output's
// batch-norm statistics on the wgmma GEMM (TMA im2col loads): against cuDNN's convolution and the
// f32 CPU convolution, on non-square images (a swapped tap offset would show), row counts that
// end inside a tile, every channel count the kernel takes; the statistics against the output's
// own sums; bit-reproducible; the backend's conv2d_forward_stats with the switch; and the shapes
// it refuses.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "core/backend.h"
#include "cuda/kernels.h"
#include "cuda/kernels/gemm_bn_wgmma.h"
#include "ops/ops.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gradcheck.h"

using namespace kiln;

namespace {

const Device kGpu = Device::cuda(0);
const Device kCPU = Device::cpu();
const ConvParams kPad1{1, 1, 1, 1, 1, 1, 1};

Tensor f32(const Tensor& t) { return t.to(DType::f32).to(kCPU); }
Tensor nhwc(const Tensor& t) {
  return t.to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
}
Tensor out_like(int64_t n, int64_t c, int64_t h, int64_t w) {
  return gputest::nan_output({n, c, h, w}, DType::f16, MemoryFormat::ChannelsLast);
}

// Turns KILN_CONV3X3's path on at every size for a scope, whatever the environment says.
struct Conv3x3On {
  bool before = cuda::conv3x3_enabled();
  int64_t rows = cuda::conv3x3_max_rows();
  Conv3x3On() {
    cuda::set_conv3x3_enabled(true);
    cuda::set_conv3x3_max_rows(std::numeric_limits<int>::max());
  }
  ~Conv3x3On() {
    cuda::set_conv3x3_enabled(before);
    cuda::set_conv3x3_max_rows(rows);
  }
};

}  // namespace

TEST_CASE("the 3x3 implicit GEMM equals cuDNN's convolution and the CPU's, with its statistics") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("the 3x3 kernel runs on the wgmma GEMM (an sm_90 GPU, a build for sm_90a); skipped");
    return;
  }
  Conv3x3On on;
  struct Case {
    int64_t n, k, c, h, w;  // x (n, k, h, w) → y (n, c, h, w)
  };
  // ResNet-50's stride-1 conv2 shapes at small batches (layer 2's 128 @28, layer 3's 256 @14,
  // layer 4's 512 @7: 98 rows, less than one tile), non-square images (5 × 9, 3 × 17) whose
  // rows cross image ends inside a tile, one pixel per image (every tap but the centre padding),
  // K 64 (one k-step per tap) and C 384 (three column tiles).
  for (Case cs : {Case{2, 128, 128, 28, 28}, Case{2, 256, 256, 14, 14}, Case{2, 512, 512, 7, 7},
                  Case{3, 64, 128, 5, 9}, Case{2, 128, 384, 3, 17}, Case{5, 64, 128, 1, 1},
                  Case{1, 192, 256, 9, 4}}) {
    CAPTURE(cs.n);
    CAPTURE(cs.k);
    CAPTURE(cs.c);
    CAPTURE(cs.h);
    CAPTURE(cs.w);
    manual_seed(401 + uint64_t(cs.k + cs.c + cs.h * cs.w));
    const Tensor x = nhwc(randn({cs.n, cs.k, cs.h, cs.w}));
    const Tensor w = nhwc(F::mul(randn({cs.c, cs.k, 3, 3}), 1.0 / std::sqrt(9.0 * double(cs.k))));
    Tensor y = out_like(cs.n, cs.c, cs.h, cs.w);
    REQUIRE(cuda::conv3x3_stats_supported(y, x, w, kPad1));
    const TensorOptions f32o = TensorOptions().with_device(kGpu);
    Tensor sum = empty({cs.c}, f32o), sqsum = empty({cs.c}, f32o);
    cuda::conv3x3_forward_stats(y, sum, sqsum, x, w, kPad1);

    // cuDNN's convolution of the same f16 operands (f32 accumulation, one rounding).
    Tensor ref = out_like(cs.n, cs.c, cs.h, cs.w);
    cuda::conv2d_forward(ref, x, w, Tensor(), kPad1);
    const double scale = 3.0;  // |y| stays within a few units (weights 1/sqrt(fan-in))
    KILN_CHECK_OK(testing::compare(f32(y), f32(ref), 2e-3 * scale, 2e-3));
    // The CPU's f32 convolution of the values the GPU holds.
    const Tensor cpu = F::conv2d(f32(x), f32(w), Tensor(), /*stride=*/1, /*padding=*/1);
    KILN_CHECK_OK(testing::compare(f32(y), cpu, 2e-3 * scale, 2e-3));

    // Σy and Σy² of y as stored.
    const Tensor y32 = f32(y);
    const Tensor want_sum = F::sum(y32, {0, 2, 3});
    const Tensor want_sq = F::sum(F::mul(y32, y32), {0, 2, 3});
    const double rows = double(cs.n * cs.h * cs.w);
    KILN_CHECK_OK(testing::compare(f32(sum), want_sum, 1e-4 * rows, 1e-4));
    KILN_CHECK_OK(testing::compare(f32(sqsum), want_sq, 1e-4 * rows, 1e-4));

    // The same call again: the same bits (fixed-order sums, no atomics).
    Tensor y2 = out_like(cs.n, cs.c, cs.h, cs.w);
    Tensor sum2 = empty({cs.c}, f32o), sqsum2 = empty({cs.c}, f32o);
    cuda::conv3x3_forward_stats(y2, sum2, sqsum2, x, w, kPad1);
    KILN_CHECK_OK(testing::compare(y2, y, 0, 0));
    KILN_CHECK_OK(testing::compare(sum2, sum, 0, 0));
    KILN_CHECK_OK(testing::compare(sqsum2, sqsum, 0, 0));
  }
}

TEST_CASE("the 3x3 implicit GEMM refuses what it does not take, and says which") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("needs an sm_90 GPU and a build for sm_90a; skipped");
    return;
  }
  const Tensor x = nhwc(randn({2, 64, 8, 8}));
  const Tensor w = nhwc(randn({128, 64, 3, 3}));
  const Tensor y = out_like(2, 128, 8, 8);
  Conv3x3On on;
  CHECK(cuda::conv3x3_stats_supported(y, x, w, kPad1));
  // KILN_CONV3X3=0 turns it off; KILN_CONV3X3_ROWS caps the output rows (y has 2·8·8 = 128).
  cuda::set_conv3x3_enabled(false);
  CHECK_FALSE(cuda::conv3x3_stats_supported(y, x, w, kPad1));
  cuda::set_conv3x3_enabled(true);
  cuda::set_conv3x3_max_rows(127);
  CHECK_FALSE(cuda::conv3x3_stats_supported(y, x, w, kPad1));
  cuda::set_conv3x3_max_rows(128);
  CHECK(cuda::conv3x3_stats_supported(y, x, w, kPad1));
  CHECK_THROWS_WITH_AS(cuda::set_conv3x3_max_rows(-1), doctest::Contains("row count"), Error);
  ConvParams stride2 = kPad1;
  stride2.stride_h = stride2.stride_w = 2;
  CHECK_FALSE(cuda::conv3x3_stats_supported(out_like(2, 128, 4, 4), x, w, stride2));
  CHECK_FALSE(cuda::conv3x3_stats_supported(out_like(2, 128, 6, 6), x, w, ConvParams{}));
  // C 64 (layer 1's conv2): the GEMM's column tiles are 128 wide.
  CHECK_FALSE(cuda::conv3x3_stats_supported(out_like(2, 64, 8, 8), x, nhwc(randn({64, 64, 3, 3})),
                                            kPad1));
  // K not a multiple of 64, an NCHW weight, an NCHW x.
  CHECK_FALSE(cuda::conv3x3_stats_supported(y, nhwc(randn({2, 32, 8, 8})),
                                            nhwc(randn({128, 32, 3, 3})), kPad1));
  CHECK_FALSE(cuda::conv3x3_stats_supported(y, x, w.contiguous(), kPad1));
  CHECK_FALSE(cuda::conv3x3_stats_supported(y, x.contiguous(), w, kPad1));
  const TensorOptions f32o = TensorOptions().with_device(kGpu);
  Tensor sum = empty({128}, f32o), sqsum = empty({128}, f32o);
  CHECK_THROWS_WITH_AS(cuda::conv3x3_forward_stats(y, sum, sqsum, x, w.contiguous(), kPad1),
                       doctest::Contains("channels-last w"), Error);
}

TEST_CASE("conv2d_forward_stats takes the 3x3 kernel with KILN_CONV3X3 on: cuDNN's values") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("needs an sm_90 GPU and a build for sm_90a; skipped");
    return;
  }
  manual_seed(419);
  const Tensor x = nhwc(randn({4, 128, 14, 14}));
  const Tensor w = nhwc(F::mul(randn({256, 128, 3, 3}), 1.0 / std::sqrt(9.0 * 128)));
  const TensorOptions f32o = TensorOptions().with_device(kGpu);
  const Backend& be = backend(kGpu);
  REQUIRE(static_cast<bool>(be.conv2d_forward_stats));
  auto run = [&](bool kiln_path, Tensor& y, Tensor& sum, Tensor& sqsum) {
    const bool before = cuda::conv3x3_enabled();
    cuda::set_conv3x3_enabled(kiln_path);
    y = out_like(4, 256, 14, 14);
    sum = empty({256}, f32o);
    sqsum = empty({256}, f32o);
    const bool took = be.conv2d_forward_stats(y, sum, sqsum, x, w, kPad1);
    cuda::set_conv3x3_enabled(before);
    return took;
  };
  Tensor y1, s1, q1, y0, s0, q0;
  REQUIRE(run(true, y1, s1, q1));
  if (!run(false, y0, s0, q0)) {  // cuDNN's fused BN would run: compare with the plain conv
    cuda::conv2d_forward(y0, x, w, Tensor(), kPad1);
    const Tensor y32 = f32(y0);
    s0 = F::sum(y32, {0, 2, 3}).to(kGpu);
    q0 = F::sum(F::mul(y32, y32), {0, 2, 3}).to(kGpu);
  }
  KILN_CHECK_OK(testing::compare(f32(y1), f32(y0), 6e-3, 2e-3));
  KILN_CHECK_OK(testing::compare(f32(s1), f32(s0), 0.1, 1e-3));
  KILN_CHECK_OK(testing::compare(f32(q1), f32(q0), 0.1, 1e-3));
}
