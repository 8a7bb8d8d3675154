#pragma once
// kiln-train's --output folder, claimed before any training starts (tools/train/trainer.h):
//
//   OutputDir out(c.output, c.resume.empty() ? OutputReuse::Refuse : OutputReuse::Resume);
//   ... out.append_log(line) after each epoch ...
//
// The constructor, in order:
//   1. creates the folder (errors name --output and the reason);
//   2. probes write access by creating, writing and removing a file, so a read-only or
//      unwritable folder fails now and not after the first epoch;
//   3. takes an exclusive lock on DIR/.kiln-train.lock (flock: released by the kernel when the
//      process dies, even by kill -9). A folder locked by a running kiln-train is refused in
//      every mode, naming the lock holder's pid;
//   4. refuses a folder that already holds a run (log.jsonl, checkpoint.safetensors or
//      model.safetensors) unless the mode is Resume or Overwrite;
//   5. removes temporary files left by killed atomic saves ("<name>.tmp.<pid>" whose process
//      is gone; core/serialization.h).
// The lock is held until the object is destroyed. Refusals, and a log that cannot be written,
// are cli::UsageErrors (tools/cli/cli.h): one line naming --output or the file, no location.
//
// Logs: a new run (not Resume) starts log.jsonl afresh at its first append_log, so a re-run that
// fails before finishing an epoch leaves the old log in place; Overwrite also removes the old
// model.safetensors then (it would not match the new run).
#include <cstdint>
#include <string>

namespace kiln::train {

enum class OutputReuse {
  Refuse,    // a folder holding a previous run is an error (kiln-train's default)
  Resume,    // --resume: the run continues; log.jsonl is appended to
  Overwrite  // --overwrite: the previous run is replaced
};

class OutputDir {
 public:
  OutputDir(const std::string& dir, OutputReuse reuse);
  ~OutputDir();
  OutputDir(const OutputDir&) = delete;
  OutputDir& operator=(const OutputDir&) = delete;

  const std::string& path() const { return dir_; }
  std::string file(const std::string& name) const;  // dir/name
  int64_t stale_temp_files_removed() const { return stale_removed_; }
  // Appends one line (a newline is added) to log.jsonl and flushes it.
  void append_log(const std::string& line);

 private:
  std::string dir_;
  OutputReuse reuse_;
  int lock_fd_ = -1;
  bool log_started_ = false;
  int64_t stale_removed_ = 0;
};

}  // namespace kiln::train
