// kiln-loader-bench: throughput of the ImageNet-style input pipeline: decoded + augmented images
// per second, in total and per worker, for each decoder and worker count, side by side.
//
//   kiln-loader-bench [--folder DIR] [--decoder stb,turbo,nvjpeg] [--workers 1,8,16] [-b 256]
//                     [--batches N] [--eval] [--json PATH]
//   kiln-loader-bench --generate N [--val M] [--classes C] [--output-dir DIR] ...
//
// Decoders: stb and turbo run data::ImageLoader (u8 batches on the host); nvjpeg runs
// data::GpuJpegLoader (file reading on the workers, batched nvJPEG decode and the fused
// crop/resize/normalise kernel on the GPU, f16 batches on the device; CUDA builds with nvJPEG
// only). Each row times --batches batches after one warm-up batch, and reports the process's
// CPU time (user + system, every thread) per image.
//
// --generate writes N ImageNet-like JPEGs (short side 300..500, aspect 3/4..4/3, textured so
// quality 90 gives ~100 KB a file; the corpus's measured mean size and pixels are printed) in
// --classes classes, into --output-dir (kept) or a temporary folder (deleted at exit). With
// --val M, DIR gets train/ (N) and val/ (M) as kiln-train --data wants; the benchmark reads
// train/. --batches 0 only generates.
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/version.h"
#include "core/generator.h"
#include "core/serialization.h"
#include "data/gpu_jpeg.h"
#include "data/image.h"
#include "data/image_loader.h"
#include "data/jpeg_turbo.h"
#include "tools/cli/cli.h"
#ifdef KILN_WITH_CUDA
#include "cuda/runtime.h"
#endif

namespace {

namespace fs = std::filesystem;
using namespace kiln;

// One ImageNet-like picture: a smooth colour field (bilinear over a coarse random grid), a few
// flat-coloured shapes with hard edges, oriented stripes, and per-pixel noise. The noise and
// stripe amplitudes set the JPEG size; they are tuned so that quality 90 gives ~100 KB at the
// corpus's mean of ~190 kpx (ImageNet's train set: ~110 KB).
data::Image imagenet_like(Generator& gen) {
  data::Image im;
  const int64_t short_side = 300 + int64_t(gen.below(201));
  const double aspect = std::exp(std::log(0.75) + (std::log(4.0 / 3.0) - std::log(0.75)) * gen.uniform());
  if (aspect >= 1.0) {
    im.height = short_side;
    im.width = int64_t(double(short_side) * aspect);
  } else {
    im.width = short_side;
    im.height = int64_t(double(short_side) / aspect);
  }
  const int64_t H = im.height, W = im.width;
  im.pixels.resize(size_t(H * W * 3));
  constexpr int G = 6;  // coarse grid
  float grid[G + 1][G + 1][3];
  for (auto& row : grid)
    for (auto& cell : row)
      for (float& v : cell) v = float(gen.uniform() * 255.0);
  struct Shape {
    double cy, cx, ry, rx;
    float rgb[3];
  };
  std::vector<Shape> shapes(4 + gen.below(6));
  for (Shape& s : shapes) {
    s.cy = gen.uniform() * double(H);
    s.cx = gen.uniform() * double(W);
    s.ry = 10 + gen.uniform() * double(H) / 4;
    s.rx = 10 + gen.uniform() * double(W) / 4;
    for (float& v : s.rgb) v = float(gen.uniform() * 255.0);
  }
  const double fy = 0.05 + gen.uniform() * 0.4, fx = 0.05 + gen.uniform() * 0.4;
  const double stripe = 10 + gen.uniform() * 20;
  uint64_t noise = gen.next_u64();
  for (int64_t y = 0; y < H; ++y) {
    const double gy = double(y) / double(H) * G;
    const int iy = std::min(int(gy), G - 1);
    const float ty = float(gy - iy);
    for (int64_t x = 0; x < W; ++x) {
      const double gx = double(x) / double(W) * G;
      const int ix = std::min(int(gx), G - 1);
      const float tx = float(gx - ix);
      float rgb[3];
      for (int c = 0; c < 3; ++c)
        rgb[c] = (1 - ty) * ((1 - tx) * grid[iy][ix][c] + tx * grid[iy][ix + 1][c]) +
                 ty * ((1 - tx) * grid[iy + 1][ix][c] + tx * grid[iy + 1][ix + 1][c]);
      for (const Shape& s : shapes) {
        const double dy = (double(y) - s.cy) / s.ry, dx = (double(x) - s.cx) / s.rx;
        if (dy * dy + dx * dx < 1.0)
          for (int c = 0; c < 3; ++c) rgb[c] = s.rgb[c];
      }
      const float st = float(stripe * std::sin(fy * double(y) + fx * double(x)));
      noise = noise * 6364136223846793005ULL + 1442695040888963407ULL;  // LCG: cheap per pixel
      for (int c = 0; c < 3; ++c) {
        const float n = float(int((noise >> (20 + 8 * c)) & 63) - 32);
        const float v = rgb[c] + st + n;
        im.pixels[size_t((y * W + x) * 3 + c)] = uint8_t(std::clamp(v, 0.0f, 255.0f));
      }
    }
  }
  return im;
}

struct CorpusStats {
  int64_t files = 0, bytes = 0, pixels = 0;
};

// Writes `n` images into root/class<i % classes>/ on all hardware threads; image i comes from a
// Generator seeded by (seed, i), so the corpus does not depend on the thread count.
CorpusStats generate_split(const fs::path& root, int64_t n, int64_t classes,
                           const std::string& format, uint64_t seed) {
  for (int64_t c = 0; c < classes; ++c) fs::create_directories(root / ("class" + std::to_string(c)));
  std::atomic<int64_t> next{0}, bytes{0}, pixels{0};
  std::vector<std::thread> threads;
  std::exception_ptr error;
  std::mutex mu;
  const int nt = int(std::max(1u, std::thread::hardware_concurrency()));
  for (int t = 0; t < nt; ++t)
    threads.emplace_back([&] {
      try {
        for (int64_t i; (i = next++) < n;) {
          Generator gen(derive_seed(seed, uint64_t(i), 7));
          const data::Image im = imagenet_like(gen);
          const std::string path =
              (root / ("class" + std::to_string(i % classes)) /
               (std::to_string(i) + "." + format))
                  .string();
          if (format == "png")
            data::write_png(path, im);
          else
            data::write_jpeg(path, im, 90);
          bytes += int64_t(fs::file_size(path));
          pixels += im.height * im.width;
        }
      } catch (...) {
        std::lock_guard lk(mu);
        error = std::current_exception();
        next = n;
      }
    });
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
  return {n, bytes.load(), pixels.load()};
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = s.find(',', pos);
    out.push_back(s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

double cpu_seconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         1e-6 * double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

struct Row {
  std::string decoder;
  int workers = 0;
  int64_t images = 0, batches = 0;
  double seconds = 0, cpu = 0;
  int64_t bad = 0;
};

// Times `batches` batches after a warm-up one, cycling over epochs; `epoch_fn(e)` returns an
// object with next() -> optional<batch> and bad_count(); `count(batch)` its images.
// `sync()` runs before each epoch's clock stops (the GPU path: wait for the device, so queued
// decodes and kernels are inside the timed window).
template <typename Loader, typename Count, typename Sync>
Row time_loader(Loader& loader, int64_t batches, Count count, Sync sync) {
  Row r;
  for (int64_t e = 0; r.batches < batches; ++e) {
    auto ep = loader.epoch(e);
    auto t0 = std::chrono::steady_clock::now();
    double c0 = cpu_seconds();
    bool first = e == 0;
    bool any = false;
    while (r.batches < batches) {
      auto b = ep.next();
      if (!b) break;
      any = true;
      if (first) {
        first = false;
        t0 = std::chrono::steady_clock::now();
        c0 = cpu_seconds();
        continue;
      }
      r.images += count(*b);
      ++r.batches;
    }
    sync();
    r.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.cpu += cpu_seconds() - c0;
    r.bad += ep.bad_count();
    if (!any) cli::usage_error("fewer images than one batch: lower --batch-size or add images");
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string temp_dir;
  const int rc = cli::run_tool("kiln-loader-bench", [&] {
    std::string folder, format = "jpg", json_path, out_dir, decoder_list;
    std::vector<int64_t> worker_list;
    int64_t batch = 64, batches = 20, generate = 512, val = 0, classes = 4;
    bool eval = false;
    cli::Parser p("kiln-loader-bench", "[--folder DIR] [--decoder LIST] [--workers LIST] [flags]",
                  "Decoded + augmented images per second of the ImageNet-style input pipeline, "
                  "per decoder and worker count.");
    p.version(kiln::version_line("kiln-loader-bench"));
    p.value("--folder", "DIR", &folder,
            "an ImageFolder (default: generate ImageNet-like JPEGs, see --generate)");
    p.value("--decoder", "LIST", &decoder_list,
            "comma-separated: stb, turbo, nvjpeg (default: stb, turbo when built with "
            "libjpeg-turbo, nvjpeg when built with nvJPEG and a GPU is present)");
    p.list("--workers", "LIST", &worker_list,
           "comma-separated worker counts (default 1,2,4,...,hardware threads)", 0);
    p.value("-b, --batch-size", "BATCH", &batch, "batch size", 1);
    p.value("--batches", "N", &batches, "timed batches per row (0: only generate)", 0);
    p.flag("--eval", &eval, "Resize(256)+CenterCrop(224) instead of RandomResizedCrop+flip");
    p.value("--json", "PATH", &json_path, "also write the rows as a JSON list of objects");
    p.value("--generate", "N", &generate, "ImageNet-like images to write when no --folder", 1);
    p.value("--val", "M", &val, "also write M validation images (DIR/train and DIR/val)", 0);
    p.value("--classes", "C", &classes, "class folders of the generated corpus", 1);
    p.value("--output-dir", "DIR", &out_dir,
            "write the generated corpus here and keep it (default: a temp folder, deleted)");
    p.choice("--format", &format, {"jpg", "png"}, "generated image format");
    if (!p.parse(argc, argv)) {
      std::fputs(p.info().c_str(), stdout);
      return 0;
    }
    std::vector<std::string> decoders = decoder_list.empty() ? std::vector<std::string>{}
                                                             : split(decoder_list);
    if (decoders.empty()) {
      decoders = {"stb"};
      if (data::jpeg_turbo_available()) decoders.push_back("turbo");
      if (data::gpu_jpeg_available()) decoders.push_back("nvjpeg");
    }
    for (const std::string& d : decoders) {
      if (d != "stb" && d != "turbo" && d != "nvjpeg")
        cli::usage_error("--decoder '", d, "': expected stb, turbo or nvjpeg");
      if (d == "turbo" && !data::jpeg_turbo_available())
        cli::usage_error("--decoder turbo: this kiln was built without libjpeg-turbo");
      if (d == "nvjpeg" && !data::gpu_jpeg_available())
        cli::usage_error("--decoder nvjpeg: this kiln was built without nvJPEG, or no GPU is "
                         "present");
    }
    std::vector<int> workers(worker_list.begin(), worker_list.end());
    if (workers.empty()) {
      const int hw = int(std::max(1u, std::thread::hardware_concurrency()));
      for (int w = 1; w < hw; w *= 2) workers.push_back(w);
      workers.push_back(hw);
    }
    const bool generated = folder.empty();
    if (generated) {
      fs::path root;
      if (out_dir.empty()) {
        std::string tmpl = (fs::temp_directory_path() / "kiln-loader-bench-XXXXXX").string();
        KILN_CHECK(mkdtemp(tmpl.data()) != nullptr, "kiln-loader-bench: cannot create a temp folder");
        root = temp_dir = tmpl;
      } else {
        root = out_dir;
        std::error_code ec;
        if (fs::exists(root, ec) && !(fs::is_directory(root, ec) && fs::is_empty(root, ec)))
          cli::usage_error("--output-dir '", out_dir,
                           "' exists and is not an empty folder (a corpus it holds can be read "
                           "with --folder); the generator writes into an empty or new folder only");
      }
      const fs::path train = val > 0 ? root / "train" : root;
      std::printf("generating %lld %s images in %lld classes under %s...\n",
                  static_cast<long long>(generate + val), format.c_str(),
                  static_cast<long long>(classes), root.string().c_str());
      std::fflush(stdout);
      const auto g0 = std::chrono::steady_clock::now();
      const CorpusStats st = generate_split(train, generate, classes, format, 1234);
      if (val > 0) generate_split(root / "val", val, classes, format, 5678);
      std::printf(
          "corpus: %lld train files, mean %.1f KB, mean %.1f kpx (%.2f bytes/pixel), "
          "generated in %.1f s\n",
          static_cast<long long>(st.files), double(st.bytes) / double(st.files) / 1e3,
          double(st.pixels) / double(st.files) / 1e3, double(st.bytes) / double(st.pixels),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - g0).count());
      folder = train.string();
    }
    if (batches == 0) return 0;
    const data::ImageFolder images =
        cli::user_input(generated ? "the generated corpus: " : "--folder: ",
                        [&] { return data::ImageFolder(folder); });
    std::printf(
        "%s: %lld images, %lld classes; batch %lld, %s\n", folder.c_str(),
        static_cast<long long>(images.size()), static_cast<long long>(images.num_classes()),
        static_cast<long long>(batch),
        eval ? "eval (resize 256 + center crop 224)" : "train (random resized crop 224 + flip)");
    std::printf("%8s %8s %10s %12s %16s %14s %10s %6s\n", "decoder", "workers", "images",
                "images/s", "images/s/worker", "cpu ms/image", "ms/batch", "bad");
    std::vector<Row> rows;
    for (int w : workers)
      for (const std::string& dec : decoders) {
        Row r;
        data::ImageLoaderOptions o;
        o.batch_size = batch;
        o.workers = w;
        o.augment = eval ? data::Augment::Eval : data::Augment::Train;
        o.drop_last = true;
        o.warn = false;
        if (dec == "nvjpeg") {
          data::GpuJpegLoader loader(images, o, Device::cuda(0));
          r = time_loader(
              loader, batches, [](const data::DeviceBatch& b) { return b.y.size(0); }, [] {
#ifdef KILN_WITH_CUDA
                cuda::synchronize();
#endif
              });
          std::printf("  (nvJPEG backend: %s)\n", loader.backend());
        } else {
          o.decoder = data::parse_jpeg_decoder(dec);
          data::ImageLoader loader(images, o);
          r = time_loader(
              loader, batches, [](const data::ImageBatch& b) { return b.images.size(0); }, [] {});
        }
        r.decoder = dec;
        r.workers = w;
        const double ips = double(r.images) / r.seconds;
        std::printf("%8s %8d %10lld %12.1f %16.1f %14.3f %10.2f %6lld\n", dec.c_str(), w,
                    static_cast<long long>(r.images), ips, ips / double(std::max(w, 1)),
                    1e3 * r.cpu / double(r.images), 1e3 * r.seconds / double(r.batches),
                    static_cast<long long>(r.bad));
        std::fflush(stdout);
        rows.push_back(r);
      }
    if (!json_path.empty()) {
      std::string f = "[\n";
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        char line[512];
        std::snprintf(line, sizeof line,
                      "  {\"decoder\": \"%s\", \"workers\": %d, \"images_per_s\": %.1f, "
                      "\"cpu_ms_per_image\": %.4f, \"ms_per_batch\": %.3f, \"images\": %lld, "
                      "\"batch\": %lld, \"augment\": \"%s\", \"bad\": %lld}%s\n",
                      r.decoder.c_str(), r.workers, double(r.images) / r.seconds,
                      1e3 * r.cpu / double(r.images), 1e3 * r.seconds / double(r.batches),
                      static_cast<long long>(r.images), static_cast<long long>(batch),
                      eval ? "eval" : "train", static_cast<long long>(r.bad),
                      i + 1 < rows.size() ? "," : "");
        f += line;
      }
      f += "]\n";
      cli::user_input("--json: ", [&] { write_file_atomic(json_path, f); });
    }
    return 0;
  });
  if (!temp_dir.empty()) {
    std::error_code ec;
    fs::remove_all(temp_dir, ec);
  }
  return rc;
}
