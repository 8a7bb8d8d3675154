#pragma once
// The kernels of a replayed CUDA graph as they really ran: start and end of each on the GPU's
// clock, from CUPTI's activity records (concurrent-kernel mode: nothing is serialised, no cache
// is flushed, clocks are not locked). Nsight Compute times each kernel alone, one after another
// with its tools in between; this is the other view, the step's own timeline (nsys is not on the
// GPU machine). kiln-bench --model M --batches B --graph-only --trace-kernels FILE.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kiln::bench {

struct TracedKernel {
  int step = 0;                   // which of the traced runs
  std::string name;               // demangled
  uint64_t start_ns = 0, end_ns = 0;
  int grid[3] = {0, 0, 0}, block[3] = {0, 0, 0};
  int registers = 0;
  int64_t shared_bytes = 0;       // static + dynamic
};

// Whether this build can trace (CUPTI found at configure time).
bool kernel_trace_available();

// Runs `run` `steps` times, each to completion, with CUPTI's kernel records on, and returns the
// kernels of each run in start order. Throws kiln::Error when CUPTI is missing or refuses.
// back_to_back: the runs are issued one after another with no synchronisation between them, as
// a training loop issues its steps, and the records are split into runs afterwards by count
// (each run must launch the same number of kernels, as replays of one graph do; else it throws).
std::vector<TracedKernel> trace_kernels(const std::function<void()>& run, int steps,
                                        bool back_to_back = false);

// Back-to-back runs' records, sorted by start, tagged with their run: `steps` runs of the same
// number of kernels each, in order. Throws kiln::Error when the count does not divide evenly.
void split_runs_by_count(std::vector<TracedKernel>& kernels, int steps);

// The records as CSV: step, index, start_us (from the step's first kernel), duration_us,
// exclusive_us (end − max(start, the previous kernel's end): the time the step waited on this
// kernel, with programmatic dependent launch's early starts not counted twice), the grid, the
// block, registers, shared bytes, the name.
std::string trace_csv(const std::vector<TracedKernel>& kernels);

// One line per step: span (first start to last end), kernels, the sum of exclusive times, and
// the idle time inside the span (no kernel running). gaps: also, from the second step on, the
// time between the previous step's last end and this step's first start (meaningful for
// back-to-back runs; synchronised ones put the host's sync and flush there), and the period:
// the first step's start to the last step's end, divided by the number of steps.
std::string trace_summary(const std::vector<TracedKernel>& kernels, bool gaps = false);

}  // namespace kiln::bench
