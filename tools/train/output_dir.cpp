#include "tools/train/output_dir.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "tools/cli/cli.h"

namespace kiln::train {

namespace fs = std::filesystem;

namespace {

constexpr const char* kLockName = ".kiln-train.lock";

// "<run file>.tmp.<pid>" (write_file_atomic's temporary name for one of kRunFiles) -> pid, else 0.
long temp_file_pid(const std::string& name) {
  const size_t at = name.rfind(".tmp.");
  if (at == std::string::npos || at + 5 >= name.size()) return 0;
  bool ours = false;
  for (const char* f : kRunFiles) ours |= name.compare(0, at, f) == 0 && std::strlen(f) == at;
  const std::string digits = name.substr(at + 5);
  if (!ours || digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 9)
    return 0;
  return std::stol(digits);
}

bool process_alive(long pid) { return ::kill(pid_t(pid), 0) == 0 || errno == EPERM; }

// A temporary file of a save whose process is gone.
bool stale_temp(const std::string& name) {
  const long pid = temp_file_pid(name);
  return pid > 0 && pid != long(::getpid()) && !process_alive(pid);
}

bool is_run_file(const std::string& name) {
  for (const char* f : kRunFiles)
    if (name == f) return true;
  return false;
}

// `inner` lies in (or is) `outer`, component by component; both absolute and normalised.
bool inside(const fs::path& inner, const fs::path& outer) {
  auto i = inner.begin();
  for (auto o = outer.begin(); o != outer.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

// What stops a New run from writing into `dir`: "" when the folder is empty (or absent) apart
// from an earlier kiln-train's lock file and stale temporary files.
std::string why_not_empty(const std::string& dir) {
  std::error_code ec;
  // Stale temporaries are kiln-train's only in a folder an earlier kiln-train locked.
  const bool locked_before = fs::is_regular_file(fs::symlink_status(fs::path(dir) / kLockName, ec));
  std::vector<std::string> run, other;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name == kLockName || (locked_before && stale_temp(name))) continue;
    (is_run_file(name) ? run : other).push_back(name);
  }
  if (ec) cli::usage_error("--output '", dir, "': cannot list the folder: ", ec.message());
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size() && i < 3; ++i) s += (i ? ", " : "") + v[i];
    return v.size() > 3 ? s + " and " + std::to_string(v.size() - 3) + " more" : s;
  };
  if (!run.empty())
    return "--output '" + dir + "' already holds a run (" + list(run) + "); pass --resume " +
           (fs::path(dir) / "checkpoint.safetensors").string() +
           " to continue it, --overwrite to replace it, or choose another --output";
  if (!other.empty())
    return "--output '" + dir + "' is not empty (it holds " + list(other) +
           "); kiln-train writes into an empty or new folder: choose another --output, or pass "
           "--overwrite to write beside these files";
  return "";
}

}  // namespace

bool resumes_own_run(const std::string& output, const std::string& resume) {
  if (resume.empty()) return false;
  const fs::path own = fs::path(output) / "checkpoint.safetensors";
  std::error_code ec;
  if (fs::exists(own, ec) && fs::exists(resume, ec)) return fs::equivalent(own, resume, ec);
  return fs::weakly_canonical(own, ec) == fs::weakly_canonical(resume, ec);
}

OutputPlan plan_output(const std::string& dir, OutputReuse reuse,
                       const std::vector<std::string>& data_roots) {
  std::error_code ec;
  const fs::path out = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  for (const std::string& root : data_roots) {
    std::error_code rec;
    const fs::path data = fs::canonical(root, rec);
    if (!rec && !ec && inside(out, data))
      cli::usage_error("--output '", dir, "' lies inside the data '", root,
                       "'; kiln-train never writes into a data set: choose an --output outside it");
  }
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    cli::usage_error("--output '", dir, "' exists and is not a folder");
  if (reuse == OutputReuse::New && fs::is_directory(dir, ec)) {
    const std::string why = why_not_empty(dir);
    if (!why.empty()) cli::usage_error(why);
  }
  return {dir, reuse};
}

OutputDir::OutputDir(const OutputPlan& plan) : dir_(plan.dir), reuse_(plan.reuse) {
  std::error_code ec;
  // A folder this run creates is removed again should set-up fail (release(); not the parents
  // create_directories may have made on the way).
  created_dir_ = !fs::exists(dir_, ec);
  fs::create_directories(dir_, ec);
  if (ec) cli::usage_error("--output '", dir_, "': cannot create the folder: ", ec.message());
  if (!fs::is_directory(dir_, ec)) cli::usage_error("--output '", dir_, "' exists and is not a folder");

  // mkstemp: a name of its own (O_EXCL), never a file or link someone left there.
  std::string probe = file(".kiln-write-probe.XXXXXX");
  const int pfd = ::mkstemp(probe.data());
  if (pfd < 0) {
    const int err = errno;
    release();
    cli::usage_error("--output '", dir_, "' is not writable: cannot create '", probe,
                     "': ", std::strerror(err));
  }
  const bool wrote = ::write(pfd, "k", 1) == 1 && ::fsync(pfd) == 0;
  const int werr = errno;
  ::close(pfd);
  ::unlink(probe.c_str());
  if (!wrote) {
    release();
    cli::usage_error("--output '", dir_, "' is not writable: writing '", probe,
                     "' failed: ", std::strerror(werr));
  }

  const std::string lock = file(kLockName);
  created_lock_ = !fs::exists(fs::symlink_status(lock, ec));
  // O_NOFOLLOW: a link planted in the folder must not make kiln-train write somewhere else.
  lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  struct stat lst;
  if (lock_fd_ >= 0 && (::fstat(lock_fd_, &lst) != 0 || !S_ISREG(lst.st_mode))) {
    ::close(lock_fd_);
    lock_fd_ = -1;
    errno = EINVAL;
  }
  if (lock_fd_ < 0) {
    const int err = errno;
    created_lock_ = false;  // not ours to remove
    release();
    if (err == ELOOP || err == EINVAL)
      cli::usage_error("--output '", dir_, "': '", lock,
                       "' is not a regular file (a link, FIFO or device); remove it or choose "
                       "another --output");
    cli::usage_error("--output '", dir_, "': cannot create '", lock, "': ", std::strerror(err));
  }
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char pid[32] = {};
    const ssize_t n = ::pread(lock_fd_, pid, sizeof pid - 1, 0);
    ::close(lock_fd_);
    lock_fd_ = -1;
    created_lock_ = false;  // the running process's
    release();
    if (err == EWOULDBLOCK)
      cli::usage_error("--output '", dir_, "' is in use by a running kiln-train",
                       n > 0 ? std::string(" (pid ") + std::string(pid, size_t(n)) + ")" : "",
                       "; choose another --output or wait for it to finish");
    cli::usage_error("--output '", dir_, "': cannot lock '", lock, "': ", std::strerror(err));
  }
  // The pid is only for the message above (the flock is the lock). An existing lock file's
  // earlier contents come back should set-up fail, so a refused run leaves the folder as it was.
  if (!created_lock_) {
    char old[64];
    const ssize_t n = ::pread(lock_fd_, old, sizeof old, 0);
    if (n >= 0 && size_t(n) < sizeof old) lock_before_ = std::string(old, size_t(n));
    else keep_lock_contents_ = true;  // not a pid we wrote: leave it
  }
  if (!keep_lock_contents_) write_lock(std::to_string(::getpid()));
  if (reuse_ == OutputReuse::New) {  // again, under the lock: another run may have started
    const std::string why = why_not_empty(dir_);
    if (!why.empty()) {
      release();
      cli::usage_error(why);
    }
  }

}

void OutputDir::begin() {
  // Temporary files of saves killed mid-write, in a folder an earlier kiln-train locked: their
  // writer is gone (and, under our lock, no other kiln-train writes here). Only now, at the
  // commit point: a run refused during set-up leaves them.
  std::error_code ec;
  if (!created_lock_) {
    for (const auto& e : fs::directory_iterator(dir_, ec)) {
      const std::string name = e.path().filename().string();
      if (!stale_temp(name) || !e.is_regular_file(ec) || e.is_symlink(ec)) continue;
      if (fs::remove(e.path(), ec)) ++stale_removed_;
    }
  }
  if (reuse_ == OutputReuse::Overwrite) {
    for (const char* f : kRunFiles) {
      std::error_code ec;
      fs::remove(file(f), ec);
      if (ec)
        cli::usage_error("--overwrite: cannot remove '", file(f), "' of the previous run: ",
                         ec.message());
    }
  }
  begun_ = true;
}

void OutputDir::write_lock(const std::string& text) {
  if (::ftruncate(lock_fd_, 0) != 0 || ::pwrite(lock_fd_, text.data(), text.size(), 0) < 0) {
    // Best effort: the contents are a message, not the lock.
  }
}

void OutputDir::release() {
  std::error_code ec;
  if (created_lock_) fs::remove(file(kLockName), ec);
  else if (lock_fd_ >= 0 && !keep_lock_contents_) write_lock(lock_before_);
  if (lock_fd_ >= 0) ::close(lock_fd_);
  lock_fd_ = -1;
  if (created_dir_ && fs::is_empty(dir_, ec)) fs::remove(dir_, ec);
  created_lock_ = created_dir_ = false;
}

OutputDir::~OutputDir() {
  if (!begun_) {
    release();  // set-up failed: take back what this run created
  } else if (lock_fd_ >= 0) {
    ::close(lock_fd_);  // releases the flock; the file stays (harmless)
  }
}

std::string OutputDir::file(const std::string& name) const {
  return (fs::path(dir_) / name).string();
}

}  // namespace kiln::train
