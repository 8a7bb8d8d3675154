// Re-encodes an ImageFolder of JPEGs smaller, so that a real-photo data set fits in what one
// device call carries (64 MiB with the checkout; docs/lab/norm-conv.md, the Imagenette check).
// Each JPEG is decoded by libjpeg-turbo at 1/DENOM of its size (the decoder's DCT scaling, no
// separate resize) and written again at QUALITY; the folder structure is kept. Files that do
// not decode are skipped and counted. Not part of the build:
//   g++ -O2 -std=c++20 tools/bench/shrink_jpegs.cpp -lturbojpeg -o /tmp/shrink_jpegs
//   /tmp/shrink_jpegs SRC DST [DENOM=2] [QUALITY=75]
#include <turbojpeg.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s SRC DST [DENOM=2] [QUALITY=75]\n", argv[0]);
    return 2;
  }
  const fs::path src = argv[1], dst = argv[2];
  const int denom = argc > 3 ? std::stoi(argv[3]) : 2, quality = argc > 4 ? std::stoi(argv[4]) : 75;
  if (!fs::is_directory(src)) {
    std::fprintf(stderr, "%s: not a folder\n", src.c_str());
    return 2;
  }
  if (fs::exists(dst) && !fs::is_empty(dst)) {
    std::fprintf(stderr, "%s: exists and is not empty; refusing to write into it\n", dst.c_str());
    return 2;
  }
  tjhandle dec = tjInitDecompress(), enc = tjInitCompress();
  long written = 0, skipped = 0;
  uintmax_t bytes_in = 0, bytes_out = 0;
  for (const auto& e : fs::recursive_directory_iterator(src)) {
    if (!e.is_regular_file()) continue;
    std::string ext = e.path().extension().string();
    for (char& ch : ext) ch = char(std::tolower(static_cast<unsigned char>(ch)));
    if (ext != ".jpeg" && ext != ".jpg") continue;
    std::ifstream in(e.path(), std::ios::binary);
    std::vector<unsigned char> buf((std::istreambuf_iterator<char>(in)), {});
    int w = 0, h = 0, sub = 0, cs = 0;
    if (tjDecompressHeader3(dec, buf.data(), buf.size(), &w, &h, &sub, &cs) != 0) {
      std::fprintf(stderr, "skipped %s: %s\n", e.path().c_str(), tjGetErrorStr2(dec));
      ++skipped;
      continue;
    }
    const tjscalingfactor f{1, denom};
    const int sw = TJSCALED(w, f), sh = TJSCALED(h, f);
    std::vector<unsigned char> rgb(size_t(sw) * sh * 3);
    if (tjDecompress2(dec, buf.data(), buf.size(), rgb.data(), sw, 0, sh, TJPF_RGB, 0) != 0) {
      std::fprintf(stderr, "skipped %s: %s\n", e.path().c_str(), tjGetErrorStr2(dec));
      ++skipped;
      continue;
    }
    unsigned char* out = nullptr;
    unsigned long out_size = 0;
    if (tjCompress2(enc, rgb.data(), sw, 0, sh, TJPF_RGB, &out, &out_size, TJSAMP_420, quality,
                    0) != 0) {
      std::fprintf(stderr, "skipped %s: %s\n", e.path().c_str(), tjGetErrorStr2(enc));
      ++skipped;
      continue;
    }
    const fs::path target = dst / fs::relative(e.path(), src);
    fs::create_directories(target.parent_path());
    std::ofstream file(target, std::ios::binary);
    file.write(reinterpret_cast<const char*>(out), long(out_size));
    tjFree(out);
    if (!file) {
      std::fprintf(stderr, "%s: could not be written\n", target.c_str());
      return 1;
    }
    bytes_in += buf.size();
    bytes_out += out_size;
    ++written;
  }
  tjDestroy(dec);
  tjDestroy(enc);
  std::printf("%ld written (%.1f MB from %.1f MB), %ld skipped\n", written, bytes_out / 1e6,
              bytes_in / 1e6, skipped);
  return skipped > 0 && written == 0 ? 1 : 0;
}
