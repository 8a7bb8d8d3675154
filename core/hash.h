#pragma once
// SplitMix64's output function, a 64-bit bijection that spreads nearby inputs apart, and the
// counter hash of the synthetic image source built on it. Host and device (core/hostdevice.h):
// the CPU generator and the CUDA kernel (cuda/kernels/normalize.cu) produce the same bytes.
#include <cstdint>

#include "core/hostdevice.h"

namespace kiln {

KILN_HD uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Synthetic pixels: byte i = byte (i % 8) of splitmix64(seed + i / 8).
KILN_HD uint8_t synthetic_byte(uint64_t seed, int64_t i) {
  return uint8_t(splitmix64(seed + uint64_t(i) / 8) >> (8 * (uint64_t(i) % 8)));
}
// Synthetic label i in [0, classes); the label stream uses a seed distinct from the pixels'.
KILN_HD int64_t synthetic_label(uint64_t seed, int64_t i, int64_t classes) {
  return int64_t(splitmix64(~seed + uint64_t(i) * 0x632be59bd9b4e019ULL) % uint64_t(classes));
}

}  // namespace kiln
