#include "core/generator.h"

#include <cmath>
#include <map>
#include <mutex>
#include <sstream>

#include "core/error.h"

namespace kiln {

double Generator::normal() {
  double u1 = uniform();
  double u2 = uniform();
  if (u1 < 1e-300) u1 = 1e-300;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

uint64_t Generator::below(uint64_t n) {
  KILN_CHECK(n > 0, "Generator::below(0)");
  // Rejection sampling: no modulo bias.
  uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t r;
  do r = engine_(); while (r >= limit);
  return r % n;
}

std::string Generator::state() const {
  std::ostringstream os;
  os << engine_;
  return os.str();
}

void Generator::set_state(const std::string& s) {
  std::istringstream is(s);
  is >> engine_;
  KILN_CHECK(!is.fail(), "Generator::set_state: malformed state string");
}

namespace {
uint64_t mix(uint64_t a, uint64_t b) { return splitmix64(a ^ splitmix64(b)); }
}  // namespace

uint64_t derive_seed(uint64_t seed, uint64_t a, uint64_t b) { return mix(mix(seed, a), b); }

Generator& default_generator() {
  static Generator g;
  return g;
}

namespace {

constexpr uint64_t kPhiloxTag = 0x7068696c6f78ULL;  // "philox"

struct PhiloxStreams {
  std::mutex m;
  uint64_t base_seed = 0x6b696c6eULL;  // Generator's default seed until manual_seed
  std::map<std::pair<int, int>, PhiloxStream> streams;  // (device type, index)
};
PhiloxStreams& philox_streams() {
  static PhiloxStreams s;
  return s;
}

uint64_t stream_seed(uint64_t base, Device d) {
  return derive_seed(base ^ kPhiloxTag, uint64_t(d.type), uint64_t(d.index));
}

}  // namespace

void manual_seed(uint64_t seed) {
  default_generator().manual_seed(seed);
  PhiloxStreams& ps = philox_streams();
  std::lock_guard<std::mutex> lock(ps.m);
  ps.base_seed = seed;
  for (auto& [key, st] : ps.streams) {
    st.seed = stream_seed(seed, Device{DeviceType(key.first), key.second});
    st.offset.zero_();
  }
}

PhiloxStream& philox_stream(Device d) {
  PhiloxStreams& ps = philox_streams();
  std::lock_guard<std::mutex> lock(ps.m);
  auto [it, fresh] = ps.streams.try_emplace({int(d.type), d.is_cpu() ? 0 : d.index});
  if (fresh) {
    it->second.seed = stream_seed(ps.base_seed, d);
    it->second.offset = zeros({1}, TensorOptions(DType::i64).with_device(d));
  }
  return it->second;
}

std::vector<std::pair<Device, std::string>> philox_states() {
  PhiloxStreams& ps = philox_streams();
  std::lock_guard<std::mutex> lock(ps.m);
  std::vector<std::pair<Device, std::string>> out;
  for (auto& [key, st] : ps.streams) {
    const int64_t off = st.offset.to(Device::cpu()).data<int64_t>()[0];
    out.emplace_back(Device{DeviceType(key.first), key.second},
                     std::to_string(st.seed) + " " + std::to_string(off));
  }
  return out;
}

void set_philox_state(Device d, const std::string& state) {
  std::istringstream is(state);
  uint64_t seed = 0;
  int64_t off = -1;
  is >> seed >> off;
  KILN_CHECK(!is.fail() && off >= 0 && is.eof(), "set_philox_state: malformed state '", state,
             "' (expected '<seed> <offset>')");
  PhiloxStream& st = philox_stream(d);
  st.seed = seed;
  st.offset.fill_(double(off));
}

}  // namespace kiln
