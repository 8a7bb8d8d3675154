#include "tools/train/dist_env.h"

#include <cerrno>
#include <cstdlib>

#include "core/error.h"

namespace kiln {
namespace {

// Whole-string base-10 integer in [lo, hi]; the error names the variable and what it held.
int parse_int(const char* name, const std::string& text, long lo, long hi) {
  KILN_CHECK(!text.empty(), "environment variable ", name, " is set but empty");
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  KILN_CHECK(errno == 0 && end && *end == '\0', "environment variable ", name, "='", text,
             "' is not an integer");
  KILN_CHECK(v >= lo && v <= hi, "environment variable ", name, "=", v, " is out of range [", lo,
             ", ", hi, "]");
  return int(v);
}

}  // namespace

DistEnv DistEnv::from_lookup(const std::function<std::optional<std::string>(const char*)>& getenv) {
  DistEnv env;
  const auto world = getenv("WORLD_SIZE");
  const auto rank = getenv("RANK");
  const auto local = getenv("LOCAL_RANK");
  const auto addr = getenv("MASTER_ADDR");
  const auto port = getenv("MASTER_PORT");
  if (world) env.world_size = parse_int("WORLD_SIZE", *world, 1, 1 << 20);
  if (env.world_size > 1) {
    KILN_CHECK(rank.has_value(),
               "environment variable RANK is not set but WORLD_SIZE=", env.world_size,
               " (launch with kiln-train --nproc N or torchrun)");
    KILN_CHECK(addr.has_value(),
               "environment variable MASTER_ADDR is not set but WORLD_SIZE=", env.world_size);
    KILN_CHECK(port.has_value(),
               "environment variable MASTER_PORT is not set but WORLD_SIZE=", env.world_size);
  }
  if (rank) env.rank = parse_int("RANK", *rank, 0, env.world_size - 1);
  env.local_rank = local ? parse_int("LOCAL_RANK", *local, 0, env.world_size - 1) : env.rank;
  if (addr) {
    KILN_CHECK(!addr->empty(), "environment variable MASTER_ADDR is set but empty");
    env.master_addr = *addr;
  }
  if (port) env.master_port = parse_int("MASTER_PORT", *port, 1, 65535);
  return env;
}

DistEnv DistEnv::from_env() {
  return from_lookup([](const char* name) -> std::optional<std::string> {
    const char* v = std::getenv(name);
    if (!v) return std::nullopt;
    return std::string(v);
  });
}

}  // namespace kiln
