#include "data/fashion_mnist.h"

#include <filesystem>
#include <vector>

namespace kiln::data {
namespace {

// The first existing file among the MNIST spellings of `stem` ("train-images", "idx3").
std::string find_idx_file(const std::string& dir, const std::string& stem, const char* idx,
                          const std::string& install_hint) {
  namespace fs = std::filesystem;
  const std::vector<std::string> names = {
      stem + "-" + idx + "-ubyte.gz", stem + "-" + idx + "-ubyte", stem + "." + idx + "-ubyte.gz",
      stem + "." + idx + "-ubyte"};
  std::error_code ec;
  for (const auto& n : names) {
    fs::path p = fs::path(dir) / n;
    if (fs::is_regular_file(p, ec)) return p.string();
  }
  std::string tried;
  for (const auto& n : names) tried += (tried.empty() ? "" : ", ") + n;
  KILN_FAIL("MNIST-style dataset file not found in '", dir, "' (tried ", tried, ")",
            install_hint.empty() ? "" : "; ", install_hint);
}

}  // namespace

IdxPair load_mnist(const std::string& dir, Split split, const std::string& install_hint) {
  const std::string prefix = split == Split::Train ? "train" : "t10k";
  const std::string images = find_idx_file(dir, prefix + "-images", "idx3", install_hint);
  const std::string labels = find_idx_file(dir, prefix + "-labels", "idx1", install_hint);
  return read_idx_pair(images, labels);
}

IdxPair load_fashion_mnist(const std::string& dir, Split split) {
  std::string hint;
  if (dir == kFashionMnistDir)
    hint = "install Fashion-MNIST with `apt-get install dataset-fashion-mnist`";
  else
    hint = "install Fashion-MNIST with `apt-get install dataset-fashion-mnist` (files go to " +
           std::string(kFashionMnistDir) + ") or download the four IDX files into this folder";
  return load_mnist(dir, split, hint);
}

}  // namespace kiln::data
