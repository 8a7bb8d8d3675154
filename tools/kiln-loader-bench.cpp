// kiln-loader-bench: throughput of the ImageNet-style input pipeline (data/image_loader.h):
// decoded + augmented images per second, in total and per worker, for several worker counts.
//
//   kiln-loader-bench [--folder DIR] [--workers 1,2,4,8] [-b 64] [--batches 20] [--eval]
//                     [--generate N] [--format jpg|png]
//
// Without --folder it writes N (default 512) synthetic images of ImageNet-like sizes
// (300..600 px a side, smooth colour gradients plus noise) into a fresh temporary folder in 4
// classes, benchmarks on those and deletes the folder afterwards. Each row times --batches
// batches after one warm-up batch; decoding dominates, so scaling with workers is the number
// to watch (this machine's core count bounds it).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/version.h"
#include "core/generator.h"
#include "data/image.h"
#include "data/image_loader.h"
#include "tools/cli/cli.h"

namespace {

namespace fs = std::filesystem;
using namespace kiln;

std::string generate_folder(int64_t n, const std::string& format) {
  std::string tmpl = (fs::temp_directory_path() / "kiln-loader-bench-XXXXXX").string();
  KILN_CHECK(mkdtemp(tmpl.data()) != nullptr, "kiln-loader-bench: cannot create a temp folder");
  Generator gen(1234);
  for (int64_t i = 0; i < n; ++i) {
    const fs::path dir = fs::path(tmpl) / ("class" + std::to_string(i % 4));
    fs::create_directories(dir);
    data::Image im;
    im.height = 300 + int64_t(gen.below(301));
    im.width = 300 + int64_t(gen.below(301));
    im.pixels.resize(size_t(im.height * im.width * 3));
    const double f[3] = {gen.uniform(), gen.uniform(), gen.uniform()};
    for (int64_t y = 0; y < im.height; ++y)
      for (int64_t x = 0; x < im.width; ++x)
        for (int c = 0; c < 3; ++c) {
          const double v = 255.0 * f[c] * double(x + y) / double(im.width + im.height);
          im.pixels[size_t((y * im.width + x) * 3 + c)] = uint8_t(v + double(gen.below(24)));
        }
    const std::string path = (dir / (std::to_string(i) + "." + format)).string();
    if (format == "png")
      data::write_png(path, im);
    else
      data::write_jpeg(path, im, 90);
  }
  return tmpl;
}

}  // namespace

int main(int argc, char** argv) {
  std::string temp_dir;
  const int rc = cli::run_tool("kiln-loader-bench", [&] {
    std::string folder, format = "jpg";
    std::vector<int64_t> worker_list;
    int64_t batch = 64, batches = 20, generate = 512;
    bool eval = false;
    cli::Parser p("kiln-loader-bench", "[--folder DIR] [--workers LIST] [-b BATCH] [flags]",
                  "Decoded + augmented images per second of the ImageNet-style input pipeline.");
    p.version(kiln::version_line("kiln-loader-bench"));
    p.value("--folder", "DIR", &folder,
            "an ImageFolder (default: generate synthetic images in a temp folder)");
    p.list("--workers", "LIST", &worker_list,
           "comma-separated worker counts (default 1,2,4,...,hardware threads)", 0);
    p.value("-b, --batch-size", "BATCH", &batch, "batch size", 1);
    p.value("--batches", "N", &batches, "timed batches per row", 1);
    p.flag("--eval", &eval, "Resize(256)+CenterCrop(224) instead of RandomResizedCrop+flip");
    p.value("--generate", "N", &generate, "synthetic images to write when no --folder", 1);
    p.choice("--format", &format, {"jpg", "png"}, "synthetic image format");
    if (!p.parse(argc, argv)) {
      std::fputs(p.info().c_str(), stdout);
      return 0;
    }
    std::vector<int> workers(worker_list.begin(), worker_list.end());
    if (workers.empty()) {
      const int hw = int(std::max(1u, std::thread::hardware_concurrency()));
      for (int w = 1; w < hw; w *= 2) workers.push_back(w);
      workers.push_back(hw);
    }
    if (folder.empty()) {
      std::printf("generating %lld synthetic %s images...\n", static_cast<long long>(generate),
                  format.c_str());
      folder = temp_dir = generate_folder(generate, format);
    }
    const data::ImageFolder images(folder);
    std::printf(
        "%s: %lld images, %lld classes; batch %lld, %s\n", folder.c_str(),
        static_cast<long long>(images.size()), static_cast<long long>(images.num_classes()),
        static_cast<long long>(batch),
        eval ? "eval (resize 256 + center crop 224)" : "train (random resized crop 224 + flip)");
    std::printf("%8s %10s %12s %16s %10s\n", "workers", "images", "images/s", "images/s/worker",
                "ms/batch");
    for (int w : workers) {
      data::ImageLoaderOptions o;
      o.batch_size = batch;
      o.workers = w;
      o.augment = eval ? data::Augment::Eval : data::Augment::Train;
      o.drop_last = true;
      data::ImageLoader loader(images, o);
      int64_t done = 0, n_batches = 0;
      double seconds = 0;
      // Cycle over epochs until `batches` timed batches (the first batch is a warm-up).
      for (int64_t e = 0; n_batches < batches; ++e) {
        KILN_CHECK(loader.num_batches() > 0, "kiln-loader-bench: fewer images than one batch");
        data::ImageEpoch ep = loader.epoch(e);
        auto t0 = std::chrono::steady_clock::now();
        bool first = e == 0;
        while (n_batches < batches) {
          std::optional<data::ImageBatch> b = ep.next();
          if (!b) break;
          if (first) {
            first = false;
            t0 = std::chrono::steady_clock::now();
            continue;
          }
          done += b->images.size(0);
          ++n_batches;
        }
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      const double ips = double(done) / seconds;
      std::printf("%8d %10lld %12.1f %16.1f %10.2f\n", w, static_cast<long long>(done), ips,
                  ips / double(std::max(w, 1)), 1e3 * seconds / double(n_batches));
    }
    return 0;
  });
  if (!temp_dir.empty()) {
    std::error_code ec;
    fs::remove_all(temp_dir, ec);
  }
  return rc;
}
