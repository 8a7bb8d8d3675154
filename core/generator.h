#pragma once
// Seeded random number generation on the host. A Generator is cheap to copy (state is a
// std::mt19937_64) so its state can be saved with a checkpoint and restored exactly.
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/hash.h"
#include "core/tensor.h"

namespace kiln {

class Generator {
 public:
  explicit Generator(uint64_t seed = 0x6b696c6eULL) : engine_(seed) {}
  void manual_seed(uint64_t seed) { engine_.seed(seed); }
  uint64_t next_u64() { return engine_(); }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return double(engine_() >> 11) * 0x1.0p-53; }
  // Standard normal (Box–Muller; no cached second value so the state is the engine alone).
  double normal();
  // Uniform integer in [0, n).
  uint64_t below(uint64_t n);
  // Text form of the engine state, for checkpoints.
  std::string state() const;
  void set_state(const std::string& s);

 private:
  std::mt19937_64 engine_;
};

// The seed of an independent random stream named by (seed, a, b): SplitMix64 mixing, so
// nearby tuples such as (s, e) and (s + 1, e - 1) do not share a stream. Loaders derive their
// per-epoch and per-sample generators with it, which keeps them independent of thread timing.
uint64_t derive_seed(uint64_t seed, uint64_t a, uint64_t b);

// The process-wide default generator used when none is passed. manual_seed also reseeds every
// device's Philox stream (below) and rewinds it to its start.
Generator& default_generator();
void manual_seed(uint64_t seed);

// A device's counter-based random stream (core/philox.h), which dropout draws from: a 64-bit
// seed, and the offset of the next unclaimed element, kept in the device's own memory (i64, one
// element) so that draws inside a captured CUDA graph claim fresh elements on every replay with
// no host work (Backend::philox_advance). Created zeroed at a device's first draw, its seed
// derived from manual_seed's (or the default) seed and the device. Not thread-safe against
// manual_seed running at the same time.
struct PhiloxStream {
  uint64_t seed = 0;
  Tensor offset;  // i64 (1) on the device
};
PhiloxStream& philox_stream(Device device);
// "<seed> <offset>" of every device stream created so far (the offsets copied to the host), for
// checkpoints; and back. A device named in `state` gets its stream created.
std::vector<std::pair<Device, std::string>> philox_states();
void set_philox_state(Device device, const std::string& state);

}  // namespace kiln
