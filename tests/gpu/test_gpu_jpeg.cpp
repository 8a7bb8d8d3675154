// The GPU input path (data/gpu_jpeg.h) against the CPU path on the same folder: same labels and
// order, pixels within a measured tolerance (nvJPEG vs libjpeg-turbo decoding, the CPU path's DCT
// scaling and u8 rounding), identical batches for 1 and 4 workers, files nvJPEG does not take
// (PNG, progressive, CMYK, grayscale) and bad files (skipped and counted, never a crash); the
// stall guard with failover off (a wedge) and on (the CPU path takes over, bit for bit).
#include <doctest/doctest.h>

#include <execinfo.h>
#include <pthread.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <csignal>
#include <mutex>
#include <cmath>
#include <filesystem>
#include <memory>
#include <thread>

#include "cuda/runtime.h"
#include "data/gpu_jpeg.h"
#include "data/image_loader.h"
#include "data/jpeg_turbo.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/image_test_util.h"
#include "tests/jpeg_test_util.h"

using namespace kiln;
using namespace kiln::data;
using kiln::testing::TempDir;
namespace fs = std::filesystem;

namespace {

// Mean |a - b| of two normalised batches, in 0..255 pixel levels (stddev ~0.225).
constexpr double kMeanLevels = 3.0;

Image photo(int64_t h, int64_t w, uint64_t seed) {
  Generator g(seed);
  Image im;
  im.height = h;
  im.width = w;
  im.pixels.resize(size_t(h * w * 3));
  for (int64_t y = 0; y < h; ++y)
    for (int64_t x = 0; x < w; ++x)
      for (int c = 0; c < 3; ++c) {
        double v = 128 + 100 * std::sin(0.04 * double(x) * (c + 1) + 0.025 * double(y));
        if ((x / 41 + y / 29) % 3 == 0) v = 255 - v;
        v += double(g.below(12)) - 6;
        im.pixels[size_t((y * w + x) * 3 + c)] = uint8_t(std::clamp(v, 0.0, 255.0));
      }
  return im;
}

void put(const TempDir& dir, const std::string& rel, const std::vector<uint8_t>& bytes) {
  testing::write_raw(dir / rel, bytes);
}

// n baseline JPEGs (quality 90) alternating between classes c0 and c1, named 10.jpg, 11.jpg,
// ...; image i is photo(h0 + dh * i, w, i).
void two_classes(const TempDir& dir, int n, int64_t h0, int64_t dh, int64_t w) {
  for (int i = 0; i < n; ++i) {
    fs::create_directories(dir.path() / ("c" + std::to_string(i % 2)));
    write_jpeg(dir / ("c" + std::to_string(i % 2) + "/" + std::to_string(10 + i) + ".jpg"),
               photo(h0 + dh * i, w, uint64_t(i)), 90);
  }
}

}  // namespace

namespace kiln::testing {
namespace {
// Prints this thread's stack to stderr (glibc backtrace; addr2line turns the +0x offsets into
// lines) when it is still running `seconds` after construction, then every `seconds`.
void print_stack(int) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  const char msg[] = "---- stack of the watched thread ----\n";
  (void)!write(2, msg, sizeof msg - 1);
  backtrace_symbols_fd(frames, n, 2);
}
class StackOnStall {
 public:
  explicit StackOnStall(double seconds) : target_(pthread_self()) {
    std::signal(SIGUSR1, print_stack);
    thread_ = std::thread([this, seconds] {
      std::unique_lock lk(mu_);
      while (!cv_.wait_for(lk, std::chrono::duration<double>(seconds), [this] { return done_; }))
        pthread_kill(target_, SIGUSR1);
    });
  }
  void stop() {
    {
      std::lock_guard lk(mu_);
      done_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    std::signal(SIGUSR1, SIG_DFL);
  }
  ~StackOnStall() { stop(); }

 private:
  pthread_t target_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};
}  // namespace
}  // namespace kiln::testing

namespace {

std::vector<double> values(const Tensor& t) {
  Tensor h = t.to(Device::cpu()).to(DType::f64).contiguous();
  return std::vector<double>(h.data<double>(), h.data<double>() + h.numel());
}

}  // namespace

TEST_CASE("GPU JPEG path: same samples as the CPU path, pixels within tolerance; bad files") {
  if (!gpu_jpeg_available()) {
    MESSAGE("kiln built without nvJPEG: skipped");
    return;
  }
  TempDir dir;
  Generator g(3);
  for (int i = 0; i < 40; ++i) {
    const Image im = photo(200 + int64_t(g.below(200)), 200 + int64_t(g.below(200)), uint64_t(i));
    const std::string rel = "c" + std::to_string(i % 3) + "/" + std::to_string(i);
    fs::create_directories(dir.path() / ("c" + std::to_string(i % 3)));
    if (i == 5) {
      write_png(dir / (rel + ".png"), im);
#ifdef KILN_WITH_LIBJPEG
    } else if (i == 6) {
      Image gray;
      gray.height = im.height;
      gray.width = im.width;
      gray.channels = 1;
      for (int64_t p = 0; p < im.height * im.width; ++p)
        gray.pixels.push_back(im.pixels[size_t(p * 3)]);
      put(dir, rel + ".jpg", testing::libjpeg_encode(gray, 90, false));  // one component
    } else if (i == 7) {
      put(dir, rel + ".jpg", testing::libjpeg_encode(im, 90, true));  // progressive
    } else if (i == 8) {
      put(dir, rel + ".jpg", testing::libjpeg_encode(im, 90, false, true));  // CMYK
    } else if (i == 9) {
      // Arithmetic-coded: the header rule keeps it on the host.
      put(dir, rel + ".jpg", testing::libjpeg_encode(im, 90, false, false, true));
#endif
    } else {
      write_jpeg(dir / (rel + ".jpg"), im, 90);
    }
  }
  const std::vector<uint8_t> good = read_file_bytes(dir / "c0/0.jpg");
  put(dir, "c1/bad_zero.jpg", {});
  put(dir, "c2/bad_trunc.jpg", std::vector<uint8_t>(good.begin(), good.begin() + 300));
  put(dir, "c0/bad_text.jpg", {'h', 'e', 'l', 'l', 'o'});
  const ImageFolder folder(dir.path().string());
  for (Augment aug : {Augment::Train, Augment::Eval}) {
    ImageLoaderOptions o;
    o.batch_size = 8;
    o.image_size = 64;
    o.resize_size = 73;
    o.augment = aug;
    o.seed = 4;
    o.max_bad_fraction = 0.2;
    o.warn = false;
    o.drop_last = true;
    std::vector<std::vector<double>> ref_x;
    std::vector<std::vector<int64_t>> ref_y;
    int64_t gpu_samples = 0, host_samples = 0;
    for (int w : {1, 4}) {
      o.workers = w;
      GpuJpegLoader loader(folder, o, gputest::kGpu, DType::f32);
      if (w == 1) {
        const std::string backend = loader.backend();
        MESSAGE("nvJPEG backend: ", backend);
        // Which files nvJPEG takes (the host decodes the rest): found, not assumed.
        for (const char* f :
             {"c0/0.jpg", "c2/5.png", "c0/6.jpg", "c1/7.jpg", "c2/8.jpg", "c0/9.jpg"})
          if (fs::exists(dir / f))
            MESSAGE(std::string(f), " decoded on the GPU: ", loader.decodes_on_gpu(dir / f));
        CHECK(loader.decodes_on_gpu(dir / "c0/0.jpg"));   // baseline 4:2:0 RGB
        CHECK_FALSE(loader.decodes_on_gpu(dir / "c2/5.png"));
#ifdef KILN_WITH_LIBJPEG
        CHECK_FALSE(loader.decodes_on_gpu(dir / "c2/8.jpg"));  // CMYK
        CHECK_FALSE(loader.decodes_on_gpu(dir / "c0/9.jpg"));  // arithmetic-coded
        if (backend == "hardware") CHECK_FALSE(loader.decodes_on_gpu(dir / "c1/7.jpg"));
#endif
      }
      GpuJpegEpoch ep = loader.epoch(2);
      int64_t k = 0;
      while (std::optional<DeviceBatch> b = ep.next()) {
        std::vector<double> x = values(b->x);
        Tensor yh = b->y.to(Device::cpu());
        std::vector<int64_t> y(yh.data<int64_t>(), yh.data<int64_t>() + yh.numel());
        if (w == 1) {
          ref_x.push_back(x);
          ref_y.push_back(y);
        } else {
          REQUIRE(size_t(k) < ref_x.size());
          CHECK(x == ref_x[size_t(k)]);  // bit-identical for any worker count
          CHECK(y == ref_y[size_t(k)]);
        }
        ++k;
      }
      CHECK(k == loader.num_batches());
      CHECK(ep.bad_count() == 3);
      gpu_samples = ep.gpu_decoded();
      host_samples = ep.host_decoded();
    }
    MESSAGE("samples decoded by nvJPEG: ", gpu_samples, ", on the host: ", host_samples);
    CHECK(gpu_samples > 20);
    CHECK(host_samples >= 1);  // at least the PNG
    // The CPU path on the same folder and seeds: same labels, close pixels.
    o.workers = 2;
    ImageLoader cpu(folder, o);
    ImageEpoch ep = cpu.epoch(2);
    DeviceFeeder feed(ep, Device::cpu());
    double sum = 0, worst = 0;
    int64_t n = 0, k = 0;
    while (std::optional<DeviceBatch> b = feed.next()) {
      const std::vector<double> x = values(b->x);
      const Tensor& yc = b->y;
      REQUIRE(size_t(k) < ref_x.size());
      CHECK(std::vector<int64_t>(yc.data<int64_t>(), yc.data<int64_t>() + yc.numel()) ==
            ref_y[size_t(k)]);
      for (size_t i = 0; i < x.size(); ++i) {
        const double d = std::abs(x[i] - ref_x[size_t(k)][i]) * 0.225 * 255.0;
        sum += d;
        worst = std::max(worst, d);
        ++n;
      }
      ++k;
    }
    MESSAGE(std::string(aug == Augment::Train ? "train" : "eval"), ": GPU vs CPU path, mean ", sum / double(n),
            " levels, max ", worst);
    CHECK(sum / double(n) < kMeanLevels);
  }
}

TEST_CASE("GPU JPEG path: a valid header over corrupt scan data never crashes") {
  if (!gpu_jpeg_available()) {
    MESSAGE("kiln built without nvJPEG: skipped");
    return;
  }
  TempDir dir;
  two_classes(dir, 15, 120, 7, 160);
  std::vector<uint8_t> bad = read_file_bytes(dir / "c0/10.jpg");
  for (size_t i = bad.size() / 3; i + 2 < bad.size(); ++i) bad[i] = uint8_t(i * 13 + 1);
  put(dir, "c1/99_corrupt.jpg", bad);
  const ImageFolder folder(dir.path().string());
  ImageLoaderOptions o;
  o.batch_size = 16;
  o.image_size = 32;
  o.workers = 2;
  o.shuffle = false;
  o.max_bad_fraction = 0.5;
  o.warn = false;
  GpuJpegLoader loader(folder, o, gputest::kGpu);
  GpuJpegEpoch ep = loader.epoch(0);
  std::optional<DeviceBatch> b = ep.next();
  REQUIRE(b);
  CHECK(b->x.size(0) == 16);
  CHECK_FALSE(ep.next().has_value());
  const std::vector<double> x = values(b->x);
  CHECK(std::all_of(x.begin(), x.end(), [](double v) { return std::isfinite(v); }));
  // nvJPEG may decode the corrupt scan (garbage pixels, no error: what the H200's hardware
  // decoder did in device call 2) or fail the batch, whose samples then go to the host, where
  // libjpeg rejects the file and it is replaced.
  MESSAGE("corrupt scan: bad files counted ", ep.bad_count(), ", host-decoded samples ",
          ep.host_decoded());
  CHECK(ep.bad_count() <= 1);
}

TEST_CASE("GPU JPEG path: host_fraction sends a fixed share of the files to the CPU path") {
  if (!gpu_jpeg_available()) {
    MESSAGE("kiln built without nvJPEG: skipped");
    return;
  }
  TempDir dir;
  two_classes(dir, 32, 100, 3, 130);
  const ImageFolder folder(dir.path().string());
  ImageLoaderOptions o;
  o.batch_size = 8;
  o.image_size = 32;
  o.seed = 2;
  o.warn = false;
  for (double frac : {0.0, 0.5, 1.0}) {
    std::vector<std::vector<double>> ref;
    for (int w : {1, 3}) {
      o.workers = w;
      GpuJpegLoader loader(folder, o, gputest::kGpu, DType::f32, NormalizeStats{}, frac);
      GpuJpegEpoch ep = loader.epoch(0);
      size_t k = 0;
      while (std::optional<DeviceBatch> b = ep.next()) {
        if (w == 1)
          ref.push_back(values(b->x));
        else
          CHECK(values(b->x) == ref[k]);  // the same files go to the host for any worker count
        ++k;
      }
      CHECK(ep.gpu_decoded() + ep.host_decoded() == 32);
      if (frac == 0.0) CHECK(ep.host_decoded() == 0);
      if (frac == 1.0) CHECK(ep.gpu_decoded() == 0);
      if (frac == 0.5) {
        CHECK(ep.host_decoded() > 4);
        CHECK(ep.gpu_decoded() > 4);
      }
    }
  }
  CHECK_THROWS_AS(GpuJpegLoader(folder, o, gputest::kGpu, DType::f32, NormalizeStats{}, 1.5),
                  Error);
}

// Next to last in this file: it leaves a decode thread running for 4 s.
TEST_CASE("GPU JPEG path: with failover off, a decode call that never returns wedges the loader") {
  if (!gpu_jpeg_available()) {
    MESSAGE("kiln built without nvJPEG: skipped");
    return;
  }
  TempDir dir;
  two_classes(dir, 24, 90, 2, 120);
  ImageLoaderOptions o;
  o.batch_size = 8;
  o.image_size = 32;
  o.workers = 2;
  o.warn = false;
  auto loader = std::make_unique<GpuJpegLoader>(ImageFolder(dir.path().string()), o,
                                                gputest::kGpu, DType::f32);
  // The second batch's nvJPEG call "hangs" for 4 s; the guard gives up after 1 s.
  loader->set_failover(false);
  loader->set_stall_timeout(1.0);
  loader->set_test_stall(1, 4.0);
  std::string handled;
  loader->set_stall_handler([&](const std::string& m) { handled = m; });
  CHECK_THROWS_AS(loader->set_stall_timeout(0.0), Error);
  auto ep = std::make_unique<GpuJpegEpoch>(loader->epoch(0));
  REQUIRE(ep->next().has_value());
  const auto t0 = std::chrono::steady_clock::now();
  std::string what;
  try {
    ep->next();
  } catch (const Error& e) {
    what = e.what();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(took >= 1.0);
  CHECK(took < 3.5);  // gave up before the "hung" call returned
  CHECK(what.find("nvjpegDecodeBatched") != std::string::npos);
  CHECK(what.find("--decoder cpu") != std::string::npos);
  CHECK(what.find(handled) != std::string::npos);  // the handler saw the same message first
  CHECK_FALSE(handled.empty());
  CHECK(loader->wedged());
  CHECK_FALSE(loader->failed_over());
  CHECK_THROWS_AS(ep->next(), Error);
  CHECK_THROWS_AS(loader->decodes_on_gpu((dir.path() / "c0/10.jpg").string()), Error);
  // Destroying them neither blocks on the stuck thread nor frees what it still uses: when the
  // call "returns" it finishes its batch on leaked, live state.
  const auto t1 = std::chrono::steady_clock::now();
  ep.reset();
  loader.reset();
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count() < 1.0);
  std::this_thread::sleep_for(std::chrono::seconds(4));
  CHECK_NOTHROW(cuda::synchronize());
}

// Last in this file: after it every GPU JPEG loader of the process decodes on the CPU.
TEST_CASE("GPU JPEG path: a decode stream that stops draining fails over to the CPU path") {
  if (!gpu_jpeg_available()) {
    MESSAGE("kiln built without nvJPEG: skipped");
    return;
  }
  TempDir dir;
  two_classes(dir, 44, 90, 2, 120);
  const ImageFolder folder(dir.path().string());
  ImageLoaderOptions o;
  o.batch_size = 8;
  o.image_size = 32;
  o.workers = 2;
  o.seed = 3;
  o.warn = false;
  // What the failover must give from the stuck batch on: every JPEG on the CPU path.
  std::vector<std::vector<double>> ref_x[2], ref_y[2];
  {
    GpuJpegLoader ref(folder, o, gputest::kGpu, DType::f32, NormalizeStats{}, 1.0);
    for (int e : {0, 1}) {
      GpuJpegEpoch ep = ref.epoch(e);
      while (std::optional<DeviceBatch> b = ep.next()) {
        ref_x[e].push_back(values(b->x));
        ref_y[e].push_back(values(b->y));
      }
    }
  }
  REQUIRE(ref_x[0].size() == 6);  // 44 / 8: five full batches and one of 4
  // The pixels agree bit for bit when the workers and the failover use the same decoder.
  const bool same_decoder = jpeg_turbo_available();
  auto check_batch = [&](int e, size_t k, const DeviceBatch& b) {
    REQUIRE(k < ref_x[e].size());
    CHECK(b.index == int64_t(k));
    CHECK(values(b.y) == ref_y[e][k]);
    if (same_decoder) CHECK(values(b.x) == ref_x[e][k]);
  };

  auto loader = std::make_unique<GpuJpegLoader>(folder, o, gputest::kGpu, DType::f32);
  // The third batch's work on the decode stream does not run for kStall s (a host function
  // sleeps on the stream, as the decode stream stopped draining in the hangs); the guard gives up
  // after 1 s. kiln's step stream and this thread never wait for the decode stream.
  constexpr double kStall = 12;
  loader->set_stall_timeout(1.0);
  loader->set_test_stall(2, kStall, GpuJpegLoader::TestStall::OnStream);
  const auto t0 = std::chrono::steady_clock::now();
  auto since_t0 = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  auto ep = std::make_unique<GpuJpegEpoch>(loader->epoch(0));
  // Should this thread be held up past the guard's second, say where (stack on stderr).
  testing::StackOnStall watch(4.0);
  size_t k = 0;
  std::string arrivals;  // seconds since t0 at which each batch came, for the log
  while (std::optional<DeviceBatch> b = ep->next()) {
    if (k >= 2) check_batch(0, k, *b);  // batches 0 and 1 came from nvJPEG
    CHECK(values(b->y) == ref_y[0][k]);
    arrivals += " " + std::to_string(since_t0()).substr(0, 5);
    ++k;
  }
  watch.stop();
  MESSAGE("batches arrived at (s):" << arrivals);
  CHECK(k == 6);
  CHECK(loader->failed_over());
  CHECK_FALSE(loader->wedged());
  CHECK(ep->gpu_decoded() == 16);
  CHECK(ep->host_decoded() == 44 - 16);
  // Later epochs start on the CPU path.
  {
    GpuJpegEpoch e1 = loader->epoch(1);
    size_t n = 0;
    while (std::optional<DeviceBatch> b = e1.next()) check_batch(1, n++, *b);
    CHECK(n == 6);
    CHECK(e1.gpu_decoded() == 0);
  }
  CHECK_FALSE(loader->decodes_on_gpu((dir.path() / "c0/10.jpg").string()));
  // All of that while the decode stream was still stuck, and destroying the loader and its epoch
  // (leaked: the stuck thread points into them) does not wait for it either.
  ep.reset();
  loader.reset();
  CHECK(since_t0() < kStall - 4);
  // The stall ends, the abandoned thread finishes on live state, and the device drains.
  std::this_thread::sleep_for(std::chrono::duration<double>(kStall + 1 - since_t0()));
  CHECK_NOTHROW(cuda::synchronize());
  // A loader made after the failover decodes on the CPU path from its first epoch.
  GpuJpegLoader late(folder, o, gputest::kGpu, DType::f32);
  GpuJpegEpoch e0 = late.epoch(0);
  size_t n = 0;
  while (std::optional<DeviceBatch> b = e0.next()) check_batch(0, n++, *b);
  CHECK(n == 6);
  CHECK(e0.gpu_decoded() == 0);
}
