// cuda::conv1x1_backward_weight, kiln's weight gradient of a stride-1 1x1 convolution on the
// wgmma kernel: against cuDNN's and the f32 CPU product dyᵀ · x, for both operand orders (O a
// multiple of 128, or only I), 128- and 64-column tiles, row counts that end in a partial k-step,
// one part or many per tile; written and added, f16 and f32, a strided dw; bit-reproducible; the
// path conv2d_backward_weight takes; and the shapes it leaves to cuDNN. The form that also sums
// x's columns (the tail fold's Σx): the same dw, and the sums against f64.
#include <doctest/doctest.h>

#include <cmath>

#include "cuda/kernels.h"
#include "cuda/kernels/gemm_bn_wgmma.h"
#include "ops/ops.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gradcheck.h"

using namespace kiln;

namespace {

const Device kGpu = Device::cuda(0);
const Device kCPU = Device::cpu();

Tensor f32(const Tensor& t) { return t.to(DType::f32).to(kCPU); }
Tensor nhwc(const Tensor& t) {
  return t.to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast);
}

// The weight gradient into a fresh dw (O, I, 1, 1) of `dtype`, on kiln's kernel (`kiln`) or
// cuDNN's, through conv2d_backward_weight: written, or added onto `base` when it is defined.
// `strided`: dw is a (I, O) buffer's transposed view, so its strides are (1, O).
Tensor wgrad(const Tensor& dy, const Tensor& x, bool kiln, DType dtype,
             const Tensor& base = Tensor(), bool strided = false) {
  const int64_t O = dy.size(1), I = x.size(1);
  Tensor dw = strided ? gputest::nan_output({I, O, 1, 1}, dtype).permute({1, 0, 2, 3})
                      : gputest::nan_output({O, I, 1, 1}, dtype);
  if (base.defined()) dw.copy_(base.to(dtype));
  const bool before = cuda::conv1x1_wgrad_enabled();
  cuda::set_conv1x1_wgrad_enabled(kiln);
  CHECK(cuda::conv1x1_wgrad_supported(dw, dy, x, ConvParams{}) == kiln);
  cuda::conv2d_backward_weight(dw, dy, x, ConvParams{}, /*accumulate=*/base.defined());
  cuda::set_conv1x1_wgrad_enabled(before);
  return dw;
}

}  // namespace

TEST_CASE("the 1x1 weight gradient equals cuDNN's and the CPU's, written or added") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("conv1x1_backward_weight runs on the wgmma kernel: it needs an sm_90 GPU and a "
            "build for sm_90a; skipped");
    return;
  }
  struct Case {
    int64_t n, o, i, h, w;  // dy (n, o, h, w), x (n, i, h, w), dw (o, i, 1, 1)
  };
  // O 256 with I 64 (64-column tiles), O 128 with I 512 and O 512 with I 128 (128-column tiles),
  // ResNet-50's 64-channel conv1s (O 64: the operands swapped, dwᵀ computed), I 192 (three
  // 64-column tiles), rows that end inside a k-step (3·7·7 = 147, 5·5·7 = 175), and layer 1 at
  // batch 8 (25,088 rows, 392 k-steps split over 66 parts per tile).
  for (Case cs : {Case{3, 256, 64, 7, 7}, Case{2, 128, 512, 14, 14}, Case{2, 512, 128, 7, 7},
                  Case{2, 64, 256, 14, 14}, Case{5, 64, 128, 5, 7}, Case{2, 128, 192, 8, 8},
                  Case{8, 256, 64, 56, 56}, Case{4, 1024, 256, 14, 14}}) {
    CAPTURE(cs.n);
    CAPTURE(cs.o);
    CAPTURE(cs.i);
    CAPTURE(cs.h);
    manual_seed(211 + uint64_t(cs.o + 3 * cs.i + cs.h));
    const Tensor dy = nhwc(randn({cs.n, cs.o, cs.h, cs.w}));
    const Tensor x = nhwc(F::add(randn({cs.n, cs.i, cs.h, cs.w}), 0.5));
    const int64_t M = cs.n * cs.h * cs.w;
    // The f32 CPU product of the same f16 values: dw = dyᵀ · x over the M rows.
    const Tensor dym = f32(dy).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.o});
    const Tensor xm = f32(x).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.i});
    const Tensor cpu = F::matmul(dym.t(), xm).reshape({cs.o, cs.i, 1, 1});
    // Entries add M products of size ~1: ~sqrt(M) in size; f16 keeps 2^-11 of that.
    const double scale = std::sqrt(double(M));
    const Tensor mine = wgrad(dy, x, true, DType::f16);
    const Tensor ref = wgrad(dy, x, false, DType::f16);
    KILN_CHECK_OK(testing::compare(f32(mine), f32(ref), 2e-3 * scale, 2e-3));
    KILN_CHECK_OK(testing::compare(f32(mine), cpu, 2e-3 * scale, 2e-3));
    const Tensor mine32 = wgrad(dy, x, true, DType::f32);
    KILN_CHECK_OK(testing::compare(f32(mine32), cpu, 1e-4 * scale, 1e-4));
    // Added onto a gradient already there: base + dW, rounded once.
    const Tensor base = F::mul(randn({cs.o, cs.i, 1, 1}), scale).to(DType::f16).to(kGpu);
    const Tensor added = wgrad(dy, x, true, DType::f16, base);
    KILN_CHECK_OK(
        testing::compare(f32(added), F::add(f32(base), f32(mine32)), 2e-3 * scale, 2e-3));
    // A dw with other strides gets the same bits; a second run too.
    KILN_CHECK_OK(testing::compare(wgrad(dy, x, true, DType::f16, Tensor(), true).contiguous(),
                                   mine, 0, 0));
    KILN_CHECK_OK(testing::compare(wgrad(dy, x, true, DType::f16), mine, 0, 0));
  }
}

TEST_CASE("conv1x1_backward_weight_x_sum: the same dw, and x's column sums from the same pass") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("needs the wgmma kernel (an sm_90 GPU, a build for sm_90a); skipped");
    return;
  }
  struct Case {
    int64_t n, o, i, h, w;
  };
  // 64- and 128-column tiles, three 64-column tiles, rows that end inside a k-step, layer 1 at
  // batch 8 (66 parts per tile on an H100) and layer 2's conv3 shape.
  for (Case cs : {Case{3, 256, 64, 7, 7}, Case{2, 512, 128, 7, 7}, Case{2, 128, 192, 8, 8},
                  Case{5, 128, 64, 5, 7}, Case{8, 256, 64, 56, 56}, Case{4, 512, 128, 28, 28}}) {
    CAPTURE(cs.n);
    CAPTURE(cs.o);
    CAPTURE(cs.i);
    CAPTURE(cs.h);
    manual_seed(907 + uint64_t(cs.o + 5 * cs.i + cs.h));
    const Tensor dy = nhwc(randn({cs.n, cs.o, cs.h, cs.w}));
    // Non-negative, as a ReLU's output (the tail fold's x), and some exact zeros.
    const Tensor x = nhwc(F::relu(F::add(randn({cs.n, cs.i, cs.h, cs.w}), 0.3)));
    const TensorOptions f32opts = gputest::gpu_opts(DType::f32);
    Tensor dw = empty({cs.o, cs.i, 1, 1}, f32opts);
    REQUIRE(cuda::conv1x1_wgrad_x_sum_supported(dw, dy, x));
    Tensor sums = gputest::nan_output({cs.i}, DType::f32);
    cuda::conv1x1_backward_weight_x_sum(dw, sums, dy, x);
    Tensor plain = empty({cs.o, cs.i, 1, 1}, f32opts);
    cuda::conv1x1_backward_weight(plain, dy, x, ConvParams{}, false);
    // The MMAs and their parts are untouched: the same bits.
    KILN_CHECK_OK(testing::compare(f32(dw), f32(plain), 0, 0));
    // Σ over the rows in f64 on the host, against f32 sums of M values of size ~1.
    const int64_t M = cs.n * cs.h * cs.w;
    const Tensor xm = f32(x).to(DType::f64).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.i});
    const Tensor ref = F::sum(xm, {0});
    KILN_CHECK_OK(testing::compare(f32(sums).to(DType::f64), ref, 1e-5 * double(M), 1e-5));
    // A second run gives the same bits.
    Tensor again = gputest::nan_output({cs.i}, DType::f32);
    cuda::conv1x1_backward_weight_x_sum(dw, again, dy, x);
    KILN_CHECK_OK(testing::compare(f32(again), f32(sums), 0, 0));
  }
  // Where x is the kernel's first operand (O not a multiple of 128) the entry is refused, and with
  // the switch off.
  const Tensor dy64 = nhwc(randn({2, 64, 4, 4}));
  const Tensor x256 = nhwc(randn({2, 256, 4, 4}));
  CHECK_FALSE(cuda::conv1x1_wgrad_x_sum_supported(
      empty({64, 256, 1, 1}, gputest::gpu_opts(DType::f32)), dy64, x256));
  const Tensor dy = nhwc(randn({2, 256, 4, 4}));
  const Tensor x = nhwc(randn({2, 64, 4, 4}));
  const Tensor dw = empty({256, 64, 1, 1}, gputest::gpu_opts(DType::f32));
  const bool before = cuda::conv1x1_wgrad_x_sum_enabled();
  cuda::set_conv1x1_wgrad_x_sum_enabled(false);
  CHECK_FALSE(cuda::conv1x1_wgrad_x_sum_supported(dw, dy, x));
  cuda::set_conv1x1_wgrad_x_sum_enabled(before);
  CHECK(cuda::conv1x1_wgrad_x_sum_supported(dw, dy, x) == before);
}

TEST_CASE("conv1x1_backward_weight_x_sum with x's Gram from the same loads (KILN_WGRAD_X_GRAM)") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("needs the wgmma kernel (an sm_90 GPU, a build for sm_90a); skipped");
    return;
  }
  const bool before = cuda::conv1x1_wgrad_x_gram_enabled();
  cuda::set_conv1x1_wgrad_x_gram_enabled(true);
  struct Case {
    int64_t n, o, i, h, w;
  };
  // I 64 (one 64-column tile: warpgroup 0 alone multiplies for the Gram) and 128 (both), rows
  // that end inside a k-step, many parts a tile, and layers 1 and 2 of the tail fold.
  for (Case cs : {Case{3, 256, 64, 7, 7}, Case{2, 512, 128, 7, 7}, Case{5, 128, 64, 5, 7},
                  Case{8, 256, 64, 56, 56}, Case{4, 512, 128, 28, 28}}) {
    CAPTURE(cs.o);
    CAPTURE(cs.i);
    CAPTURE(cs.h);
    manual_seed(919 + uint64_t(cs.o + 5 * cs.i + cs.h));
    const Tensor dy = nhwc(randn({cs.n, cs.o, cs.h, cs.w}));
    const Tensor x = nhwc(F::relu(F::add(randn({cs.n, cs.i, cs.h, cs.w}), 0.3)));
    const TensorOptions f32opts = gputest::gpu_opts(DType::f32);
    Tensor dw = empty({cs.o, cs.i, 1, 1}, f32opts);
    REQUIRE(cuda::conv1x1_wgrad_x_gram_supported(dw, dy, x));
    Tensor sums = gputest::nan_output({cs.i}, DType::f32);
    Tensor gram = gputest::nan_output({cs.i, cs.i, 1, 1}, DType::f32);
    cuda::conv1x1_backward_weight_x_sum(dw, sums, dy, x, gram);
    // dw and the sums: the bits of the form without the Gram.
    Tensor dw0 = empty({cs.o, cs.i, 1, 1}, f32opts);
    Tensor sums0 = gputest::nan_output({cs.i}, DType::f32);
    cuda::conv1x1_backward_weight_x_sum(dw0, sums0, dy, x);
    KILN_CHECK_OK(testing::compare(f32(dw), f32(dw0), 0, 0));
    KILN_CHECK_OK(testing::compare(f32(sums), f32(sums0), 0, 0));
    // The Gram against f64 on the host: entries add M products of size ~1.
    const int64_t M = cs.n * cs.h * cs.w;
    const Tensor xm = f32(x).to(DType::f64).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.i});
    const Tensor ref = F::matmul(xm.t(), xm).reshape({cs.i, cs.i, 1, 1});
    KILN_CHECK_OK(testing::compare(f32(gram).to(DType::f64), ref, 1e-5 * double(M), 1e-5));
    // The same bits again.
    Tensor again = gputest::nan_output({cs.i, cs.i, 1, 1}, DType::f32);
    cuda::conv1x1_backward_weight_x_sum(dw, sums, dy, x, again);
    KILN_CHECK_OK(testing::compare(f32(again), f32(gram), 0, 0));
  }
  // I 192 (three tiles) is refused, and so is every shape with the switch off.
  const Tensor dy = nhwc(randn({2, 128, 8, 8}));
  const Tensor x192 = nhwc(randn({2, 192, 8, 8}));
  CHECK_FALSE(cuda::conv1x1_wgrad_x_gram_supported(
      empty({128, 192, 1, 1}, gputest::gpu_opts(DType::f32)), dy, x192));
  cuda::set_conv1x1_wgrad_x_gram_enabled(false);
  const Tensor x64 = nhwc(randn({2, 64, 8, 8}));
  CHECK_FALSE(cuda::conv1x1_wgrad_x_gram_supported(
      empty({128, 64, 1, 1}, gputest::gpu_opts(DType::f32)), dy, x64));
  cuda::set_conv1x1_wgrad_x_gram_enabled(before);
}

TEST_CASE("the 1x1 weight gradient through autograd matches cuDNN's") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("needs the wgmma kernel (an sm_90 GPU, a build for sm_90a); skipped");
    return;
  }
  manual_seed(223);
  const Tensor x0 = nhwc(randn({4, 128, 14, 14}));
  const Tensor w0 = F::mul(randn({256, 128, 1, 1}), 0.1).to(DType::f16).to(kGpu);
  const Tensor g = nhwc(randn({4, 256, 14, 14}));
  auto grads = [&](bool kiln) {
    const bool before = cuda::conv1x1_wgrad_enabled();
    cuda::set_conv1x1_wgrad_enabled(kiln);
    Tensor x = x0.detach(), w = w0.detach();
    x.set_requires_grad(true);
    w.set_requires_grad(true);
    F::conv2d(x, w, Tensor(), 1, 0).backward(g);
    cuda::set_conv1x1_wgrad_enabled(before);
    return std::pair{w.grad(), x.grad()};
  };
  const auto [w_kiln, x_kiln] = grads(true);
  const auto [w_ref, x_ref] = grads(false);
  const double scale = std::sqrt(4.0 * 14 * 14);
  KILN_CHECK_OK(testing::compare(f32(w_kiln), f32(w_ref), 2e-3 * scale, 2e-3));
  // The data gradient is cuDNN's either way.
  KILN_CHECK_OK(testing::compare(f32(x_kiln), f32(x_ref), 2e-3 * scale, 2e-3));
}

TEST_CASE("the 1x1 weight gradient refuses what its kernel does not take") {
  const Tensor dy = nhwc(randn({2, 256, 4, 4}));
  const Tensor x = nhwc(randn({2, 64, 4, 4}));
  const Tensor dw = empty({256, 64, 1, 1}, gputest::gpu_opts(DType::f16));
  CHECK(cuda::conv1x1_wgrad_supported(dw, dy, x, ConvParams{}) ==
        cuda::dgrad1x1_bn_wgmma_available());
  ConvParams strided;
  strided.stride_h = strided.stride_w = 2;
  CHECK_FALSE(cuda::conv1x1_wgrad_supported(dw, nhwc(randn({2, 256, 2, 2})), x, strided));
  // O 64 with I 64 (neither a multiple of 128), I 96 (not a multiple of 64), f32 and NCHW
  // operands, a 3x3 weight.
  const Tensor dy64 = nhwc(randn({2, 64, 4, 4}));
  CHECK_FALSE(cuda::conv1x1_wgrad_supported(empty({64, 64, 1, 1}, gputest::gpu_opts(DType::f16)),
                                            dy64, x, ConvParams{}));
  const Tensor x96 = nhwc(randn({2, 96, 4, 4}));
  CHECK_FALSE(cuda::conv1x1_wgrad_supported(empty({256, 96, 1, 1}, gputest::gpu_opts(DType::f16)),
                                            dy, x96, ConvParams{}));
  CHECK_FALSE(cuda::conv1x1_wgrad_supported(dw, dy, x.to(DType::f32), ConvParams{}));
  CHECK_FALSE(cuda::conv1x1_wgrad_supported(dw, dy, x.contiguous(), ConvParams{}));
  CHECK_FALSE(cuda::conv1x1_wgrad_supported(empty({256, 64, 3, 3}, gputest::gpu_opts(DType::f16)),
                                            dy, x, ConvParams{}));
  // Called on a shape it does not take, it says which.
  CHECK_THROWS_WITH_AS(cuda::conv1x1_backward_weight(dw, dy, x.contiguous(), ConvParams{}, false),
                       doctest::Contains("O a multiple of 128"), Error);
}

// ---- the batch norm + ReLU prologue (conv1x1_bn_relu_forward_stats and
// conv1x1_bn_relu_backward_weight) against the apply pass followed by the plain kernels ----

TEST_CASE("the bn + ReLU prologue gives the apply pass's bits, forward and weight gradient") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("the prologue runs on the wgmma kernels (an sm_90 GPU, a build for sm_90a); skipped");
    return;
  }
  struct Case {
    int64_t n, k, c, h, w;  // y (n, k, h, w) through bn + ReLU into a 1x1 convolution k → c
  };
  // ResNet-50's conv3 shapes (64 → 256: the weight gradient's x in 64-column tiles; 128 → 512;
  // 256 → 1,024 with several k-steps per tile), rows that end inside a tile (2·7·7), layer 1 at
  // batch 4 (12,544 rows), and a 64-channel output (the weight gradient's operands swapped: the
  // prologue on its A side; the forward does not take C 64).
  // With KILN_CONV_PROLOGUE on, the weight gradient's register-A form (kPro 3) and every weight
  // gradient of its shapes in its orientation; off, the shared-memory forms and dy as A.
  const bool before = cuda::conv1x1_bn_relu_enabled();
  for (bool prologue : {true, false})
  for (Case cs : {Case{2, 64, 256, 7, 7}, Case{2, 128, 512, 14, 14}, Case{2, 256, 1024, 14, 14},
                  Case{4, 64, 256, 56, 56}, Case{2, 256, 64, 14, 14}, Case{3, 128, 128, 5, 7}}) {
    cuda::set_conv1x1_bn_relu_enabled(prologue);
    CAPTURE(prologue);
    CAPTURE(cs.n);
    CAPTURE(cs.k);
    CAPTURE(cs.c);
    CAPTURE(cs.h);
    manual_seed(307 + uint64_t(cs.k + cs.c + cs.h));
    const Tensor y = nhwc(F::add(randn({cs.n, cs.k, cs.h, cs.w}), 0.3));
    BnStatsFinalize f = gputest::bn_finalize_of(y);
    const Tensor a = empty_like(y);  // relu(bn(y)) as the apply pass writes it
    cuda::bn_nhwc_apply(a, y, Tensor(), f, Activation::Relu);
    const Tensor w =
        F::mul(randn({cs.c, cs.k, 1, 1}), 1.0 / std::sqrt(double(cs.k))).to(DType::f16).to(kGpu);
    const TensorOptions f32o = TensorOptions().with_device(kGpu);
    const Tensor out_like = nhwc(zeros({cs.n, cs.c, cs.h, cs.w}));
    if (cuda::conv1x1_stats_supported(out_like, a, w, ConvParams{}) && cs.k % 128 == 0) {
      Tensor y1 = empty_like(out_like), s1 = empty({cs.c}, f32o), q1 = empty({cs.c}, f32o);
      Tensor y2 = empty_like(out_like), s2 = empty({cs.c}, f32o), q2 = empty({cs.c}, f32o);
      cuda::conv1x1_forward_stats(y1, s1, q1, a, w, ConvParams{});
      cuda::conv1x1_bn_relu_forward_stats(y2, s2, q2, y, f.scale_shift, w, ConvParams{});
      KILN_CHECK_OK(testing::compare(y2, y1, 0, 0));
      KILN_CHECK_OK(testing::compare(s2, s1, 0, 0));
      KILN_CHECK_OK(testing::compare(q2, q1, 0, 0));
    } else {
      CHECK((cs.c % 128 != 0 || cs.k % 128 != 0));
    }
    const Tensor dy = nhwc(randn({cs.n, cs.c, cs.h, cs.w}));
    const Tensor dw = gputest::nan_output({cs.c, cs.k, 1, 1}, DType::f16);
    REQUIRE(cuda::conv1x1_wgrad_supported(dw, dy, a, ConvParams{}));
    const Tensor dw1 = gputest::nan_output({cs.c, cs.k, 1, 1}, DType::f16);
    const Tensor dw2 = gputest::nan_output({cs.c, cs.k, 1, 1}, DType::f16);
    cuda::conv1x1_backward_weight(dw1, dy, a, ConvParams{}, false);
    cuda::conv1x1_bn_relu_backward_weight(dw2, dy, y, f.scale_shift, ConvParams{}, false);
    KILN_CHECK_OK(testing::compare(dw2, dw1, 0, 0));
    // And the values are dyᵀ · relu(bn(y)) (the CPU's product of the applied tensor).
    const int64_t M = cs.n * cs.h * cs.w;
    const Tensor dym = f32(dy).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.c});
    const Tensor am = f32(a).permute({0, 2, 3, 1}).contiguous().reshape({M, cs.k});
    KILN_CHECK_OK(testing::compare(f32(dw2), F::matmul(dym.t(), am).reshape({cs.c, cs.k, 1, 1}),
                                   2e-3 * std::sqrt(double(M)), 2e-3));
  }
  cuda::set_conv1x1_bn_relu_enabled(before);
}

TEST_CASE("KILN_PROLOGUE_F16: the f16-factor prologue stays close to the composition") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("the prologue runs on the wgmma kernels (an sm_90 GPU, a build for sm_90a); skipped");
    return;
  }
  const bool before = cuda::conv1x1_bn_relu_enabled(), before16 = cuda::prologue_f16_enabled();
  cuda::set_conv1x1_bn_relu_enabled(true);  // the register forms, which the f16 form changes
  cuda::set_prologue_f16_enabled(true);
  // Layer 2's and layer 3's conv3 at small batches.
  for (int64_t k : {128, 256}) {
    CAPTURE(k);
    const int64_t n = 2, c = 4 * k, hw = 14;
    manual_seed(331 + uint64_t(k));
    const Tensor y = nhwc(F::add(randn({n, k, hw, hw}), 0.3));
    BnStatsFinalize f = gputest::bn_finalize_of(y);
    const Tensor a = empty_like(y);
    cuda::bn_nhwc_apply(a, y, Tensor(), f, Activation::Relu);
    const Tensor w =
        F::mul(randn({c, k, 1, 1}), 1.0 / std::sqrt(double(k))).to(DType::f16).to(kGpu);
    const TensorOptions f32o = TensorOptions().with_device(kGpu);
    const Tensor like = nhwc(zeros({n, c, hw, hw}));
    Tensor y1 = empty_like(like), s1 = empty({c}, f32o), q1 = empty({c}, f32o);
    Tensor y2 = empty_like(like), s2 = empty({c}, f32o), q2 = empty({c}, f32o);
    cuda::conv1x1_forward_stats(y1, s1, q1, a, w, ConvParams{});
    cuda::conv1x1_bn_relu_forward_stats(y2, s2, q2, y, f.scale_shift, w, ConvParams{});
    // The factors' f16 rounding (relative 2^-11 of scale and shift) and one more rounding of
    // each operand value: a few f16 units of the output.
    KILN_CHECK_OK(testing::compare(f32(y2), f32(y1), 1e-2, 1e-2));
    const double rows = double(n * hw * hw);
    KILN_CHECK_OK(testing::compare(f32(s2), f32(s1), 1e-2 * std::sqrt(rows), 1e-2));
    KILN_CHECK_OK(testing::compare(f32(q2), f32(q1), 1e-2 * std::sqrt(rows), 1e-2));
    const Tensor dy = nhwc(randn({n, c, hw, hw}));
    const Tensor dw1 = gputest::nan_output({c, k, 1, 1}, DType::f32);
    const Tensor dw2 = gputest::nan_output({c, k, 1, 1}, DType::f32);
    cuda::conv1x1_backward_weight(dw1, dy, a, ConvParams{}, false);
    cuda::conv1x1_bn_relu_backward_weight(dw2, dy, y, f.scale_shift, ConvParams{}, false);
    KILN_CHECK_OK(testing::compare(f32(dw2), f32(dw1), 1e-2 * std::sqrt(rows), 1e-2));
  }
  cuda::set_prologue_f16_enabled(before16);
  cuda::set_conv1x1_bn_relu_enabled(before);
}

TEST_CASE("the prologue's entry points refuse a scale_shift of the wrong size") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("needs the wgmma kernels (an sm_90 GPU, a build for sm_90a); skipped");
    return;
  }
  const Tensor y = nhwc(randn({2, 64, 4, 4}));
  const Tensor w = randn({256, 64, 1, 1}).to(DType::f16).to(kGpu);
  const Tensor out = nhwc(zeros({2, 256, 4, 4}));
  const TensorOptions f32o = TensorOptions().with_device(kGpu);
  const Tensor bad = empty({64}, f32o);  // scale only: 2·64 are needed
  Tensor s = empty({256}, f32o), q = empty({256}, f32o);
  CHECK_THROWS_WITH_AS(
      cuda::conv1x1_bn_relu_forward_stats(out, s, q, y, bad, w, ConvParams{}),
      doctest::Contains("scale_shift must be a contiguous f32 (2·K = 128)"), Error);
  const Tensor dw = empty({256, 64, 1, 1}, gputest::gpu_opts(DType::f16));
  CHECK_THROWS_WITH_AS(
      cuda::conv1x1_bn_relu_backward_weight(dw, nhwc(randn({2, 256, 4, 4})), y, bad, ConvParams{},
                                            false),
      doctest::Contains("scale_shift must be a contiguous f32 (2·I = 128)"), Error);
}

// ---- F::batch_norm_relu_conv1x1 (a bottleneck's bn2 → ReLU → conv3) against its composition ----

namespace {

struct Bn2Conv3 {
  Tensor y3, sum3, sqsum3, running_mean, running_var, dy2, dweight, dbias, dw3;
  std::string node;
};

// Two training steps' forward and backward of conv3(relu(bn2(y2))) with the fused op on or off;
// the second backward adds into the .grad the first left (the engine's accumulate-into).
Bn2Conv3 bn2_conv3(const Tensor& y2_in, const Tensor& w3_in, const Tensor& g, bool fused) {
  const bool before = cuda::conv1x1_bn_relu_enabled();
  cuda::set_conv1x1_bn_relu_enabled(fused);
  const int64_t C = y2_in.size(1);
  const TensorOptions f32o = TensorOptions().with_device(kGpu);
  Tensor y2 = y2_in.detach(), w3 = w3_in.detach();
  y2.set_requires_grad(true);
  w3.set_requires_grad(true);
  manual_seed(331);
  F::BatchNormParams p;
  p.weight = uniform({C}, 0.5, 1.5).to(kGpu);
  p.bias = uniform({C}, -0.5, 0.5).to(kGpu);
  p.weight.set_requires_grad(true);
  p.bias.set_requires_grad(true);
  p.running_mean = zeros({C}, f32o);
  p.running_var = ones({C}, f32o);
  Bn2Conv3 out;
  for (int step = 0; step < 2; ++step) {
    F::ChannelStats s2{empty({C}, f32o), empty({C}, f32o), y2.version()};
    cuda::bn_nhwc_stats(s2.sum, s2.sqsum, y2.detach());
    F::ChannelStats s3;
    out.y3 = F::batch_norm_relu_conv1x1(y2, s2, p, /*training=*/true, w3, &s3);
    out.node = out.y3.grad_fn() ? out.y3.grad_fn()->name() : "";
    REQUIRE(s3.defined());
    out.sum3 = s3.sum.clone();
    out.sqsum3 = s3.sqsum.clone();
    out.y3.backward(g);
  }
  out.running_mean = p.running_mean;
  out.running_var = p.running_var;
  out.dy2 = y2.grad();
  out.dweight = p.weight.grad();
  out.dbias = p.bias.grad();
  out.dw3 = w3.grad();
  cuda::set_conv1x1_bn_relu_enabled(before);
  return out;
}

}  // namespace

TEST_CASE("F::batch_norm_relu_conv1x1 gives its composition's bits: forward, statistics, "
          "running statistics, every gradient") {
  if (!cuda::dgrad1x1_bn_wgmma_available()) {
    MESSAGE("the fused path runs on the wgmma kernels (an sm_90 GPU, a build for sm_90a); "
            "skipped");
    return;
  }
  // C 64 (layer 1): the register-A forward takes K a multiple of 128, so the op declines and
  // runs its composition. C 128 and 256: the fused path, its data gradient the inner-form GEMM
  // with bn2's sums.
  for (int64_t C : {64, 128, 256}) {
    CAPTURE(C);
    manual_seed(337 + uint64_t(C));
    const int64_t hw = C == 64 ? 28 : 14;
    const Tensor y2 = nhwc(F::add(randn({4, C, hw, hw}), 0.2));
    const Tensor w3 =
        F::mul(randn({4 * C, C, 1, 1}), 1.0 / std::sqrt(double(C))).to(DType::f16).to(kGpu);
    const Tensor g = nhwc(randn({4, 4 * C, hw, hw}));
    const Bn2Conv3 on = bn2_conv3(y2, w3, g, true), off = bn2_conv3(y2, w3, g, false);
    CHECK(on.node == (C % 128 == 0 ? "BatchNormReluConv1x1Backward" : "Conv2dBackward"));
    CHECK(off.node == "Conv2dBackward");
    KILN_CHECK_OK(testing::compare(on.y3, off.y3, 0, 0));
    KILN_CHECK_OK(testing::compare(on.sum3, off.sum3, 0, 0));
    KILN_CHECK_OK(testing::compare(on.sqsum3, off.sqsum3, 0, 0));
    KILN_CHECK_OK(testing::compare(on.running_mean, off.running_mean, 0, 0));
    KILN_CHECK_OK(testing::compare(on.running_var, off.running_var, 0, 0));
    KILN_CHECK_OK(testing::compare(on.dy2, off.dy2, 0, 0));
    KILN_CHECK_OK(testing::compare(on.dweight, off.dweight, 0, 0));
    KILN_CHECK_OK(testing::compare(on.dbias, off.dbias, 0, 0));
    KILN_CHECK_OK(testing::compare(on.dw3, off.dw3, 0, 0));
  }
}
