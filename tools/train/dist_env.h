#pragma once
// The process's place in a data-parallel job, read from the environment its launcher set. In
// order of precedence (the first that is present decides):
//
//   launcher               variables read                                      rank 0's port
//   kiln --nproc N         RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT,      MASTER_PORT
//                          KILN_LAUNCHER=kiln
//   torchrun               the same (TORCHELASTIC_RUN_ID or                     MASTER_PORT + 1
//                          TORCHELASTIC_USE_AGENT_STORE marks torchrun)
//   by hand                RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT       MASTER_PORT
//   Open MPI's mpirun      OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK;            MASTER_PORT
//                          MASTER_ADDR/PORT (mpirun -x MASTER_ADDR -x MASTER_PORT)
//   Slurm's srun           SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID;           MASTER_PORT
//                          MASTER_ADDR/PORT
//
// KILN_RDZV_PORT, when set, is the rendezvous port whatever the launcher. torchrun's agent holds
// a store on MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE), so kiln's rendezvous
// (tools/train/rendezvous.h) listens on the next port there; rank 0 always runs on MASTER_ADDR's
// host under torchrun (its node rank 0 hosts both).
//
//   DistEnv env = DistEnv::from_env();   // single process (rank 0 of 1) when nothing is set
//   if (env.distributed()) { Rendezvous rv(env); ... }
//
// Only what the place needs is read: MASTER_ADDR, MASTER_PORT and KILN_RDZV_PORT only when the
// world size is > 1 (a single process is never refused for a stray or malformed one of them).
// Every value read must parse completely (no trailing characters) and lie in range (0 <= rank <
// world size, 0 <= local rank < world size, ports in [1, 65535], MASTER_ADDR non-empty, an IPv6
// literal either bare or in brackets: "::1" or "[::1]"). With a world size > 1 the rank,
// MASTER_ADDR and MASTER_PORT are required and the local rank defaults to the rank. Errors are
// cli::UsageErrors (tools/cli/cli.h): one line naming the variable, its value and what was
// expected (for a missing one, how that launcher is told to set it), no source location.
//
// Variables of a launcher further down the table that contradict the one that decides give a
// warning (DistEnv::warnings), and the table's order still decides. A launcher started inside
// another's job (torchrun in an srun task) runs at least as many processes as the outer job has,
// so an outer world size larger than the deciding one contradicts it ("WORLD_SIZE=1 and
// SLURM_NTASKS=8 disagree"); and with equal world sizes, a hand-set RANK other than the outer
// rank does (torchrun, kiln and mpirun number their processes their own way).
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace kiln {

enum class Launcher { None, Kiln, Torchrun, Env, Mpi, Slurm };

// "torchrun", "Slurm (srun)", ...
const char* launcher_name(Launcher l);

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // selects the GPU on a node
  // As getaddrinfo takes it: an IPv6 literal bare ("::1").
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int rdzv_port = 29500;  // where rank 0's rendezvous listens (see the table above)
  Launcher launcher = Launcher::None;
  // One line per contradiction between launchers' variables (see above), without a prefix:
  // "WORLD_SIZE=1 and SLURM_NTASKS=8 disagree; WORLD_SIZE takes precedence, so this process is
  // rank 0 of 1".
  std::vector<std::string> warnings;

  bool distributed() const { return world_size > 1; }
  // "rank 1 of 4 (local rank 1), launched by torchrun"
  std::string describe() const;

  // Reads the real environment, and prints each warning on stderr as "kiln: warning: ..." the
  // first time this process meets it (tools read their place more than once).
  static DistEnv from_env();
  // Reads through `getenv` (returns nullopt for an unset variable) and prints nothing; for tests.
  static DistEnv from_lookup(const std::function<std::optional<std::string>(const char*)>& getenv);
};

// An address as getaddrinfo takes it: an IPv6 literal's brackets removed ("[::1]" -> "::1"),
// anything else unchanged.
std::string bare_host(const std::string& addr);
// "host:port" for messages and URLs, an IPv6 literal in brackets ("[::1]:29500").
std::string host_port(const std::string& addr, int port);

}  // namespace kiln
