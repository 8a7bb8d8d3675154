#pragma once
// Local multi-process launch for data-parallel jobs (what `kiln-train --nproc N` and torchrun's
// --nproc_per_node do): N children of one program, each told its place through torchrun's
// environment variables, RANK = LOCAL_RANK = i, WORLD_SIZE = N, MASTER_ADDR, MASTER_PORT, and
// KILN_LAUNCHER=kiln (so a child knows kiln started it), with NCCL_NVLS_ENABLE=0 unless the
// caller's environment sets it (NVLink multicast stays off).
//
//   LaunchResult r = launch_processes({"/proc/self/exe", "--epochs", "3"}, {.nproc = 2});
//   if (!r.ok()) { std::cerr << r.message << "\n"; return r.exit_code; }
//
// The launcher waits for every child. When one fails (non-zero exit or a signal) it sends
// SIGTERM to the others, waits up to `kill_grace` for them, then SIGKILLs what remains, and
// reports the first failure. Children that fail because a sibling died are not reported.
// Linux/POSIX only; call it before creating threads or touching CUDA (it forks).
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "tools/train/dist_env.h"

namespace kiln {

struct LaunchOptions {
  int nproc = 1;
  std::string master_addr = "127.0.0.1";  // an IPv6 literal bare or in brackets
  int master_port = 0;  // 0: a free port of master_addr, chosen by the launcher
  std::chrono::milliseconds kill_grace{std::chrono::seconds(5)};
};

struct LaunchResult {
  int exit_code = 0;     // 0, the failing child's exit code, or 128 + its signal number
  int failed_rank = -1;  // -1 when all succeeded
  std::string message;   // "rank 1 exited with code 3", "rank 0 was killed by signal 11 (...)"
  bool ok() const { return exit_code == 0; }
};

// Runs argv (argv[0] is the program's path; "/proc/self/exe" re-runs this binary) as `nproc`
// children. Throws kiln::Error for nproc < 1, an empty argv, or a failed fork.
LaunchResult launch_processes(const std::vector<std::string>& argv, const LaunchOptions& opts);

// Same, but each child runs fn(env) in a forked copy of this process and exits with its return
// value (an exception is printed to stderr and becomes exit code 1). For tests.
LaunchResult launch_functions(const std::function<int(const DistEnv&)>& fn,
                              const LaunchOptions& opts);

// What a tool given --nproc N does, decided before anything is spawned: true when it should start
// N local ranks (launch_processes), false when it should run as it is (N == 1, or it is one of
// the ranks kiln started: env.launcher == Launcher::Kiln). Throws kiln::Error when another
// launcher already placed this process in a job of several (torchrun, mpirun and srun start the
// processes themselves), or when fewer than N CUDA devices are visible (`visible_gpus`, e.g.
// kiln::cuda_device_count(); one rank per GPU), naming both numbers and CUDA_VISIBLE_DEVICES.
bool plan_local_launch(int nproc, const DistEnv& env, int visible_gpus);

// A TCP port on `addr` (an IPv6 literal bare or in brackets) that is free now (bind to port 0,
// read it back, close).
int find_free_port(const std::string& addr = "127.0.0.1");

}  // namespace kiln
