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

namespace {

namespace fs = std::filesystem;
using namespace kiln;

void usage() {
  std::printf(
      "usage: kiln-loader-bench [--folder DIR] [--workers LIST] [-b BATCH] [--batches N]\n"
      "                         [--eval] [--generate N] [--format jpg|png]\n"
      "  --folder DIR   an ImageFolder (default: generate synthetic images in a temp folder)\n"
      "  --workers L    comma-separated worker counts (default 1,2,4,...,hardware threads)\n"
      "  -b BATCH       batch size (default 64)\n"
      "  --batches N    timed batches per row (default 20)\n"
      "  --eval         Resize(256)+CenterCrop(224) instead of RandomResizedCrop+flip\n"
      "  --generate N   synthetic images to write when no --folder (default 512)\n"
      "  --format F     synthetic image format, jpg (default) or png\n"
      "  --version      kiln's version and build\n");
}

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

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = s.find(',', pos);
    const std::string item =
        s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    const int v = std::stoi(item);
    KILN_CHECK(v >= 0, "kiln-loader-bench: worker counts must be >= 0, got ", v);
    out.push_back(v);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string temp_dir;
  try {
    std::string folder, format = "jpg";
    std::vector<int> workers;
    int64_t batch = 64, batches = 20, generate = 512;
    bool eval = false;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        KILN_CHECK(i + 1 < argc, "kiln-loader-bench: flag ", a, " needs a value");
        return argv[++i];
      };
      if (a == "-h" || a == "--help") {
        usage();
        return 0;
      } else if (a == "--version") {
        std::printf("%s\n", kiln::version_line("kiln-loader-bench").c_str());
        return 0;
      } else if (a == "--folder") {
        folder = value();
      } else if (a == "--workers") {
        workers = parse_list(value());
      } else if (a == "-b" || a == "--batch-size") {
        batch = std::stoll(value());
      } else if (a == "--batches") {
        batches = std::stoll(value());
      } else if (a == "--eval") {
        eval = true;
      } else if (a == "--generate") {
        generate = std::stoll(value());
      } else if (a == "--format") {
        format = value();
        KILN_CHECK(format == "jpg" || format == "png", "kiln-loader-bench: --format jpg|png");
      } else {
        KILN_FAIL("kiln-loader-bench: unknown flag ", a, " (see --help)");
      }
    }
    KILN_CHECK(batch > 0 && batches > 0 && generate > 0,
               "kiln-loader-bench: -b, --batches and --generate must be positive");
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
    if (!temp_dir.empty()) fs::remove_all(temp_dir);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln-loader-bench: error: %s\n", e.what());
    if (!temp_dir.empty()) {
      std::error_code ec;
      fs::remove_all(temp_dir, ec);
    }
    return 1;
  }
}
