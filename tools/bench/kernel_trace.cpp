// CUPTI kernel records of a replayed step (contract in tools/bench/kernel_trace.h).
#include "tools/bench/kernel_trace.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "core/error.h"

#ifdef KILN_HAVE_CUPTI
#include <cuda_runtime.h>
#include <cupti.h>
#include <cxxabi.h>
#endif

namespace kiln::bench {

#ifdef KILN_HAVE_CUPTI
namespace {

// CUPTI hands filled buffers to buffer_completed on its own thread; the records go here, tagged
// with the run that was in flight (runs are synchronised and flushed one by one).
struct Collector {
  std::mutex m;
  std::vector<TracedKernel> kernels;
  int step = 0;
};
Collector& collector() {
  static Collector c;
  return c;
}

constexpr size_t kBufferBytes = size_t(8) << 20;

std::string demangle(const char* name) {
  if (name == nullptr) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = status == 0 && d != nullptr ? d : name;
  std::free(d);
  return out;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  Collector& c = collector();
  CUpti_Activity* rec = nullptr;
  std::lock_guard<std::mutex> lock(c.m);
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    TracedKernel t;
    t.step = c.step;
    t.name = demangle(k->name);
    t.start_ns = k->start;
    t.end_ns = k->end;
    t.grid[0] = k->gridX;
    t.grid[1] = k->gridY;
    t.grid[2] = k->gridZ;
    t.block[0] = k->blockX;
    t.block[1] = k->blockY;
    t.block[2] = k->blockZ;
    t.registers = k->registersPerThread;
    t.shared_bytes = int64_t(k->staticSharedMemory) + int64_t(k->dynamicSharedMemory);
    c.kernels.push_back(std::move(t));
  }
  std::free(buffer);
}

void cupti_check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  KILN_FAIL("kernel trace: ", what, ": ", msg != nullptr ? msg : "unknown CUPTI error");
}

}  // namespace

bool kernel_trace_available() { return true; }

std::vector<TracedKernel> trace_kernels(const std::function<void()>& run, int steps,
                                        bool back_to_back) {
  Collector& c = collector();
  {
    std::lock_guard<std::mutex> lock(c.m);
    c.kernels.clear();
  }
  cupti_check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
              "registering the buffer callbacks");
  if (cudaDeviceSynchronize() != cudaSuccess) KILN_FAIL("kernel trace: the device failed before tracing");
  cupti_check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL),
              "enabling the kernel records");
  if (back_to_back) {
    {
      std::lock_guard<std::mutex> lock(c.m);
      c.step = 0;
    }
    for (int s = 0; s < steps; ++s) run();
    if (cudaDeviceSynchronize() != cudaSuccess) KILN_FAIL("kernel trace: the traced steps failed");
    cupti_check(cuptiActivityFlushAll(0), "flushing the records");
  } else {
    for (int s = 0; s < steps; ++s) {
      {
        std::lock_guard<std::mutex> lock(c.m);
        c.step = s;
      }
      run();
      if (cudaDeviceSynchronize() != cudaSuccess) KILN_FAIL("kernel trace: step ", s, " failed");
      cupti_check(cuptiActivityFlushAll(0), "flushing the records");
    }
  }
  cupti_check(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL),
              "disabling the kernel records");
  cupti_check(cuptiActivityFlushAll(1), "flushing the last records");
  std::vector<TracedKernel> out;
  {
    std::lock_guard<std::mutex> lock(c.m);
    out.swap(c.kernels);
  }
  std::stable_sort(out.begin(), out.end(), [](const TracedKernel& a, const TracedKernel& b) {
    return a.step != b.step ? a.step < b.step : a.start_ns < b.start_ns;
  });
  if (back_to_back) split_runs_by_count(out, steps);
  return out;
}
#else
bool kernel_trace_available() { return false; }

std::vector<TracedKernel> trace_kernels(const std::function<void()>&, int, bool) {
  KILN_FAIL("kernel trace: this kiln-bench was built without CUPTI (the CUDA toolkit's "
            "libcupti was not found at configure time)");
}
#endif

void split_runs_by_count(std::vector<TracedKernel>& k, int steps) {
  KILN_CHECK(steps >= 1, "kernel trace: ", steps, " runs to split into");
  // One stream, one graph: the runs' kernels come in run order, the same count each.
  if (k.size() % size_t(steps) != 0)
    KILN_FAIL("kernel trace: ", k.size(), " kernels recorded for ", steps,
              " back-to-back runs, not the same number per run: they cannot be told apart");
  std::stable_sort(k.begin(), k.end(), [](const TracedKernel& a, const TracedKernel& b) {
    return a.start_ns < b.start_ns;
  });
  const size_t per = k.size() / size_t(steps);
  for (size_t i = 0; i < k.size(); ++i) k[i].step = int(i / per);
}

namespace {

// Each step's kernels with their exclusive times, by index into `k`.
struct StepView {
  size_t begin = 0, end = 0;
  std::vector<double> exclusive_us;
  double span_us = 0, idle_us = 0;
  uint64_t end_ns = 0;  // the step's last kernel end
};

std::vector<StepView> steps_of(const std::vector<TracedKernel>& k) {
  std::vector<StepView> out;
  for (size_t i = 0; i < k.size();) {
    StepView v;
    v.begin = i;
    while (i < k.size() && k[i].step == k[v.begin].step) ++i;
    v.end = i;
    uint64_t covered_to = k[v.begin].start_ns, last_end = k[v.begin].start_ns;
    for (size_t j = v.begin; j < v.end; ++j) {
      const uint64_t from = std::max(k[j].start_ns, last_end);
      v.exclusive_us.push_back(k[j].end_ns > from ? double(k[j].end_ns - from) * 1e-3 : 0.0);
      if (k[j].start_ns > covered_to) v.idle_us += double(k[j].start_ns - covered_to) * 1e-3;
      covered_to = std::max(covered_to, k[j].end_ns);
      last_end = std::max(last_end, k[j].end_ns);
    }
    v.span_us = double(covered_to - k[v.begin].start_ns) * 1e-3;
    v.end_ns = covered_to;
    out.push_back(std::move(v));
  }
  return out;
}

std::string csv_quote(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) out += ch == '"' ? std::string("\"\"") : std::string(1, ch);
  return out + "\"";
}

}  // namespace

std::string trace_csv(const std::vector<TracedKernel>& k) {
  std::string out =
      "step,index,start_us,duration_us,exclusive_us,grid,block,registers,shared_bytes,name\n";
  for (const StepView& v : steps_of(k)) {
    for (size_t j = v.begin; j < v.end; ++j) {
      const TracedKernel& t = k[j];
      char buf[256];
      std::snprintf(buf, sizeof buf, "%d,%zu,%.3f,%.3f,%.3f,%d %d %d,%d %d %d,%d,%lld,", t.step,
                    j - v.begin, double(t.start_ns - k[v.begin].start_ns) * 1e-3,
                    double(t.end_ns - t.start_ns) * 1e-3, v.exclusive_us[j - v.begin],
                    t.grid[0], t.grid[1], t.grid[2], t.block[0], t.block[1], t.block[2],
                    t.registers, static_cast<long long>(t.shared_bytes));
      out += buf + csv_quote(t.name) + "\n";
    }
  }
  return out;
}

std::string trace_summary(const std::vector<TracedKernel>& k, bool gaps) {
  std::string out;
  const std::vector<StepView> views = steps_of(k);
  uint64_t prev_end = 0;
  for (const StepView& v : views) {
    double excl = 0;
    for (double e : v.exclusive_us) excl += e;
    char buf[320];
    int n = std::snprintf(buf, sizeof buf,
                          "kernel trace, step %d: %zu kernels, span %.3f ms, exclusive sum %.3f "
                          "ms, idle inside the span %.3f ms",
                          k[v.begin].step, v.end - v.begin, v.span_us * 1e-3, excl * 1e-3,
                          v.idle_us * 1e-3);
    const uint64_t start = k[v.begin].start_ns;
    if (gaps && &v != &views.front() && n > 0 && size_t(n) < sizeof buf)
      std::snprintf(buf + n, sizeof buf - size_t(n), ", gap before it %.3f ms",
                    (double(start) - double(prev_end)) * 1e-6);
    prev_end = v.end_ns;
    out += std::string(buf) + "\n";
  }
  if (gaps && views.size() > 1) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "kernel trace: %zu steps back to back, %.3f ms per step\n",
                  views.size(),
                  (double(prev_end) - double(k[views.front().begin].start_ns)) * 1e-6 /
                      double(views.size()));
    out += buf;
  }
  return out;
}

}  // namespace kiln::bench
