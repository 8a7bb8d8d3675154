// libFuzzer target for the file readers that take a path: load_safetensors (checkpoints,
// --weights, --pretrained, --resume) and read_idx (MNIST-style data, raw or gzipped). Every file
// must load or fail with a kiln::Error. Each input is written to /dev/shm and read; the first
// byte picks the reader (even: safetensors, odd: IDX).
// Not built by CMake. With a CPU build in build-cpu, from the repository root (the reader and
// the JSON parser compiled instrumented, the rest taken from libkiln.a):
//   clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -I. -Ibuild-cpu/include \
//     tools/fuzz/fuzz_files.cpp core/serialization.cpp core/json.cpp data/idx.cpp \
//     -Wl,--allow-multiple-definition build-cpu/libkiln.a -fopenmp -lz -lpthread -ljpeg \
//     -o /tmp/fuzz_files
//   /tmp/fuzz_files CORPUS SEEDS -max_len=4096 -max_total_time=420
// SEEDS: small safetensors files of several dtypes and shapes, with and without __metadata__,
// and small IDX files (raw and gzipped), each behind a selector byte
// (docs/lab/input-pipeline.md, 2026-12-05).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "core/error.h"
#include "core/serialization.h"
#include "data/idx.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* d, size_t n) {
  if (n == 0) return 0;
  const bool idx = d[0] % 2 == 1;
  ++d;
  --n;
  static const std::string path = "/dev/shm/kiln_fuzz_" + std::to_string(::getpid());
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  std::fwrite(d, 1, n, f);
  std::fclose(f);
  try {
    if (idx) (void)kiln::data::read_idx(path);
    else (void)kiln::load_safetensors(path);
  } catch (const kiln::Error&) {
  }
  return 0;
}
