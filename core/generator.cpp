#include "core/generator.h"

#include <cmath>
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

void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

}  // namespace kiln
