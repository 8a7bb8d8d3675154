// DataLoader: batching, drop_last, shuffling determinism across runs and worker counts,
// normalisation, crop/flip, early exit and worker errors.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include "core/device_query.h"
#include "data/device_loader.h"
#include "data/distributed_sampler.h"
#include "data/loader.h"

using namespace kiln;
using namespace kiln::data;

namespace {

// N images (N, C, H, W) whose pixels encode (sample, position): ((i * 31 + p * 7) % 251);
// label i.
TensorDataset make_dataset(int64_t n, int64_t c = 1, int64_t h = 4, int64_t w = 4) {
  std::vector<uint8_t> px(size_t(n * c * h * w));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t p = 0; p < c * h * w; ++p)
      px[size_t(i * c * h * w + p)] = uint8_t((i * 31 + p * 7) % 251);
  std::vector<int64_t> labels(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) labels[size_t(i)] = i;
  return TensorDataset(from_vector(px, {n, c, h, w}, DType::u8),
                       from_vector(labels, {n}, DType::i64));
}

struct Run {
  std::vector<std::vector<int64_t>> labels;  // per batch
  std::vector<std::vector<float>> x;         // per batch
};
Run run_epoch(const DataLoader& loader, int64_t e) {
  Run r;
  int64_t expect_index = 0;
  for (Batch& b : loader.epoch(e)) {
    CHECK(b.index == expect_index++);
    CHECK(b.x.dtype() == DType::f32);
    CHECK(b.y.dtype() == DType::i64);
    CHECK(b.x.is_contiguous());
    r.labels.push_back(b.y.to_vector<int64_t>());
    r.x.push_back(b.x.to_vector<float>());
  }
  return r;
}
bool bit_equal(const Run& a, const Run& b) {
  if (a.labels != b.labels || a.x.size() != b.x.size()) return false;
  for (size_t i = 0; i < a.x.size(); ++i)
    if (a.x[i].size() != b.x[i].size() ||
        std::memcmp(a.x[i].data(), b.x[i].data(), a.x[i].size() * sizeof(float)) != 0)
      return false;
  return true;
}
std::vector<int64_t> flat(const Run& r) {
  std::vector<int64_t> v;
  for (auto& b : r.labels) v.insert(v.end(), b.begin(), b.end());
  return v;
}

// Independent reference: build the zero-padded image explicitly, crop at (top, left), mirror.
std::vector<uint8_t> reference_aug(const std::vector<uint8_t>& img, int64_t c, int64_t h, int64_t w,
                                   int64_t pad, int64_t top, int64_t left, bool flip) {
  const int64_t ph = h + 2 * pad, pw = w + 2 * pad;
  std::vector<uint8_t> padded(size_t(c * ph * pw), 0), out(size_t(c * h * w));
  for (int64_t k = 0; k < c; ++k)
    for (int64_t y = 0; y < h; ++y)
      for (int64_t x = 0; x < w; ++x)
        padded[size_t((k * ph + y + pad) * pw + x + pad)] = img[size_t((k * h + y) * w + x)];
  for (int64_t k = 0; k < c; ++k)
    for (int64_t y = 0; y < h; ++y)
      for (int64_t x = 0; x < w; ++x) {
        int64_t sx = flip ? (w - 1 - x) : x;
        out[size_t((k * h + y) * w + x)] = padded[size_t((k * ph + top + y) * pw + left + sx)];
      }
  return out;
}

}  // namespace

TEST_CASE("every sample exactly once per epoch; drop_last; pixels follow labels") {
  TensorDataset ds = make_dataset(10);
  for (int workers : {0, 1, 3}) {
    for (bool shuffle : {false, true}) {
      CAPTURE(workers);
      CAPTURE(shuffle);
      LoaderOptions o;
      o.batch_size = 3;
      o.shuffle = shuffle;
      o.workers = workers;
      DataLoader loader(ds, o);
      CHECK(loader.num_batches() == 4);
      Run r = run_epoch(loader, 0);
      REQUIRE(r.labels.size() == 4);
      CHECK(r.labels[0].size() == 3);
      CHECK(r.labels[3].size() == 1);
      std::vector<int64_t> seen = flat(r);
      CHECK(seen == loader.order(0));
      std::multiset<int64_t> ms(seen.begin(), seen.end());
      CHECK(ms.size() == 10);
      for (int64_t i = 0; i < 10; ++i) CHECK(ms.count(i) == 1);
      if (!shuffle) CHECK(seen == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
      // x of each sample is its own image / 255.
      for (size_t b = 0; b < r.labels.size(); ++b)
        for (size_t j = 0; j < r.labels[b].size(); ++j) {
          const int64_t i = r.labels[b][j];
          for (int64_t p = 0; p < 16; ++p)
            CHECK(r.x[b][j * 16 + size_t(p)] == float((i * 31 + p * 7) % 251) / 255.0f);
        }

      o.drop_last = true;
      DataLoader dl(ds, o);
      CHECK(dl.num_batches() == 3);
      auto ep = dl.epoch(0);
      CHECK(ep.size() == 3);
      std::set<int64_t> distinct;
      int64_t batches = 0;
      while (std::optional<Batch> b = ep.next()) {
        CHECK(b->y.size(0) == 3);
        for (int64_t v : b->y.to_vector<int64_t>()) distinct.insert(v);
        ++batches;
      }
      CHECK(batches == 3);
      CHECK(distinct.size() == 9);
      CHECK(!ep.next().has_value());  // stays at the end
    }
  }
}

TEST_CASE("shuffle and augmentation are deterministic across runs and worker counts") {
  TensorDataset ds = make_dataset(37, 2, 5, 6);
  LoaderOptions o;
  o.batch_size = 4;
  o.shuffle = true;
  o.seed = 1234;
  o.crop_padding = 2;
  o.horizontal_flip = true;
  o.mean = {0.5f, 0.25f};
  o.stddev = {0.5f, 2.0f};
  o.workers = 0;
  const Run ref0 = run_epoch(DataLoader(ds, o), 0);
  const Run ref1 = run_epoch(DataLoader(ds, o), 1);
  for (int workers : {0, 1, 3}) {
    for (int prefetch : {0, 1, 5}) {
      CAPTURE(workers);
      CAPTURE(prefetch);
      o.workers = workers;
      o.prefetch = prefetch;
      DataLoader loader(ds, o);
      CHECK(bit_equal(run_epoch(loader, 0), ref0));
      CHECK(bit_equal(run_epoch(loader, 1), ref1));
    }
  }
  // Different epochs and different seeds give different orders and augmentations.
  CHECK(flat(ref0) != flat(ref1));
  o.seed = 1235;
  const Run other_seed = run_epoch(DataLoader(ds, o), 0);
  CHECK(flat(other_seed) != flat(ref0));
  // Same order without shuffling, but the augmentation still changes with the epoch.
  o.shuffle = false;
  DataLoader plain(ds, o);
  Run p0 = run_epoch(plain, 0), p1 = run_epoch(plain, 1);
  CHECK(flat(p0) == flat(p1));
  CHECK(!bit_equal(p0, p1));
}

TEST_CASE("an epoch started at batch k hands out the whole epoch's batches k, k + 1, ...") {
  TensorDataset ds = make_dataset(37, 2, 5, 6);
  LoaderOptions o;
  o.batch_size = 4;
  o.shuffle = true;
  o.seed = 99;
  o.crop_padding = 2;
  o.horizontal_flip = true;
  const int64_t n = 10;  // ceil(37 / 4)
  for (int workers : {0, 2}) {
    CAPTURE(workers);
    o.workers = workers;
    DataLoader loader(ds, o);
    REQUIRE(loader.num_batches() == n);
    const Run whole = run_epoch(loader, 3);
    for (int64_t first : {int64_t(0), int64_t(1), int64_t(7), n - 1, n}) {
      CAPTURE(first);
      Epoch ep = loader.epoch(3, first);
      CHECK(ep.size() == n - first);
      int64_t k = first;
      while (std::optional<Batch> b = ep.next()) {
        REQUIRE(k < n);
        CHECK(b->index == k);
        CHECK(b->y.to_vector<int64_t>() == whole.labels[size_t(k)]);
        const std::vector<float> x = b->x.to_vector<float>();
        CHECK(std::memcmp(x.data(), whole.x[size_t(k)].data(), x.size() * sizeof(float)) == 0);
        ++k;
      }
      CHECK(k == n);
    }
    CHECK_THROWS_AS(loader.epoch(3, n + 1), Error);
    CHECK_THROWS_AS(loader.epoch(3, -1), Error);
  }
}

TEST_CASE("normalisation per channel: (pixel / 255 - mean) / stddev") {
  std::vector<uint8_t> px = {0,   255, 51, 102,  // channel 0
                             10,  20,  30, 40,   // channel 1
                             128, 64,  32, 16};  // channel 2
  TensorDataset ds(from_vector(px, {1, 3, 2, 2}, DType::u8),
                   from_vector<int64_t>({7}, {1}, DType::u8));
  LoaderOptions o;
  o.batch_size = 8;
  o.mean = {0.1f, 0.2f, 0.3f};
  o.stddev = {0.5f, 0.25f, 2.0f};
  DataLoader loader(ds, o);
  Batch b = *loader.epoch(0).next();
  CHECK(b.x.shape() == Shape{1, 3, 2, 2});
  CHECK(b.y.to_vector<int64_t>() == std::vector<int64_t>{7});
  std::vector<float> x = b.x.to_vector<float>();
  for (size_t i = 0; i < px.size(); ++i) {
    const size_t c = i / 4;
    const double expect = (px[i] / 255.0 - o.mean[c]) / o.stddev[c];
    CHECK(x[i] == doctest::Approx(expect).epsilon(1e-6));
  }
  CHECK(x[0] == doctest::Approx(-0.2));
  CHECK(x[1] == doctest::Approx(1.8));
  // One mean/stddev for all channels.
  o.mean = {0.5f};
  o.stddev = {0.5f};
  x = DataLoader(ds, o).epoch(0).next()->x.to_vector<float>();
  CHECK(x[0] == doctest::Approx(-1.0));
  CHECK(x[1] == doctest::Approx(1.0));
  CHECK(x[8] == doctest::Approx(128 / 127.5 - 1.0));
}

TEST_CASE("crop_flip_normalize on a hand-made image") {
  // 1 channel, 2 x 3:   1 2 3
  //                     4 5 6
  const uint8_t img[] = {1, 2, 3, 4, 5, 6};
  std::vector<float> lut(256);
  for (int v = 0; v < 256; ++v) lut[size_t(v)] = float(v);
  std::vector<float> out(6);
  auto run = [&](int64_t pad, SampleTransform t) {
    crop_flip_normalize(img, 1, 2, 3, pad, t, lut.data(), out.data());
    return out;
  };
  CHECK(run(0, {0, 0, false}) == std::vector<float>{1, 2, 3, 4, 5, 6});
  CHECK(run(0, {0, 0, true}) == std::vector<float>{3, 2, 1, 6, 5, 4});
  CHECK(run(1, {1, 1, false}) == std::vector<float>{1, 2, 3, 4, 5, 6});  // centred crop
  // Crop at the padded corner (0, 0): the image moves down-right, zeros come in.
  CHECK(run(1, {0, 0, false}) == std::vector<float>{0, 0, 0, 0, 1, 2});
  // Crop at (2, 2): the image moves up-left.
  CHECK(run(1, {2, 2, false}) == std::vector<float>{5, 6, 0, 0, 0, 0});
  CHECK(run(1, {1, 2, false}) == std::vector<float>{2, 3, 0, 5, 6, 0});
  // Flip applies after the crop.
  CHECK(run(1, {1, 2, true}) == std::vector<float>{0, 3, 2, 0, 6, 5});
  // Padding takes lut[0] (normalised zero), not 0.
  lut[0] = -7;
  CHECK(run(1, {0, 1, false}) == std::vector<float>{-7, -7, -7, 1, 2, 3});
}

TEST_CASE("crop_flip_normalize with reflect padding mirrors about the edge pixels") {
  // 1 channel, 3 x 3:   1 2 3
  //                     4 5 6
  //                     7 8 9
  const uint8_t img[] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  std::vector<float> lut(256);
  for (int v = 0; v < 256; ++v) lut[size_t(v)] = float(v);
  std::vector<float> out(9);
  auto run = [&](int64_t pad, SampleTransform t) {
    crop_flip_normalize(img, 1, 3, 3, pad, t, lut.data(), out.data(), Padding::Reflect);
    return out;
  };
  CHECK(run(1, {1, 1, false}) == std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8, 9});
  // Crop at (0, 0): row -1 reads row 1, column -1 reads column 1 (torch's 'reflect').
  CHECK(run(1, {0, 0, false}) == std::vector<float>{5, 4, 5, 2, 1, 2, 5, 4, 5});
  // Crop at (2, 2): row 3 reads row 1, column 3 reads column 1.
  CHECK(run(1, {2, 2, false}) == std::vector<float>{5, 6, 5, 8, 9, 8, 5, 6, 5});
  // Pad 2 (the largest below the side 3): -2 reads 2, 4 reads 0.
  CHECK(run(2, {0, 0, false}) == std::vector<float>{9, 8, 7, 6, 5, 4, 3, 2, 1});
  // Flip before the shift, as with zero padding.
  CHECK(run(1, {1, 2, true}) == std::vector<float>{2, 3, 2, 5, 6, 5, 8, 9, 8});
  CHECK(reflect_index(-1, 5) == 1);
  CHECK(reflect_index(5, 5) == 3);
  CHECK(reflect_index(2, 5) == 2);
}

TEST_CASE("alternating flip: a coin per sample in epoch 0, then each epoch the other view") {
  const int64_t n = 64;
  LoaderOptions o;
  o.batch_size = 10;
  o.shuffle = true;
  o.horizontal_flip = true;
  o.alternating_flip = true;
  o.crop_padding = 1;
  o.padding = Padding::Reflect;
  o.seed = 5;
  const DataLoader loader(make_dataset(n, 1, 4, 4), o);
  // flips[e][i]: whether dataset sample i was mirrored in epoch e.
  std::vector<std::map<int64_t, bool>> flips(4);
  BatchPlan plan;
  for (int64_t e = 0; e < 4; ++e) {
    const std::vector<int64_t> order = loader.order(e);
    for (int64_t k = 0; k < loader.num_batches(); ++k) {
      loader.batch_plan(e, k, order, plan);
      for (size_t i = 0; i < plan.indices.size(); ++i) flips[size_t(e)][plan.indices[i]] = plan.transforms[i].flip;
    }
  }
  int first = 0;
  for (int64_t i = 0; i < n; ++i) {
    CAPTURE(i);
    first += flips[0].at(i);
    CHECK(flips[1].at(i) == !flips[0].at(i));
    CHECK(flips[2].at(i) == flips[0].at(i));
    CHECK(flips[3].at(i) == !flips[0].at(i));
  }
  CHECK(first > 16);  // a fair coin over 64 samples
  CHECK(first < 48);
  // The crops are still drawn at random: epochs 0 and 2 differ somewhere.
  bool differ = false;
  for (int64_t k = 0; k < loader.num_batches(); ++k) {
    BatchPlan a, b;
    loader.batch_plan(0, k, loader.order(0), a);
    loader.batch_plan(2, k, loader.order(2), b);
    for (size_t i = 0; i < a.transforms.size(); ++i)
      differ |= a.transforms[i].top != b.transforms[i].top || a.transforms[i].left != b.transforms[i].left;
  }
  CHECK(differ);
}

TEST_CASE("fixed_transform and tta_views: every sample one view; the views' weights sum to 1") {
  const TensorDataset ds = make_dataset(7, 2, 4, 4);
  for (int level : {0, 1, 2}) {
    CAPTURE(level);
    const std::vector<TtaView> views = tta_views(level);
    CHECK(views.size() == (level == 0 ? 1u : level == 1 ? 2u : 6u));
    double total = 0;
    for (const TtaView& v : views) {
      total += v.weight;
      LoaderOptions o;
      o.batch_size = 3;
      o.crop_padding = 1;
      o.padding = Padding::Reflect;
      o.fixed_transform = v.transform;
      const DataLoader loader(ds, o);
      const std::vector<float>& lut = loader.lut();
      for (Batch& b : loader.epoch(0)) {
        const std::vector<float> x = b.x.to_vector<float>();
        for (int64_t i = 0; i < b.y.numel(); ++i) {
          const int64_t idx = b.y.to_vector<int64_t>()[size_t(i)];
          std::vector<float> want(2 * 16);
          crop_flip_normalize(ds.image(idx), 2, 4, 4, 1, v.transform, lut.data(), want.data(),
                              Padding::Reflect);
          CHECK(std::memcmp(x.data() + i * 32, want.data(), 32 * sizeof(float)) == 0);
        }
      }
    }
    CHECK(total == doctest::Approx(1.0));
  }
  CHECK(tta_views(1)[1].transform == SampleTransform{1, 1, true});
  CHECK_THROWS_AS(tta_views(3), Error);
}

TEST_CASE("loader augmentation: every sample is one valid crop/flip, and all of them occur") {
  const int64_t n = 64, c = 2, h = 3, w = 4, pad = 1;
  TensorDataset ds = make_dataset(n, c, h, w);
  LoaderOptions o;
  o.batch_size = 16;
  o.crop_padding = pad;
  o.horizontal_flip = true;
  o.seed = 7;
  o.workers = 2;
  DataLoader loader(ds, o);
  std::map<std::tuple<int64_t, int64_t, bool>, int> seen;
  int flips = 0, total = 0;
  for (int64_t e = 0; e < 4; ++e) {
    for (Batch& b : loader.epoch(e)) {
      std::vector<float> x = b.x.to_vector<float>();
      std::vector<int64_t> y = b.y.to_vector<int64_t>();
      for (size_t j = 0; j < y.size(); ++j) {
        const uint8_t* src = ds.image(y[j]);
        std::vector<uint8_t> img(src, src + c * h * w);
        std::vector<uint8_t> got(size_t(c * h * w));
        for (size_t p = 0; p < got.size(); ++p)
          got[p] = uint8_t(std::lround(x[j * got.size() + p] * 255.0f));
        int matches = 0;
        std::tuple<int64_t, int64_t, bool> which;
        for (int64_t top = 0; top <= 2 * pad; ++top)
          for (int64_t left = 0; left <= 2 * pad; ++left)
            for (bool flip : {false, true})
              if (reference_aug(img, c, h, w, pad, top, left, flip) == got) {
                ++matches;
                which = {top, left, flip};
              }
        CHECK(matches == 1);  // the test images have no symmetric crops
        seen[which]++;
        flips += std::get<2>(which);
        ++total;
      }
    }
  }
  CHECK(total == 4 * n);
  CHECK(seen.size() == 18);         // all 3 x 3 offsets x 2 flips
  CHECK(flips > total * 35 / 100);  // p = 0.5 over 256 draws: bounds ~4.8 sigma out
  CHECK(flips < total * 65 / 100);
}

TEST_CASE("batch_plan names each batch's samples and augmentation (what DeviceLoader draws)") {
  const int64_t n = 29, c = 3, h = 4, w = 5, pad = 2;
  const TensorDataset ds = make_dataset(n, c, h, w);
  for (bool sharded : {false, true}) {
    CAPTURE(sharded);
    LoaderOptions o;
    o.batch_size = 8;  // the last batch is partial
    o.crop_padding = pad;
    o.horizontal_flip = true;
    o.seed = 11;
    o.workers = 2;
    if (sharded)
      o.sampler = std::make_shared<DistributedSampler>(n, 2, 1, DistributedSamplerOptions{true, 3});
    else
      o.shuffle = true;
    const DataLoader loader(ds, o);
    BatchPlan plan;  // reused across batches, as DeviceLoader does
    int flips = 0, total = 0;
    std::set<std::pair<int64_t, int64_t>> offsets;
    for (int64_t e = 0; e < 2; ++e) {
      const std::vector<int64_t> order = loader.order(e);
      std::vector<int64_t> visited;
      for (Batch& b : loader.epoch(e)) {
        loader.batch_plan(e, b.index, order, plan);
        const std::vector<int64_t> y = b.y.to_vector<int64_t>();
        REQUIRE(plan.indices.size() == y.size());
        REQUIRE(plan.transforms.size() == y.size());
        CHECK(plan.indices == y);  // make_dataset's label i is sample i
        const std::vector<float> x = b.x.to_vector<float>();
        std::vector<float> mine(size_t(c * h * w));
        for (size_t j = 0; j < y.size(); ++j) {
          const SampleTransform t = plan.transforms[j];
          REQUIRE(t.top >= 0);
          REQUIRE(t.top <= 2 * pad);
          REQUIRE(t.left >= 0);
          REQUIRE(t.left <= 2 * pad);
          // Independent reference: the explicitly padded image, cropped and mirrored.
          const uint8_t* src = ds.image(plan.indices[j]);
          const std::vector<uint8_t> ref = reference_aug(std::vector<uint8_t>(src, src + c * h * w),
                                                         c, h, w, pad, t.top, t.left, t.flip);
          for (size_t p = 0; p < ref.size(); ++p)
            REQUIRE(std::lround(x[j * ref.size() + p] * 255.0f) == ref[p]);
          // And bit for bit what the loader's own kernel makes of the plan with its lut().
          crop_flip_normalize(src, c, h, w, pad, t, loader.lut().data(), mine.data());
          CHECK(std::memcmp(mine.data(), x.data() + j * mine.size(), mine.size() * 4) == 0);
          flips += t.flip;
          offsets.insert({t.top, t.left});
          ++total;
        }
        visited.insert(visited.end(), plan.indices.begin(), plan.indices.end());
      }
      CHECK(visited == order);
    }
    CHECK(offsets.size() > 5);  // offsets are drawn, not fixed (25 possible, ~30-58 draws)
    CHECK(flips > 0);
    CHECK(flips < total);
    CHECK_THROWS_AS(loader.batch_plan(0, loader.num_batches(), loader.order(0), plan), Error);
    CHECK_THROWS_AS(loader.batch_plan(0, -1, loader.order(0), plan), Error);
    CHECK_THROWS_AS(loader.batch_plan(0, 0, std::vector<int64_t>{0, 1}, plan), Error);
  }
}

TEST_CASE("DeviceLoader needs a CUDA device (and a CUDA build)") {
  const DataLoader loader(make_dataset(8), LoaderOptions{});
  try {
    DeviceLoader d(loader, Device::cpu());
    FAIL("DeviceLoader accepted the CPU");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("needs a CUDA device, got cpu") != std::string::npos);
  }
  if (cuda_device_count() == 0) {  // CPU-only builds, or no GPU here: a clear refusal
    try {
      DeviceLoader d(loader, Device::cuda(0), DType::f16);
      FAIL("DeviceLoader accepted cuda:0 without a CUDA device");
    } catch (const Error& e) {
      const std::string m = e.what();
      CHECK(m.find("DeviceLoader: cuda:0 requested") != std::string::npos);
      CHECK(m.find(built_with_cuda() ? "CUDA device(s) are visible" : "built without CUDA") !=
            std::string::npos);
    }
  }
  LoaderOptions hooked;
  hooked.on_batch = [](Batch&) {};
  CHECK_THROWS_AS(DeviceLoader(DataLoader(make_dataset(8), hooked), Device::cuda(0)), Error);
  CHECK_THROWS_AS(DeviceLoader(loader, Device::cuda(0), DType::f64), Error);
}

TEST_CASE("early exit and consumer exceptions do not hang") {
  TensorDataset ds = make_dataset(200, 1, 8, 8);
  LoaderOptions o;
  o.batch_size = 2;
  o.workers = 3;
  o.prefetch = 2;
  o.shuffle = true;
  DataLoader loader(ds, o);
  int got = 0;
  for (Batch& b : loader.epoch(0)) {
    (void)b;
    if (++got == 2) break;
  }
  CHECK(got == 2);
  { auto ep = loader.epoch(1); }  // never consumed
  CHECK_THROWS_AS(
      [&] {
        for (Batch& b : loader.epoch(2))
          if (b.index == 5) KILN_FAIL("consumer gives up");
      }(),
      Error);
  // Moving an epoch keeps it running.
  auto ep = loader.epoch(3);
  auto moved = std::move(ep);
  int64_t count = 0;
  while (moved.next()) ++count;
  CHECK(count == 100);
}

TEST_CASE("an error while building batch k reaches the consumer after batches 0..k-1") {
  TensorDataset ds = make_dataset(20);
  for (int workers : {0, 1, 3}) {
    CAPTURE(workers);
    LoaderOptions o;
    o.batch_size = 2;
    o.workers = workers;
    o.on_batch = [](Batch& b) {
      if (b.index == 4) KILN_FAIL("bad batch ", b.index);
    };
    DataLoader loader(ds, o);
    auto ep = loader.epoch(0);
    std::vector<int64_t> indices;
    std::string msg;
    try {
      while (auto b = ep.next()) indices.push_back(b->index);
    } catch (const Error& e) {
      msg = e.what();
    }
    CHECK(indices == std::vector<int64_t>{0, 1, 2, 3});
    CHECK(msg.find("bad batch 4") != std::string::npos);
    CHECK(!ep.next().has_value());
  }
}

TEST_CASE("dataset and option validation") {
  Tensor img3 = zeros({4, 5, 6}, DType::u8);
  CHECK(TensorDataset(img3, zeros({4}, DType::u8)).channels() == 1);
  CHECK_THROWS_AS(TensorDataset(img3, zeros({3}, DType::i64)), Error);
  CHECK_THROWS_AS(TensorDataset(zeros({4, 5, 6}), zeros({4}, DType::i64)), Error);  // f32 images
  CHECK_THROWS_AS(TensorDataset(zeros({4, 5}, DType::u8), zeros({4}, DType::i64)), Error);
  CHECK_THROWS_AS(TensorDataset(img3, zeros({4}, DType::f32)), Error);
  TensorDataset ds = make_dataset(4, 3, 2, 2);
  auto bad = [&](auto edit) {
    LoaderOptions o;
    edit(o);
    return DataLoader(ds, o);
  };
  CHECK_THROWS_AS(bad([](LoaderOptions& o) { o.batch_size = 0; }), Error);
  CHECK_THROWS_AS(bad([](LoaderOptions& o) { o.workers = -1; }), Error);
  CHECK_THROWS_AS(bad([](LoaderOptions& o) { o.crop_padding = -1; }), Error);
  // Reflect padding reaches at most side - 1 pixels out (the images are 2 x 2).
  CHECK_THROWS_AS(bad([](LoaderOptions& o) {
                    o.crop_padding = 2;
                    o.padding = Padding::Reflect;
                  }),
                  Error);
  CHECK_NOTHROW(bad([](LoaderOptions& o) {
    o.crop_padding = 1;
    o.padding = Padding::Reflect;
  }));
  CHECK_THROWS_AS(bad([](LoaderOptions& o) {
                    o.crop_padding = 1;
                    o.fixed_transform = SampleTransform{3, 0, false};
                  }),
                  Error);
  CHECK_THROWS_AS(bad([](LoaderOptions& o) { o.mean = {0.1f, 0.2f}; }), Error);
  CHECK_THROWS_AS(bad([](LoaderOptions& o) { o.stddev = {1.0f, 0.0f, 1.0f}; }), Error);
  CHECK_NOTHROW(bad([](LoaderOptions& o) { o.mean = {0.1f, 0.2f, 0.3f}; }));
}
