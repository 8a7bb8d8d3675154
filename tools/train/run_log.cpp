#include "tools/train/run_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/serialization.h"
#include "tools/train/output_dir.h"

namespace kiln::train {

namespace fs = std::filesystem;

namespace {

// Opens `path` for appending, never through a link or into a FIFO or device: the run's own file.
std::FILE* open_append(const std::string& path) {
  const int fd =
      ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  KILN_IO_CHECK(fd >= 0, "cannot write '", path, "': ",
                errno == ELOOP ? "it is a symbolic link (kiln-train writes its own files only)"
                               : std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    KILN_IO_FAIL("cannot write '", path, "': it is not a regular file (a FIFO, device or socket)");
  }
  std::FILE* f = ::fdopen(fd, "a");
  if (f == nullptr) {
    const int err = errno;
    ::close(fd);
    KILN_IO_FAIL("cannot write '", path, "': ", std::strerror(err));
  }
  return f;
}

// The lines of `path` whose number `key` is <= max; `dropped` says whether any went. `path` must
// be a regular file: a FIFO or a link to a device would never end.
std::string lines_up_to(const std::string& path, const std::string& key, double max,
                        bool* dropped) {
  std::error_code ec;
  KILN_IO_CHECK(fs::is_regular_file(path, ec), "cannot read '", path,
                "': it is not a regular file (a folder, FIFO or device)");
  std::ifstream f(path);
  KILN_IO_CHECK(f.good(), "cannot read '", path, "': ", std::strerror(errno));
  std::string kept;
  for (std::string line; std::getline(f, line);) {
    bool keep = false;
    try {
      const json::Value v = json::parse(line);
      keep = v.is_object() && v.contains(key) && v.at(key).number() <= max;
    } catch (const Error&) {
    }
    if (keep)
      kept += line + "\n";
    else if (dropped)
      *dropped = true;
  }
  return kept;
}

void append(const std::string& path, const std::string& text) {
  std::FILE* f = open_append(path);
  const bool ok = std::fputs(text.c_str(), f) >= 0 && std::fflush(f) == 0;
  const int err = errno;
  const bool closed = std::fclose(f) == 0;
  KILN_IO_CHECK(ok && closed, "writing '", path, "' failed: ", std::strerror(err));
}

}  // namespace

void trim_jsonl(const std::string& path, const std::string& key, double max) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) return;
  bool dropped = false;
  const std::string kept = lines_up_to(path, key, max, &dropped);
  if (dropped) write_file_atomic(path, kept);
}

RunLog::RunLog(const OutputDir& out, int64_t start_epoch, int64_t start_step,
               const std::string& resumed_from)
    : steps_path_(out.file("steps.jsonl")), epochs_path_(out.file("log.jsonl")) {
  const double epoch = double(start_epoch), step = double(start_step);
  if (out.reuse() == OutputReuse::Resume) {
    trim_jsonl(epochs_path_, "epoch", epoch);
    trim_jsonl(steps_path_, "step", step);
  } else if (!resumed_from.empty() && (start_epoch > 0 || start_step > 0)) {
    // A new folder (begin() emptied it of an earlier run's logs) continuing another's run.
    const fs::path from(resumed_from);
    std::error_code ec;
    if (fs::exists(from / "log.jsonl", ec))
      write_file_atomic(epochs_path_, lines_up_to((from / "log.jsonl").string(), "epoch", epoch,
                                                  nullptr));
    if (fs::exists(from / "steps.jsonl", ec))
      write_file_atomic(steps_path_, lines_up_to((from / "steps.jsonl").string(), "step", step,
                                                 nullptr));
  }
  steps_ = open_append(steps_path_);
}

RunLog::~RunLog() {
  if (steps_) std::fclose(steps_);
}

void RunLog::step(const json::ObjectWriter& line) {
  const std::string text = line.str() + "\n";
  KILN_IO_CHECK(std::fputs(text.c_str(), steps_) >= 0, "writing '", steps_path_,
                "' failed: ", std::strerror(errno));
}

void RunLog::epoch(const json::ObjectWriter& line) {
  flush();
  append(epochs_path_, line.str() + "\n");
}

void RunLog::flush() {
  KILN_IO_CHECK(std::fflush(steps_) == 0, "writing '", steps_path_, "' failed: ",
                std::strerror(errno));
}

}  // namespace kiln::train
