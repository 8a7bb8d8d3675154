#include "tools/train/output_dir.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "tools/cli/cli.h"

namespace kiln::train {

namespace fs = std::filesystem;

namespace {

constexpr const char* kLockName = ".kiln-train.lock";
constexpr const char* kRunFiles[] = {"log.jsonl", "checkpoint.safetensors", "model.safetensors"};

// "<anything>.tmp.<pid>" -> pid, else 0.
long temp_file_pid(const std::string& name) {
  const size_t at = name.rfind(".tmp.");
  if (at == std::string::npos || at + 5 >= name.size()) return 0;
  const std::string digits = name.substr(at + 5);
  if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 9) return 0;
  return std::stol(digits);
}

bool process_alive(long pid) { return ::kill(pid_t(pid), 0) == 0 || errno == EPERM; }

}  // namespace

OutputDir::OutputDir(const std::string& dir, OutputReuse reuse) : dir_(dir), reuse_(reuse) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  // Everything refused here is about the user's --output: cli::UsageErrors, one line each.
  if (ec) cli::usage_error("--output '", dir, "': cannot create the folder: ", ec.message());
  if (!fs::is_directory(dir, ec))
    cli::usage_error("--output '", dir, "' exists and is not a folder");

  const std::string probe = file(".kiln-write-probe." + std::to_string(::getpid()));
  const int pfd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (pfd < 0)
    cli::usage_error("--output '", dir, "' is not writable: cannot create '", probe,
                     "': ", std::strerror(errno));
  const bool wrote = ::write(pfd, "k", 1) == 1 && ::fsync(pfd) == 0;
  const int werr = errno;
  ::close(pfd);
  ::unlink(probe.c_str());
  if (!wrote)
    cli::usage_error("--output '", dir, "' is not writable: writing '", probe,
                     "' failed: ", std::strerror(werr));

  const std::string lock = file(kLockName);
  lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0)
    cli::usage_error("--output '", dir, "': cannot create '", lock, "': ", std::strerror(errno));
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char pid[32] = {};
    const ssize_t n = ::pread(lock_fd_, pid, sizeof pid - 1, 0);
    ::close(lock_fd_);
    lock_fd_ = -1;
    if (err == EWOULDBLOCK)
      cli::usage_error("--output '", dir, "' is in use by a running kiln-train",
                       n > 0 ? std::string(" (pid ") + std::string(pid, size_t(n)) + ")" : "",
                       "; choose another --output or wait for it to finish");
    cli::usage_error("--output '", dir, "': cannot lock '", lock, "': ", std::strerror(err));
  }
  const std::string me = std::to_string(::getpid());
  if (::ftruncate(lock_fd_, 0) != 0 || ::pwrite(lock_fd_, me.data(), me.size(), 0) < 0) {
    // The pid is only for the message above; the lock itself holds.
  }

  if (reuse == OutputReuse::Refuse) {
    std::string found;
    for (const char* f : kRunFiles)
      if (fs::exists(file(f), ec)) found += (found.empty() ? "" : ", ") + std::string(f);
    if (!found.empty()) {
      ::close(lock_fd_);
      lock_fd_ = -1;
      cli::usage_error("--output '", dir, "' already holds a run (", found, "); pass --resume ",
                       file("checkpoint.safetensors"),
                       " to continue it, --overwrite to replace it, or choose another --output");
    }
  }

  // Temporary files of saves killed mid-write: their writer is gone (and, under our lock, no
  // other kiln-train writes here).
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const long pid = temp_file_pid(name);
    if (pid <= 0 || pid == long(::getpid()) || process_alive(pid)) continue;
    if (!e.is_regular_file(ec)) continue;
    if (fs::remove(e.path(), ec)) ++stale_removed_;
  }
}

OutputDir::~OutputDir() {
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock; the file stays (harmless)
}

std::string OutputDir::file(const std::string& name) const {
  return (fs::path(dir_) / name).string();
}

void OutputDir::append_log(const std::string& line) {
  const std::string path = file("log.jsonl");
  const bool fresh = !log_started_ && reuse_ != OutputReuse::Resume;
  if (fresh && reuse_ == OutputReuse::Overwrite) {
    std::error_code ec;
    fs::remove(file("model.safetensors"), ec);
  }
  std::FILE* f = std::fopen(path.c_str(), fresh ? "w" : "a");
  if (f == nullptr) cli::usage_error("cannot write '", path, "': ", std::strerror(errno));
  const bool ok = std::fputs((line + "\n").c_str(), f) >= 0 && std::fflush(f) == 0;
  const int err = errno;
  std::fclose(f);
  if (!ok) cli::usage_error("writing '", path, "' failed: ", std::strerror(err));
  log_started_ = true;
}

}  // namespace kiln::train
