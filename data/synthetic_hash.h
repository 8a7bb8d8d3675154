#pragma once
// The counter-based hash behind the synthetic image source (data/device_batches.h), shared by
// the CPU generator and the CUDA kernel (cuda/kernels/normalize.cu) so both produce the same
// bytes for a seed: byte i = byte (i % 8) of splitmix64(seed + i / 8).
#include <cstdint>

#if defined(__CUDACC__)
#define KILN_HOST_DEVICE __host__ __device__
#else
#define KILN_HOST_DEVICE
#endif

namespace kiln::data {

KILN_HOST_DEVICE inline uint64_t synthetic_hash(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
KILN_HOST_DEVICE inline uint8_t synthetic_byte(uint64_t seed, int64_t i) {
  return uint8_t(synthetic_hash(seed + uint64_t(i) / 8) >> (8 * (uint64_t(i) % 8)));
}
// Label i in [0, classes); the label stream uses a seed distinct from the image stream.
KILN_HOST_DEVICE inline int64_t synthetic_label(uint64_t seed, int64_t i, int64_t classes) {
  return int64_t(synthetic_hash(~seed + uint64_t(i) * 0x632be59bd9b4e019ULL) % uint64_t(classes));
}

}  // namespace kiln::data
