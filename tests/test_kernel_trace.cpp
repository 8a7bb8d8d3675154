// The arithmetic of kiln-bench's kernel trace (tools/bench/kernel_trace.h) on made-up records:
// exclusive times with overlapping kernels, idle time, back-to-back runs split by count, the gaps
// between runs and the period. CUPTI itself is needed only to record; none of this touches it.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"
#include "tools/bench/kernel_trace.h"

using kiln::bench::TracedKernel;

namespace {

TracedKernel kernel(const std::string& name, double start_ms, double end_ms) {
  TracedKernel k;
  k.name = name;
  k.start_ns = uint64_t(start_ms * 1e6 + 0.5);
  k.end_ns = uint64_t(end_ms * 1e6 + 0.5);
  return k;
}

// Two runs of three kernels, as a back-to-back trace records them (every record tagged run 0).
// Run 0: b starts before a ends (an early launch), c after 0.5 ms of nothing. Run 1 starts
// 0.25 ms after run 0's last end; its b waits for a, its c follows b at once.
std::vector<TracedKernel> two_runs() {
  return {kernel("a", 0.0, 1.0),   kernel("b", 0.8, 2.0),   kernel("c", 2.5, 3.0),
          kernel("a", 3.25, 4.25), kernel("b", 4.0, 5.25), kernel("c", 5.25, 6.25)};
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("kernel trace: back-to-back runs split by count, whatever order the records came in") {
  std::vector<TracedKernel> k = two_runs();
  std::reverse(k.begin(), k.end());
  kiln::bench::split_runs_by_count(k, 2);
  REQUIRE(k.size() == 6);
  for (size_t i = 0; i < k.size(); ++i) {
    CHECK(k[i].step == int(i / 3));
    CHECK(k[i].name == std::string(1, char('a' + i % 3)));
  }
  std::vector<TracedKernel> odd = two_runs();
  odd.pop_back();
  CHECK_THROWS_AS(kiln::bench::split_runs_by_count(odd, 2), kiln::Error);
  CHECK_THROWS_AS(kiln::bench::split_runs_by_count(odd, 0), kiln::Error);
}

TEST_CASE("kernel trace: span, exclusive time, idle time, the gaps and the period") {
  std::vector<TracedKernel> k = two_runs();
  kiln::bench::split_runs_by_count(k, 2);
  const std::string plain = kiln::bench::trace_summary(k);
  // Run 0: a 1.0 + b's part after a 1.0 + c 0.5; nothing runs from 2.0 to 2.5.
  CHECK(has(plain, "step 0: 3 kernels, span 3.000 ms, exclusive sum 2.500 ms, idle inside the "
                   "span 0.500 ms\n"));
  CHECK(has(plain, "step 1: 3 kernels, span 3.000 ms, exclusive sum 3.000 ms, idle inside the "
                   "span 0.000 ms\n"));
  CHECK(!has(plain, "gap"));
  CHECK(!has(plain, "back to back"));
  const std::string gaps = kiln::bench::trace_summary(k, true);
  CHECK(has(gaps, "idle inside the span 0.000 ms, gap before it 0.250 ms\n"));
  CHECK(!has(gaps, "0.500 ms, gap"));  // the first run has no gap before it
  CHECK(has(gaps, "kernel trace: 2 steps back to back, 3.125 ms per step\n"));

  // The CSV: times from each run's first start, the exclusive time beside the raw duration.
  const std::string csv = kiln::bench::trace_csv(k);
  CHECK(has(csv, "0,1,800.000,1200.000,1000.000,0 0 0,0 0 0,0,0,\"b\"\n"));
  CHECK(has(csv, "1,1,750.000,1250.000,1000.000,0 0 0,0 0 0,0,0,\"b\"\n"));
  CHECK(has(csv, "1,2,2000.000,1000.000,1000.000,0 0 0,0 0 0,0,0,\"c\"\n"));
}
