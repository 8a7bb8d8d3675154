// DeviceLoader (data/device_loader.h) and its kernel (cuda::gather_crop_flip_normalize) against
// the CPU DataLoader: the same batches in the same order, x bit-identical to what
// amp::prepare_input makes of the CPU batch (f32 contiguous, f16 channels-last), the other
// dtype/layout pairs within the dtype's rounding, labels equal, batch counts equal.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/normalize.h"
#include "data/device_loader.h"
#include "data/distributed_sampler.h"
#include "optim/amp.h"
#include "tests/gpu/gpu_test_util.h"

using namespace kiln;
using namespace kiln::gputest;
using namespace kiln::data;

namespace {

// Random u8 pixels (N, C, H, W) and labels in [0, 10), from a seed.
TensorDataset random_dataset(int64_t n, int64_t c, int64_t h, int64_t w, uint64_t seed) {
  Generator g(seed);
  std::vector<uint8_t> px(size_t(n * c * h * w));
  for (auto& p : px) p = uint8_t(g.below(256));
  std::vector<int64_t> labels(static_cast<size_t>(n));
  for (auto& l : labels) l = int64_t(g.below(10));
  return TensorDataset(from_vector(px, {n, c, h, w}, DType::u8),
                       from_vector(labels, {n}, DType::i64));
}

// x's values on the host as f32 in logical (NCHW) order; f16 -> f32 is exact, so equal bytes
// here mean equal f16 bits.
std::vector<float> host_values(const Tensor& x) {
  return x.to(Device::cpu()).to(DType::f32).contiguous().to_vector<float>();
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Case {
  std::string name;
  int64_t n, c, h, w;
  LoaderOptions opts;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  auto add = [&](std::string name, int64_t n, int64_t c, int64_t h, int64_t w, int64_t batch,
                 int64_t pad, bool flip) {
    LoaderOptions o;
    o.batch_size = batch;
    o.crop_padding = pad;
    o.horizontal_flip = flip;
    o.seed = uint64_t(n * 131 + c);
    o.mean = c == 1 ? std::vector<float>{0.2860f} : std::vector<float>{0.1f, 0.5f, 0.9f};
    o.stddev = c == 1 ? std::vector<float>{0.3530f} : std::vector<float>{0.2f, 0.3f, 0.7f};
    out.push_back({std::move(name), n, c, h, w, o});
    return &out.back().opts;
  };
  add("C=1 7x5, in order, no augmentation, last batch of 3", 23, 1, 7, 5, 4, 0, false);
  add("C=1 9x11, shuffled, pad 4 + flip", 37, 1, 9, 11, 8, 4, true)->shuffle = true;
  LoaderOptions* o = add("C=3 5x7, shuffled, pad 2 + flip, drop_last", 19, 3, 5, 7, 6, 2, true);
  o->shuffle = true;
  o->drop_last = true;
  add("C=3 13x6, flip only", 17, 3, 13, 6, 4, 0, true);
  add("C=1 3x3, pad 4 (crops reach past the image)", 10, 1, 3, 3, 4, 4, false)->shuffle = true;
  o = add("C=3 6x9, DistributedSampler rank 1 of 3, pad 4 + flip", 29, 3, 6, 9, 3, 4, true);
  o->sampler = std::make_shared<DistributedSampler>(29, 3, 1, DistributedSamplerOptions{true, 9});
  o = add("C=3 8x8, reflect pad 2 + alternating flip (the speedrun's)", 21, 3, 8, 8, 5, 2, true);
  o->padding = Padding::Reflect;
  o->alternating_flip = true;
  o->shuffle = true;
  o = add("C=3 5x6, reflect pad 4 (the largest below the side)", 11, 3, 5, 6, 4, 4, false);
  o->padding = Padding::Reflect;
  o = add("C=3 7x7, a fixed view (test-time augmentation)", 9, 3, 7, 7, 4, 1, false);
  o->padding = Padding::Reflect;
  o->fixed_transform = SampleTransform{2, 0, true};
  return out;
}

}  // namespace

TEST_CASE("DeviceLoader batches equal the DataLoader's, batch by batch") {
  struct Output {
    DType dtype;
    MemoryFormat format;
  };
  for (const Case& cs : cases()) {
    const DataLoader cpu(random_dataset(cs.n, cs.c, cs.h, cs.w, uint64_t(cs.n)), cs.opts);
    for (Output out : {Output{DType::f32, MemoryFormat::Contiguous},
                       Output{DType::f16, MemoryFormat::ChannelsLast},
                       Output{DType::f16, MemoryFormat::Contiguous},
                       Output{DType::f32, MemoryFormat::ChannelsLast}}) {
      const std::string what = cs.name + ", " + dtype_name(out.dtype) +
                               (out.format == MemoryFormat::ChannelsLast ? " NHWC" : " NCHW");
      CAPTURE(what);
      const DeviceLoader gpu(cpu, kGpu, out.dtype, out.format);
      REQUIRE(gpu.num_batches() == cpu.num_batches());
      // The amp precision whose prepare_input makes exactly this dtype and layout, if any.
      const bool amp_form = (out.dtype == DType::f32) == (out.format == MemoryFormat::Contiguous);
      const amp::Precision precision =
          out.dtype == DType::f16 ? amp::Precision::Mixed16 : amp::Precision::FP32;
      for (int64_t e = 0; e < 2; ++e) {
        // All of an epoch's device batches are held before any is compared: later batches
        // (and the reuse of ring slots) must not disturb earlier ones.
        DeviceEpoch ge = gpu.epoch(e);
        CHECK(ge.size() == cpu.num_batches());
        std::vector<DeviceBatch> got;
        while (std::optional<DeviceBatch> b = ge.next()) got.push_back(std::move(*b));
        CHECK_FALSE(ge.next().has_value());
        std::vector<Batch> want;
        for (Batch& b : cpu.epoch(e)) want.push_back(std::move(b));
        REQUIRE(got.size() == want.size());
        REQUIRE(int64_t(got.size()) == cpu.num_batches());
        for (size_t k = 0; k < got.size(); ++k) {
          const DeviceBatch& g = got[k];
          const Batch& w = want[k];
          CAPTURE(k);
          CHECK(g.index == w.index);
          CHECK(g.x.device() == kGpu);
          CHECK(g.x.dtype() == out.dtype);
          CHECK(g.x.shape() == w.x.shape());
          CHECK(g.x.is_contiguous(out.format));
          CHECK(g.x.suggest_memory_format() == out.format);  // also for C = 1
          CHECK(g.y.device() == kGpu);
          CHECK(g.y.dtype() == DType::i64);
          CHECK(g.y.to(Device::cpu()).to_vector<int64_t>() == w.y.to_vector<int64_t>());
          const std::vector<float> gx = host_values(g.x);
          if (out.dtype == DType::f32)
            CHECK_MESSAGE(same_bits(gx, w.x.to_vector<float>()), "f32 x differs from the CPU's");
          else  // one rounding of the CPU's f32 value
            check_close(g.x.to(Device::cpu()).to(DType::f64), w.x.to(DType::f64),
                        {std::ldexp(1.0, -25), std::ldexp(1.0, -11)}, "f16 x");
          if (amp_form) {
            const Tensor p = amp::prepare_input(w.x, kGpu, precision);
            CHECK(g.x.strides() == p.strides());
            CHECK_MESSAGE(same_bits(gx, host_values(p)), "x differs from amp::prepare_input's");
          }
        }
      }
    }
  }
}

TEST_CASE("DeviceLoader: a sampler's shards together cover the dataset once") {
  const int64_t n = 20, world = 4;
  std::vector<int64_t> seen;
  for (int64_t r = 0; r < world; ++r) {
    LoaderOptions o;
    o.batch_size = 2;
    o.sampler = std::make_shared<DistributedSampler>(n, world, r, DistributedSamplerOptions{});
    // Labels are the sample numbers, so y names the samples.
    std::vector<int64_t> labels(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) labels[size_t(i)] = i;
    const DataLoader cpu(TensorDataset(empty({n, 1, 2, 2}, DType::u8).fill_(3),
                                       from_vector(labels, {n}, DType::i64)),
                         o);
    const DeviceLoader gpu(cpu, kGpu);
    DeviceEpoch ep = gpu.epoch(0);
    while (std::optional<DeviceBatch> b = ep.next())
      for (int64_t v : b->y.to(Device::cpu()).to_vector<int64_t>()) seen.push_back(v);
  }
  std::sort(seen.begin(), seen.end());
  std::vector<int64_t> all(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) all[size_t(i)] = i;
  CHECK(seen == all);
}

TEST_CASE("DeviceLoader: an epoch started at batch k gives the whole epoch's batches from k") {
  // What kiln-train's resume in the middle of an epoch reads (tools/train/trainer.cpp).
  LoaderOptions o;
  o.batch_size = 6;
  o.shuffle = true;
  o.seed = 17;
  o.crop_padding = 2;
  o.horizontal_flip = true;
  const DataLoader cpu(random_dataset(40, 3, 8, 8, 5), o);  // 7 batches, the last of 4
  const DeviceLoader gpu(cpu, kGpu, DType::f16, MemoryFormat::ChannelsLast);
  std::vector<std::vector<float>> whole_x;
  std::vector<std::vector<int64_t>> whole_y;
  DeviceEpoch whole = gpu.epoch(2);
  while (std::optional<DeviceBatch> b = whole.next()) {
    whole_x.push_back(host_values(b->x));
    whole_y.push_back(b->y.to(Device::cpu()).to_vector<int64_t>());
  }
  REQUIRE(whole_x.size() == 7);
  for (int64_t first : {1, 4, 6, 7}) {
    CAPTURE(first);
    DeviceEpoch ep = gpu.epoch(2, first);
    CHECK(ep.size() == 7 - first);
    int64_t k = first;
    while (std::optional<DeviceBatch> b = ep.next()) {
      REQUIRE(k < 7);
      CHECK(b->index == k);
      CHECK(same_bits(host_values(b->x), whole_x[size_t(k)]));
      CHECK(b->y.to(Device::cpu()).to_vector<int64_t>() == whole_y[size_t(k)]);
      ++k;
    }
    CHECK(k == 7);
  }
  CHECK_THROWS_AS(gpu.epoch(2, 8), Error);
}

TEST_CASE("gather_crop_flip_normalize validates its tensors") {
  const Tensor images = empty({5, 3, 4, 6}, gpu_opts(DType::u8)).fill_(1);
  const Tensor labels = empty({5}, gpu_opts(DType::i64)).fill_(0);
  const Tensor jobs = empty({2, 4}, gpu_opts(DType::i32)).fill_(0);
  const Tensor lut = empty({3 * 256}, gpu_opts(DType::f32)).fill_(0);
  const Tensor y = empty({2}, gpu_opts(DType::i64));
  auto message = [&](const Tensor& x, const Tensor& yy, const Tensor& j, const Tensor& l) {
    try {
      cuda::gather_crop_flip_normalize(x, yy, images, labels, j, 0, l);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  // Valid calls, both layouts; an all-zero job with pad 0 copies image 0 (pixel 1 -> lut 0).
  for (MemoryFormat f : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
    Tensor x = nan_output({2, 3, 4, 6}, DType::f32, f);
    CHECK(message(x, y, jobs, lut).empty());
    for (float v : host_values(x)) REQUIRE(v == 0.0f);
  }
  const std::string wrong_c = message(nan_output({2, 1, 4, 6}, DType::f32), y, jobs, lut);
  CHECK(wrong_c.find("(B, 3, 4, 6)") != std::string::npos);
  CHECK(wrong_c.find("[2, 1, 4, 6]") != std::string::npos);
  CHECK_FALSE(message(nan_output({2, 3, 4, 6}, DType::f64), y, jobs, lut).empty());
  CHECK(message(nan_output({3, 3, 4, 6}, DType::f32), Tensor(), jobs, lut).find("jobs") !=
        std::string::npos);
  CHECK(message(nan_output({2, 3, 4, 6}, DType::f32), y, jobs, empty({256}, gpu_opts(DType::f32)))
            .find("lut") != std::string::npos);
  CHECK(message(nan_output({2, 3, 4, 6}, DType::f32), empty({3}, gpu_opts(DType::i64)), jobs, lut)
            .find("y must be") != std::string::npos);
}
