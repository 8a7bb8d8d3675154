// Data-parallel plumbing without GPUs: launcher environment parsing (torchrun, kiln --nproc,
// mpirun, srun; one-line errors, contradictions, IPv6 addresses), DistributedSampler (and its
// DataLoader hook), the TCP rendezvous between forked local processes under each launcher's
// variables and over IPv6, and the launcher.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <map>
#include <set>

#include "core/autograd.h"
#include "tools/train/dist_env.h"
#include "tools/cli/cli.h"
#include "tools/train/launcher.h"
#include "tools/train/rendezvous.h"
#include "tools/train/trainer.h"
#include "data/distributed_sampler.h"
#include "ops/ops.h"
#include "tests/test_util.h"

using namespace kiln;
using namespace kiln::data;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using kiln::testing::error_of;

namespace {

using Env = std::map<std::string, std::string>;

DistEnv parse(const Env& vars) {
  return DistEnv::from_lookup([&](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

// The message of the cli::UsageError that fn throws ("" when it throws nothing); any other
// exception's message comes back marked, so that comparing it with the expected line fails.
template <typename Fn>
std::string usage_error_of(Fn&& fn) {
  try {
    fn();
  } catch (const cli::UsageError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("(not a UsageError) ") + e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Inside a forked rank: reports a failed expectation on stderr and turns it into exit code 1.
int expect(bool ok, const std::string& what) {
  if (!ok) std::cerr << "expectation failed: " << what << std::endl;
  return ok ? 0 : 1;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
TEST_CASE("DistEnv: defaults, valid values and errors that name the variable") {
  DistEnv single = parse({});
  CHECK(single.rank == 0);
  CHECK(single.world_size == 1);
  CHECK(!single.distributed());

  DistEnv e = parse({{"RANK", "2"},
                     {"WORLD_SIZE", "4"},
                     {"LOCAL_RANK", "0"},
                     {"MASTER_ADDR", "node7"},
                     {"MASTER_PORT", "1234"}});
  CHECK(e.rank == 2);
  CHECK(e.world_size == 4);
  CHECK(e.local_rank == 0);
  CHECK(e.master_addr == "node7");
  CHECK(e.master_port == 1234);
  CHECK(e.distributed());
  // LOCAL_RANK defaults to RANK.
  CHECK(parse({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "9"}})
            .local_rank == 1);

  // Each mistake is one line naming the variable, its value and what was expected: a
  // cli::UsageError without a source location.
  const Env ok = {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "80"}};
  auto with = [&](const std::string& k, const std::string& v) {
    Env x = ok;
    x[k] = v;
    return usage_error_of([&] { parse(x); });
  };
  auto without = [&](const std::string& k) {
    Env x = ok;
    x.erase(k);
    return usage_error_of([&] { parse(x); });
  };
  const std::string rank_range = "': expected an integer between 0 and 1 (below WORLD_SIZE=2)";
  CHECK(with("RANK", "abc") == "environment variable RANK='abc" + rank_range);
  CHECK(with("RANK", "2") == "environment variable RANK='2" + rank_range);
  CHECK(with("RANK", "-1") == "environment variable RANK='-1" + rank_range);
  CHECK(with("RANK", "1 ") == "environment variable RANK='1 " + rank_range);
  CHECK(with("LOCAL_RANK", "5") == "environment variable LOCAL_RANK='5" + rank_range);
  CHECK(with("WORLD_SIZE", "0") ==
        "environment variable WORLD_SIZE='0': expected an integer between 1 and 1048576");
  CHECK(with("WORLD_SIZE", "2x") ==
        "environment variable WORLD_SIZE='2x': expected an integer between 1 and 1048576");
  CHECK(with("MASTER_PORT", "70000") ==
        "environment variable MASTER_PORT='70000': expected an integer between 1 and 65535");
  CHECK(with("MASTER_PORT", "") ==
        "environment variable MASTER_PORT='': expected an integer between 1 and 65535");
  CHECK(with("KILN_RDZV_PORT", "x") ==
        "environment variable KILN_RDZV_PORT='x': expected an integer between 1 and 65535");
  const std::string addr_expected =
      "': expected a host name or address (an IPv6 address bare or in brackets: ::1 or [::1])";
  CHECK(with("MASTER_ADDR", "") == "environment variable MASTER_ADDR='" + addr_expected);
  CHECK(with("MASTER_ADDR", "[::1") == "environment variable MASTER_ADDR='[::1" + addr_expected);
  CHECK(with("MASTER_ADDR", "[]") == "environment variable MASTER_ADDR='[]" + addr_expected);
  CHECK(with("MASTER_ADDR", "a b") == "environment variable MASTER_ADDR='a b" + addr_expected);
  CHECK(without("RANK") ==
        "environment variable RANK is not set but WORLD_SIZE=2 (launch with kiln-train --nproc N, "
        "torchrun, mpirun or srun)");
  CHECK(without("MASTER_ADDR") ==
        "environment variable MASTER_ADDR is not set but WORLD_SIZE=2 (kiln-train --nproc N and "
        "torchrun set it)");
  CHECK(without("MASTER_PORT") ==
        "environment variable MASTER_PORT is not set but WORLD_SIZE=2 (kiln-train --nproc N and "
        "torchrun set it)");
  CHECK(without("LOCAL_RANK").empty());
  CHECK_FALSE(contains(with("RANK", "abc"), "dist_env.cpp"));
  CHECK(cli::without_location(with("MASTER_ADDR", "")) == with("MASTER_ADDR", ""));
}

TEST_CASE("DistEnv: a single process never reads MASTER_ADDR, MASTER_PORT or KILN_RDZV_PORT") {
  // Left over in a shell, or set for another job: whatever they hold, one process runs.
  const Env stray = {{"MASTER_ADDR", ""}, {"MASTER_PORT", "garbage"}, {"KILN_RDZV_PORT", "-5"}};
  auto single = [&](Env vars) {
    vars.insert(stray.begin(), stray.end());
    const std::string err = usage_error_of([&] { parse(vars); });
    CHECK(err == "");
    return err.empty() ? parse(vars) : DistEnv{};
  };
  for (const Env& place : {Env{}, Env{{"WORLD_SIZE", "1"}}, Env{{"WORLD_SIZE", "1"}, {"RANK", "0"}},
                           Env{{"WORLD_SIZE", "1"}, {"TORCHELASTIC_RUN_ID", "r"}},
                           Env{{"OMPI_COMM_WORLD_SIZE", "1"}, {"OMPI_COMM_WORLD_RANK", "0"}},
                           Env{{"SLURM_NTASKS", "1"}, {"SLURM_PROCID", "0"}}}) {
    const DistEnv e = single(place);
    CHECK_FALSE(e.distributed());
    CHECK(e.rank == 0);
    CHECK(e.master_addr == "127.0.0.1");  // the defaults, not the stray values
    CHECK(e.master_port == 29500);
    CHECK(e.rdzv_port == 29500);
  }
  // With more than one process the same values are refused, naming the first one read.
  CHECK(usage_error_of([&] {
          Env two = {{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"MASTER_ADDR", "h"}};
          two.insert(stray.begin(), stray.end());
          parse(two);
        }) ==
        "environment variable MASTER_PORT='garbage': expected an integer between 1 and 65535");
  // The process's own place still has to make sense.
  CHECK(usage_error_of([] {
          parse({{"WORLD_SIZE", "1"}, {"RANK", "x"}});
        }) ==
        "environment variable RANK='x': expected an integer between 0 and 0 (below WORLD_SIZE=1)");
}

TEST_CASE("DistEnv: torchrun, kiln --nproc, Open MPI and Slurm variables") {
  const Env master = {{"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"}};
  auto with_master = [&](Env vars) {
    vars.insert(master.begin(), master.end());
    return vars;
  };
  // torchrun: its agent holds MASTER_PORT, so kiln's rendezvous takes the next port.
  DistEnv t = parse(with_master({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                                 {"TORCHELASTIC_RUN_ID", "none"},
                                 {"TORCHELASTIC_USE_AGENT_STORE", "True"}}));
  CHECK(t.launcher == Launcher::Torchrun);
  CHECK(t.rank == 3);
  CHECK(t.world_size == 4);
  CHECK(t.local_rank == 1);
  CHECK(t.master_port == 29500);
  CHECK(t.rdzv_port == 29501);
  CHECK(contains(t.describe(), "rank 3 of 4 (local rank 1), launched by torchrun"));
  CHECK(parse({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "65535"},
               {"TORCHELASTIC_RUN_ID", "x"}})
            .rdzv_port == 65534);
  // kiln's own launcher, and the same variables set by hand: MASTER_PORT itself.
  DistEnv k = parse(with_master({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"KILN_LAUNCHER", "kiln"}}));
  CHECK(k.launcher == Launcher::Kiln);
  CHECK(k.rdzv_port == 29500);
  DistEnv h = parse(with_master({{"RANK", "1"}, {"WORLD_SIZE", "2"}}));
  CHECK(h.launcher == Launcher::Env);
  CHECK(h.rdzv_port == 29500);
  // Open MPI's mpirun.
  DistEnv m = parse(with_master({{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                                 {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}}));
  CHECK(m.launcher == Launcher::Mpi);
  CHECK(m.rank == 5);
  CHECK(m.world_size == 8);
  CHECK(m.local_rank == 1);
  CHECK(m.master_addr == "node0");
  CHECK(m.rdzv_port == 29500);
  // Slurm's srun.
  DistEnv sl = parse(with_master(
      {{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "2"}}));
  CHECK(sl.launcher == Launcher::Slurm);
  CHECK(sl.rank == 6);
  CHECK(sl.world_size == 16);
  CHECK(sl.local_rank == 2);
  // One Slurm task, or MPI's single process: not distributed, no MASTER_* needed.
  CHECK(!parse({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}).distributed());
  CHECK(!parse({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}}).distributed());
  // Precedence: torchrun (or kiln --nproc) inside an MPI or Slurm job sets RANK/WORLD_SIZE for its
  // children, which describe the process better than the outer job's variables.
  DistEnv inner = parse(with_master({{"RANK", "1"}, {"WORLD_SIZE", "2"},
                                     {"TORCHELASTIC_RUN_ID", "r"}, {"SLURM_PROCID", "0"},
                                     {"SLURM_NTASKS", "1"}, {"OMPI_COMM_WORLD_SIZE", "1"}}));
  CHECK(inner.launcher == Launcher::Torchrun);
  CHECK(inner.world_size == 2);
  CHECK(parse(with_master({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                           {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}))
            .launcher == Launcher::Mpi);
  // KILN_RDZV_PORT wins over every rule.
  CHECK(parse(with_master({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_RUN_ID", "r"},
                           {"KILN_RDZV_PORT", "40000"}}))
            .rdzv_port == 40000);
  CHECK(parse(with_master({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"},
                           {"KILN_RDZV_PORT", "40001"}}))
            .rdzv_port == 40001);

  // Errors name the launcher's variable, and say how to pass MASTER_ADDR under it.
  auto err = [&](const Env& vars) { return usage_error_of([&] { parse(vars); }); };
  CHECK(err(with_master({{"OMPI_COMM_WORLD_RANK", "x"}, {"OMPI_COMM_WORLD_SIZE", "2"}})) ==
        "environment variable OMPI_COMM_WORLD_RANK='x': expected an integer between 0 and 1 "
        "(below OMPI_COMM_WORLD_SIZE=2)");
  CHECK(err(with_master({{"OMPI_COMM_WORLD_SIZE", "2"}})) ==
        "environment variable OMPI_COMM_WORLD_RANK is not set but OMPI_COMM_WORLD_SIZE=2 (launch "
        "with kiln-train --nproc N, torchrun, mpirun or srun)");
  CHECK(err({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}}) ==
        "environment variable MASTER_ADDR is not set but OMPI_COMM_WORLD_SIZE=2 (under mpirun: "
        "export it, then mpirun -x MASTER_ADDR -x MASTER_PORT ...)");
  CHECK(err(with_master({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "7"}})) ==
        "environment variable SLURM_LOCALID='7': expected an integer between 0 and 1 (below "
        "SLURM_NTASKS=2)");
  CHECK(err(with_master({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}})) ==
        "environment variable SLURM_PROCID='2': expected an integer between 0 and 1 (below "
        "SLURM_NTASKS=2)");
  CHECK(err({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"MASTER_PORT", "1"}}) ==
        "environment variable MASTER_ADDR is not set but SLURM_NTASKS=2 (under Slurm: export "
        "MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) and a "
        "MASTER_PORT before srun)");
  CHECK(err(with_master({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"KILN_RDZV_PORT", "0"}})) ==
        "environment variable KILN_RDZV_PORT='0': expected an integer between 1 and 65535");
}

TEST_CASE("DistEnv: contradicting launchers' variables warn, naming both; precedence stands") {
  const Env master = {{"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"}};
  auto with_master = [&](Env vars) {
    vars.insert(master.begin(), master.end());
    return vars;
  };
  // A stray WORLD_SIZE=1 in an 8-task Slurm job: every task would train alone.
  DistEnv lone = parse({{"WORLD_SIZE", "1"}, {"SLURM_NTASKS", "8"}, {"SLURM_PROCID", "3"}});
  CHECK(lone.world_size == 1);
  CHECK(lone.launcher == Launcher::Env);
  CHECK(lone.warnings ==
        std::vector<std::string>{"WORLD_SIZE=1 and SLURM_NTASKS=8 disagree; WORLD_SIZE takes "
                                 "precedence, so this process is rank 0 of 1"});
  // A hand-set RANK against mpirun's in a world of the same size.
  DistEnv r = parse(with_master({{"RANK", "0"},
                                 {"WORLD_SIZE", "4"},
                                 {"OMPI_COMM_WORLD_RANK", "3"},
                                 {"OMPI_COMM_WORLD_SIZE", "4"}}));
  CHECK(r.rank == 0);
  CHECK(r.warnings == std::vector<std::string>{"RANK=0 and OMPI_COMM_WORLD_RANK=3 disagree; RANK "
                                               "takes precedence, so this process is rank 0 of 4"});
  // Open MPI's variables against Slurm's: the world sizes.
  DistEnv m = parse(with_master({{"OMPI_COMM_WORLD_RANK", "1"},
                                 {"OMPI_COMM_WORLD_SIZE", "2"},
                                 {"SLURM_PROCID", "5"},
                                 {"SLURM_NTASKS", "16"}}));
  CHECK(m.launcher == Launcher::Mpi);
  CHECK(m.warnings == std::vector<std::string>{"OMPI_COMM_WORLD_SIZE=2 and SLURM_NTASKS=16 "
                                               "disagree; OMPI_COMM_WORLD_SIZE takes precedence, "
                                               "so this process is rank 1 of 2"});
  // Both outer launchers contradict: one line each.
  CHECK(parse({{"WORLD_SIZE", "1"},
               {"OMPI_COMM_WORLD_SIZE", "2"},
               {"SLURM_NTASKS", "4"},
               {"SLURM_PROCID", "0"}})
            .warnings.size() == 2);

  // Agreement, and launchers nested in a job (more processes inside than tasks outside, each
  // numbered its own way), are silent.
  CHECK(
      parse(with_master(
                {{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "8"}}))
          .warnings.empty());
  CHECK(parse(with_master({{"RANK", "9"},
                           {"WORLD_SIZE", "16"},
                           {"TORCHELASTIC_RUN_ID", "r"},
                           {"SLURM_PROCID", "1"},
                           {"SLURM_NTASKS", "2"}}))
            .warnings.empty());
  CHECK(parse(with_master({{"RANK", "1"},
                           {"WORLD_SIZE", "2"},
                           {"TORCHELASTIC_RUN_ID", "r"},
                           {"SLURM_PROCID", "0"},
                           {"SLURM_NTASKS", "2"}}))
            .warnings.empty());  // torchrun's own numbering of as many processes
  CHECK(parse(with_master({{"OMPI_COMM_WORLD_RANK", "5"},
                           {"OMPI_COMM_WORLD_SIZE", "16"},
                           {"SLURM_PROCID", "0"},
                           {"SLURM_NTASKS", "2"}}))
            .warnings.empty());  // mpirun's daemons started by srun, one per node
  CHECK(parse({{"WORLD_SIZE", "1"}, {"SLURM_NTASKS", "8"}}).warnings.empty());  // batch script
  CHECK(parse({{"WORLD_SIZE", "1"}, {"SLURM_NTASKS", "x"}, {"SLURM_PROCID", "0"}})
            .warnings.empty());  // an outer value that is no number is not compared
  CHECK(parse({{"SLURM_NTASKS", "8"},
               {"SLURM_PROCID", "3"},
               {"MASTER_ADDR", "a"},
               {"MASTER_PORT", "1"}})
            .warnings.empty());
}

TEST_CASE("plan_local_launch: --nproc is checked before anything is spawned") {
  DistEnv single;
  CHECK(!plan_local_launch(1, single, 0));
  CHECK(plan_local_launch(2, single, 2));
  CHECK(plan_local_launch(2, single, 8));
  ::unsetenv("CUDA_VISIBLE_DEVICES");
  const std::string few = error_of([&] { plan_local_launch(3, single, 1); });
  CHECK(contains(few, "--nproc 3 needs one GPU per process, but 1 CUDA device(s) are visible"));
  CHECK(contains(few, "nothing was started"));
  CHECK_FALSE(contains(few, "launcher.cpp"));  // the user's request: no source location
  CHECK_THROWS_AS(plan_local_launch(3, single, 1), cli::UsageError);
  ::setenv("CUDA_VISIBLE_DEVICES", "1", 1);
  CHECK(contains(error_of([&] { plan_local_launch(2, single, 1); }), "CUDA_VISIBLE_DEVICES=1"));
  ::unsetenv("CUDA_VISIBLE_DEVICES");
  // A rank kiln started runs; a rank another launcher started must not launch again.
  DistEnv child;
  child.world_size = 2;
  child.launcher = Launcher::Kiln;
  CHECK(!plan_local_launch(2, child, 2));
  DistEnv torch = child;
  torch.launcher = Launcher::Torchrun;
  CHECK(contains(error_of([&] { plan_local_launch(2, torch, 2); }),
                 "already rank 0 of 2 (local rank 0), launched by torchrun"));
  CHECK_THROWS_AS(plan_local_launch(0, single, 1), Error);
  // The tools fail at once with --nproc beyond any machine's GPUs (without CUDA and NCCL they
  // say so instead), and print their version.
  const auto t0 = Clock::now();
  CHECK(train::main({"--nproc", "1000", "--quiet"}) == 1);
  CHECK(seconds_since(t0) < 10.0);
  CHECK(train::main({"--version"}) == 0);
}

// ---------------------------------------------------------------------------------------------
TEST_CASE("DistributedSampler: shards are equal, disjoint, cover the data, deterministic") {
  for (int64_t n : {0, 1, 7, 10, 12, 31}) {
    for (int64_t world : {1, 2, 3, 4}) {
      for (bool drop_last : {false, true}) {
        if (drop_last && n < world) continue;
        CAPTURE(n);
        CAPTURE(world);
        CAPTURE(drop_last);
        const int64_t per = drop_last ? n / world : (n + world - 1) / world;
        std::multiset<int64_t> seen;
        for (int64_t r = 0; r < world; ++r) {
          DistributedSampler s(n, world, r, {.shuffle = true, .seed = 5, .drop_last = drop_last});
          const std::vector<int64_t> idx = s.indices(3);
          CHECK(s.size() == per);
          CHECK(int64_t(idx.size()) == per);
          CHECK(idx == DistributedSampler(n, world, r, {true, 5, drop_last}).indices(3));
          for (int64_t i : idx) {
            CHECK(i >= 0);
            CHECK(i < n);
            seen.insert(i);
          }
        }
        const std::set<int64_t> distinct(seen.begin(), seen.end());
        if (drop_last) {
          CHECK(int64_t(seen.size()) == world * (n / world));
          CHECK(distinct.size() == seen.size());  // disjoint
        } else {
          CHECK(int64_t(distinct.size()) == n);  // every sample, each at least once
          // Only the padding repeats: n + padding entries in all.
          CHECK(int64_t(seen.size()) == world * per);
          if (n >= world) {
            for (int64_t i : distinct) CHECK(seen.count(i) <= 2);
          }
        }
      }
    }
  }
}

TEST_CASE("DistributedSampler: PyTorch's layout without shuffle; epochs and seeds differ") {
  // PyTorch: indices + indices[:padding], then indices[rank::world].
  CHECK(DistributedSampler(5, 2, 0, {.shuffle = false}).indices(0) ==
        std::vector<int64_t>{0, 2, 4});
  CHECK(DistributedSampler(5, 2, 1, {.shuffle = false}).indices(0) ==
        std::vector<int64_t>{1, 3, 0});
  CHECK(DistributedSampler(2, 5, 4, {.shuffle = false}).global_indices(0) ==
        std::vector<int64_t>{0, 1, 0, 1, 0});
  CHECK(DistributedSampler(7, 3, 2, {.shuffle = false, .drop_last = true}).indices(0) ==
        std::vector<int64_t>{2, 5});

  DistributedSampler a(100, 4, 1, {.seed = 1});
  CHECK(a.indices(0) != a.indices(1));
  CHECK(a.global_indices(0) != a.global_indices(1));
  CHECK(a.indices(0) != DistributedSampler(100, 4, 1, {.seed = 2}).indices(0));
  // Every rank draws the same epoch permutation.
  CHECK(a.global_indices(4) == DistributedSampler(100, 4, 3, {.seed = 1}).global_indices(4));

  CHECK_THROWS_AS(DistributedSampler(10, 0, 0), Error);
  CHECK_THROWS_AS(DistributedSampler(10, 2, 2), Error);
  CHECK_THROWS_AS(DistributedSampler(10, 2, -1), Error);
  CHECK_THROWS_AS(DistributedSampler(1, 2, 0, {.drop_last = true}), Error);
}

TEST_CASE("DataLoader with a DistributedSampler loads exactly the rank's shard") {
  const int64_t n = 11;
  std::vector<uint8_t> px(size_t(n * 4));
  std::vector<int64_t> labels(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) labels[size_t(i)] = i;
  TensorDataset ds(from_vector(px, {n, 2, 2}, DType::u8), from_vector(labels, {n}, DType::i64));
  for (int workers : {0, 2}) {
    auto sampler =
        std::make_shared<DistributedSampler>(n, 3, 1, DistributedSamplerOptions{.seed = 9});
    LoaderOptions opts;
    opts.batch_size = 3;
    opts.sampler = sampler;
    opts.workers = workers;
    DataLoader loader(ds, opts);
    CHECK(loader.num_batches() == 2);  // 4 samples per rank -> batches of 3 and 1
    std::vector<int64_t> got;
    for (Batch& b : loader.epoch(2))
      for (int64_t v : b.y.to_vector<int64_t>()) got.push_back(v);
    CHECK(got == sampler->indices(2));
    CHECK(loader.order(2) == sampler->indices(2));
  }
  LoaderOptions bad;
  bad.sampler = std::make_shared<DistributedSampler>(n, 2, 0);
  bad.shuffle = true;
  CHECK(contains(error_of([&] { DataLoader(ds, bad); }), "shuffle"));
  // A sampler for a larger dataset hands out indices the loader refuses.
  LoaderOptions big;
  big.sampler = std::make_shared<DistributedSampler>(n + 40, 1, 0);
  DataLoader loader(ds, big);
  CHECK(contains(error_of([&] { loader.epoch(0); }), "out of range"));
}

// ---------------------------------------------------------------------------------------------
TEST_CASE("Rendezvous: broadcast, all_gather and barrier across 3 local processes") {
  LaunchResult r = launch_functions(
      [](const DistEnv& env) {
        Rendezvous rv(env, {.timeout = milliseconds(10000)});
        int bad = expect(rv.rank() == env.rank && rv.world_size() == 3, "rank/world");
        Rendezvous::Blob mine(40, uint8_t(env.rank + 1));  // only rank 0's counts
        Rendezvous::Blob id = rv.broadcast(mine);
        bad |= expect(id == Rendezvous::Blob(40, uint8_t(1)), "broadcast blob");
        // Blobs of different sizes: rank r sends r + 1 bytes of value 10 + r.
        auto all = rv.all_gather(Rendezvous::Blob(size_t(env.rank + 1), uint8_t(10 + env.rank)));
        bad |= expect(all.size() == 3, "all_gather size");
        for (int q = 0; q < 3 && all.size() == 3; ++q)
          bad |= expect(all[size_t(q)] == Rendezvous::Blob(size_t(q + 1), uint8_t(10 + q)),
                        "all_gather blob of rank " + std::to_string(q));
        rv.barrier();
        bad |= expect(rv.broadcast(Rendezvous::Blob{}).empty(), "empty broadcast");
        return bad;
      },
      {.nproc = 3});
  INFO(r.message);
  CHECK(r.ok());

  // A world of one needs no peers.
  Rendezvous solo("127.0.0.1", 1, 0, 1);
  CHECK(solo.broadcast({1, 2}) == Rendezvous::Blob{1, 2});
  CHECK(solo.all_gather({3}) == std::vector<Rendezvous::Blob>{{3}});
}

TEST_CASE("Rendezvous: a rank that never arrives fails rank 0 in time, naming it") {
  LaunchResult r = launch_functions(
      [](const DistEnv& env) {
        if (env.rank == 2) return 0;  // never joins
        const auto t0 = Clock::now();
        const std::string err =
            error_of([&] { Rendezvous rv(env, {.timeout = milliseconds(1500)}); });
        const double took = seconds_since(t0);
        if (env.rank == 0)
          return expect(contains(err, "waiting for rank(s) 2 of world size 3") &&
                            contains(err, "arrived: 0, 1") && took < 4.0,
                        "rank 0: '" + err + "' after " + std::to_string(took) + " s");
        // Rank 1 joined; it learns of the failure when rank 0 gives up.
        return expect(contains(err, "rank 0 closed the connection") && took < 4.0,
                      "rank 1: '" + err + "'");
      },
      {.nproc = 3});
  INFO(r.message);
  CHECK(r.ok());
}

TEST_CASE("Rendezvous: an unreachable rank 0 fails in time, naming the address") {
  const int port = find_free_port();  // nobody listens there
  const auto t0 = Clock::now();
  const std::string err = usage_error_of(
      [&] { Rendezvous rv("127.0.0.1", port, 1, 2, {.timeout = milliseconds(400)}); });
  CHECK(seconds_since(t0) < 3.0);
  CHECK(err == "rendezvous: rank 1 could not reach rank 0 at 127.0.0.1:" + std::to_string(port) +
                   " within 0.4 s (last error: Connection refused); is rank 0 running, and are "
                   "MASTER_ADDR/MASTER_PORT (KILN_RDZV_PORT) right?");
  // The resolver's reason depends on the host (no DNS: a temporary failure).
  const std::string unknown =
      usage_error_of([] { Rendezvous("no-such-host.invalid", 1234, 1, 2); });
  CHECK(unknown.rfind("rendezvous: rank 1 cannot resolve MASTER_ADDR 'no-such-host.invalid': ",
                      0) == 0);
  CHECK(cli::without_location(unknown) == unknown);
  // Arguments DistEnv has already checked are internal errors.
  CHECK_THROWS_AS(Rendezvous("127.0.0.1", 1234, 2, 2), Error);
  CHECK_THROWS_AS(Rendezvous("127.0.0.1", 0, 1, 2), Error);
  CHECK(contains(error_of([] { Rendezvous("127.0.0.1", 0, 1, 2); }), "rendezvous.cpp:"));
}

TEST_CASE("Rendezvous: processes given different world sizes are told, without a location") {
  LaunchResult r = launch_functions(
      [](const DistEnv& env) {
        // Rank 1 was told of a world of 3, rank 0 of 2.
        const int world = env.rank == 0 ? 2 : 3;
        const std::string err = usage_error_of([&] {
          Rendezvous rv(env.master_addr, env.rdzv_port, env.rank, world,
                        {.timeout = milliseconds(3000)});
        });
        if (env.rank == 0)
          return expect(err ==
                            "rendezvous: rank 0 (world size 2) got a join from rank 1 with "
                            "world size 3; every process needs the same world size and a "
                            "rank of its own",
                        "rank 0: '" + err + "'");
        return expect(!err.empty(), "rank 1 joined a world it disagrees with");
      },
      {.nproc = 2});
  INFO(r.message);
  CHECK(r.ok());
}

TEST_CASE("Rendezvous: rank 0 listens on every interface unless MASTER_ADDR is the loopback") {
  // Another rank may reach rank 0's host by a different address than the one MASTER_ADDR resolves
  // to there (a host name /etc/hosts maps to 127.0.1.1 locally). Stand-in: rank 0 is given this
  // host's non-loopback IPv4 address, rank 1 connects to 127.0.0.1.
  std::string ip;
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i && ip.empty(); i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_LOOPBACK))
        continue;
      char buf[INET_ADDRSTRLEN] = {};
      ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
      ip = buf;
    }
    ::freeifaddrs(ifs);
  }
  if (ip.empty()) {
    MESSAGE("SKIPPED: this host has no non-loopback IPv4 address");
    return;
  }
  const int port = find_free_port();
  LaunchResult r = launch_functions(
      [&](const DistEnv& env) {
        Rendezvous rv(env.rank == 0 ? ip : "127.0.0.1", port, env.rank, 2,
                      {.timeout = milliseconds(3000)});
        return expect(rv.all_gather({}).size() == 2, "all_gather");
      },
      {.nproc = 2});
  INFO("rank 0 given " << ip << ": " << r.message);
  CHECK(r.ok());
}

namespace {

// Whether this host can listen on IPv6's loopback (a sandbox may have no IPv6 at all).
bool have_ipv6_loopback() {
  const int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// An IPv6 address of this host other than the loopback and link-local ones, or "".
std::string global_ipv6_address() {
  std::string ip;
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) return ip;
  for (ifaddrs* i = ifs; i && ip.empty(); i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET6 || (i->ifa_flags & IFF_LOOPBACK))
      continue;
    const in6_addr& a = reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr;
    if (IN6_IS_ADDR_LINKLOCAL(&a) || IN6_IS_ADDR_LOOPBACK(&a)) continue;
    char buf[INET6_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET6, &a, buf, sizeof buf);
    ip = buf;
  }
  ::freeifaddrs(ifs);
  return ip;
}

}  // namespace

TEST_CASE("IPv6 literals: bare for the resolver, in brackets in address:port") {
  CHECK(bare_host("[::1]") == "::1");
  CHECK(bare_host("::1") == "::1");
  CHECK(bare_host("[fe80::1%eth0]") == "fe80::1%eth0");
  CHECK(bare_host("node7") == "node7");
  CHECK(bare_host("[") == "[");
  CHECK(host_port("::1", 29500) == "[::1]:29500");
  CHECK(host_port("[fd00::2]", 1) == "[fd00::2]:1");
  CHECK(host_port("10.0.0.1", 80) == "10.0.0.1:80");
  CHECK(host_port("node7", 80) == "node7:80");
  // MASTER_ADDR in either spelling: DistEnv keeps it bare.
  const Env v6 = {
      {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "[::1]"}, {"MASTER_PORT", "29500"}};
  CHECK(parse(v6).master_addr == "::1");
  Env bare = v6;
  bare["MASTER_ADDR"] = "fd00::2";
  CHECK(parse(bare).master_addr == "fd00::2");
  // What --dist-url tcp://[::1]:29500 sets.
  CHECK(train::launch_env(train::parse_args(
            {"--world-size", "2", "--rank", "1", "--dist-url", "tcp://[::1]:29500"}))[3] ==
        std::pair<std::string, std::string>{"MASTER_ADDR", "::1"});

  if (!have_ipv6_loopback()) {
    MESSAGE("SKIPPED: the rendezvous over IPv6 (this host cannot listen on ::1)");
    return;
  }
  // Nobody listens: the message shows the address in brackets, however MASTER_ADDR spelt it.
  const int free = find_free_port("[::1]");
  for (const char* addr : {"::1", "[::1]"}) {
    CHECK(usage_error_of([&] {
            Rendezvous rv(addr, free, 1, 2, {.timeout = milliseconds(300)});
          }) == "rendezvous: rank 1 could not reach rank 0 at [::1]:" + std::to_string(free) +
                    " within 0.3 s (last error: Connection refused); is rank 0 running, and are "
                    "MASTER_ADDR/MASTER_PORT (KILN_RDZV_PORT) right?");
  }
  // End to end: --dist-url tcp://[::1]:PORT -> the variables -> DistEnv -> the rendezvous. The
  // launcher itself was given "[::1]": its children see MASTER_ADDR bare.
  const int port = find_free_port("::1");
  LaunchResult r = launch_functions(
      [&](const DistEnv& given) {
        const char* from_launcher = std::getenv("MASTER_ADDR");
        int bad = expect(from_launcher && std::string(from_launcher) == "::1",
                         "the launcher's MASTER_ADDR");
        ::unsetenv("KILN_LAUNCHER");
        for (const auto& [k, v] : train::launch_env(
                 train::parse_args({"--world-size", "2", "--rank", std::to_string(given.rank),
                                    "--dist-url", "tcp://[::1]:" + std::to_string(port)})))
          ::setenv(k.c_str(), v.c_str(), 1);
        const DistEnv env = DistEnv::from_env();
        bad |= expect(env.master_addr == "::1" && env.rdzv_port == port && env.rank == given.rank &&
                          env.launcher == Launcher::Env,
                      "place: " + env.describe() + " at " + env.master_addr);
        Rendezvous rv(env, {.timeout = milliseconds(10000)});
        auto all = rv.all_gather(Rendezvous::Blob(1, uint8_t(env.rank)));
        bad |= expect(
            all.size() == 2 && all[0] == Rendezvous::Blob{0} && all[1] == Rendezvous::Blob{1},
            "all_gather");
        return bad;
      },
      {.nproc = 2, .master_addr = "[::1]"});
  INFO(r.message);
  CHECK(r.ok());

  // Rank 0 given this host's global IPv6 address listens on every interface, IPv4 and IPv6: one
  // rank joins by that address, one by 127.0.0.1.
  const std::string ip = global_ipv6_address();
  if (ip.empty()) {
    MESSAGE("SKIPPED: the rendezvous over a global IPv6 address (this host has none)");
    return;
  }
  const int port2 = find_free_port();
  LaunchResult g = launch_functions(
      [&](const DistEnv& env) {
        Rendezvous rv(env.rank == 2 ? "127.0.0.1" : ip, port2, env.rank, 3,
                      {.timeout = milliseconds(5000)});
        return expect(rv.all_gather({}).size() == 3, "all_gather");
      },
      {.nproc = 3});
  INFO("rank 0 given " << ip << ": " << g.message);
  CHECK(g.ok());
}

TEST_CASE("Rendezvous: ranks in different collectives are told so") {
  LaunchResult r = launch_functions(
      [](const DistEnv& env) {
        Rendezvous rv(env, {.timeout = milliseconds(3000)});
        if (env.rank == 0) {
          rv.broadcast({1});
          // Stay until rank 1 has sent its all_gather message (its send would fail otherwise).
          error_of([&] { rv.all_gather({}); });
          return 0;
        }
        const std::string err = error_of([&] { rv.all_gather({2}); });
        return expect(contains(err, "rank 1 is in all_gather but rank 0 is in broadcast"),
                      "rank 1: '" + err + "'");
      },
      {.nproc = 2});
  INFO(r.message);
  CHECK(r.ok());
}

namespace {

// A listening TCP socket on 127.0.0.1:port (-1 when the port is taken): stands in for torchrun's
// agent store, which holds MASTER_PORT for the whole job.
int listen_on(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, 4) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Replaces the torchrun-style variables launch_functions set in a child with one launcher's.
void become(const std::string& launcher, const DistEnv& env) {
  for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "KILN_LAUNCHER"}) ::unsetenv(v);
  const std::string rank = std::to_string(env.rank), world = std::to_string(env.world_size);
  if (launcher == "torchrun") {
    ::setenv("RANK", rank.c_str(), 1);
    ::setenv("LOCAL_RANK", rank.c_str(), 1);
    ::setenv("WORLD_SIZE", world.c_str(), 1);
    ::setenv("TORCHELASTIC_RUN_ID", "test", 1);
    ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  } else if (launcher == "env") {
    ::setenv("RANK", rank.c_str(), 1);
    ::setenv("WORLD_SIZE", world.c_str(), 1);
  } else if (launcher == "mpirun") {
    ::setenv("OMPI_COMM_WORLD_RANK", rank.c_str(), 1);
    ::setenv("OMPI_COMM_WORLD_LOCAL_RANK", rank.c_str(), 1);
    ::setenv("OMPI_COMM_WORLD_SIZE", world.c_str(), 1);
  } else if (launcher == "srun") {
    ::setenv("SLURM_PROCID", rank.c_str(), 1);
    ::setenv("SLURM_LOCALID", rank.c_str(), 1);
    ::setenv("SLURM_NTASKS", world.c_str(), 1);
  }
}

}  // namespace

TEST_CASE("Rendezvous of two processes under each launcher's variables") {
  // MASTER_PORT is held by a listening socket, as torchrun's agent holds it; the next port is free.
  int port = 0, store = -1;
  for (int attempt = 0; attempt < 20 && store < 0; ++attempt) {
    port = find_free_port();
    if (port >= 65535) continue;
    const int next = listen_on(port + 1);
    if (next < 0) continue;
    ::close(next);
    store = listen_on(port);
  }
  REQUIRE(store >= 0);
  for (const std::string launcher : {"torchrun", "mpirun", "srun", "kiln"}) {
    INFO(launcher);
    // Under Slurm, MPI and kiln nothing else holds MASTER_PORT: give them a free one.
    const int master_port = launcher == "torchrun" ? port : find_free_port();
    LaunchResult r = launch_functions(
        [&](const DistEnv& given) {
          if (launcher != "kiln") become(launcher, given);
          const DistEnv env = DistEnv::from_env();
          const Launcher want = launcher == "torchrun" ? Launcher::Torchrun
                                : launcher == "mpirun" ? Launcher::Mpi
                                : launcher == "srun"   ? Launcher::Slurm
                                                       : Launcher::Kiln;
          int bad = expect(env.launcher == want, "launcher of " + env.describe());
          bad |= expect(env.rank == given.rank && env.local_rank == given.rank &&
                            env.world_size == 2 && env.master_port == master_port,
                        "place: " + env.describe());
          Rendezvous rv(env, {.timeout = milliseconds(10000)});
          auto all = rv.all_gather(Rendezvous::Blob(1, uint8_t(env.rank)));
          bad |= expect(all.size() == 2 && all[0] == Rendezvous::Blob{0} &&
                            all[1] == Rendezvous::Blob{1},
                        "all_gather");
          return bad;
        },
        {.nproc = 2, .master_port = master_port});
    INFO(r.message);
    CHECK(r.ok());
  }

  // Without torchrun's marker, rank 0 would bind MASTER_PORT itself: the collision the
  // rendezvous port avoids, reported with what to do about it.
  LaunchResult clash = launch_functions(
      [&](const DistEnv& given) {
        if (given.rank != 0) return 0;
        become("env", given);
        const std::string err = usage_error_of(
            [] { Rendezvous rv(DistEnv::from_env(), {.timeout = milliseconds(500)}); });
        return expect(
            err == "rendezvous: rank 0 cannot listen on 127.0.0.1:" + std::to_string(port) +
                       ": Address already in use (the port is taken: another job, or a "
                       "launcher's own store; set KILN_RDZV_PORT to a free port for "
                       "every rank)",
            "rank 0: '" + err + "'");
      },
      {.nproc = 2, .master_port = port});
  INFO(clash.message);
  CHECK(clash.ok());
  ::close(store);
}

// ---------------------------------------------------------------------------------------------
TEST_CASE("launcher: children see torchrun's variables; a failure stops the others") {
  ::unsetenv("NCCL_NVLS_ENABLE");
  LaunchResult ok = launch_processes(
      {"/bin/sh", "-c",
       "test \"$RANK\" = \"$LOCAL_RANK\" && test \"$WORLD_SIZE\" = 3 && test \"$RANK\" -lt 3 && "
       "test \"$MASTER_ADDR\" = 127.0.0.1 && test \"$MASTER_PORT\" -gt 0 && "
       "test \"$NCCL_NVLS_ENABLE\" = 0"},
      {.nproc = 3});
  INFO(ok.message);
  CHECK(ok.ok());
  CHECK(ok.failed_rank == -1);

  // Rank 1 fails at once; the others would sleep for a minute but are terminated.
  const auto t0 = Clock::now();
  LaunchResult bad = launch_processes(
      {"/bin/sh", "-c", "if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 60"}, {.nproc = 3});
  CHECK(seconds_since(t0) < 10.0);
  CHECK(bad.exit_code == 3);
  CHECK(bad.failed_rank == 1);
  CHECK(contains(bad.message, "rank 1 exited with code 3"));

  LaunchResult sig = launch_processes({"/bin/sh", "-c", "kill -SEGV $$"}, {.nproc = 1});
  CHECK(sig.exit_code == 128 + 11);
  CHECK(contains(sig.message, "signal 11"));

  LaunchResult missing = launch_processes({"/nonexistent/kiln-train"}, {.nproc = 2});
  CHECK(missing.exit_code == 127);

  LaunchResult thrown = launch_functions(
      [](const DistEnv& env) -> int {
        KILN_CHECK(env.rank != 1, "rank 1 gives up");
        return 0;
      },
      {.nproc = 2});
  CHECK(thrown.exit_code == 1);
  CHECK(thrown.failed_rank == 1);
  CHECK_THROWS_AS(launch_processes({"/bin/true"}, {.nproc = 0}), Error);
}

// ---------------------------------------------------------------------------------------------
// The hook GradBucketer uses to launch a bucket's all-reduce as soon as its gradients are done.
TEST_CASE("post-accumulate-grad hooks run after each accumulation, in order, and detach") {
  Tensor w = tensor({1.0, 2.0}).set_requires_grad(true);
  Tensor unused = tensor({3.0}).set_requires_grad(true);
  std::vector<std::string> calls;
  const uint64_t a = autograd::add_post_accumulate_grad_hook(w, [&](const Tensor& leaf) {
    CHECK(leaf.is_same(w));
    CHECK(!GradMode::is_enabled());
    calls.push_back("a:" + std::to_string(leaf.grad().to_vector<double>()[0]));
  });
  autograd::add_post_accumulate_grad_hook(w, [&](const Tensor&) { calls.push_back("b"); });
  autograd::add_post_accumulate_grad_hook(unused, [&](const Tensor&) { calls.push_back("u"); });
  F::sum(w * 3.0).backward();
  CHECK(calls == std::vector<std::string>{"a:3.000000", "b"});
  F::sum(w * 2.0).backward();  // `+=`: the hook sees the accumulated gradient
  CHECK(calls == std::vector<std::string>{"a:3.000000", "b", "a:5.000000", "b"});
  autograd::remove_post_accumulate_grad_hook(w, a);
  calls.clear();
  F::sum(w * 1.0).backward();
  CHECK(calls == std::vector<std::string>{"b"});
  CHECK_THROWS_AS(autograd::add_post_accumulate_grad_hook(w * 2.0, [](const Tensor&) {}), Error);
}
