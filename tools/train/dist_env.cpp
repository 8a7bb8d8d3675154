#include "tools/train/dist_env.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>

#include "tools/cli/cli.h"

namespace kiln {
namespace {

// The integer `text` holds, when it is one whole base-10 integer.
std::optional<long> to_long(const std::string& text) {
  if (text.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (errno != 0 || !end || *end != '\0') return std::nullopt;
  return v;
}

// Whole-string base-10 integer in [lo, hi]; the error names the variable, what it held and the
// range (`context` says where the range comes from).
int parse_int(const char* name, const std::string& text, long lo, long hi,
              const std::string& context = "") {
  const std::optional<long> v = to_long(text);
  if (!v || *v < lo || *v > hi)
    cli::usage_error("environment variable ", name, "='", text, "': expected an integer between ",
                     lo, " and ", hi, context);
  return int(*v);
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
// In order of precedence.
constexpr const Scheme* kSchemes[] = {&kTorch, &kMpi, &kSlurm};

using Lookup = std::function<std::optional<std::string>(const char*)>;

bool present(const Scheme& s, const Lookup& getenv) {
  // Slurm sets SLURM_NTASKS in a batch script too, where no task has a rank yet.
  return getenv(s.world) && (&s != &kSlurm || getenv(s.rank));
}

// Adds to env.warnings the contradictions between the deciding scheme `w` (already parsed into
// env) and the schemes after it (dist_env.h); their values are compared, never required to parse.
void check_others(const Scheme& w, DistEnv& env, const Lookup& getenv) {
  bool past = false;
  for (const Scheme* o : kSchemes) {
    if (o == &w) past = true;
    if (o == &w || !past || !present(*o, getenv)) continue;
    const std::optional<long> world = to_long(*getenv(o->world));
    const std::optional<std::string> rank_text = getenv(o->rank);
    const std::optional<long> rank = rank_text ? to_long(*rank_text) : std::nullopt;
    const std::string verdict = " takes precedence, so this process is rank " +
                                std::to_string(env.rank) + " of " + std::to_string(env.world_size);
    if (world && *world > env.world_size) {
      env.warnings.push_back(std::string(w.world) + "=" + std::to_string(env.world_size) + " and " +
                             o->world + "=" + std::to_string(*world) + " disagree; " + w.world +
                             verdict);
    } else if (world && *world == env.world_size && rank && *rank != env.rank &&
               env.launcher == Launcher::Env) {
      env.warnings.push_back(std::string(w.rank) + "=" + std::to_string(env.rank) + " and " +
                             o->rank + "=" + std::to_string(*rank) + " disagree; " + w.rank +
                             verdict);
    }
  }
}

}  // namespace

std::string bare_host(const std::string& addr) {
  if (addr.size() >= 2 && addr.front() == '[' && addr.back() == ']')
    return addr.substr(1, addr.size() - 2);
  return addr;
}

std::string host_port(const std::string& addr, int port) {
  const std::string host = bare_host(addr);
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

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

DistEnv DistEnv::from_lookup(const Lookup& getenv) {
  // Precedence: torchrun-style variables (torchrun and kiln's own launcher may run inside an MPI
  // or Slurm job, and then set them for their children), then Open MPI's, then Slurm's.
  const Scheme* scheme = nullptr;
  for (const Scheme* s : kSchemes)
    if (!scheme && present(*s, getenv)) scheme = s;

  DistEnv env;
  if (!scheme) return env;
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
  const std::string below_world =
      " (below " + std::string(scheme->world) + "=" + std::to_string(env.world_size) + ")";
  if (rank) env.rank = parse_int(scheme->rank, *rank, 0, env.world_size - 1, below_world);
  env.local_rank =
      local ? parse_int(scheme->local, *local, 0, env.world_size - 1, below_world) : env.rank;
  check_others(*scheme, env, getenv);
  if (env.world_size == 1) return env;  // MASTER_* and KILN_RDZV_PORT are not read

  const std::string needed =
      " but " + std::string(scheme->world) + "=" + std::to_string(env.world_size);
  if (!rank)
    cli::usage_error("environment variable ", scheme->rank, " is not set", needed,
                     " (launch with kiln-train --nproc N, torchrun, mpirun or srun)");
  const auto addr = getenv("MASTER_ADDR");
  const auto port = getenv("MASTER_PORT");
  if (!addr)
    cli::usage_error("environment variable MASTER_ADDR is not set", needed, " ",
                     scheme->how_to_set_master);
  if (!port)
    cli::usage_error("environment variable MASTER_PORT is not set", needed, " ",
                     scheme->how_to_set_master);
  const std::string host = bare_host(*addr);
  if (host.empty() || host.find_first_of("[] \t") != std::string::npos)
    cli::usage_error("environment variable MASTER_ADDR='", *addr,
                     "': expected a host name or address (an IPv6 address bare or in brackets: "
                     "::1 or [::1])");
  env.master_addr = host;
  env.master_port = parse_int("MASTER_PORT", *port, 1, 65535);
  // torchrun's agent listens on MASTER_PORT itself: take the next port (the one below at the top).
  env.rdzv_port = env.master_port;
  if (env.launcher == Launcher::Torchrun)
    env.rdzv_port = env.master_port < 65535 ? env.master_port + 1 : env.master_port - 1;
  if (const auto rdzv = getenv("KILN_RDZV_PORT"))
    env.rdzv_port = parse_int("KILN_RDZV_PORT", *rdzv, 1, 65535);
  return env;
}

DistEnv DistEnv::from_env() {
  DistEnv env = from_lookup([](const char* name) -> std::optional<std::string> {
    const char* v = std::getenv(name);
    if (!v) return std::nullopt;
    return std::string(v);
  });
  // The texts already printed: a tool reads its place several times, a warning says it once.
  static std::mutex mutex;
  static std::set<std::string> printed;
  const std::lock_guard<std::mutex> lock(mutex);
  for (const std::string& w : env.warnings)
    if (printed.insert(w).second) std::fprintf(stderr, "kiln: warning: %s\n", w.c_str());
  return env;
}

}  // namespace kiln
