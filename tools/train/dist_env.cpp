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

// The variable names one launcher uses for rank, world size and local rank, and how its user
// passes MASTER_ADDR/MASTER_PORT to every process.
struct Scheme {
  Launcher launcher;
  const char* rank;
  const char* world;
  const char* local;
  const char* how_to_set_master;
};

constexpr Scheme kTorch{Launcher::Env, "RANK", "WORLD_SIZE", "LOCAL_RANK",
                        "(kiln-train --nproc N and torchrun set it)"};
constexpr Scheme kMpi{Launcher::Mpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                      "OMPI_COMM_WORLD_LOCAL_RANK",
                      "(under mpirun: export it, then mpirun -x MASTER_ADDR -x MASTER_PORT ...)"};
constexpr Scheme kSlurm{Launcher::Slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                        "(under Slurm: export MASTER_ADDR=$(scontrol show hostnames "
                        "\"$SLURM_JOB_NODELIST\" | head -n 1) and a MASTER_PORT before srun)"};

}  // namespace

const char* launcher_name(Launcher l) {
  switch (l) {
    case Launcher::None:
      return "nothing (a single process)";
    case Launcher::Kiln:
      return "kiln --nproc";
    case Launcher::Torchrun:
      return "torchrun";
    case Launcher::Env:
      return "RANK/WORLD_SIZE variables";
    case Launcher::Mpi:
      return "Open MPI (mpirun)";
    case Launcher::Slurm:
      return "Slurm (srun)";
  }
  return "?";
}

std::string DistEnv::describe() const {
  return "rank " + std::to_string(rank) + " of " + std::to_string(world_size) + " (local rank " +
         std::to_string(local_rank) + "), launched by " + launcher_name(launcher);
}

DistEnv DistEnv::from_lookup(const std::function<std::optional<std::string>(const char*)>& getenv) {
  // Precedence: torchrun-style variables (torchrun and kiln's own launcher may run inside an MPI
  // or Slurm job, and then set them for their children), then Open MPI's, then Slurm's.
  const Scheme* scheme = nullptr;
  if (getenv(kTorch.world))
    scheme = &kTorch;
  else if (getenv(kMpi.world))
    scheme = &kMpi;
  else if (getenv(kSlurm.world) && getenv(kSlurm.rank))
    scheme = &kSlurm;

  DistEnv env;
  const auto addr = getenv("MASTER_ADDR");
  const auto port = getenv("MASTER_PORT");
  if (scheme) {
    const auto world = getenv(scheme->world);
    const auto rank = getenv(scheme->rank);
    const auto local = getenv(scheme->local);
    env.launcher = scheme->launcher;
    if (scheme == &kTorch) {
      if (getenv("KILN_LAUNCHER").value_or("") == "kiln")
        env.launcher = Launcher::Kiln;
      else if (getenv("TORCHELASTIC_RUN_ID") || getenv("TORCHELASTIC_USE_AGENT_STORE"))
        env.launcher = Launcher::Torchrun;
    }
    env.world_size = parse_int(scheme->world, *world, 1, 1 << 20);
    if (env.world_size > 1) {
      KILN_CHECK(rank.has_value(), "environment variable ", scheme->rank, " is not set but ",
                 scheme->world, "=", env.world_size,
                 " (launch with kiln-train --nproc N, torchrun, mpirun or srun)");
      KILN_CHECK(addr.has_value(), "environment variable MASTER_ADDR is not set but ",
                 scheme->world, "=", env.world_size, " ", scheme->how_to_set_master);
      KILN_CHECK(port.has_value(), "environment variable MASTER_PORT is not set but ",
                 scheme->world, "=", env.world_size, " ", scheme->how_to_set_master);
    }
    if (rank) env.rank = parse_int(scheme->rank, *rank, 0, env.world_size - 1);
    env.local_rank = local ? parse_int(scheme->local, *local, 0, env.world_size - 1) : env.rank;
  }
  if (addr) {
    KILN_CHECK(!addr->empty(), "environment variable MASTER_ADDR is set but empty");
    env.master_addr = *addr;
  }
  if (port) env.master_port = parse_int("MASTER_PORT", *port, 1, 65535);
  // torchrun's agent listens on MASTER_PORT itself: take the next port (the one below at the top).
  env.rdzv_port = env.master_port;
  if (env.launcher == Launcher::Torchrun)
    env.rdzv_port = env.master_port < 65535 ? env.master_port + 1 : env.master_port - 1;
  if (const auto rdzv = getenv("KILN_RDZV_PORT")) env.rdzv_port = parse_int("KILN_RDZV_PORT", *rdzv, 1, 65535);
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
