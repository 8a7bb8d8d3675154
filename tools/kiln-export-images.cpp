// kiln-export-images: writes Fashion-MNIST out as an ImageFolder of PNG files, to exercise
// the ImageNet-style input pipeline (data/image_loader.h) on real images.
//
//   kiln-export-images --out DIR [--split train|test] [--limit N] [--rgb] [--force]
//                      [--data FASHION_MNIST_DIR]
//
// Layout: DIR/<k>_<class name>/<sample index>.png (data/export_images.h). A non-empty DIR is
// refused unless --force.
#include <cstdio>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/version.h"
#include "data/export_images.h"
#include "data/fashion_mnist.h"

namespace {

void usage() {
  std::printf(
      "usage: kiln-export-images --out DIR [--split train|test] [--limit N] [--rgb] [--force]\n"
      "                          [--data DIR]\n"
      "  --out DIR    output folder (created; must be empty unless --force)\n"
      "  --split S    train (default) or test\n"
      "  --limit N    export the first N images only (default: all)\n"
      "  --rgb        3-channel PNGs (default: grayscale)\n"
      "  --force      write into a non-empty folder\n"
      "  --data DIR   Fashion-MNIST IDX folder (default %s)\n"
      "  --version    kiln's version and build\n",
      kiln::data::kFashionMnistDir);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kiln;
  try {
    std::string out, split = "train", data_dir = data::kFashionMnistDir;
    data::ExportOptions opts;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        KILN_CHECK(i + 1 < argc, "kiln-export-images: flag ", a, " needs a value");
        return argv[++i];
      };
      if (a == "-h" || a == "--help") {
        usage();
        return 0;
      } else if (a == "--version") {
        std::printf("%s\n", kiln::version_line("kiln-export-images").c_str());
        return 0;
      } else if (a == "--out") {
        out = value();
      } else if (a == "--split") {
        split = value();
        KILN_CHECK(split == "train" || split == "test",
                   "kiln-export-images: --split must be train or test, got ", split);
      } else if (a == "--limit") {
        opts.limit = std::stoll(value());
        KILN_CHECK(opts.limit >= 0, "kiln-export-images: --limit must be >= 0");
      } else if (a == "--rgb") {
        opts.rgb = true;
      } else if (a == "--force") {
        opts.force = true;
      } else if (a == "--data") {
        data_dir = value();
      } else {
        KILN_FAIL("kiln-export-images: unknown flag ", a, " (see --help)");
      }
    }
    KILN_CHECK(!out.empty(), "kiln-export-images: --out DIR is required (see --help)");
    const data::IdxPair d = data::load_fashion_mnist(
        data_dir, split == "train" ? data::Split::Train : data::Split::Test);
    const std::vector<std::string> classes(data::kFashionMnistClasses.begin(),
                                           data::kFashionMnistClasses.end());
    const int64_t n = data::export_image_folder(d.images, d.labels, classes, out, opts);
    std::printf("wrote %lld PNG files (%s, %s) to %s\n", static_cast<long long>(n), split.c_str(),
                opts.rgb ? "RGB" : "grayscale", out.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln-export-images: error: %s\n", e.what());
    return 1;
  }
}
