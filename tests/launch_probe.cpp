// launch_probe: checks that a launcher's processes find each other, without GPUs or NCCL. Every
// process reads its place (tools/train/dist_env.h), joins kiln's rendezvous and all-gathers
// one line per rank (host, pid, place, rendezvous address); rank 0 prints them and
// "launch_probe: OK, N rank(s) met" (the rendezvous itself rejects duplicate ranks and world
// sizes that disagree). Exit status 0 on success, 1 with the error on stderr.
//   torchrun --standalone --nproc_per_node=2 --no-python build/launch_probe
//   srun -n 2 build/launch_probe   (with MASTER_ADDR/MASTER_PORT exported)
// tools/device/launch-check.sh runs it under each launcher.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "tools/train/dist_env.h"
#include "tools/train/rendezvous.h"

int main() {
  try {
    const kiln::DistEnv env = kiln::DistEnv::from_env();
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    kiln::Rendezvous rv(env, {.timeout = std::chrono::seconds(60)});
    const std::string me = std::string(host) + " pid " + std::to_string(::getpid()) + ": " +
                           env.describe() + ", rendezvous " +
                           kiln::host_port(env.master_addr, env.rdzv_port);
    const auto all = rv.all_gather(kiln::Rendezvous::Blob(me.begin(), me.end()));
    rv.barrier();
    if (env.rank == 0) {
      for (const auto& b : all) std::printf("  %s\n", std::string(b.begin(), b.end()).c_str());
      std::printf("launch_probe: OK, %d rank(s) met\n", rv.world_size());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "launch_probe: error: %s\n", e.what());
    return 1;
  }
}
