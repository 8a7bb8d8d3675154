#pragma once
// The process's place in a data-parallel job, read from the environment variables torchrun
// sets: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
//
//   DistEnv env = DistEnv::from_env();   // single process (rank 0 of 1) when WORLD_SIZE is unset
//   if (env.distributed()) { Rendezvous rv(env); ... }
//
// Validation: every value present must parse completely (no trailing characters) and lie in
// range (0 <= RANK < WORLD_SIZE, 0 <= LOCAL_RANK < WORLD_SIZE, 1 <= MASTER_PORT <= 65535,
// MASTER_ADDR non-empty). With WORLD_SIZE > 1, RANK, MASTER_ADDR and MASTER_PORT are required
// and LOCAL_RANK defaults to RANK. Errors are kiln::Errors that name the variable and its value.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace kiln {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // selects the GPU on a node
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;

  bool distributed() const { return world_size > 1; }

  // Reads the real environment.
  static DistEnv from_env();
  // Reads through `getenv` (returns nullopt for an unset variable); for tests.
  static DistEnv from_lookup(const std::function<std::optional<std::string>(const char*)>& getenv);
};

}  // namespace kiln
