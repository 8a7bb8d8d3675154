// NVTX ranges and the CUDA-event op profiler. Events come from a pool so that timing an op does
// not create and destroy events on every call; they are read only when a report is made.
#include "cuda/profiler.h"

#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <mutex>
#include <vector>

#include "core/tensor.h"
#include "cuda/check.h"
#include "cuda/runtime.h"

namespace kiln::cuda {
namespace {

struct Pending {
  const char* name;
  std::string shape;  // the op's main input, as Tensor::desc() gives it
  cudaEvent_t start, stop;
};
struct Totals {
  int64_t calls = 0;
  double total_ms = 0;
};

std::atomic<bool> g_enabled{false};
std::mutex g_mutex;
std::vector<cudaEvent_t> g_free_events;        // guarded by g_mutex
std::vector<Pending> g_pending;                // guarded by g_mutex
std::map<std::string, Totals> g_totals;        // by op; guarded by g_mutex
std::map<std::string, Totals> g_shape_totals;  // by op and input; guarded by g_mutex
thread_local const char* t_last_op = nullptr;

cudaEvent_t take_event() {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!g_free_events.empty()) {
      cudaEvent_t e = g_free_events.back();
      g_free_events.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  CUDA_CHECK(cudaEventCreate(&e));
  return e;
}

// Reads every pending pair into the totals. Caller holds g_mutex.
void drain_pending() {
  for (const Pending& p : g_pending) {
    CUDA_CHECK(cudaEventSynchronize(p.stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, p.start, p.stop));
    for (Totals* t : {&g_totals[p.name], &g_shape_totals[std::string(p.name) + "  " + p.shape]}) {
      ++t->calls;
      t->total_ms += ms;
    }
    g_free_events.push_back(p.start);
    g_free_events.push_back(p.stop);
  }
  g_pending.clear();
}

}  // namespace

NvtxRange::NvtxRange(const char* name) { nvtxRangePushA(name); }
NvtxRange::~NvtxRange() { nvtxRangePop(); }

const char* last_profiled_op() { return t_last_op; }
void set_last_profiled_op(const char* name) { t_last_op = name; }

namespace {
constexpr int kMaxOpDepth = 32;  // deeper nesting is counted but not named
struct RunningOp {
  const char* name;
  const Tensor* input;
};
thread_local RunningOp t_ops[kMaxOpDepth];
thread_local int t_op_depth = 0;
}  // namespace

void push_current_op(const char* name, const Tensor* input) {
  if (t_op_depth < kMaxOpDepth) t_ops[t_op_depth] = {name, input};
  ++t_op_depth;
}
void pop_current_op() {
  if (t_op_depth > 0) --t_op_depth;
}
const char* current_op() {
  return t_op_depth > 0 ? t_ops[std::min(t_op_depth, kMaxOpDepth) - 1].name : nullptr;
}
std::string current_op_input() {
  if (t_op_depth == 0) return "";
  const Tensor* t = t_ops[std::min(t_op_depth, kMaxOpDepth) - 1].input;
  return t && t->defined() ? t->desc() : "";
}

void enable_profiler(bool on) { g_enabled.store(on, std::memory_order_relaxed); }
bool profiler_enabled() { return g_enabled.load(std::memory_order_relaxed); }

void profiler_reset() {
  std::lock_guard<std::mutex> lock(g_mutex);
  drain_pending();
  g_totals.clear();
  g_shape_totals.clear();
}

std::string profiler_report(bool by_input) {
  std::lock_guard<std::mutex> lock(g_mutex);
  drain_pending();
  const auto& table = by_input ? g_shape_totals : g_totals;
  std::vector<std::pair<std::string, Totals>> rows(table.begin(), table.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.total_ms > b.second.total_ms; });
  double all = 0;
  for (const auto& r : rows) all += r.second.total_ms;
  int width = 32;
  for (const auto& r : rows) width = std::max(width, int(r.first.size()));
  std::string out;
  char line[128];
  auto name_column = [&](const std::string& name) {
    out += name;
    out.append(size_t(width - int(name.size())), ' ');
  };
  name_column("op");
  std::snprintf(line, sizeof(line), " %10s %14s %12s %8s\n", "calls", "total ms", "mean ms", "%");
  out += line;
  for (const auto& [name, t] : rows) {
    name_column(name);
    std::snprintf(line, sizeof(line), " %10lld %14.3f %12.4f %7.2f%%\n",
                  static_cast<long long>(t.calls), t.total_ms, t.total_ms / double(t.calls),
                  all > 0 ? 100.0 * t.total_ms / all : 0.0);
    out += line;
  }
  name_column("total");
  std::snprintf(line, sizeof(line), " %10s %14.3f\n", "", all);
  out += line;
  return out;
}

ProfileOp::ProfileOp(const char* name, std::string shape) : shape_(std::move(shape)) {
  if (!name) return;
  cudaStream_t s = current_stream();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(s, &status));
  if (status != cudaStreamCaptureStatusNone) return;  // events cannot be timed inside a graph
  name_ = name;
  stream_ = s;
  cudaEvent_t e = take_event();
  CUDA_CHECK(cudaEventRecord(e, s));
  start_ = e;
  nvtxRangePushA(shape_.empty() ? name_ : (std::string(name_) + " " + shape_).c_str());
}

ProfileOp::~ProfileOp() {
  if (!name_) return;
  nvtxRangePop();
  // A destructor must not throw: a failure here drops this one sample.
  try {
    cudaEvent_t stop = take_event();
    CUDA_CHECK(cudaEventRecord(stop, static_cast<cudaStream_t>(stream_)));
    std::lock_guard<std::mutex> lock(g_mutex);
    g_pending.push_back({name_, std::move(shape_), static_cast<cudaEvent_t>(start_), stop});
  } catch (const Error&) {
  }
}

}  // namespace kiln::cuda
