#pragma once
// Helpers of the image-pipeline suites: a temporary folder removed at scope exit, and writers
// for small test images and raw (broken) files.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/image.h"

namespace kiln::testing {

class TempDir {
 public:
  TempDir() {
    std::string t = (std::filesystem::temp_directory_path() / "kiln-test-XXXXXX").string();
    KILN_CHECK(mkdtemp(t.data()) != nullptr, "cannot create a temp folder");
    path_ = t;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string operator/(const std::string& rel) const { return (path_ / rel).string(); }

 private:
  std::filesystem::path path_;
};

inline void write_raw(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// An RGB image of one colour.
inline data::Image solid_image(int64_t h, int64_t w, uint8_t r, uint8_t g, uint8_t b) {
  data::Image im;
  im.height = h;
  im.width = w;
  im.channels = 3;
  im.pixels.resize(size_t(h * w * 3));
  for (int64_t p = 0; p < h * w; ++p) {
    im.pixels[size_t(p * 3)] = r;
    im.pixels[size_t(p * 3 + 1)] = g;
    im.pixels[size_t(p * 3 + 2)] = b;
  }
  return im;
}

inline void write_png_at(const std::string& path, const data::Image& im) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  data::write_png(path, im);
}

}  // namespace kiln::testing
