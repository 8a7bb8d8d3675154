// cuDNN convolution (cuda/conv.cpp) against the CPU backend in f64: every distinct conv shape of
// ResNet-50 at batch 2 and small spatial sizes, f32 and f16, NCHW and NHWC, forward,
// backward-data and backward-weight; groups, dilation, bias, mixed layouts; the algorithm cache;
// accumulating backward (beta = 1) directly and through autograd.
// Outputs are pre-filled with NaN so an unwritten element fails.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/autograd.h"
#include "core/generator.h"
#include "cuda/conv.h"
#include "cuda/kernels.h"
#include "ops/ops.h"
#include "tests/gpu/ref_check.h"

using namespace kiln;
using namespace kiln::ref_check;

namespace {

struct ConvCase {
  const char* name;
  int64_t c_in, c_out, k, stride, pad, hw;  // square kernel, square input hw x hw
  int64_t dil = 1, groups = 1;
};

// The distinct convolutions of ResNet-50 (v1.5: stride on the 3x3), spatial sizes shrunk.
const std::vector<ConvCase> kResNet50 = {
    {"stem 7x7/2 3->64", 3, 64, 7, 2, 3, 32},
    {"l1 1x1 64->64", 64, 64, 1, 1, 0, 8},
    {"l1 3x3 64->64", 64, 64, 3, 1, 1, 8},
    {"l1 1x1 64->256", 64, 256, 1, 1, 0, 8},
    {"l1 1x1 256->64", 256, 64, 1, 1, 0, 8},
    {"l1 downsample 1x1 64->256", 64, 256, 1, 1, 0, 8},
    {"l2 1x1 256->128", 256, 128, 1, 1, 0, 8},
    {"l2 3x3/2 128->128", 128, 128, 3, 2, 1, 8},
    {"l2 3x3 128->128", 128, 128, 3, 1, 1, 4},
    {"l2 1x1 128->512", 128, 512, 1, 1, 0, 4},
    {"l2 1x1 512->128", 512, 128, 1, 1, 0, 4},
    {"l2 downsample 1x1/2 256->512", 256, 512, 1, 2, 0, 8},
    {"l3 1x1 512->256", 512, 256, 1, 1, 0, 4},
    {"l3 3x3/2 256->256", 256, 256, 3, 2, 1, 4},
    {"l3 3x3 256->256", 256, 256, 3, 1, 1, 4},
    {"l3 1x1 256->1024", 256, 1024, 1, 1, 0, 2},
    {"l3 1x1 1024->256", 1024, 256, 1, 1, 0, 2},
    {"l3 downsample 1x1/2 512->1024", 512, 1024, 1, 2, 0, 4},
    {"l4 1x1 1024->512", 1024, 512, 1, 1, 0, 2},
    {"l4 3x3/2 512->512", 512, 512, 3, 2, 1, 4},
    {"l4 3x3 512->512", 512, 512, 3, 1, 1, 2},
    {"l4 1x1 512->2048", 512, 2048, 1, 1, 0, 2},
    {"l4 1x1 2048->512", 2048, 512, 1, 1, 0, 2},
    {"l4 downsample 1x1/2 1024->2048", 1024, 2048, 1, 2, 0, 4},
};

ConvParams params_of(const ConvCase& c) {
  ConvParams p;
  p.stride_h = p.stride_w = c.stride;
  p.pad_h = p.pad_w = c.pad;
  p.dil_h = p.dil_w = c.dil;
  p.groups = c.groups;
  return p;
}
int64_t out_size(const ConvCase& c) {
  return (c.hw + 2 * c.pad - c.dil * (c.k - 1) - 1) / c.stride + 1;
}

struct Reference {
  Tensor x, w, dy;      // f64 CPU inputs (already rounded to the GPU dtype)
  Tensor y, dx, dw;     // f64 CPU results
};

// CPU f64 forward and (through autograd) both gradients.
Reference reference(const Tensor& x, const Tensor& w, const Tensor& dy, const ConvCase& c) {
  Reference r{x, w, dy, {}, {}, {}};
  Tensor xl = x.detach(), wl = w.detach();
  xl.set_requires_grad(true);
  wl.set_requires_grad(true);
  Tensor y = F::conv2d(xl, wl, Tensor(), c.stride, c.pad, c.dil, c.groups);
  y.backward(dy);
  r.y = y.detach();
  r.dx = xl.grad();
  r.dw = wl.grad();
  return r;
}

// Runs the three CUDA ops in (dtype, fmt) and compares them with the reference. The weight is
// given in `w_fmt` (NCHW-contiguous weights with NHWC activations is the common case).
void check_gpu(const Reference& r, const ConvCase& c, DType dtype, MemoryFormat fmt,
               MemoryFormat w_fmt) {
  CAPTURE(dtype_name(dtype));
  CAPTURE(fmt == MemoryFormat::ChannelsLast ? "NHWC" : "NCHW");
  const double tol = tol_for(dtype);
  ConvParams p = params_of(c);
  Tensor x = to_gpu(r.x, dtype, fmt), w = to_gpu(r.w, dtype, w_fmt), dy = to_gpu(r.dy, dtype, fmt);

  Tensor y = nan_gpu(r.y.shape(), dtype, fmt);
  cuda::conv2d_forward(y, x, w, Tensor(), p);
  KILN_CHECK_OK(compare_scaled(y, r.y, tol));

  Tensor dx = nan_gpu(r.x.shape(), dtype, fmt);
  cuda::conv2d_backward_data(dx, dy, w, p);
  KILN_CHECK_OK(compare_scaled(dx, r.dx, tol));

  Tensor dw = nan_gpu(r.w.shape(), dtype, w_fmt);
  cuda::conv2d_backward_weight(dw, dy, x, p);
  KILN_CHECK_OK(compare_scaled(dw, r.dw, tol));
}

// Random inputs for case c (weights scaled by 1/sqrt(fan-in) so outputs are O(1)).
void run_case(const ConvCase& c, Generator& gen) {
  CAPTURE(c.name);
  const int64_t n = 2, ho = out_size(c);
  const double ws = 1.0 / std::sqrt(double(c.c_in / c.groups * c.k * c.k));
  Tensor x = randn({n, c.c_in, c.hw, c.hw}, DType::f64, &gen);
  Tensor w = randn({c.c_out, c.c_in / c.groups, c.k, c.k}, DType::f64, &gen) * ws;
  Tensor dy = randn({n, c.c_out, ho, ho}, DType::f64, &gen);
  for (DType dtype : {DType::f32, DType::f16}) {
    Reference r = reference(rounded(x, dtype), rounded(w, dtype), rounded(dy, dtype), c);
    check_gpu(r, c, dtype, MemoryFormat::Contiguous, MemoryFormat::Contiguous);
    check_gpu(r, c, dtype, MemoryFormat::ChannelsLast, MemoryFormat::Contiguous);
    check_gpu(r, c, dtype, MemoryFormat::ChannelsLast, MemoryFormat::ChannelsLast);
  }
}

}  // namespace

TEST_CASE("conv2d: every ResNet-50 convolution, f32/f16, NCHW/NHWC, fwd + both backwards") {
  Generator gen(7);
  for (const ConvCase& c : kResNet50) run_case(c, gen);
}

TEST_CASE("conv2d: groups, depthwise, dilation, odd sizes, 1- and 2-channel stems") {
  Generator gen(8);
  const std::vector<ConvCase> cases = {
      // f16 inputs with 1-3 channels run padded to 4 NHWC channels (Fashion-MNIST's stem)
      {"grayscale stem 3x3 1->64", 1, 64, 3, 1, 1, 28},
      {"2-channel 3x3/2 2->16", 2, 16, 3, 2, 1, 9},
      {"grouped 3x3 8->16 g4", 8, 16, 3, 1, 1, 7, 1, 4},
      {"depthwise 3x3/2 16 g16", 16, 16, 3, 2, 1, 9, 1, 16},
      {"dilated 3x3 d2 8->8", 8, 8, 3, 1, 2, 9, 2, 1},
      {"5x5/3 pad 1, 5->6", 5, 6, 5, 3, 1, 11, 1, 1},
  };
  for (const ConvCase& c : cases) run_case(c, gen);
}

TEST_CASE("conv2d: bias, mismatched output layout, f16 stem padding") {
  Generator gen(9);
  for (DType dtype : {DType::f32, DType::f16}) {
    CAPTURE(dtype_name(dtype));
    // 3 input channels: the f16 run goes through the padded-to-4 NHWC path.
    Tensor x = rounded(randn({2, 3, 12, 12}, DType::f64, &gen), dtype);
    Tensor w = rounded(randn({8, 3, 3, 3}, DType::f64, &gen) * 0.2, dtype);
    Tensor b = rounded(randn({8}, DType::f64, &gen), dtype);
    Tensor ref = F::conv2d(x, w, b, 2, 1);
    ConvParams p;
    p.stride_h = p.stride_w = 2;
    p.pad_h = p.pad_w = 1;
    // x NCHW, y requested NHWC: computed in x's layout and copied over.
    Tensor y = nan_gpu(ref.shape(), dtype, MemoryFormat::ChannelsLast);
    cuda::conv2d_forward(y, to_gpu(x, dtype), to_gpu(w, dtype), to_gpu(b, dtype), p);
    KILN_CHECK_OK(compare_scaled(y, ref, tol_for(dtype)));
    // and the other way round
    Tensor y2 = nan_gpu(ref.shape(), dtype);
    cuda::conv2d_forward(y2, to_gpu(x, dtype, MemoryFormat::ChannelsLast), to_gpu(w, dtype),
                         to_gpu(b, dtype), p);
    KILN_CHECK_OK(compare_scaled(y2, ref, tol_for(dtype)));
  }
}

TEST_CASE("conv2d: algorithm cache hits and misses") {
  cuda::clear_conv_algo_cache();
  auto stats = cuda::conv_algo_cache_stats();
  CHECK(stats.hits == 0);
  CHECK(stats.misses == 0);
  CHECK(stats.entries == 0);
  Generator gen(10);
  Tensor xh = randn({2, 16, 8, 8}, DType::f64, &gen), wh = randn({16, 16, 3, 3}, DType::f64, &gen);
  Tensor x = to_gpu(xh, DType::f32), w = to_gpu(wh, DType::f32);
  ConvParams p;
  p.pad_h = p.pad_w = 1;
  Tensor y = nan_gpu({2, 16, 8, 8}, DType::f32);
  cuda::conv2d_forward(y, x, w, Tensor(), p);
  stats = cuda::conv_algo_cache_stats();
  CHECK(stats.misses == 1);
  CHECK(stats.hits == 0);
  cuda::conv2d_forward(y, x, w, Tensor(), p);
  cuda::conv2d_forward(y, x, w, Tensor(), p);
  stats = cuda::conv_algo_cache_stats();
  CHECK(stats.misses == 1);
  CHECK(stats.hits == 2);
  CHECK(stats.entries == 1);
  // Every part of the problem is in the key: layout, padding, op, dtype.
  Tensor yl = nan_gpu({2, 16, 8, 8}, DType::f32, MemoryFormat::ChannelsLast);
  cuda::conv2d_forward(yl, to_gpu(xh, DType::f32, MemoryFormat::ChannelsLast), w, Tensor(), p);
  ConvParams p0;  // no padding: 6x6 output
  Tensor y0 = nan_gpu({2, 16, 6, 6}, DType::f32);
  cuda::conv2d_forward(y0, x, w, Tensor(), p0);
  Tensor dx = nan_gpu({2, 16, 8, 8}, DType::f32);
  cuda::conv2d_backward_data(dx, y, w, p);
  Tensor yh = nan_gpu({2, 16, 8, 8}, DType::f16);
  cuda::conv2d_forward(yh, to_gpu(xh, DType::f16), to_gpu(wh, DType::f16), Tensor(), p);
  stats = cuda::conv_algo_cache_stats();
  CHECK(stats.misses == 5);
  CHECK(stats.hits == 2);
  CHECK(stats.entries == 5);
  // The cached choice still computes the right thing.
  KILN_CHECK_OK(compare_scaled(y, F::conv2d(rounded(xh, DType::f32), rounded(wh, DType::f32),
                                            Tensor(), 1, 1),
                               1e-4));
}

TEST_CASE("conv2d: deterministic mode gives bit-identical backward-weight") {
  cuda::set_conv_deterministic(true);
  Generator gen(11);
  Tensor x = to_gpu(randn({4, 32, 14, 14}, DType::f64, &gen), DType::f16, MemoryFormat::ChannelsLast);
  Tensor dy = to_gpu(randn({4, 32, 14, 14}, DType::f64, &gen), DType::f16, MemoryFormat::ChannelsLast);
  ConvParams p;
  p.pad_h = p.pad_w = 1;
  Tensor a = nan_gpu({32, 32, 3, 3}, DType::f16), b = nan_gpu({32, 32, 3, 3}, DType::f16);
  cuda::conv2d_backward_weight(a, dy, x, p);
  cuda::conv2d_backward_weight(b, dy, x, p);
  cuda::set_conv_deterministic(false);
  CHECK(a.to_vector<float>() == b.to_vector<float>());
}

// Deterministic mode chooses without timing (cuda/conv.h). With the algorithm cache cleared
// between rounds every problem is searched and tuned again, as in another process, where a timed
// choice between close candidates can come out the other way; deterministic mode must give the
// same bits every round: forward, data gradient, weight gradient (=) and (+=, which the tuner
// would otherwise time against beta = 0 plus an add), on ResNet-50's convolutions at batch 8.
TEST_CASE("conv2d: deterministic mode chooses the same algorithms when searched again") {
  cuda::set_conv_deterministic(true);
  const bool wgrad1x1 = cuda::conv1x1_wgrad_enabled();  // cuDNN's 1x1 weight gradients too
  cuda::set_conv1x1_wgrad_enabled(false);
  const MemoryFormat fmt = MemoryFormat::ChannelsLast;
  std::vector<std::vector<float>> first;
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    cuda::clear_conv_algo_cache();
    Generator gen(15);  // the same operands every round
    size_t k = 0;
    for (const ConvCase& c : kResNet50) {
      CAPTURE(c.name);
      const int64_t ho = out_size(c);
      const ConvParams p = params_of(c);
      Tensor x = to_gpu(randn({8, c.c_in, c.hw, c.hw}, DType::f64, &gen), DType::f16, fmt);
      Tensor w = to_gpu(randn({c.c_out, c.c_in, c.k, c.k}, DType::f64, &gen) *
                            (1.0 / std::sqrt(double(c.c_in * c.k * c.k))),
                        DType::f16, fmt);
      Tensor dy = to_gpu(randn({8, c.c_out, ho, ho}, DType::f64, &gen), DType::f16, fmt);
      Tensor y = nan_gpu(dy.shape(), DType::f16, fmt), dx = nan_gpu(x.shape(), DType::f16, fmt);
      Tensor dw = nan_gpu(w.shape(), DType::f16, fmt);
      Tensor dw_acc = to_gpu(randn(w.shape(), DType::f64, &gen), DType::f16, fmt);
      cuda::conv2d_forward(y, x, w, Tensor(), p);
      cuda::conv2d_backward_data(dx, dy, w, p);
      cuda::conv2d_backward_weight(dw, dy, x, p);
      cuda::conv2d_backward_weight(dw_acc, dy, x, p, /*accumulate=*/true);
      for (const Tensor* t : {&y, &dx, &dw, &dw_acc}) {
        std::vector<float> v = t->to_vector<float>();
        CHECK(std::all_of(v.begin(), v.end(), [](float f) { return std::isfinite(f); }));
        if (round == 0) {
          first.push_back(std::move(v));
        } else {
          REQUIRE(k < first.size());
          CHECK(v == first[k]);
        }
        ++k;
      }
    }
  }
  cuda::set_conv_deterministic(false);
  cuda::set_conv1x1_wgrad_enabled(wgrad1x1);
  cuda::clear_conv_algo_cache();
}

TEST_CASE("conv2d: a cached plan reused with other buffers computes on the new data") {
  // The second call of each op hits the cached plan (descriptors built for the first call's
  // problem) with different pointers; both results must match their own reference.
  Generator gen(12);
  for (const ConvCase& c : {ConvCase{"1x1 64->64", 64, 64, 1, 1, 0, 6},
                            ConvCase{"3x3/2 16->32", 16, 32, 3, 2, 1, 9}}) {
    CAPTURE(c.name);
    for (DType dtype : {DType::f32, DType::f16}) {
      CAPTURE(dtype_name(dtype));
      const int64_t ho = out_size(c);
      const double ws = 1.0 / std::sqrt(double(c.c_in * c.k * c.k));
      const ConvParams p = params_of(c);
      const MemoryFormat fmt = MemoryFormat::ChannelsLast;
      std::vector<Tensor> ys, dxs, dws;
      std::vector<Reference> refs;
      const auto before = cuda::conv_algo_cache_stats();
      for (int call = 0; call < 2; ++call) {
        Tensor x = randn({2, c.c_in, c.hw, c.hw}, DType::f64, &gen);
        Tensor w = randn({c.c_out, c.c_in, c.k, c.k}, DType::f64, &gen) * ws;
        Tensor dy = randn({2, c.c_out, ho, ho}, DType::f64, &gen);
        refs.push_back(reference(rounded(x, dtype), rounded(w, dtype), rounded(dy, dtype), c));
        const Reference& r = refs.back();
        Tensor xg = to_gpu(r.x, dtype, fmt), wg = to_gpu(r.w, dtype, fmt);
        Tensor dyg = to_gpu(r.dy, dtype, fmt);
        ys.push_back(nan_gpu(r.y.shape(), dtype, fmt));
        dxs.push_back(nan_gpu(r.x.shape(), dtype, fmt));
        dws.push_back(nan_gpu(r.w.shape(), dtype, fmt));
        cuda::conv2d_forward(ys.back(), xg, wg, Tensor(), p);
        cuda::conv2d_backward_data(dxs.back(), dyg, wg, p);
        cuda::conv2d_backward_weight(dws.back(), dyg, xg, p);
      }
      const auto after = cuda::conv_algo_cache_stats();
      CHECK(after.hits >= before.hits + 3);  // the second call of each op
      for (int call = 0; call < 2; ++call) {
        CAPTURE(call);
        KILN_CHECK_OK(compare_scaled(ys[size_t(call)], refs[size_t(call)].y, tol_for(dtype)));
        KILN_CHECK_OK(compare_scaled(dxs[size_t(call)], refs[size_t(call)].dx, tol_for(dtype)));
        KILN_CHECK_OK(compare_scaled(dws[size_t(call)], refs[size_t(call)].dw, tol_for(dtype)));
      }
    }
  }
}

TEST_CASE("conv2d: backend-API plans (forced) on every ResNet-50 convolution, f16/bf16 NHWC") {
  // Force: every problem the backend API can run uses its fastest plan, so this checks those
  // plans themselves (Auto keeps a legacy algorithm where that is faster).
  cuda::clear_conv_algo_cache();
  cuda::set_conv_backend(cuda::ConvBackend::Force);
  // cuDNN for the stem too (kiln's own stem kernels take its f16 weight gradient by default).
  const int stem_mode = cuda::stem_conv_mode();
  cuda::set_stem_conv_mode(0);
  const bool wgrad1x1 = cuda::conv1x1_wgrad_enabled();  // the 1x1 weight gradients on cuDNN too
  cuda::set_conv1x1_wgrad_enabled(false);
  Generator gen(13);
  for (const ConvCase& c : kResNet50) {
    CAPTURE(c.name);
    const int64_t ho = out_size(c);
    const double ws = 1.0 / std::sqrt(double(c.c_in * c.k * c.k));
    Tensor x = randn({2, c.c_in, c.hw, c.hw}, DType::f64, &gen);
    Tensor w = randn({c.c_out, c.c_in, c.k, c.k}, DType::f64, &gen) * ws;
    Tensor dy = randn({2, c.c_out, ho, ho}, DType::f64, &gen);
    for (DType dtype : {DType::f16, DType::bf16}) {
      Reference r = reference(rounded(x, dtype), rounded(w, dtype), rounded(dy, dtype), c);
      check_gpu(r, c, dtype, MemoryFormat::ChannelsLast, MemoryFormat::ChannelsLast);
      check_gpu(r, c, dtype, MemoryFormat::ChannelsLast, MemoryFormat::Contiguous);
    }
  }
  const auto st = cuda::conv_algo_cache_stats();
  cuda::set_conv_backend(cuda::ConvBackend::Auto);
  cuda::set_stem_conv_mode(stem_mode);
  cuda::set_conv1x1_wgrad_enabled(wgrad1x1);
  MESSAGE("backend-API plans: ", st.engine_plans, " of ", st.entries, " problems");
  // 23 distinct shapes (two of the 24 cases coincide) x 2 dtypes x 3 directions; a problem no
  // engine runs falls back to the legacy API, which is allowed, but most must have a plan or
  // this test checks little.
  CHECK(st.entries == 23 * 2 * 3);
  CHECK(st.engine_plans * 10 >= st.entries * 9);
  cuda::clear_conv_algo_cache();
}

TEST_CASE("conv2d: the plan file keeps the tuner's choices, and a later search takes them") {
  namespace fs = std::filesystem;
  const std::string path =
      (fs::temp_directory_path() / ("kiln_conv_plans_" + std::to_string(::getpid()) + ".txt"))
          .string();
  fs::remove(path);
  const std::string before = cuda::conv_plan_file();
  cuda::set_conv_plan_file(path);
  auto lines = [&] {
    std::vector<std::string> out;
    std::ifstream in(path);
    for (std::string l; std::getline(in, l);) out.push_back(l);
    return out;
  };
  // Five of ResNet-50's problems, every direction, f16 NHWC and f32 NCHW (the backend API and the
  // legacy API), and a weight gradient added into an existing one (its beta = 0 + add choice).
  const std::vector<ConvCase> cases = {kResNet50[2], kResNet50[7], kResNet50[12], kResNet50[14],
                                       kResNet50[19]};
  auto run_all = [&](uint64_t seed) {
    Generator gen(seed);
    for (const ConvCase& c : cases) {
      CAPTURE(c.name);
      const int64_t ho = out_size(c);
      const double ws = 1.0 / std::sqrt(double(c.c_in * c.k * c.k));
      Tensor x = randn({2, c.c_in, c.hw, c.hw}, DType::f64, &gen);
      Tensor w = randn({c.c_out, c.c_in, c.k, c.k}, DType::f64, &gen) * ws;
      Tensor dy = randn({2, c.c_out, ho, ho}, DType::f64, &gen);
      Reference r = reference(rounded(x, DType::f16), rounded(w, DType::f16),
                              rounded(dy, DType::f16), c);
      check_gpu(r, c, DType::f16, MemoryFormat::ChannelsLast, MemoryFormat::ChannelsLast);
      Reference r32 = reference(x, w, dy, c);
      check_gpu(r32, c, DType::f32, MemoryFormat::Contiguous, MemoryFormat::Contiguous);
      // dw += the gradient, into ones
      Tensor xg = to_gpu(r.x, DType::f16, MemoryFormat::ChannelsLast);
      Tensor dyg = to_gpu(r.dy, DType::f16, MemoryFormat::ChannelsLast);
      Tensor dw = to_gpu(ones(r.w.shape(), DType::f64), DType::f16, MemoryFormat::ChannelsLast);
      cuda::conv2d_backward_weight(dw, dyg, xg, params_of(c), true);
      KILN_CHECK_OK(compare_scaled(dw, r.dw + 1.0, tol_for(DType::f16)));
    }
  };
  cuda::clear_conv_algo_cache();
  run_all(31);
  const cuda::ConvCacheStats tuned = cuda::conv_algo_cache_stats();
  CHECK(tuned.from_file == 0);
  CHECK(tuned.misses > 0);
  std::vector<std::string> written = lines();
  REQUIRE(written.size() > 1);
  CHECK(written[0].rfind("kiln conv plans 1\t", 0) == 0);
  // One record per tuned convolution (the kiln kernels' problems never reach the tuner), and
  // the accumulating weight gradients' decisions.
  CHECK(written.size() - 1 >= tuned.entries);
  const size_t f_records = size_t(std::count_if(written.begin(), written.end(), [](const auto& l) {
    return l.rfind("F ", 0) == 0;
  }));
  MESSAGE(tuned.entries, " problems tuned, ", written.size() - 1, " records, ", f_records,
          " of them accumulating weight gradients' decisions");

  // A later search takes every choice from the file and computes the same results.
  cuda::clear_conv_algo_cache();
  run_all(31);
  const cuda::ConvCacheStats taken = cuda::conv_algo_cache_stats();
  CHECK(taken.entries == tuned.entries);
  CHECK(taken.from_file == taken.entries + f_records);
  CHECK(lines() == written);  // nothing new to record

  // A file written for another GPU or cuDNN is not used, and is rewritten.
  {
    std::ofstream out(path);
    out << "kiln conv plans 1\tsome other GPU\tcudnn 1\n" << written.back() << "\n";
  }
  cuda::set_conv_plan_file(path);
  cuda::clear_conv_algo_cache();
  run_all(31);
  CHECK(cuda::conv_algo_cache_stats().from_file == 0);
  CHECK(lines().front() == written.front());

  // A file that is not a plan file (a mistyped path) is neither read nor overwritten.
  {
    std::ofstream out(path);
    out << "not a plan file\n";
  }
  cuda::set_conv_plan_file(path);
  cuda::clear_conv_algo_cache();
  run_all(31);
  CHECK(cuda::conv_algo_cache_stats().from_file == 0);
  CHECK(cuda::conv_plan_file().empty());
  CHECK(lines() == std::vector<std::string>{"not a plan file"});

  cuda::set_conv_plan_file(before);
  cuda::clear_conv_algo_cache();
  fs::remove(path);
}

TEST_CASE("conv2d: forced backend-API plans are deterministic in deterministic mode") {
  cuda::clear_conv_algo_cache();
  cuda::set_conv_backend(cuda::ConvBackend::Force);
  cuda::set_conv_deterministic(true);
  const bool wgrad1x1 = cuda::conv1x1_wgrad_enabled();  // this 1x1 weight gradient on cuDNN
  cuda::set_conv1x1_wgrad_enabled(false);
  Generator gen(14);
  Tensor x = to_gpu(randn({8, 64, 14, 14}, DType::f64, &gen), DType::f16, MemoryFormat::ChannelsLast);
  Tensor dy = to_gpu(randn({8, 256, 14, 14}, DType::f64, &gen), DType::f16, MemoryFormat::ChannelsLast);
  ConvParams p;
  Tensor a = nan_gpu({256, 64, 1, 1}, DType::f16, MemoryFormat::ChannelsLast);
  Tensor b = nan_gpu({256, 64, 1, 1}, DType::f16, MemoryFormat::ChannelsLast);
  cuda::conv2d_backward_weight(a, dy, x, p);
  cuda::conv2d_backward_weight(b, dy, x, p);
  const auto st = cuda::conv_algo_cache_stats();
  cuda::set_conv_deterministic(false);
  cuda::set_conv_backend(cuda::ConvBackend::Auto);
  cuda::set_conv1x1_wgrad_enabled(wgrad1x1);
  CHECK(st.engine_plans == 1);
  CHECK(a.to_vector<float>() == b.to_vector<float>());
  cuda::clear_conv_algo_cache();
}

TEST_CASE("conv2d: a weight gradient into another dtype than x's is converted, = and +=") {
  // cuDNN writes in its operands' dtype: an f32 dw of f16 operands is computed in f16 and widened
  // (before, the f16 bits were written into the f32 buffer). 3x3, so that cuDNN runs it.
  Generator gen(21);
  const MemoryFormat nhwc = MemoryFormat::ChannelsLast;
  Tensor x = to_gpu(randn({2, 64, 8, 8}, DType::f64, &gen), DType::f16, nhwc);
  Tensor dy = to_gpu(randn({2, 64, 8, 8}, DType::f64, &gen), DType::f16, nhwc);
  ConvParams p;
  p.pad_h = p.pad_w = 1;
  Tensor own = nan_gpu({64, 64, 3, 3}, DType::f16);
  cuda::conv2d_backward_weight(own, dy, x, p);
  const std::vector<float> expected = own.to_vector<float>();
  Tensor wide = nan_gpu({64, 64, 3, 3}, DType::f32);
  cuda::conv2d_backward_weight(wide, dy, x, p);
  CHECK(wide.to_vector<float>() == expected);
  // +=: onto ones, in f32.
  Tensor acc = to_gpu(ones({64, 64, 3, 3}), DType::f32);
  cuda::conv2d_backward_weight(acc, dy, x, p, /*accumulate=*/true);
  const std::vector<float> got = acc.to_vector<float>();
  REQUIRE(got.size() == expected.size());
  size_t off = 0;
  for (size_t i = 0; i < got.size(); ++i) off += got[i] != 1.0f + expected[i];
  CHECK(off == 0);
  // dy of another dtype than x: refused, naming both.
  CHECK_THROWS_WITH_AS(cuda::conv2d_backward_weight(wide, dy.to(DType::f32), x, p),
                       doctest::Contains("dy and x must have one dtype"), Error);
}

TEST_CASE("conv2d: accumulate (beta = 1) adds into dx/dw once, legacy and backend-API plans") {
  // Targets hold known values t0; after the call they must hold t0 + grad, not grad (beta
  // ignored, or the search overwrote the target) and not t0 + k·grad (the tuning runs added
  // into the real target). Each call runs twice with a fresh target: the first call searches,
  // the second hits the cached plan. The stem (channel padding) and an NCHW weight gradient
  // with NHWC activations take the fresh-result-plus-add path.
  Generator gen(15);
  const std::vector<ConvCase> cases = {{"1x1 64->256", 64, 256, 1, 1, 0, 8},
                                       {"3x3/2 128->128", 128, 128, 3, 2, 1, 8},
                                       {"1x1/2 256->512", 256, 512, 1, 2, 0, 8},
                                       {"stem 7x7/2 3->64", 3, 64, 7, 2, 3, 16}};
  for (cuda::ConvBackend mode : {cuda::ConvBackend::Off, cuda::ConvBackend::Force}) {
    CAPTURE(int(mode));
    cuda::clear_conv_algo_cache();
    cuda::set_conv_backend(mode);
    for (const ConvCase& c : cases) {
      CAPTURE(c.name);
      const DType dtype = DType::f16;
      const double tol = tol_for(dtype);
      const ConvParams p = params_of(c);
      const int64_t ho = out_size(c);
      const double ws = 1.0 / std::sqrt(double(c.c_in * c.k * c.k));
      Tensor x = randn({2, c.c_in, c.hw, c.hw}, DType::f64, &gen);
      Tensor w = randn({c.c_out, c.c_in, c.k, c.k}, DType::f64, &gen) * ws;
      Tensor dy = randn({2, c.c_out, ho, ho}, DType::f64, &gen);
      const Reference r = reference(rounded(x, dtype), rounded(w, dtype), rounded(dy, dtype), c);
      // Targets of the gradients' magnitude, so losing either part shows.
      const Tensor t0x = rounded(randn(r.x.shape(), DType::f64, &gen) * max_abs(r.dx), dtype);
      const Tensor t0w = rounded(randn(r.w.shape(), DType::f64, &gen) * max_abs(r.dw), dtype);
      const MemoryFormat nhwc = MemoryFormat::ChannelsLast;
      Tensor xg = to_gpu(r.x, dtype, nhwc), dyg = to_gpu(r.dy, dtype, nhwc);
      for (MemoryFormat w_fmt : {nhwc, MemoryFormat::Contiguous}) {
        CAPTURE(w_fmt == nhwc ? "w NHWC" : "w NCHW");
        Tensor wg = to_gpu(r.w, dtype, w_fmt);
        for (int call = 0; call < 2; ++call) {
          CAPTURE(call);
          Tensor dx = to_gpu(t0x, dtype, nhwc);
          cuda::conv2d_backward_data(dx, dyg, wg, p, /*accumulate=*/true);
          KILN_CHECK_OK(compare_scaled(dx, F::add(t0x, r.dx), tol));
          // Both ways of adding a weight gradient (beta = 1, fresh buffer + add) and the
          // tuner's choice between them.
          for (cuda::WgradAccumulate wa :
               {cuda::WgradAccumulate::Tuned, cuda::WgradAccumulate::BetaOne,
                cuda::WgradAccumulate::FreshAndAdd}) {
            CAPTURE(int(wa));
            cuda::set_wgrad_accumulate(wa);
            Tensor dw = to_gpu(t0w, dtype, w_fmt);
            cuda::conv2d_backward_weight(dw, dyg, xg, p, /*accumulate=*/true);
            KILN_CHECK_OK(compare_scaled(dw, F::add(t0w, r.dw), tol));
          }
          cuda::set_wgrad_accumulate(cuda::WgradAccumulate::Tuned);
        }
      }
    }
    // accumulate is part of the key: the same problem with beta = 0 is a new entry, and
    // computes `=` (NaN-filled output fully overwritten).
    const ConvCase& c = cases[0];
    const ConvParams p = params_of(c);
    Tensor x = randn({2, c.c_in, c.hw, c.hw}, DType::f64, &gen);
    Tensor w = randn({c.c_out, c.c_in, 1, 1}, DType::f64, &gen) * 0.125;
    Tensor dy = randn({2, c.c_out, c.hw, c.hw}, DType::f64, &gen);
    const Reference r = reference(rounded(x, DType::f16), rounded(w, DType::f16),
                                  rounded(dy, DType::f16), c);
    const auto before = cuda::conv_algo_cache_stats();
    Tensor dx = nan_gpu(r.x.shape(), DType::f16, MemoryFormat::ChannelsLast);
    cuda::conv2d_backward_data(dx, to_gpu(r.dy, DType::f16, MemoryFormat::ChannelsLast),
                               to_gpu(r.w, DType::f16, MemoryFormat::ChannelsLast), p);
    KILN_CHECK_OK(compare_scaled(dx, r.dx, tol_for(DType::f16)));
    const auto after = cuda::conv_algo_cache_stats();
    CHECK(after.misses == before.misses + 1);
    cuda::set_conv_backend(cuda::ConvBackend::Auto);
    cuda::clear_conv_algo_cache();
  }
}

TEST_CASE("conv2d: autograd accumulates conv gradients in place on the GPU, same as without") {
  // x feeds two convolutions (a residual fork) and the weights have a pre-filled .grad (as in
  // the fused optimizer's arena): with accumulation on, the second dgrad lands in the first's
  // buffer and both wgrads in .grad; gradients match the run without it.
  Generator gen(16);
  const MemoryFormat nhwc = MemoryFormat::ChannelsLast;
  Tensor x0 = randn({4, 64, 8, 8}, DType::f64, &gen);
  Tensor w1 = randn({64, 64, 3, 3}, DType::f64, &gen) * (1.0 / 24);
  Tensor w2 = randn({256, 64, 1, 1}, DType::f64, &gen) * 0.125;
  Tensor v1 = randn({4, 64, 8, 8}, DType::f64, &gen), v2 = randn({4, 256, 8, 8}, DType::f64, &gen);
  std::vector<std::vector<double>> results[2];
  for (bool on : {false, true}) {
    const bool prev = autograd::accumulate_into_enabled();
    autograd::set_accumulate_into_enabled(on);
    autograd::reset_accumulate_stats();
    Tensor x = to_gpu(x0, DType::f16, nhwc).set_requires_grad(true);
    Tensor a = to_gpu(w1, DType::f16, nhwc).set_requires_grad(true);
    Tensor b = to_gpu(w2, DType::f16, nhwc).set_requires_grad(true);
    a.set_grad(to_gpu(F::mul(w1, 0.5), DType::f16, nhwc));
    b.set_grad(to_gpu(F::mul(w2, -0.5), DType::f16, nhwc));
    Tensor h = F::mul(x, 1.0);  // non-leaf fork, like a block input
    Tensor y1 = F::conv2d(h, a, Tensor(), 1, 1), y2 = F::conv2d(h, b);
    Tensor loss = F::add(F::sum(F::mul(y1, to_gpu(v1, DType::f16, nhwc)).to(DType::f32)),
                         F::sum(F::mul(y2, to_gpu(v2, DType::f16, nhwc)).to(DType::f32)));
    loss.backward();
    const auto st = autograd::accumulate_stats();
    autograd::set_accumulate_into_enabled(prev);
    if (on) {
      CHECK(st.offered == 3);  // h's partial sum, a.grad, b.grad
      CHECK(st.used == 3);
    }
    for (const Tensor& t : {x, a, b}) results[on].push_back(to_cpu64(t.grad()).to_vector<double>());
  }
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    const Shape n{int64_t(results[0][i].size())};
    const Tensor off = from_vector(results[0][i], n, DType::f64);
    const Tensor on = from_vector(results[1][i], n, DType::f64);
    KILN_CHECK_OK(testing::compare(on, off, 2e-2 * std::max(max_abs(off), 1e-30), 2e-2));
  }
}
