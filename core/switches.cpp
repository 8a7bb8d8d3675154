#include "core/switches.h"

#include <cstdlib>
#include <cstring>
#include <limits>

namespace kiln {
namespace {

bool is(const char* v, const char* s) { return v && std::strcmp(v, s) == 0; }

// A whole number 0 to 2^30, or -1 for anything else (unset, empty, "abc", "12x", negative):
// strtol alone would read "abc" as 0, a setting with a meaning of its own.
int whole_number(const char* v) {
  if (v == nullptr || *v == '\0') return -1;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return *end == '\0' && n >= 0 && n <= (1L << 30) ? int(n) : -1;
}

Switches read_switches() {
  Switches s;
  s.fused_bn = !is(std::getenv("KILN_FUSED_BN"), "0");
  s.fused_dgrad = !is(std::getenv("KILN_FUSED_DGRAD"), "0");
  s.fused_dgrad_relu = !is(std::getenv("KILN_FUSED_DGRAD_RELU"), "0");
  s.conv1x1_stats = !is(std::getenv("KILN_CONV1X1_STATS"), "0");
  const char* mc = std::getenv("KILN_STATS_MIN_C");
  const long min_c = mc ? std::strtol(mc, nullptr, 10) : 0;
  if (min_c > 0) s.stats_min_channels = min_c;
  const char* tg = std::getenv("KILN_TAIL_GEMM");
  s.tail_gemm = is(tg, "mma") ? 0 : is(tg, "mixed") ? 1 : 2;
  s.tail_tma_epi = !is(std::getenv("KILN_TAIL_TMA_EPI"), "0");
  s.tail_w_direct = !is(std::getenv("KILN_TAIL_W_DIRECT"), "0");
  s.wgmma_pipeline = !is(std::getenv("KILN_WGMMA_PIPELINE"), "0");
  s.wgrad1x1 = !is(std::getenv("KILN_WGRAD1X1"), "0");
  s.conv_prologue = is(std::getenv("KILN_CONV_PROLOGUE"), "1");
  s.conv3x3 = !is(std::getenv("KILN_CONV3X3"), "0");
  if (is(std::getenv("KILN_CONV3X3"), "1")) s.conv3x3_max_rows = std::numeric_limits<int>::max();
  if (const int rows = whole_number(std::getenv("KILN_CONV3X3_ROWS")); rows >= 0)
    s.conv3x3_max_rows = rows;
  s.dgrad3x3 = !is(std::getenv("KILN_DGRAD3X3"), "0");
  s.gemm_tall = is(std::getenv("KILN_GEMM_TALL"), "1");
  s.gemm_b_resident = !is(std::getenv("KILN_GEMM_B_RESIDENT"), "0");
  s.dual_dgrad = !is(std::getenv("KILN_DUAL_DGRAD"), "0");
  s.tail_fold = !is(std::getenv("KILN_TAIL_FOLD"), "0");
  // KILN_TAIL_FOLD_MIN and KILN_CONV3X3_ROWS: anything but a whole number keeps the default.
  if (const int tf_min = whole_number(std::getenv("KILN_TAIL_FOLD_MIN")); tf_min >= 0)
    s.tail_fold_min = tf_min;
  s.tail_fold_dual = !is(std::getenv("KILN_TAIL_FOLD_DUAL"), "0");
  s.tail_fold_shortcut = !is(std::getenv("KILN_TAIL_FOLD_SHORTCUT"), "0");
  s.dgrad_stride2 = !is(std::getenv("KILN_DGRAD_STRIDE2"), "0");
  s.wgrad_x_sum = !is(std::getenv("KILN_WGRAD_X_SUM"), "0");
  s.wgrad_x_gram = !is(std::getenv("KILN_WGRAD_X_GRAM"), "0");
  s.wgrad_sum_fence = !is(std::getenv("KILN_WGRAD_SUM_FENCE"), "0");
  s.tail_fold_t = !is(std::getenv("KILN_TAIL_FOLD_T"), "0");
  s.dgrad_pair64 = !is(std::getenv("KILN_DGRAD_PAIR64"), "0");
  s.stem_pool_tile = !is(std::getenv("KILN_STEM_POOL_TILE"), "0");
  s.stem_pool_at_max = !is(std::getenv("KILN_STEM_POOL_AT_MAX"), "0");
  s.stem_pool_raw_tile = !is(std::getenv("KILN_STEM_POOL_RAW_TILE"), "0");
  s.prologue_f16 = is(std::getenv("KILN_PROLOGUE_F16"), "1");
  const char* sc = std::getenv("KILN_STEM_CONV");
  s.stem_conv = is(sc, "0") ? 0 : is(sc, "forward") ? 1 : 2;
  const char* sw = std::getenv("KILN_STEM_WGMMA");
  s.stem_wgmma = is(sw, "0") ? 0 : is(sw, "forward") ? 1 : 2;
  s.stem_a_smem = !is(std::getenv("KILN_STEM_A_SMEM"), "0");
  s.stem_wgrad_a_smem = !is(std::getenv("KILN_STEM_WGRAD_A_SMEM"), "0");
  s.pdl = !is(std::getenv("KILN_PDL"), "0");
  s.accumulate_grads = !is(std::getenv("KILN_ACCUMULATE_GRADS"), "0");
  s.grad_overwrite = !is(std::getenv("KILN_GRAD_OVERWRITE"), "0");
  const char* b = std::getenv("KILN_CUDNN_BACKEND");
  s.cudnn_backend = is(b, "0") ? 0 : is(b, "force") ? 2 : 1;
  const char* log = std::getenv("KILN_CUDNN_FIND_LOG");
  s.cudnn_find_log = log && *log && !is(log, "0");
  const char* c = std::getenv("KILN_CONV_CANDIDATES");
  const long n = c ? std::strtol(c, nullptr, 10) : 0;
  if (n > 0) s.conv_candidates = size_t(n);
  s.tune_cold = is(std::getenv("KILN_TUNE_COLD"), "1");
  if (const char* plans = std::getenv("KILN_CONV_PLANS")) s.conv_plans = plans;
  const char* jt = std::getenv("KILN_JPEG_TRACE");
  s.jpeg_trace = jt && *jt && !is(jt, "0");
  if (const char* at = std::getenv("KILN_ALLOC_TRACE")) s.alloc_trace = at;
  const char* st = std::getenv("KILN_JPEG_STALL_S");
  const double stall = st ? std::strtod(st, nullptr) : 0.0;
  if (stall > 0) s.jpeg_stall_s = stall;
  // KILN_JPEG_TEST_STALL=CALL:SECONDS; anything else leaves the test stall off.
  if (const char* ts = std::getenv("KILN_JPEG_TEST_STALL")) {
    char* end = nullptr;
    const long call = std::strtol(ts, &end, 10);
    const double secs = end && *end == ':' ? std::strtod(end + 1, nullptr) : 0.0;
    if (end != ts && call >= 0 && secs > 0) {
      s.jpeg_test_stall_call = call;
      s.jpeg_test_stall_s = secs;
    }
  }
  s.row_kernels = !is(std::getenv("KILN_ROW_KERNELS"), "0");
  s.cudnn_attention = !is(std::getenv("KILN_CUDNN_ATTENTION"), "0");
  s.cudnn_tail_mask = !is(std::getenv("KILN_CUDNN_TAIL_MASK"), "0");
  s.gemm_tune = !is(std::getenv("KILN_GEMM_TUNE"), "0");
  const char* gl = std::getenv("KILN_GEMM_TUNE_LOG");
  s.gemm_tune_log = gl && *gl && !is(gl, "0");
  return s;
}

}  // namespace

const Switches& switches() {
  static const Switches s = read_switches();
  return s;
}

}  // namespace kiln
