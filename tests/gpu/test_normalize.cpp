// Input-pipeline kernels (cuda/normalize.h) against the CPU reference: u8 NHWC -> normalised
// f32/f16 channels-last, the synthetic source's bytes and labels, and DeviceFeeder's pinned
// upload + normalise path against the CPU feeder on the same loader batches.
#include <doctest/doctest.h>

#include "cuda/normalize.h"
#include "cuda/runtime.h"
#include "data/device_batches.h"
#include "core/hash.h"
#include "data/transforms.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/image_test_util.h"

using namespace kiln;
using namespace kiln::gputest;
using namespace kiln::data;

namespace {

Tensor random_u8(const Shape& shape, uint64_t seed) {
  Tensor t = empty(shape, DType::u8);
  Generator g(seed);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<uint8_t>()[i] = uint8_t(g.below(256));
  return t;
}

// The CPU reference: f32 (N, 3, H, W) contiguous, widened to f64.
Tensor cpu_reference(const Tensor& px, const float mean[3], const float sd[3]) {
  const int64_t N = px.size(0), H = px.size(1), W = px.size(2);
  Tensor out = empty({N, 3, H, W}, DType::f32);
  normalize_nhwc_to_nchw(px.data<uint8_t>(), N, H, W, mean, sd, out.data<float>());
  return out.to(DType::f64);
}

}  // namespace

TEST_CASE("normalize_images matches the CPU reference (f32, f16; odd sizes)") {
  const float mean[3] = {0.1f, 0.5f, 0.9f}, sd[3] = {0.2f, 0.3f, 0.7f};
  for (DType dt : {DType::f32, DType::f16})
    for (Shape s : {Shape{3, 5, 7, 3}, Shape{1, 1, 1, 3}, Shape{2, 33, 17, 3}}) {
      const Tensor px = random_u8(s, uint64_t(s[1] * 100 + s[2]));
      Tensor out = nan_output({s[0], 3, s[1], s[2]}, dt, MemoryFormat::ChannelsLast);
      cuda::normalize_images(out, px.to(kGpu), mean, sd);
      check_close(host_f64(out), cpu_reference(px, mean, sd), tol_for(dt),
                  std::string("normalize ") + dtype_name(dt) + " " + shape_str(s));
    }
  const Tensor px = random_u8({2, 4, 4, 3}, 1).to(kGpu);
  CHECK_THROWS_AS(
      cuda::normalize_images(nan_output({2, 3, 4, 4}, DType::f32), px, kImageNetMean, kImageNetStd),
      Error);  // NCHW output refused
  CHECK_THROWS_AS(
      cuda::normalize_images(nan_output({2, 3, 4, 4}, DType::f64, MemoryFormat::ChannelsLast), px,
                             kImageNetMean, kImageNetStd),
      Error);
}

TEST_CASE("synthetic bytes and labels: GPU equals CPU") {
  Tensor b = empty({1000}, gpu_opts(DType::u8));
  cuda::fill_synthetic_bytes(b, 77);
  const Tensor hb = b.to(Device::cpu());
  for (int64_t i = 0; i < 1000; ++i) REQUIRE(hb.data<uint8_t>()[i] == synthetic_byte(77, i));
  Tensor y = empty({300}, gpu_opts(DType::i64));
  cuda::fill_synthetic_labels(y, 77, 1000);
  const Tensor hy = y.to(Device::cpu());
  for (int64_t i = 0; i < 300; ++i) REQUIRE(hy.data<int64_t>()[i] == synthetic_label(77, i, 1000));

  for (DType dt : {DType::f32, DType::f16}) {
    SyntheticImages gpu(4, 9, 10, kGpu, dt, 5), cpu(4, 9, 10, Device::cpu(), DType::f32, 5);
    for (int k = 0; k < 2; ++k) {
      const DeviceBatch g = gpu.next(), c = cpu.next();
      CHECK(g.x.is_contiguous(MemoryFormat::ChannelsLast));
      check_close(host_f64(g.x), c.x.to(DType::f64), tol_for(dt), "synthetic x");
      CHECK(g.y.to(Device::cpu()).to_vector<int64_t>() == c.y.to_vector<int64_t>());
    }
  }
}

TEST_CASE("DeviceFeeder on CUDA equals the CPU feeder, batch by batch") {
  testing::TempDir dir;
  Generator g(3);
  for (int64_t id = 0; id < 11; ++id) {
    Image im;
    im.height = 20 + int64_t(g.below(20));
    im.width = 20 + int64_t(g.below(20));
    im.pixels.resize(size_t(im.height * im.width * 3));
    for (auto& p : im.pixels) p = uint8_t(g.below(256));
    testing::write_png_at(dir / ("c" + std::to_string(id % 2) + "/" + std::to_string(id) + ".png"),
                          im);
  }
  ImageLoaderOptions o;
  o.batch_size = 3;  // 4 batches, the last of 2: both staging slots reused, a short batch
  o.image_size = 12;
  o.workers = 2;
  const ImageLoader loader(ImageFolder(dir.path().string()), o);
  {
    ImageEpoch ep = loader.epoch(0);
    CHECK(ep.next()->pinned);
  }
  for (DType dt : {DType::f32, DType::f16}) {
    ImageEpoch ge = loader.epoch(1), ce = loader.epoch(1);
    DeviceFeeder gf(ge, kGpu, dt), cf(ce, Device::cpu());
    int n = 0;
    while (true) {
      std::optional<DeviceBatch> gb = gf.next(), cb = cf.next();
      REQUIRE(gb.has_value() == cb.has_value());
      if (!gb) break;
      CHECK(gb->index == cb->index);
      CHECK(gb->x.device() == kGpu);
      CHECK(gb->x.dtype() == dt);
      CHECK(gb->x.is_contiguous(MemoryFormat::ChannelsLast));
      check_close(host_f64(gb->x), cb->x.to(DType::f64), tol_for(dt), "feeder x");
      CHECK(gb->y.to(Device::cpu()).to_vector<int64_t>() == cb->y.to_vector<int64_t>());
      ++n;
    }
    CHECK(n == 4);
  }
}
