// What reading a JPEG's header twice costs the CPU loader (docs/lab/input-pipeline.md): the
// training path reads the header (data::read_jpeg_info) to draw its crop, then
// data::decode_jpeg_resampled reads it again and decodes the crop at 224 × 224. This times, per
// file of a folder, the header read alone and the two together (a centre crop of 3/4 of the
// short side, one thread), three rounds.
//
// Build and run (links a CPU-only build's library; a corpus from kiln-loader-bench --generate):
//   KILN_CUDA=OFF KILN_BUILD_DIR=build-cpu bash tools/kiln.sh build
//   build-cpu/kiln-loader-bench --generate 800 --output-dir /tmp/jpg --batches 0
//   g++ -O2 -std=c++20 -I. -Ibuild-cpu/include tools/bench/jpeg_header_cost.cpp
//       build-cpu/libkiln.a -lturbojpeg -ljpeg -lpng -lz -fopenmp -pthread -o /tmp/jhc   (one line)
//   /tmp/jhc /tmp/jpg
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "data/image.h"
#include "data/jpeg_turbo.h"

int main(int argc, char** argv) {
  using namespace kiln::data;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s FOLDER (of JPEG files, searched recursively)\n", argv[0]);
    return 2;
  }
  std::vector<std::vector<uint8_t>> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(argv[1]))
    if (e.is_regular_file()) files.push_back(read_file_bytes(e.path().string(), int64_t(1) << 28));
  if (files.empty()) {
    std::fprintf(stderr, "%s: no files under %s\n", argv[0], argv[1]);
    return 1;
  }
  std::vector<uint8_t> dst(224 * 224 * 3);
  const auto now = [] { return std::chrono::steady_clock::now(); };
  const auto us = [&](auto a, auto b) {
    return std::chrono::duration<double, std::micro>(b - a).count() / double(files.size());
  };
  for (int round = 0; round < 3; ++round) {
    int64_t widths = 0;  // kept, so the header loop is not optimised away
    const auto t0 = now();
    for (const auto& f : files) widths += read_jpeg_info(f.data(), f.size(), "file").width;
    const auto t1 = now();
    for (const auto& f : files) {
      const JpegInfo info = read_jpeg_info(f.data(), f.size(), "file");
      const int64_t s = std::min(info.height, info.width) * 3 / 4;
      const CropBox box{(info.height - s) / 2, (info.width - s) / 2, s, s};
      const BoxF boxf{double(box.top), double(box.left), double(s), double(s)};
      decode_jpeg_resampled(f.data(), f.size(), "file", boxf, box, 224, 224, false, dst.data());
    }
    const auto t2 = now();
    std::printf(
        "%zu files: header %.1f us, header + crop decode %.1f us (the header %.2f%%; "
        "widths %lld)\n",
        files.size(), us(t0, t1), us(t1, t2), 100.0 * us(t0, t1) / us(t1, t2),
        static_cast<long long>(widths));
  }
  return 0;
}
