// ImageFolder and ImageLoader: class discovery and errors, batches and labels, determinism
// across worker counts, sharding, bad-file handling, the CPU feeder and synthetic source,
// and Fashion-MNIST exported as PNG files loaded end to end. decode_image_folder (small photos
// decoded once into memory), small_image_side and channel_stats.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "data/device_batches.h"
#include "data/export_images.h"
#include "data/fashion_mnist.h"
#include "data/folder_tensors.h"
#include "data/gpu_jpeg.h"
#include "data/image_folder.h"
#include "data/image_loader.h"
#include "data/prefetch.h"
#include "image_test_util.h"
#include "tests/test_util.h"

using namespace kiln;
using namespace kiln::data;
using kiln::testing::TempDir;
namespace fs = std::filesystem;
using kiln::testing::error_of;

namespace {

// Files of `n` solid images: red = 40 * class + 10 identifies the class, green the file id.
// Class c gets files id with id % classes == c; sizes vary so the transforms resample.
void make_solid_folder(const TempDir& dir, int64_t n, int64_t classes) {
  for (int64_t id = 0; id < n; ++id) {
    const int64_t c = id % classes;
    const std::string path =
        dir / ("class" + std::to_string(c) + "/img" + std::to_string(100 + id) + ".png");
    testing::write_png_at(
        path, testing::solid_image(9 + id % 5, 12 + id % 7, uint8_t(40 * c + 10), uint8_t(id), 77));
  }
}

// Files with random content and varied sizes (augmentation shows in the bytes).
void make_random_folder(const TempDir& dir, int64_t n) {
  Generator g(7);
  for (int64_t id = 0; id < n; ++id) {
    Image im;
    im.height = 20 + int64_t(g.below(30));
    im.width = 20 + int64_t(g.below(30));
    im.pixels.resize(size_t(im.height * im.width * 3));
    for (auto& p : im.pixels) p = uint8_t(g.below(256));
    const std::string path = dir / ("c" + std::to_string(id % 3) + "/" + std::to_string(id) +
                                    (id % 2 ? ".png" : ".jpg"));
    fs::create_directories(fs::path(path).parent_path());
    if (id % 2)
      write_png(path, im);
    else
      write_jpeg(path, im, 90);
  }
}

// (path, size, mtime) of everything under `root`.
std::map<std::string, std::pair<uintmax_t, fs::file_time_type>> snapshot(const fs::path& root) {
  std::map<std::string, std::pair<uintmax_t, fs::file_time_type>> m;
  for (const auto& e : fs::recursive_directory_iterator(root))
    m[e.path().string()] = {e.is_regular_file() ? e.file_size() : 0, e.last_write_time()};
  return m;
}

std::vector<std::vector<uint8_t>> run_epoch(const ImageLoader& loader, int64_t e,
                                            std::vector<int64_t>* labels = nullptr) {
  std::vector<std::vector<uint8_t>> out;
  ImageEpoch ep = loader.epoch(e);
  while (std::optional<ImageBatch> b = ep.next()) {
    const uint8_t* p = b->images.data<uint8_t>();
    out.emplace_back(p, p + b->images.numel());
    if (labels)
      for (int64_t i = 0; i < b->labels.numel(); ++i)
        labels->push_back(b->labels.data<int64_t>()[i]);
  }
  return out;
}

}  // namespace

TEST_CASE("ImageFolder: sorted classes, recursive files, image extensions only") {
  TempDir dir;
  const Image im = testing::solid_image(2, 2, 1, 2, 3);
  testing::write_png_at(dir / "b_dog/2.png", im);
  testing::write_png_at(dir / "b_dog/1.JPG", im);  // content irrelevant: only listed
  testing::write_png_at(dir / "a_cat/x.jpeg", im);
  testing::write_png_at(dir / "a_cat/sub/y.Png", im);
  testing::write_raw(dir / "a_cat/notes.txt", {'h', 'i'});
  testing::write_raw(dir / "README.png", {'x'});  // a file in root is not a class
  const ImageFolder f(dir.path().string());
  CHECK(f.classes() == std::vector<std::string>{"a_cat", "b_dog"});
  REQUIRE(f.size() == 4);
  CHECK(f[0].path == dir / "a_cat/sub/y.Png");
  CHECK(f[1].path == dir / "a_cat/x.jpeg");
  CHECK(f[2].path == dir / "b_dog/1.JPG");
  CHECK(f[3].path == dir / "b_dog/2.png");
  CHECK(f[0].label == 0);
  CHECK(f[1].label == 0);
  CHECK(f[2].label == 1);
  CHECK(f[3].label == 1);
  CHECK(has_image_extension("a.JPEG"));
  CHECK_FALSE(has_image_extension("a.gif"));
  CHECK_FALSE(has_image_extension("jpg"));
}

TEST_CASE("ImageFolder: errors name the path") {
  TempDir dir;
  const std::string missing = dir / "nope";
  CHECK(error_of([&] { ImageFolder f(missing); }).find(missing) != std::string::npos);
  testing::write_raw(dir / "file.png", {1});
  CHECK(error_of([&] { ImageFolder f(dir / "file.png"); }).find("not a folder") !=
        std::string::npos);
  const std::string e = error_of([&] { ImageFolder f(dir.path().string()); });  // only a file
  CHECK(e.find("no class folders") != std::string::npos);
  fs::create_directories(dir / "empty_root");
  CHECK(error_of([&] { ImageFolder f(dir / "empty_root"); }).find("no class folders") !=
        std::string::npos);
  testing::write_png_at(dir / "r/full/a.png", testing::solid_image(2, 2, 0, 0, 0));
  fs::create_directories(dir / "r/hollow");
  testing::write_raw(dir / "r/hollow/a.txt", {1});
  const std::string e2 = error_of([&] { ImageFolder f(dir / "r"); });
  CHECK(e2.find(dir / "r/hollow") != std::string::npos);
  CHECK(e2.find("full") == std::string::npos);
}

TEST_CASE("ImageLoader: batches hold the right images and labels; shuffling; nothing written") {
  TempDir dir;
  make_solid_folder(dir, 23, 3);
  const auto before = snapshot(dir.path());
  const ImageFolder folder(dir.path().string());
  for (Augment aug : {Augment::Eval, Augment::Train}) {
    ImageLoaderOptions o;
    o.batch_size = 5;
    o.image_size = 6;
    o.resize_size = 8;
    o.augment = aug;
    o.seed = 11;
    o.workers = 2;
    const ImageLoader loader(folder, o);
    CHECK(loader.num_batches() == 5);
    std::vector<int64_t> seen;
    for (int64_t e = 0; e < 2; ++e) {
      const std::vector<int64_t> order = loader.order(e);
      REQUIRE(order.size() == 23);
      CHECK(std::set<int64_t>(order.begin(), order.end()).size() == 23);
      ImageEpoch ep = loader.epoch(e);
      CHECK(ep.size() == 5);
      int64_t pos = 0, k = 0;
      while (std::optional<ImageBatch> b = ep.next()) {
        CHECK(b->index == k++);
        const int64_t B = b->images.size(0);
        CHECK(b->images.shape() == Shape{B, 6, 6, 3});
        CHECK(B == (k == 5 ? 3 : 5));
        for (int64_t i = 0; i < B; ++i, ++pos) {
          const ImageSample& s = folder[order[size_t(pos)]];
          const int64_t id = std::stoll(fs::path(s.path).stem().string().substr(3)) - 100;
          CHECK(b->labels.data<int64_t>()[i] == s.label);
          const uint8_t* px = b->images.data<uint8_t>() + i * 6 * 6 * 3;
          for (int64_t p = 0; p < 36; ++p) {  // solid images stay solid under any transform
            REQUIRE(px[p * 3] == uint8_t(40 * s.label + 10));
            REQUIRE(px[p * 3 + 1] == uint8_t(id));
            REQUIRE(px[p * 3 + 2] == 77);
          }
        }
      }
      CHECK(pos == 23);
      seen.insert(seen.end(), order.begin(), order.end());
    }
    CHECK(!std::equal(seen.begin(), seen.begin() + 23, seen.begin() + 23));  // epochs differ
  }
  ImageLoaderOptions o;
  o.batch_size = 5;
  o.drop_last = true;
  o.shuffle = false;
  const ImageLoader dl(folder, o);
  CHECK(dl.num_batches() == 4);
  CHECK(dl.order(3)[0] == 0);
  CHECK(run_epoch(dl, 0).size() == 4);
  CHECK(snapshot(dir.path()) == before);
  CHECK_THROWS_AS(ImageLoader(folder, ImageLoaderOptions{.batch_size = 0}), Error);
  CHECK_THROWS_AS(ImageLoader(folder, ImageLoaderOptions{.rank = 2, .world_size = 2}), Error);
  CHECK_THROWS_AS(ImageLoader(folder, ImageLoaderOptions{.max_bad_fraction = 1.5}), Error);
}

TEST_CASE("ImageLoader: batches are bit-identical for 0, 1 and 3 workers") {
  TempDir dir;
  make_random_folder(dir, 14);
  const ImageFolder folder(dir.path().string());
  std::vector<std::vector<uint8_t>> ref;
  std::vector<int64_t> ref_labels;
  for (int w : {0, 1, 3}) {
    ImageLoaderOptions o;
    o.batch_size = 4;
    o.image_size = 16;
    o.seed = 3;
    o.workers = w;
    o.prefetch = w == 3 ? 1 : 0;
    const ImageLoader loader(folder, o);
    std::vector<int64_t> labels;
    const auto batches = run_epoch(loader, 1, &labels);
    if (w == 0) {
      ref = batches;
      ref_labels = labels;
      REQUIRE(ref.size() == 4);
      CHECK(run_epoch(loader, 2) != ref);  // another epoch, other crops
    } else {
      CHECK(batches == ref);
      CHECK(labels == ref_labels);
    }
  }
}

TEST_CASE("ImageLoader: an epoch started at batch k hands out the whole epoch's batches from k") {
  TempDir dir;
  make_random_folder(dir, 14);
  const ImageFolder folder(dir.path().string());
  ImageLoaderOptions o;
  o.batch_size = 4;
  o.image_size = 16;
  o.seed = 5;
  o.workers = 2;
  const ImageLoader loader(folder, o);
  std::vector<int64_t> labels;
  const auto whole = run_epoch(loader, 2, &labels);
  REQUIRE(whole.size() == 4);
  for (int64_t first : {1, 3, 4}) {
    CAPTURE(first);
    ImageEpoch ep = loader.epoch(2, first);
    CHECK(ep.size() == 4 - first);
    int64_t k = first;
    while (std::optional<ImageBatch> b = ep.next()) {
      REQUIRE(k < 4);
      CHECK(b->index == k);
      const uint8_t* p = b->images.data<uint8_t>();
      CHECK(std::vector<uint8_t>(p, p + b->images.numel()) == whole[size_t(k)]);
      for (int64_t i = 0; i < b->labels.numel(); ++i)
        CHECK(b->labels.data<int64_t>()[i] == labels[size_t(k * 4 + i)]);
      ++k;
    }
    CHECK(k == 4);
  }
  CHECK_THROWS_AS(loader.epoch(2, 5), Error);
}

TEST_CASE("ImageLoader: sharding splits each epoch's sequence across ranks") {
  TempDir dir;
  make_solid_folder(dir, 10, 2);
  const ImageFolder folder(dir.path().string());
  std::multiset<int64_t> all;
  for (int64_t r = 0; r < 3; ++r) {
    ImageLoaderOptions o;
    o.rank = r;
    o.world_size = 3;
    o.seed = 5;
    const ImageLoader loader(folder, o);
    CHECK(loader.samples_per_epoch() == 4);
    const auto ord = loader.order(0);
    all.insert(ord.begin(), ord.end());
  }
  CHECK(all.size() == 12);  // 10 padded to 12 by wrapping
  for (int64_t i = 0; i < 10; ++i) CHECK(all.count(i) >= 1);
}

TEST_CASE("ImageLoader: bad files are skipped, counted, named, replaced deterministically") {
  TempDir dir;
  make_solid_folder(dir, 10, 2);
  std::vector<uint8_t> good = read_file_bytes(dir / "class0/img100.png");
  testing::write_raw(dir / "class0/img150_bad_trunc.png",
                     std::vector<uint8_t>(good.begin(), good.begin() + 50));
  testing::write_raw(dir / "class1/img151_bad_garbage.jpg", {'n', 'o', 'p', 'e', 0, 1, 2});
  testing::write_raw(dir / "class1/img199_bad_empty.png", {});  // last: replacement wraps
  const ImageFolder folder(dir.path().string());
  REQUIRE(folder.size() == 13);
  // Expected: each position's own file, or the next good one in (unshuffled) order.
  std::vector<int64_t> want;
  for (int64_t p = 0; p < 13; ++p) {
    int64_t q = p;
    while (folder[q % 13].path.find("_bad_") != std::string::npos) ++q;
    want.push_back(q % 13);
  }
  std::vector<uint8_t> ref;
  for (int w : {0, 2}) {
    ImageLoaderOptions o;
    o.batch_size = 13;
    o.image_size = 4;
    o.shuffle = false;
    o.max_bad_fraction = 0.5;
    o.workers = w;
    o.warn = w == 0;  // the warnings appear once on stderr
    const ImageLoader loader(folder, o);
    ImageEpoch ep = loader.epoch(0);
    std::optional<ImageBatch> b = ep.next();
    REQUIRE(b);
    CHECK(ep.bad_count() == 3);
    const auto bad = loader.bad_files();
    REQUIRE(bad.size() == 3);
    for (const char* name :
         {"img150_bad_trunc.png", "img151_bad_garbage.jpg", "img199_bad_empty.png"})
      CHECK(std::count_if(bad.begin(), bad.end(), [&](const std::string& s) {
              return s.find(name) != std::string::npos;
            }) == 1);
    for (int64_t p = 0; p < 13; ++p) {
      const ImageSample& s = folder[want[size_t(p)]];
      CHECK(b->labels.data<int64_t>()[p] == s.label);
      CHECK(b->images.data<uint8_t>()[p * 48 + 1] ==
            uint8_t(std::stoll(fs::path(s.path).stem().string().substr(3)) - 100));
    }
    const uint8_t* px = b->images.data<uint8_t>();
    if (w == 0)
      ref.assign(px, px + b->images.numel());
    else
      CHECK(std::equal(ref.begin(), ref.end(), px));
    // Known-bad files are still counted in later epochs.
    ImageEpoch ep1 = loader.epoch(1);
    CHECK(ep1.next().has_value());
    CHECK(ep1.bad_count() == 3);
  }
  // Over the threshold: 3 bad > 0.1 * 13, and the default 1%, with no minimum allowance.
  for (double frac : {0.1, 0.01}) {
    ImageLoaderOptions o;
    o.batch_size = 4;
    o.shuffle = false;
    o.max_bad_fraction = frac;
    o.min_bad_files = 0;
    o.warn = false;
    const ImageLoader loader(folder, o);
    const std::string e = error_of([&] { run_epoch(loader, 0); });
    INFO(e);
    CHECK(e.find("max_bad_fraction") != std::string::npos);
    CHECK(e.find("_bad_") != std::string::npos);
  }
}

TEST_CASE("ImageFolder: looping and cross-class folder links are skipped and counted") {
  TempDir dir, outside;
  make_solid_folder(dir, 6, 2);  // class0: 3 files, class1: 3 files
  testing::write_png_at(outside / "extra/img900.png", testing::solid_image(9, 9, 1, 2, 3));
  fs::create_directory_symlink(dir.path() / "class0", dir.path() / "class0/loop");
  fs::create_directories(dir.path() / "class1/sub");
  fs::create_directory_symlink("..", dir.path() / "class1/sub/back");                 // loop via ..
  fs::create_directory_symlink(dir.path() / "class1", dir.path() / "class0/other");   // cross
  fs::create_directory_symlink(outside.path() / "extra", dir.path() / "class1/ext");  // followed
  const ImageFolder f(dir.path().string());
  CHECK(f.size() == 7);
  CHECK(f.skipped_links() == 3);
  int64_t in_class0 = 0;
  for (const ImageSample& s : f.samples()) {
    CAPTURE(s.path);
    // class0's files have ids 100, 102, 104; nothing of class1 may be labelled 0.
    const int64_t id = std::stoll(fs::path(s.path).stem().string().substr(3));
    if (s.label == 0) {
      ++in_class0;
      CHECK(id % 2 == 0);
    }
  }
  CHECK(in_class0 == 3);
}

TEST_CASE("ImageLoader: a small folder tolerates a few bad files; oversized files are bad files") {
  TempDir dir;
  make_solid_folder(dir, 10, 2);
  testing::write_raw(dir / "class1/img151_bad_garbage.jpg", {'n', 'o', 'p', 'e', 0, 1, 2});
  const ImageFolder folder(dir.path().string());
  REQUIRE(folder.size() == 11);
  ImageLoaderOptions o;
  o.batch_size = 4;
  o.image_size = 4;
  o.shuffle = false;
  o.augment = Augment::Eval;
  o.resize_size = 4;
  o.warn = false;
  {
    // Default limits: 1 bad file of 11 is over 1% but within min_bad_files; it is counted.
    const ImageLoader loader(folder, o);
    ImageEpoch ep = loader.epoch(0);
    int64_t n = 0;
    while (std::optional<ImageBatch> b = ep.next()) n += b->labels.numel();
    CHECK(n == 11);
    CHECK(ep.bad_count() == 1);
  }
  {
    // Every file is over a 10-byte cap: each is named as oversized, then the epoch fails.
    o.max_file_bytes = 10;
    o.min_bad_files = 2;
    const ImageLoader loader(folder, o);
    const std::string e = error_of([&] { run_epoch(loader, 0); });
    INFO(e);
    CHECK(e.find("min_bad_files = 2") != std::string::npos);
    const auto bad = loader.bad_files();
    REQUIRE(!bad.empty());
    CHECK(bad[0].find("over the per-file limit of 10 bytes") != std::string::npos);
  }
  CHECK_THROWS_AS(ImageLoader(folder, ImageLoaderOptions{.min_bad_files = -1}), Error);
}

TEST_CASE("DeviceFeeder on the CPU and the synthetic source") {
  TempDir dir;
  make_random_folder(dir, 7);
  const ImageFolder folder(dir.path().string());
  ImageLoaderOptions o;
  o.batch_size = 3;
  o.image_size = 8;
  o.workers = 1;
  const ImageLoader loader(folder, o);
  const auto raw = run_epoch(loader, 0);
  ImageEpoch ep = loader.epoch(0);
  DeviceFeeder feed(ep, Device::cpu());
  size_t k = 0;
  while (std::optional<DeviceBatch> b = feed.next()) {
    REQUIRE(k < raw.size());
    const int64_t B = b->x.size(0);
    CHECK(b->x.shape() == Shape{B, 3, 8, 8});
    CHECK(b->x.dtype() == DType::f32);
    for (int64_t i = 0; i < B; ++i)
      for (int64_t c = 0; c < 3; ++c)
        for (int64_t p = 0; p < 64; ++p) {
          const float want =
              (float(raw[k][size_t((i * 64 + p) * 3 + c)]) / 255.0f - kImageNetMean[c]) /
              kImageNetStd[c];
          REQUIRE(b->x.data<float>()[(i * 3 + c) * 64 + p] == doctest::Approx(want).epsilon(1e-6));
        }
    ++k;
  }
  CHECK(k == raw.size());
  CHECK_THROWS_AS(DeviceFeeder(ep, Device::cpu(), DType::f16), Error);

  SyntheticImages syn(4, 5, 10, Device::cpu(), DType::f32, 9);
  const DeviceBatch s0 = syn.next(), s1 = syn.next();
  CHECK(s0.x.shape() == Shape{4, 3, 5, 5});
  const Tensor px = syn.pixels_cpu(0);
  const uint8_t* p0 = px.data<uint8_t>();
  CHECK(s0.x.data<float>()[1 * 25 + 7] ==
        doctest::Approx((p0[7 * 3 + 1] / 255.0f - kImageNetMean[1]) / kImageNetStd[1]));
  CHECK(std::set<uint8_t>(p0, p0 + px.numel()).size() > 100);  // looks random
  int64_t differ = 0;
  for (int64_t i = 0; i < s0.x.numel(); ++i)
    differ += s0.x.data<float>()[i] != s1.x.data<float>()[i];
  CHECK(differ > s0.x.numel() / 2);
  for (int64_t i = 0; i < 4; ++i) {
    CHECK(s0.y.data<int64_t>()[i] >= 0);
    CHECK(s0.y.data<int64_t>()[i] < 10);
  }
}

TEST_CASE("Fashion-MNIST exported as PNG loads end to end") {
  if (!fs::exists(kFashionMnistDir)) {
    WARN_MESSAGE(false, "Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)");
    return;
  }
  const IdxPair d = load_fashion_mnist(Split::Train);
  const std::vector<std::string> names(kFashionMnistClasses.begin(), kFashionMnistClasses.end());
  TempDir dir;
  const std::string out = dir / "fmnist";
  CHECK(export_image_folder(d.images, d.labels, names, out, {.limit = 200}) == 200);
  CHECK(error_of([&] {
          export_image_folder(d.images, d.labels, names, out, {.limit = 1});
        }).find("not empty") != std::string::npos);
  const ImageFolder folder(out);
  REQUIRE(folder.num_classes() == 10);
  CHECK(folder.classes()[0] == "0_T-shirt_top");
  CHECK(folder.classes()[9] == "9_Ankle_boot");
  REQUIRE(folder.size() == 200);

  ImageLoaderOptions o;  // 28 -> Resize(28) + CenterCrop(28) is the identity: exact pixels
  o.batch_size = 64;
  o.image_size = 28;
  o.resize_size = 28;
  o.augment = Augment::Eval;
  o.shuffle = false;
  o.workers = 2;
  const ImageLoader loader(folder, o);
  ImageEpoch ep = loader.epoch(0);
  const uint8_t* src = d.images.contiguous().data<uint8_t>();
  const uint8_t* lab = d.labels.contiguous().data<uint8_t>();
  int64_t pos = 0;
  while (std::optional<ImageBatch> b = ep.next()) {
    for (int64_t i = 0; i < b->images.size(0); ++i, ++pos) {
      const int64_t idx = std::stoll(fs::path(folder[pos].path).stem().string());
      REQUIRE(idx < 200);
      CHECK(b->labels.data<int64_t>()[i] == int64_t(lab[idx]));
      const uint8_t* px = b->images.data<uint8_t>() + i * 28 * 28 * 3;
      for (int64_t p = 0; p < 28 * 28; ++p)
        for (int64_t c = 0; c < 3; ++c) REQUIRE(px[p * 3 + c] == src[idx * 784 + p]);
    }
  }
  CHECK(pos == 200);
  CHECK(ep.bad_count() == 0);

  // The training transform at ImageNet size through the same files.
  o.augment = Augment::Train;
  o.image_size = 224;
  o.shuffle = true;
  const ImageLoader train(folder, o);
  std::vector<int64_t> labels;
  const auto batches = run_epoch(train, 0, &labels);
  CHECK(batches.size() == 4);
  const auto order = train.order(0);
  for (size_t i = 0; i < labels.size(); ++i) CHECK(labels[i] == folder[order[i]].label);
}

TEST_CASE("OrderedPrefetch: index order, errors after the earlier items, early destruction") {
  for (int workers : {0, 1, 3}) {
    OrderedPrefetch<int64_t> q(10, workers, 2, [](int64_t k) {
      KILN_CHECK(k != 6, "item ", k, " fails");
      return k * k;
    });
    for (int64_t k = 0; k < 6; ++k) {
      std::optional<int64_t> v = q.next();
      REQUIRE(v.has_value());
      CHECK(*v == k * k);
    }
    CHECK(error_of([&] { q.next(); }).find("item 6 fails") != std::string::npos);
    CHECK_FALSE(q.next().has_value());
  }
  {  // dropped after one item while workers wait on a full queue: must not hang
    OrderedPrefetch<int64_t> q(1000, 3, 2, [](int64_t k) { return k; });
    CHECK(q.next() == std::optional<int64_t>(0));
  }
}

TEST_CASE("GPU JPEG path's adaptive share: one step per waiting batch, to where the workers just keep up") {
  using L = GpuJpegLoader;
  const double blocked = 2 * L::kBlockedS, calm = 0.5 * L::kBlockedS;
  const double ready = 0.5 * L::kWorkersBehindS, behind = 2 * L::kWorkersBehindS;
  CHECK(L::steer_share(0.3, calm, behind) == 0.3);                     // no wait: unchanged
  CHECK(L::steer_share(0.3, blocked, ready) == doctest::Approx(0.3 + L::kShareStep));
  CHECK(L::steer_share(0.3, blocked, behind) == doctest::Approx(0.3 - L::kShareStep));
  CHECK(L::steer_share(0.0, blocked, behind) == 0.0);                   // clamped below
  CHECK(L::steer_share(L::kMaxAdaptiveShare, blocked, ready) == L::kMaxAdaptiveShare);

  // A toy of the measured situation (docs/lab/input-pipeline.md, nvJPEG under a running step,
  // 2026-12-01): nvJPEG's call costs 10 ms whatever
  // it gets plus its images' share; the workers build the next batch meanwhile, so the decode
  // thread waits for them only for what the CPU's share costs beyond the call; the step hides
  // what fits in it. The decode thread's cycle (call + wait) is shortest, 22.5 ms, at share 0.5,
  // where the workers just keep up. Returns the lowest and highest share over batches
  // 200..599, starting from 0.
  auto run = [&](double step_s) {
    double share = 0.0, lo = 1.0, hi = 0.0;
    for (int batch = 0; batch < 600; ++batch) {
      const double decode_s = 0.010 + 0.025 * (1.0 - share);
      const double cpu_s = 0.045 * share;
      const double workers_s = std::max(0.0, cpu_s - decode_s);
      const double waited = std::max(0.0, decode_s + workers_s - step_s);
      share = L::steer_share(share, waited, workers_s);
      if (batch >= 200) {
        lo = std::min(lo, share);
        hi = std::max(hi, share);
      }
    }
    return std::pair{lo, hi};
  };
  // A 20 ms step: the input path is behind at every share, so the share settles at the fastest
  // one, where the CPU's share costs as long as nvJPEG's call: 35/70 = 0.5.
  auto [lo, hi] = run(0.020);
  CHECK(lo >= 0.5 - 0.03);
  CHECK(hi <= 0.5 + 0.03);
  // A 30 ms step: from share 0.2 on nothing waits, so the share stops there rather than moving
  // more work onto the CPU than keeping up needs.
  auto [lo30, hi30] = run(0.030);
  CHECK(lo30 >= 0.2 - 0.02);
  CHECK(hi30 <= 0.2 + 0.02);
}

// ---------------- small photos decoded once (data/folder_tensors.h) ----------------

namespace {

// An 8x8 RGB image whose pixel (y, x) channel c is (seed * 31 + y * 8 + x + 64 * c) mod 256.
Image pattern_image(int64_t side, int seed) {
  Image im;
  im.height = im.width = side;
  im.pixels.resize(size_t(side * side * 3));
  for (int64_t y = 0; y < side; ++y)
    for (int64_t x = 0; x < side; ++x)
      for (int64_t c = 0; c < 3; ++c)
        im.pixels[size_t((y * side + x) * 3 + c)] = uint8_t((seed * 31 + y * 8 + x + 64 * c) % 256);
  return im;
}

}  // namespace

TEST_CASE("decode_image_folder: CHW u8 in folder order, labels, the same for any thread count") {
  TempDir dir;
  // Two classes of 8x8 PNGs (kept exactly), and a few larger and smaller JPEGs (resized and
  // centre-cropped to 8x8 as the evaluation transform does).
  for (int i = 0; i < 12; ++i)
    testing::write_png_at(dir / ("c" + std::to_string(i % 2) + "/p" + std::to_string(10 + i) + ".png"),
                          pattern_image(8, i));
  Generator g(3);
  for (int i = 0; i < 5; ++i) {
    Image im;
    im.height = 5 + int64_t(g.below(20));
    im.width = 5 + int64_t(g.below(20));
    im.pixels.resize(size_t(im.height * im.width * 3));
    for (auto& p : im.pixels) p = uint8_t(g.below(256));
    fs::create_directories(dir.path() / "c1");
    write_jpeg(dir / ("c1/j" + std::to_string(i) + ".jpg"), im, 90);
  }
  const ImageFolder folder(dir.path().string());
  REQUIRE(folder.size() == 17);
  FolderTensorsOptions o;
  o.size = 8;
  const FolderTensors one = decode_image_folder(folder, o);
  CHECK(one.images.shape() == Shape{17, 3, 8, 8});
  CHECK(one.images.dtype() == DType::u8);
  CHECK(one.labels.shape() == Shape{17});
  CHECK(one.unreadable.empty());
  for (int64_t i = 0; i < folder.size(); ++i) {
    INFO(folder[i].path);
    CHECK(one.labels.data<int64_t>()[i] == folder[i].label);
    // An 8x8 PNG comes back exactly, channel-major.
    const std::string name = fs::path(folder[i].path).filename().string();
    if (name[0] != 'p') continue;
    const Image want = pattern_image(8, std::stoi(name.substr(1)) - 10);
    const uint8_t* got = one.images.data<uint8_t>() + i * 3 * 64;
    bool same = true;
    for (int64_t c = 0; c < 3; ++c)
      for (int64_t p = 0; p < 64; ++p) same &= got[c * 64 + p] == want.pixels[size_t(p * 3 + c)];
    CHECK(same);
  }
  // Threads decode into their own slots: bit for bit the same for 1, 3 and 40 threads (more than
  // files).
  for (int threads : {3, 40}) {
    o.threads = threads;
    const FolderTensors many = decode_image_folder(folder, o);
    CHECK(std::memcmp(many.images.raw_data(), one.images.raw_data(), one.images.nbytes()) == 0);
    CHECK(std::memcmp(many.labels.raw_data(), one.labels.raw_data(), one.labels.nbytes()) == 0);
  }
  // Bad options are kiln::Errors, not crashes.
  o.size = 0;
  CHECK_THROWS_AS(decode_image_folder(folder, o), Error);
  o.size = 8;
  o.threads = 0;
  CHECK_THROWS_AS(decode_image_folder(folder, o), Error);
}

TEST_CASE("decode_image_folder: unreadable files are skipped and counted; past the limit an IoError") {
  TempDir dir;
  for (int i = 0; i < 10; ++i)
    testing::write_png_at(dir / ("c" + std::to_string(i % 2) + "/p" + std::to_string(10 + i) + ".png"),
                          pattern_image(6, i));
  testing::write_raw(dir / "c0/p11_bad.png", {'n', 'o', 't', 0, 1});
  testing::write_raw(dir / "c1/p99_empty.jpg", {});
  const ImageFolder folder(dir.path().string());
  REQUIRE(folder.size() == 12);
  FolderTensorsOptions o;
  o.size = 6;
  o.threads = 2;
  o.warn = false;
  const FolderTensors t = decode_image_folder(folder, o);
  CHECK(t.images.shape() == Shape{10, 3, 6, 6});
  REQUIRE(t.unreadable.size() == 2);
  CHECK(t.unreadable[0].find("p11_bad.png") != std::string::npos);
  CHECK(t.unreadable[1].find("p99_empty.jpg") != std::string::npos);
  CHECK(t.unreadable[0].find(" [") == std::string::npos);  // the file's fault: no source location
  // The kept images keep their labels: five of each class.
  int64_t ones = 0;
  for (int64_t i = 0; i < 10; ++i) ones += t.labels.data<int64_t>()[i];
  CHECK(ones == 5);
  // The same folder with a limit of one bad file: an IoError naming the folder and the files.
  o.min_bad_files = 1;
  o.max_bad_fraction = 0.0;
  try {
    decode_image_folder(folder, o);
    FAIL("no IoError");
  } catch (const IoError& e) {
    const std::string m = e.what();
    CHECK(m.rfind("'" + dir.path().string() + "': 2 of its 12 image files cannot be read", 0) == 0);
    CHECK(m.find("p11_bad.png") != std::string::npos);
  }
}

TEST_CASE("small_image_side: the largest probed side up to the limit, 0 above it") {
  TempDir dir;
  testing::write_png_at(dir / "a/1.png", testing::solid_image(32, 32, 1, 2, 3));
  testing::write_png_at(dir / "a/2.png", testing::solid_image(30, 40, 1, 2, 3));
  testing::write_raw(dir / "b/3.png", {'x'});  // unreadable: says nothing
  {
    const ImageFolder f(dir.path().string());
    CHECK(small_image_side(f) == 40);
    CHECK(small_image_side(f, 39) == 0);
  }
  testing::write_png_at(dir / "b/4.png", testing::solid_image(65, 20, 1, 2, 3));
  const ImageFolder f(dir.path().string());
  CHECK(small_image_side(f) == 0);
  // Probing 1 file looks at the first one only.
  CHECK(small_image_side(f, 64, 1) == 32);
}

TEST_CASE("channel_stats: exact per-channel mean and standard deviation on the 0..1 scale") {
  // Channel 0 holds 0 and 255 equally (mean 0.5, std 0.5), channel 1 is constant 51 (0.2, 0).
  Tensor x = zeros({2, 2, 1, 2}, DType::u8);
  uint8_t* p = x.data<uint8_t>();
  const uint8_t v[8] = {0, 255, 51, 51, 255, 0, 51, 51};
  std::memcpy(p, v, 8);
  std::vector<float> mean, sd;
  channel_stats(x, &mean, &sd);
  REQUIRE(mean.size() == 2);
  CHECK(mean[0] == doctest::Approx(0.5));
  CHECK(sd[0] == doctest::Approx(0.5));
  CHECK(mean[1] == doctest::Approx(0.2));
  CHECK(sd[1] == doctest::Approx(0.0).epsilon(1e-5));
  CHECK_THROWS_AS(channel_stats(zeros({2, 2}, DType::u8), &mean, &sd), Error);
}
