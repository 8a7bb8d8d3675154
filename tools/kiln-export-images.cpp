// kiln-export-images: writes Fashion-MNIST out as an ImageFolder of PNG files, to exercise
// the ImageNet-style input pipeline (data/image_loader.h) on real images.
//
//   kiln-export-images --out DIR [--split train|test] [--limit N] [--rgb] [--force]
//                      [--data FASHION_MNIST_DIR]
//
// Layout: DIR/<k>_<class name>/<sample index>.png (data/export_images.h). A non-empty DIR is
// refused unless --force; a DIR inside the --data folder always.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/version.h"
#include "data/export_images.h"
#include "data/fashion_mnist.h"
#include "tools/cli/cli.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  using namespace kiln;
  return cli::run_tool("kiln-export-images", [&] {
    std::string out, split = "train", data_dir = data::kFashionMnistDir;
    data::ExportOptions opts;
    cli::Parser p("kiln-export-images", "--out DIR [flags]",
                  "Writes Fashion-MNIST as an ImageFolder of PNG files.");
    p.version(version_line("kiln-export-images"));
    p.value("--out", "DIR", &out, "output folder (created; must be empty unless --force)");
    p.choice("--split", &split, {"train", "test"}, "which split");
    p.value("--limit", "N", &opts.limit, "export the first N images only (default: all)", 0);
    p.flag("--rgb", &opts.rgb, "3-channel PNGs (default: grayscale)");
    p.flag("--force", &opts.force, "write into a non-empty folder");
    p.value("--data", "DIR", &data_dir, "Fashion-MNIST IDX folder");
    if (!p.parse(argc, argv)) {
      std::fputs(p.info().c_str(), stdout);
      return 0;
    }
    if (out.empty()) cli::usage_error("--out DIR is required (see kiln-export-images --help)");
    std::error_code ec;
    // Never into the data it reads (not even with --force): --out inside --data is refused.
    const fs::path data_abs = fs::canonical(data_dir, ec);
    const fs::path out_abs = fs::weakly_canonical(fs::absolute(out), ec);
    if (!data_abs.empty()) {
      const auto [d_end, o_end] = std::mismatch(data_abs.begin(), data_abs.end(), out_abs.begin(),
                                                out_abs.end());
      if (d_end == data_abs.end())
        cli::usage_error("--out '", out, "' lies inside --data '", data_dir,
                         "'; kiln-export-images never writes into the data it reads");
    }
    if (!opts.force && fs::exists(out, ec) && !(fs::is_directory(out, ec) && fs::is_empty(out, ec)))
      cli::usage_error("--out '", out, "' is not an empty folder (--force writes into a folder)");
    const data::IdxPair d = cli::user_input("--data: ", [&] {
      return data::load_fashion_mnist(data_dir,
                                      split == "train" ? data::Split::Train : data::Split::Test);
    });
    const std::vector<std::string> classes(data::kFashionMnistClasses.begin(),
                                           data::kFashionMnistClasses.end());
    const int64_t n = cli::user_input("--out: ", [&] {
      return data::export_image_folder(d.images, d.labels, classes, out, opts);
    });
    std::printf("wrote %lld PNG files (%s, %s) to %s\n", static_cast<long long>(n), split.c_str(),
                opts.rgb ? "RGB" : "grayscale", out.c_str());
    return 0;
  });
}
