#pragma once
// Shared fixture of the kiln-train suites (test_kiln_train, test_kiln_predict): a temporary
// folder for this test process, removed at exit, and a small ImageFolder of Fashion-MNIST PNGs
// in it (root/train: the first 300 training images; root/val: the first 100 test images).
#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "data/export_images.h"
#include "data/fashion_mnist.h"

namespace kiln::testutil {

struct TempDir {
  std::filesystem::path dir = std::filesystem::temp_directory_path() /
                              ("kiln_test_job_" + std::to_string(::getpid()));
  TempDir() { std::filesystem::create_directories(dir); }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
};

inline TempDir& tmp() {
  static TempDir t;
  return t;
}

inline const std::string& image_folder() {
  static const std::string root = [] {
    const std::filesystem::path r = tmp().dir / "fmnist";
    std::vector<std::string> names(data::kFashionMnistClasses.begin(),
                                   data::kFashionMnistClasses.end());
    data::ExportOptions o;
    o.limit = 300;
    auto train = data::load_fashion_mnist(data::Split::Train);
    data::export_image_folder(train.images, train.labels, names, (r / "train").string(), o);
    o.limit = 100;
    auto test = data::load_fashion_mnist(data::Split::Test);
    data::export_image_folder(test.images, test.labels, names, (r / "val").string(), o);
    return r.string();
  }();
  return root;
}

}  // namespace kiln::testutil
