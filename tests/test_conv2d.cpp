// conv2d: forward against a naive 7-loop reference, gradients (finite differences and f32 vs
// f64), memory formats, error paths, and the speed of one training-sized layer (printed only).
#include <doctest/doctest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>

#include "ops/ops.h"
#include "tests/gradcheck.h"
#include "tests/test_util.h"

using namespace kiln;
using kiln::testing::compare;
using kiln::testing::error_of;
using kiln::testing::gradcheck;
using kiln::testing::leaf;

namespace {

struct Cfg {
  int64_t n, c, h, w, o, kh, kw;
  int64_t sh = 1, sw = 1, ph = 0, pw = 0, dh = 1, dw = 1, groups = 1;
  bool bias = true;
};

std::string cfg_str(const Cfg& c) {
  return "x(" + std::to_string(c.n) + "," + std::to_string(c.c) + "," + std::to_string(c.h) + "," +
         std::to_string(c.w) + ") o=" + std::to_string(c.o) + " k=" + std::to_string(c.kh) + "x" +
         std::to_string(c.kw) + " s=" + std::to_string(c.sh) + "," + std::to_string(c.sw) +
         " p=" + std::to_string(c.ph) + "," + std::to_string(c.pw) + " d=" + std::to_string(c.dh) +
         "," + std::to_string(c.dw) + " g=" + std::to_string(c.groups) + (c.bias ? " bias" : "");
}

int64_t out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) {
  return (in + 2 * p - d * (k - 1) - 1) / s + 1;
}

// The definition, in f64, on logical NCHW values.
Tensor reference(const Cfg& c, const Tensor& x, const Tensor& w, const Tensor& b) {
  const std::vector<double> xv = x.to_vector<double>(), wv = w.to_vector<double>();
  const std::vector<double> bv = b.defined() ? b.to_vector<double>() : std::vector<double>();
  const int64_t oh = out_size(c.h, c.kh, c.sh, c.ph, c.dh),
                ow = out_size(c.w, c.kw, c.sw, c.pw, c.dw);
  const int64_t cg = c.c / c.groups, og = c.o / c.groups;
  std::vector<double> y(size_t(c.n * c.o * oh * ow));
  for (int64_t n = 0; n < c.n; ++n)
    for (int64_t o = 0; o < c.o; ++o)
      for (int64_t yy = 0; yy < oh; ++yy)
        for (int64_t xx = 0; xx < ow; ++xx) {
          double s = bv.empty() ? 0.0 : bv[size_t(o)];
          const int64_t grp = o / og;
          for (int64_t ci = 0; ci < cg; ++ci)
            for (int64_t i = 0; i < c.kh; ++i)
              for (int64_t j = 0; j < c.kw; ++j) {
                const int64_t ih = yy * c.sh - c.ph + i * c.dh, iw = xx * c.sw - c.pw + j * c.dw;
                if (ih < 0 || ih >= c.h || iw < 0 || iw >= c.w) continue;
                const int64_t ch = grp * cg + ci;
                s += xv[size_t(((n * c.c + ch) * c.h + ih) * c.w + iw)] *
                     wv[size_t(((o * cg + ci) * c.kh + i) * c.kw + j)];
              }
          y[size_t(((n * c.o + o) * oh + yy) * ow + xx)] = s;
        }
  return from_vector<double>(y, {c.n, c.o, oh, ow}, DType::f64);
}

Tensor conv(const Cfg& c, const Tensor& x, const Tensor& w, const Tensor& b) {
  return F::conv2d(x, w, b, {c.sh, c.sw}, {c.ph, c.pw}, {c.dh, c.dw}, c.groups);
}

const std::vector<Cfg> kForwardCfgs = {
    {2, 3, 7, 6, 4, 3, 3},                              // plain 3x3
    {3, 4, 9, 8, 6, 3, 3, 2, 2, 1, 1},                  // stride 2, padding 1
    {2, 4, 8, 9, 4, 3, 3, 1, 1, 2, 2, 2, 2, 1, false},  // dilation 2, no bias
    {2, 6, 7, 7, 9, 3, 3, 1, 1, 1, 1, 1, 1, 3},         // groups 3
    {2, 5, 8, 7, 5, 3, 3, 2, 1, 1, 1, 1, 1, 5},         // depthwise
    {2, 4, 6, 5, 8, 3, 3, 1, 1, 1, 1, 1, 1, 4, false},  // depthwise, multiplier 2
    {2, 3, 9, 8, 4, 2, 5, 1, 2, 1, 2},                  // non-square kernel, strides
    {1, 3, 10, 11, 5, 5, 3, 3, 2, 2, 0, 1, 2},          // mixed everything, N = 1
    {4, 8, 6, 6, 5, 1, 1},                              // 1x1 (direct path)
    {2, 8, 7, 7, 4, 1, 1, 2, 2},                        // 1x1 stride 2 (im2col)
    {2, 3, 5, 5, 2, 5, 5, 1, 1, 0, 0},                  // kernel = input
    {3, 2, 4, 4, 3, 3, 3, 3, 3, 2, 2, 1, 1, 1, false},  // stride 3, padding 2
    {5, 16, 12, 12, 32, 3, 3, 1, 1, 1, 1, 1, 1, 2},     // larger, groups 2
};

}  // namespace

TEST_CASE("conv2d forward matches the naive reference (f64, f32; NCHW, NHWC)") {
  for (const Cfg& c : kForwardCfgs) {
    CAPTURE(cfg_str(c));
    Tensor x = randn({c.n, c.c, c.h, c.w}, DType::f64);
    Tensor w = randn({c.o, c.c / c.groups, c.kh, c.kw}, DType::f64);
    Tensor b = c.bias ? randn({c.o}, DType::f64) : Tensor();
    Tensor expected = reference(c, x, w, b);
    for (DType dt : {DType::f64, DType::f32}) {
      const double tol = dt == DType::f64 ? 1e-11 : 1e-4;
      Tensor xd = x.to(dt), wd = w.to(dt), bd = b.defined() ? b.to(dt) : Tensor();
      Tensor y = conv(c, xd, wd, bd);
      CHECK(y.dtype() == dt);
      CHECK(y.is_contiguous());
      KILN_CHECK_OK(compare(y, expected, tol, tol));
      Tensor xl = xd.contiguous(MemoryFormat::ChannelsLast);
      Tensor yl = conv(c, xl, wd, bd);
      if (c.o > 1 && yl.size(2) * yl.size(3) > 1)
        CHECK(yl.suggest_memory_format() == MemoryFormat::ChannelsLast);
      KILN_CHECK_OK(compare(yl, expected, tol, tol));
    }
  }
}

TEST_CASE("conv2d forward: non-contiguous input and weight views") {
  Cfg c{2, 3, 6, 7, 4, 3, 2, 1, 1, 1, 0};
  Tensor xt = randn({c.n, c.c, c.w, c.h}, DType::f64).transpose(2, 3);  // (N, C, H, W) strided
  Tensor wt = randn({c.kw, c.kh, c.c, c.o}, DType::f64).permute({3, 2, 1, 0});
  Tensor b = randn({2 * c.o}, DType::f64).slice(0, 0, 2 * c.o, 2);
  KILN_CHECK_OK(compare(conv(c, xt, wt, b), reference(c, xt, wt, b), 1e-11, 1e-11));
}

TEST_CASE("conv2d gradients (gradcheck on x, weight, bias)") {
  const std::vector<Cfg> cfgs = {
      {2, 2, 5, 4, 3, 3, 3},                              // plain
      {2, 2, 6, 5, 2, 3, 3, 2, 2, 1, 1},                  // stride 2 + padding
      {1, 2, 6, 6, 2, 2, 2, 1, 1, 1, 0, 2, 2},            // dilation, asymmetric padding
      {2, 4, 4, 4, 4, 3, 3, 1, 1, 1, 1, 1, 1, 2},         // groups 2
      {2, 3, 5, 4, 3, 3, 3, 1, 1, 1, 1, 1, 1, 3, false},  // depthwise, no bias
      {2, 2, 5, 6, 3, 2, 3, 2, 1, 0, 1},                  // non-square kernel
      {2, 3, 4, 3, 2, 1, 1},                              // 1x1 direct path
  };
  for (const Cfg& c : cfgs) {
    CAPTURE(cfg_str(c));
    Tensor x = leaf({c.n, c.c, c.h, c.w});
    Tensor w = leaf({c.o, c.c / c.groups, c.kh, c.kw});
    Tensor b = c.bias ? leaf({c.o}) : Tensor();
    KILN_CHECK_OK(gradcheck([&](auto& in) { return conv(c, in[0], in[1], in[2]); }, {x, w, b}));
  }
  // Only some inputs require grad (first layer: x constant; frozen weight and bias).
  {
    Cfg c{2, 2, 5, 5, 3, 3, 3, 2, 1, 1, 1};
    Tensor x = leaf({2, 2, 5, 5}), w = leaf({3, 2, 3, 3}), b = leaf({3});
    Tensor xc = x.detach(), wc = w.detach(), bc = b.detach();
    KILN_CHECK_OK(gradcheck([&](auto& in) { return conv(c, in[0], in[1], in[2]); }, {xc, w, b}));
    KILN_CHECK_OK(gradcheck([&](auto& in) { return conv(c, in[0], in[1], in[2]); }, {x, wc, bc}));
    KILN_CHECK_OK(gradcheck([&](auto& in) { return conv(c, in[0], in[1], in[2]); }, {xc, wc, b}));
  }
  // Through an NHWC copy of x: the gradient returns to the NCHW leaf.
  Cfg c{2, 3, 4, 5, 2, 3, 3, 1, 1, 1, 1};
  Tensor x = leaf({c.n, c.c, c.h, c.w}), w = leaf({c.o, c.c, 3, 3}), b = leaf({c.o});
  KILN_CHECK_OK(gradcheck(
      [&](auto& in) { return conv(c, in[0].contiguous(MemoryFormat::ChannelsLast), in[1], in[2]); },
      {x, w, b}));
}

TEST_CASE("conv2d backward: f32 agrees with f64, NHWC agrees with NCHW, multi-image batches") {
  for (const Cfg& c : {Cfg{6, 8, 9, 9, 12, 3, 3, 1, 1, 1, 1},
                       Cfg{5, 6, 10, 8, 6, 3, 3, 2, 2, 1, 1, 1, 1, 3}, Cfg{4, 8, 6, 6, 16, 1, 1}}) {
    CAPTURE(cfg_str(c));
    Tensor x0 = randn({c.n, c.c, c.h, c.w}, DType::f64);
    Tensor w0 = randn({c.o, c.c / c.groups, c.kh, c.kw}, DType::f64);
    Tensor b0 = randn({c.o}, DType::f64);
    Tensor yshape = reference(c, x0, w0, b0);
    Tensor g = randn(yshape.shape(), DType::f64);
    auto grads = [&](DType dt, MemoryFormat fmt) {
      Tensor x = x0.to(dt).contiguous(fmt).detach().set_requires_grad(true);
      Tensor w = w0.to(dt).detach().set_requires_grad(true);
      Tensor b = b0.to(dt).detach().set_requires_grad(true);
      conv(c, x, w, b).backward(g.to(dt));
      if (fmt == MemoryFormat::ChannelsLast) CHECK(x.grad().suggest_memory_format() == fmt);
      return std::vector<Tensor>{x.grad(), w.grad(), b.grad()};
    };
    auto ref = grads(DType::f64, MemoryFormat::Contiguous);
    auto nhwc = grads(DType::f64, MemoryFormat::ChannelsLast);
    auto f32 = grads(DType::f32, MemoryFormat::Contiguous);
    for (size_t i = 0; i < 3; ++i) {
      KILN_CHECK_OK(compare(nhwc[i], ref[i], 1e-10, 1e-10));
      KILN_CHECK_OK(compare(f32[i], ref[i], 1e-3, 1e-4));
    }
  }
}

// The weight gradient adds each image's product into dw in image order, one round of images per
// team of threads: the same bits on any thread count (as are x's gradient and the forward, one
// image per thread). Grouped, strided and 1x1 geometries, batches not a multiple of the threads.
TEST_CASE("conv2d backward: the same bits on 1 to 4 threads") {
  for (const Cfg& c : {Cfg{7, 8, 9, 9, 12, 3, 3, 1, 1, 1, 1},
                       Cfg{5, 6, 10, 8, 6, 3, 3, 2, 2, 1, 1, 1, 1, 3}, Cfg{9, 8, 6, 6, 16, 1, 1}}) {
    CAPTURE(cfg_str(c));
    const Tensor x0 = randn({c.n, c.c, c.h, c.w});
    const Tensor w0 = randn({c.o, c.c / c.groups, c.kh, c.kw}), b0 = randn({c.o});
    const Tensor g = randn(reference(c, x0, w0, b0).shape());
    auto grads = [&] {
      Tensor x = x0.detach().set_requires_grad(true), w = w0.detach().set_requires_grad(true);
      Tensor b = b0.detach().set_requires_grad(true);
      Tensor y = conv(c, x, w, b);
      y.backward(g);
      return std::vector<Tensor>{y.detach(), x.grad(), w.grad(), b.grad()};
    };
    const auto one = testing::on_threads(1, grads);
    for (int t : {2, 3, 4}) {
      CAPTURE(t);
      const auto many = testing::on_threads(t, grads);
      for (size_t i = 0; i < one.size(); ++i) {
        CAPTURE(i);
        CHECK(testing::same_bits(many[i], one[i]));
      }
    }
  }
}

namespace {
bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}
}  // namespace

TEST_CASE("conv2d error paths name the op and the shapes") {
  Tensor x = randn({2, 4, 8, 8});
  std::string m = error_of([&] { F::conv2d(x, randn({3, 3, 3, 3})); });
  CHECK(has(m, "conv2d"));
  CHECK(has(m, "[3, 3, 3, 3]"));
  CHECK(has(m, "[2, 4, 8, 8]"));
  m = error_of([&] { F::conv2d(x, randn({6, 2, 3, 3}), Tensor(), 1, 0, 1, 3); });  // 4 % 3
  CHECK(has(m, "groups"));
  m = error_of([&] { F::conv2d(x, randn({3, 2, 3, 3}), Tensor(), 1, 0, 1, 2); });  // 3 % 2
  CHECK(has(m, "groups"));
  m = error_of([&] { F::conv2d(x, randn({4, 2, 3, 3}), Tensor(), 1, 0, 1, 1); });  // C/g
  CHECK(has(m, "[4, 2, 3, 3]"));
  m = error_of([&] { F::conv2d(x, randn({5, 4, 3, 3}), randn({4})); });
  CHECK(has(m, "bias"));
  m = error_of([&] { F::conv2d(x, randn({5, 4, 9, 3})); });  // kernel taller than input
  CHECK(has(m, "larger than the padded input"));
  CHECK(has(m, "output size"));
  CHECK(error_of([&] { F::conv2d(x, randn({5, 4, 9, 3}), Tensor(), 1, {1, 0}); }).empty());
  m = error_of([&] { F::conv2d(x, randn({5, 4, 3, 3}), Tensor(), 1, 0, {5, 1}); });  // dilated 11
  CHECK(has(m, "dilated"));
  CHECK(has(error_of([&] { F::conv2d(x, randn({5, 4, 3, 3}), Tensor(), 0); }), "stride"));
  CHECK(has(error_of([&] { F::conv2d(x, randn({5, 4, 3, 3}), Tensor(), 1, -1); }), "padding"));
  CHECK(has(error_of([&] { F::conv2d(x, randn({5, 4, 3, 3}), Tensor(), 1, 0, 0); }), "dilation"));
  CHECK(has(error_of([&] { F::conv2d(x, randn({4, 4, 3, 3}), Tensor(), 1, 0, 1, 0); }), "groups"));
  CHECK(has(error_of([&] { F::conv2d(randn({4, 8, 8}), randn({5, 4, 3, 3})); }), "4-D"));
  CHECK(has(error_of([&] { F::conv2d(x, randn({5, 4, 3})); }), "weight"));
  CHECK(has(error_of([&] { F::conv2d(x, randn({5, 4, 3, 3}, DType::f64)); }), "dtype"));
  CHECK(has(error_of([&] {
              F::conv2d(x.to(DType::i64), ones({5, 4, 3, 3}, DType::i64));
            }),
            "floating"));
}

TEST_CASE("conv2d speed: 3x3 64->64 on (32, 64, 28, 28) f32, forward + backward") {
  Tensor x = randn({32, 64, 28, 28}).set_requires_grad(true);
  Tensor w = (randn({64, 64, 3, 3}) * 0.05).detach().set_requires_grad(true);
  Tensor b = zeros({64}).set_requires_grad(true);
  Tensor g = randn({32, 64, 28, 28});
  auto step = [&] { F::conv2d(x, w, b, 1, 1).backward(g); };
  step();  // warm-up: buffers, threads
  // Wall time, and the CPU time of all threads (which stays meaningful on a loaded machine).
  const std::clock_t c0 = std::clock();
  auto t0 = std::chrono::steady_clock::now();
  step();
  double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const double cpu_ms = 1e3 * double(std::clock() - c0) / CLOCKS_PER_SEC;
  const double gflop = 3 * 2.0 * 32 * 64 * 64 * 9 * 28 * 28 / 1e9;
  MESSAGE("conv2d 3x3 64->64 (32,64,28,28) f32 forward+backward: "
          << ms << " ms wall (" << gflop / (ms / 1e3) << " GFLOP/s), " << cpu_ms
          << " ms CPU over all threads");
  CHECK(w.grad().defined());
}

TEST_CASE("conv2d (cpu): out of memory for the im2col scratch is a kiln::Error, not a crash") {
  // x (2, 64, 256, 256) with a 7x7 kernel needs 64·49 x 256·256 f32 = 822 MB of scratch per
  // thread; the address space is capped 400 MB above what the process uses now.
  Tensor x = randn({2, 64, 256, 256});
  Tensor w = randn({2, 64, 7, 7});
  long pages = 0;
  {
    std::FILE* f = std::fopen("/proc/self/statm", "r");
    REQUIRE(f != nullptr);
    REQUIRE(std::fscanf(f, "%ld", &pages) == 1);
    std::fclose(f);
  }
  rlimit old{};
  REQUIRE(::getrlimit(RLIMIT_AS, &old) == 0);
  rlimit cap = old;
  cap.rlim_cur = rlim_t(pages) * rlim_t(::sysconf(_SC_PAGESIZE)) + (rlim_t(400) << 20);
  if (old.rlim_cur != RLIM_INFINITY && old.rlim_cur < cap.rlim_cur) cap.rlim_cur = old.rlim_cur;
  REQUIRE(::setrlimit(RLIMIT_AS, &cap) == 0);
  // qemu-user (tests/emulated_cpu.sh) takes the cap without enforcing it: a 600 MB block beyond
  // it must fail to map, or the test cannot run here.
  if (void* probe = std::malloc(size_t(600) << 20)) {
    std::free(probe);
    ::setrlimit(RLIMIT_AS, &old);
    MESSAGE("RLIMIT_AS is not enforced in this process (an emulator?): test not run");
    return;
  }
  std::string m = error_of([&] { F::conv2d(x, w, Tensor(), 1, 3); });
  ::setrlimit(RLIMIT_AS, &old);
  INFO(m);
  CHECK(m.find("conv2d") != std::string::npos);
  CHECK(m.find("out of memory") != std::string::npos);
  CHECK(m.find("bytes") != std::string::npos);
}
