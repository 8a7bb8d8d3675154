// libFuzzer target for load_safetensors (checkpoints, --weights, --pretrained, --resume): every
// file must load or fail with a kiln::Error. Each input is written to /dev/shm and loaded.
// Not built by CMake. With a CPU build in build-cpu, from the repository root (the reader and
// the JSON parser compiled instrumented, the rest taken from libkiln.a):
//   clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -I. -Ibuild-cpu/include \
//     tools/fuzz/fuzz_safetensors.cpp core/serialization.cpp core/json.cpp \
//     -Wl,--allow-multiple-definition build-cpu/libkiln.a -fopenmp -lz -lpthread -ljpeg \
//     -o /tmp/fuzz_safetensors
//   /tmp/fuzz_safetensors CORPUS SEEDS -max_len=4096 -max_total_time=420
// SEEDS: small safetensors files of several dtypes and shapes, with and without __metadata__
// (docs/lab/input-pipeline.md, 2026-12-05).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "core/error.h"
#include "core/serialization.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* d, size_t n) {
  static const std::string path =
      "/dev/shm/kiln_fuzz_" + std::to_string(::getpid()) + ".safetensors";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  std::fwrite(d, 1, n, f);
  std::fclose(f);
  try {
    (void)kiln::load_safetensors(path);
  } catch (const kiln::Error&) {
  }
  return 0;
}
