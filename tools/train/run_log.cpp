#include "tools/train/run_log.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/serialization.h"
#include "tools/train/output_dir.h"

namespace kiln::train {

namespace fs = std::filesystem;

namespace {

// The lines of `path` whose number `key` is <= max; `dropped` says whether any went.
std::string lines_up_to(const std::string& path, const std::string& key, double max,
                        bool* dropped) {
  std::ifstream f(path);
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
  std::FILE* f = std::fopen(path.c_str(), "a");
  KILN_CHECK(f != nullptr, "cannot write '", path, "': ", std::strerror(errno));
  const bool ok = std::fputs(text.c_str(), f) >= 0 && std::fflush(f) == 0;
  const int err = errno;
  const bool closed = std::fclose(f) == 0;
  KILN_CHECK(ok && closed, "writing '", path, "' failed: ", std::strerror(err));
}

}  // namespace

void trim_jsonl(const std::string& path, const std::string& key, double max) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return;
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
  steps_ = std::fopen(steps_path_.c_str(), "a");
  KILN_CHECK(steps_ != nullptr, "cannot write '", steps_path_, "': ", std::strerror(errno));
}

RunLog::~RunLog() {
  if (steps_) std::fclose(steps_);
}

void RunLog::step(const json::ObjectWriter& line) {
  const std::string text = line.str() + "\n";
  KILN_CHECK(std::fputs(text.c_str(), steps_) >= 0, "writing '", steps_path_,
             "' failed: ", std::strerror(errno));
}

void RunLog::epoch(const json::ObjectWriter& line) {
  flush();
  append(epochs_path_, line.str() + "\n");
}

void RunLog::flush() {
  KILN_CHECK(std::fflush(steps_) == 0, "writing '", steps_path_, "' failed: ",
             std::strerror(errno));
}

}  // namespace kiln::train
