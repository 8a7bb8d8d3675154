#pragma once
// kiln-train's two JSON-lines logs in its --output folder (tools/train/output_dir.h):
//   steps.jsonl  one object per training step: step (global, from 1), epoch (from 1), epoch_frac
//                (epochs done, fractional), loss, top1 (this step's batch on rank 0), lr,
//                loss_scale (1 without mixed precision), images_per_s (all ranks), ms_compute,
//                ms_data (the host's view: the time it waited for the batch, and the rest of the
//                step's period; on the GPU the host runs ahead, so ms_compute is the GPU's pace);
//   log.jsonl    one object per epoch: epoch, train_loss, train_top1, test_loss, test_top1,
//                test_top5, images_per_s, seconds, checkpoint_seconds, eval_seconds, lr,
//                bad_files, host_decode_share (nvJPEG runs), test_bad_files.
// Accuracies are fractions; a non-finite value is null. tools/kiln-plot draws both.
//
// A run that starts after epoch E, step S (resumed, or --start-epoch) keeps only the lines up to
// there: in its own folder (OutputReuse::Resume) the lines past them are dropped (a run stopped
// mid-epoch wrote some); resumed from another folder's checkpoint into a new --output, that
// folder's lines up to there are copied first, so the new folder's logs tell the whole run.
#include <cstdint>
#include <cstdio>
#include <string>

#include "core/json.h"

namespace kiln::train {

class OutputDir;

class RunLog {
 public:
  // `resumed_from`: the folder of the checkpoint the run continues ("" for a new run).
  RunLog(const OutputDir& out, int64_t start_epoch, int64_t start_step,
         const std::string& resumed_from);
  ~RunLog();
  RunLog(const RunLog&) = delete;
  RunLog& operator=(const RunLog&) = delete;

  void step(const json::ObjectWriter& line);   // buffered; flush() or epoch() writes it out
  void epoch(const json::ObjectWriter& line);  // appended and flushed at once
  void flush();

 private:
  std::string steps_path_, epochs_path_;
  std::FILE* steps_ = nullptr;
};

// Keeps the lines of a JSON-lines log whose number `key` is <= max and drops the others and
// unreadable ones (a line torn by a crash); rewritten atomically, and only when something goes.
// No file: nothing.
void trim_jsonl(const std::string& path, const std::string& key, double max);

}  // namespace kiln::train
