// libFuzzer target for what reads untrusted bytes in kiln's data path: decode_image and
// probe_image (PNG with stb_image, JPEG with libjpeg-turbo), libjpeg-turbo's header reader and
// decoder, and the JSON parser (checkpoint headers, logs). Every failure must be a kiln::Error:
// a sanitizer report, a crash or an allocation past -rss_limit_mb is a finding.
// The first input byte picks the target (mod 4); the rest is the file.
// Not built by CMake (it needs clang's -fsanitize=fuzzer). From the repository root:
//   clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -DKILN_WITH_LIBJPEG=1 \
//     -I. -Ibuild/include -isystem /usr/include/stb tools/fuzz/fuzz_decoders.cpp \
//     data/image.cpp data/jpeg_turbo.cpp data/transforms.cpp core/error.cpp core/json.cpp \
//     core/text.cpp -ljpeg -o /tmp/fuzz_decoders
//   mkdir -p /tmp/corpus && /tmp/fuzz_decoders /tmp/corpus SEEDS -max_len=8192 \
//     -rss_limit_mb=2048 -max_total_time=600
// SEEDS: a folder of small PNG and JPEG files, each prefixed with a byte 0-3
// (docs/lab/input-pipeline.md, 2026-12-05, has the run and what it found).
#include <cstdint>
#include <string>

#include "core/error.h"
#include "core/generator.h"
#include "core/json.h"
#include "data/image.h"
#include "data/jpeg_turbo.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* d, size_t n) {
  using namespace kiln;
  const int which = n ? d[0] % 4 : 0;
  if (n) {
    ++d;
    --n;
  }
  try {
    switch (which) {
      case 0: (void)data::decode_image(d, n, "fuzz"); break;
      case 1: (void)data::probe_image(d, n, "fuzz"); break;
      case 2:
        (void)data::read_jpeg_info(d, n, "fuzz");
        (void)data::decode_jpeg(d, n, "fuzz", n % 8 == 0 ? 8 : 1);  // DCT scaling too
        break;
      case 3: (void)json::parse(std::string(reinterpret_cast<const char*>(d), n)); break;
    }
  } catch (const kiln::Error&) {
  }
  return 0;
}

// data/transforms.cpp's random crops are not fuzzed: this stub keeps core/generator.cpp (and
// the tensor library behind it) out of the binary.
uint64_t kiln::Generator::below(uint64_t) { __builtin_trap(); }
