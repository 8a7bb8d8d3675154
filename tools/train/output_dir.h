#pragma once
// kiln-train's --output folder. The rule: a folder is written only when it is empty (or new),
// when --overwrite is given, or when --resume names that folder's own checkpoint. Nothing else
// ever replaces a finished run, and nothing is created before the data has been read:
//
//   OutputPlan plan = plan_output(c.output, reuse_of(c), {data_root});  // reads only
//   TrainData data(...);                                                // the data, validated
//   OutputDir out(plan);     // creates and locks the folder, probes write access
//   ... load weights, checkpoint: any error here leaves the folder as it was ...
//   out.begin();             // the commit point, just before the first step
//   ... out.file("checkpoint.safetensors"), RunLog (tools/train/run_log.h) ...
//
// plan_output refuses, naming --output and the way out:
//   - an --output inside the data (an ImageFolder's train/, an IDX folder): kiln-train never
//     writes into a data set;
//   - a path that exists and is not a folder;
//   - OutputReuse::New: a folder holding anything but the lock file of an earlier kiln-train and
//     the temporary files of its killed saves (a run's files get "pass --resume ... or
//     --overwrite", anything else "choose an empty or new folder").
// The OutputDir constructor, in order: creates the folder (remembering whether it did); probes
// write access by creating, writing and removing a file; takes an exclusive lock on
// DIR/.kiln-train.lock (flock, released by the kernel when the process dies, even by kill -9), so
// a folder in use by a running kiln-train is refused in every mode, naming its pid; checks New's
// emptiness again under the lock. It never follows a link planted in the folder.
// begin(): removes temporary files of saves whose process is gone ("<name>.tmp.<pid>",
// core/serialization.h), in a folder an earlier kiln-train locked; Overwrite removes the previous
// run's files (kRunFiles) so the folder never mixes two runs; New and Resume change nothing else
// (RunLog trims a resumed run's logs).
// An OutputDir destroyed before begin() removes what its constructor created (the lock file, and
// the folder when it made it) and puts back an existing lock file's contents, so a run that fails
// during set-up leaves the folder byte for byte as it was.
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::train {

enum class OutputReuse {
  New,        // the folder must be empty or absent (kiln-train's default)
  Resume,     // --resume DIR/checkpoint.safetensors: the run continues in its own folder
  Overwrite,  // --overwrite: the previous run's files are removed at begin()
};

// The files a kiln-train run writes into its folder (kiln-plot's curves.png among them).
inline constexpr const char* kRunFiles[] = {"log.jsonl",
                                            "steps.jsonl",
                                            "checkpoint.safetensors",
                                            "model.safetensors",
                                            "model_best.safetensors",
                                            "curves.png"};

// --resume names --output's own checkpoint (the same file, however spelled; or the path
// DIR/checkpoint.safetensors when that file does not exist yet).
bool resumes_own_run(const std::string& output, const std::string& resume);

struct OutputPlan {
  std::string dir;
  OutputReuse reuse = OutputReuse::New;
};

// The checks above, reading only: nothing is created. `data_roots`: the folders the run reads
// (none for built-in or synthetic data that lives elsewhere). Throws cli::UsageError.
OutputPlan plan_output(const std::string& dir, OutputReuse reuse,
                       const std::vector<std::string>& data_roots);

class OutputDir {
 public:
  explicit OutputDir(const OutputPlan& plan);
  ~OutputDir();
  OutputDir(const OutputDir&) = delete;
  OutputDir& operator=(const OutputDir&) = delete;

  void begin();
  const std::string& path() const { return dir_; }
  OutputReuse reuse() const { return reuse_; }
  std::string file(const std::string& name) const;  // dir/name
  int64_t stale_temp_files_removed() const { return stale_removed_; }

 private:
  void release();
  void write_lock(const std::string& text);
  std::string dir_;
  OutputReuse reuse_;
  int lock_fd_ = -1;
  bool created_dir_ = false, created_lock_ = false, begun_ = false;
  std::string lock_before_;          // an existing lock file's contents, restored by release()
  bool keep_lock_contents_ = false;  // ... unless they were not a pid kiln-train wrote
  int64_t stale_removed_ = 0;
};

}  // namespace kiln::train
