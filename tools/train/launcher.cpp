#include "tools/train/launcher.h"

#include "tools/cli/cli.h"

#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <thread>

#include "core/error.h"

extern char** environ;

namespace kiln {
namespace {

using Clock = std::chrono::steady_clock;

// The child's environment: the parent's, with the launcher's variables replacing any of the
// same name. Built before fork so the child only calls async-signal-safe functions.
std::vector<std::string> child_environment(const DistEnv& env) {
  std::vector<std::pair<std::string, std::string>> set = {
      {"RANK", std::to_string(env.rank)},
      {"LOCAL_RANK", std::to_string(env.local_rank)},
      {"WORLD_SIZE", std::to_string(env.world_size)},
      {"MASTER_ADDR", env.master_addr},
      {"MASTER_PORT", std::to_string(env.master_port)},
      {"KILN_LAUNCHER", "kiln"}};
  if (!std::getenv("NCCL_NVLS_ENABLE")) set.emplace_back("NCCL_NVLS_ENABLE", "0");
  std::vector<std::string> out;
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    bool replaced = false;
    for (const auto& [k, v] : set) replaced |= kv.compare(0, k.size() + 1, k + "=") == 0;
    if (!replaced) out.push_back(kv);
  }
  for (const auto& [k, v] : set) out.push_back(k + "=" + v);
  return out;
}

std::string describe_status(int rank, int status) {
  if (WIFEXITED(status))
    return "rank " + std::to_string(rank) + " exited with code " +
           std::to_string(WEXITSTATUS(status));
  const int sig = WTERMSIG(status);
  return "rank " + std::to_string(rank) + " was killed by signal " + std::to_string(sig) + " (" +
         strsignal(sig) + ")";
}

int exit_code_of(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// The environment of each rank.
std::vector<DistEnv> rank_envs(const LaunchOptions& opts) {
  KILN_CHECK(opts.nproc >= 1, "launcher: nproc must be >= 1, got ", opts.nproc);
  DistEnv base;
  base.world_size = opts.nproc;
  base.master_addr = bare_host(opts.master_addr);
  base.master_port = opts.master_port > 0 ? opts.master_port : find_free_port(opts.master_addr);
  base.rdzv_port = base.master_port;
  base.launcher = Launcher::Kiln;
  std::vector<DistEnv> envs(size_t(opts.nproc), base);
  for (int r = 0; r < opts.nproc; ++r) envs[size_t(r)].rank = envs[size_t(r)].local_rank = r;
  return envs;
}

// Forks one child per rank (`start` runs in the child and never returns) and supervises them.
LaunchResult supervise(const LaunchOptions& opts, const std::vector<DistEnv>& envs,
                       const std::function<void(const DistEnv&)>& start) {
  std::vector<pid_t> pids(size_t(opts.nproc), -1);
  auto kill_all = [&](int sig) {
    for (pid_t p : pids)
      if (p > 0) ::kill(p, sig);
  };
  for (int r = 0; r < opts.nproc; ++r) {
    std::cout.flush();
    std::cerr.flush();
    // The launcher stops a failed rank's siblings with SIGTERM, which must end them even when
    // the parent installed a handler (test frameworks do): the child resets it to the default
    // with SIGTERM blocked, so none arrives in between.
    sigset_t term, old_mask;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    ::sigprocmask(SIG_BLOCK, &term, &old_mask);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::signal(SIGTERM, SIG_DFL);
      ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
      start(envs[size_t(r)]);  // never returns
    }
    ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
    if (pid < 0) {
      const int err = errno;
      kill_all(SIGKILL);
      for (pid_t p : pids)
        if (p > 0) ::waitpid(p, nullptr, 0);
      KILN_FAIL("launcher: fork of rank ", r, " failed: ", std::strerror(err));
    }
    pids[size_t(r)] = pid;
  }

  LaunchResult result;
  int alive = opts.nproc;
  Clock::time_point kill_at{};
  bool killed = false;
  while (alive > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, result.ok() ? 0 : WNOHANG);
    if (pid < 0 && errno == EINTR) continue;
    if (pid < 0) break;  // ECHILD: nothing left to wait for
    if (pid == 0) {      // siblings of a failed rank still running
      if (!killed && Clock::now() >= kill_at) {
        kill_all(SIGKILL);
        killed = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    int rank = -1;
    for (int r = 0; r < opts.nproc; ++r)
      if (pids[size_t(r)] == pid) rank = r;
    if (rank < 0) continue;  // not ours
    pids[size_t(rank)] = -1;
    --alive;
    const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (failed && result.ok()) {
      result.exit_code = exit_code_of(status);
      result.failed_rank = rank;
      result.message = describe_status(rank, status);
      kill_all(SIGTERM);
      kill_at = Clock::now() + opts.kill_grace;
    }
  }
  return result;
}

}  // namespace

LaunchResult launch_processes(const std::vector<std::string>& argv, const LaunchOptions& opts) {
  KILN_CHECK(!argv.empty() && !argv[0].empty(), "launcher: empty command");
  const std::vector<DistEnv> envs = rank_envs(opts);
  // Everything exec needs is built before fork: a child of a threaded parent may only make
  // async-signal-safe calls (no malloc) until it execs.
  std::vector<std::vector<std::string>> env_strings;
  std::vector<std::vector<char*>> env_ptrs(envs.size());
  for (const DistEnv& e : envs) env_strings.push_back(child_environment(e));
  for (size_t r = 0; r < envs.size(); ++r) {
    for (std::string& kv : env_strings[r]) env_ptrs[r].push_back(kv.data());
    env_ptrs[r].push_back(nullptr);
  }
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  const std::string exec_failed = "launcher: cannot execute " + argv[0] + "\n";
  return supervise(opts, envs, [&](const DistEnv& env) {
    ::execve(cargv[0], cargv.data(), env_ptrs[size_t(env.rank)].data());
    ssize_t ignored = ::write(2, exec_failed.data(), exec_failed.size());
    (void)ignored;
    ::_exit(127);
  });
}

LaunchResult launch_functions(const std::function<int(const DistEnv&)>& fn,
                              const LaunchOptions& opts) {
  return supervise(opts, rank_envs(opts), [&](const DistEnv& env) {
    for (const std::string& kv : child_environment(env)) {
      const size_t eq = kv.find('=');
      ::setenv(kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), 1);
    }
    int code = 1;
    try {
      code = fn(env);
    } catch (const std::exception& e) {
      std::cerr << "rank " << env.rank << ": " << e.what() << std::endl;
    } catch (...) {
      std::cerr << "rank " << env.rank << ": unknown exception" << std::endl;
    }
    std::cout.flush();
    ::_exit(code);
  });
}

bool plan_local_launch(int nproc, const DistEnv& env, int visible_gpus) {
  // The user's own request against this machine: one line, no source location.
  if (nproc < 1) cli::usage_error("--nproc must be >= 1, got ", nproc);
  if (nproc == 1 || env.launcher == Launcher::Kiln) return false;
  if (env.distributed())
    cli::usage_error("--nproc ", nproc, ": this process is already ", env.describe(),
                     "; that launcher starts the processes, so leave out --nproc");
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (nproc > visible_gpus)
    cli::usage_error("--nproc ", nproc, " needs one GPU per process, but ", visible_gpus,
                     " CUDA device(s) are visible",
                     visible ? std::string(" (CUDA_VISIBLE_DEVICES=") + visible + ")" : std::string(),
                     "; nothing was started");
  return true;
}

int find_free_port(const std::string& addr) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(bare_host(addr).c_str(), "0", &hints, &res);
  KILN_CHECK(rc == 0 && res, "find_free_port: cannot resolve '", addr, "': ", ::gai_strerror(rc));
  int port = 0;
  for (addrinfo* a = res; a && port == 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0) {
      port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                      : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    }
    ::close(fd);
  }
  ::freeaddrinfo(res);
  KILN_CHECK(port > 0, "find_free_port: no free port on '", addr, "'");
  return port;
}

}  // namespace kiln
