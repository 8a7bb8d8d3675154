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
// Validation: every value read must parse completely (no trailing characters) and lie in range
// (0 <= rank < world size, 0 <= local rank < world size, ports in [1, 65535], MASTER_ADDR
// non-empty). With a world size > 1 the rank, MASTER_ADDR and MASTER_PORT are required and the
// local rank defaults to the rank. Errors are kiln::Errors that name the variable and its value
// (and, for a missing one, how that launcher is told to set it).
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace kiln {

enum class Launcher { None, Kiln, Torchrun, Env, Mpi, Slurm };

// "torchrun", "Slurm (srun)", ...
const char* launcher_name(Launcher l);

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // selects the GPU on a node
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int rdzv_port = 29500;  // where rank 0's rendezvous listens (see the table above)
  Launcher launcher = Launcher::None;

  bool distributed() const { return world_size > 1; }
  // "rank 1 of 4 (local rank 1), launched by torchrun"
  std::string describe() const;

  // Reads the real environment.
  static DistEnv from_env();
  // Reads through `getenv` (returns nullopt for an unset variable); for tests.
  static DistEnv from_lookup(const std::function<std::optional<std::string>(const char*)>& getenv);
};

}  // namespace kiln
