#pragma once
// Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011): a counter-based generator. The bits of a draw are a pure function of (key, counter),
// so the CPU, every GPU thread and every replay of a CUDA graph draw the same values for the same
// (seed, offset) — what makes dropout's masks reproducible without storing them.
//
// kiln's streams: a draw is keyed on a 64-bit seed and indexed by a 64-bit element offset; the
// uniform of element e is word e % 4 of philox(counter = e / 4), as 24 bits in [0, 1).
#include <cstdint>

#include "core/hostdevice.h"

namespace kiln::philox {

struct Block {
  uint32_t w[4];
};

KILN_HD uint32_t mulhi(uint32_t a, uint32_t b) {
  return uint32_t((uint64_t(a) * uint64_t(b)) >> 32);
}

// The 128-bit counter {c0, c1, c2, c3} under the 64-bit key {k0, k1}, ten rounds.
KILN_HD Block block(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                    uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // key schedule (Weyl sequence)
  for (int r = 0; r < 10; ++r) {
    const uint32_t hi0 = mulhi(kM0, c0), lo0 = kM0 * c0;
    const uint32_t hi1 = mulhi(kM1, c2), lo1 = kM1 * c2;
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return Block{{c0, c1, c2, c3}};
}

// The four uniforms in [0, 1) of block `index` (elements 4·index .. 4·index + 3) of the stream
// keyed on `seed`: the top 24 bits of each word, exactly representable in f32.
KILN_HD Block stream_block(uint64_t seed, uint64_t index) {
  return block(uint32_t(index), uint32_t(index >> 32), 0u, 0u, uint32_t(seed),
               uint32_t(seed >> 32));
}
KILN_HD float to_uniform(uint32_t word) { return float(word >> 8) * (1.0f / 16777216.0f); }

// Element e's uniform of the stream keyed on `seed` (one block per four elements).
KILN_HD float uniform(uint64_t seed, uint64_t e) {
  return to_uniform(stream_block(seed, e >> 2).w[e & 3]);
}

}  // namespace kiln::philox
