// 2-D convolution on cuDNN (entry points in cuda/kernels.h, cache controls in cuda/conv.h).
//
// Layout: the problem runs in the layout of the activations (NHWC when x — dx for backward-data
// — is channels-last, else NCHW); the filter descriptor uses the same format, and any operand
// not already dense in it is copied first (outputs go through a temporary). Descriptors carry
// the canonical dense strides of that layout, which address the same memory as the tensors'
// own strides once they pass is_contiguous(fmt) (which ignores strides of size-1 dims).
//
// Precision: FP32 accumulation (compute type FLOAT) for f32 and f16; f16 may use tensor cores
// (TENSOR_OP_MATH); f32 is restricted to FMA kernels, so no TF32 rounding.
//
// Two cuDNN APIs: each new problem is timed with the legacy cudnnFind*AlgorithmEx and, for f16
// and bf16, also tuned on the backend graph API (cuda/conv_engine.h), whose engines are 2-5x
// faster on ResNet-50's NHWC problems; the faster of the two bests is kept (ConvBackend in
// cuda/conv.h). A backend plan that fails at run time hands over to the legacy candidates.
//
// Host cost per call: each problem's descriptors, ranked algorithms and backend plan live in a
// Plan cached under a POD key (hashed, compared bytewise), so a call with a known problem builds
// the key, finds the plan, allocates the workspace from the caching allocator and launches.
// KILN_CUDNN_FIND_LOG=1 prints, for each new problem, what cudnnFind returned, every backend
// plan's time, and the choice.
//
// Stem padding: an f16 convolution with 3 input channels (the ResNet stem) runs on copies of x
// and w zero-padded to 4 channels in NHWC, which tensor-core kernels accept; the padded channels
// contribute zeros. The copies cost one extra pass over x per call.
//
// Accumulate (backward entry points): dx/dw `+=` through cuDNN's beta = 1, in place, so the
// autograd engine needs no separate add (core/autograd.h, accumulate-into). beta is part of the
// plan cache's key: the backend API bakes it into the operation graph.
#include "cuda/conv.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "core/serialization.h"
#include "core/switches.h"
#include "cuda/conv_engine.h"
#include "cuda/cudnn_util.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"

namespace kiln::cuda {
namespace {

const char* op_name(ConvOp op) {
  switch (op) {
    case ConvOp::Forward: return "forward";
    case ConvOp::BackwardData: return "backward-data";
    case ConvOp::BackwardFilter: return "backward-filter";
  }
  return "?";
}

// One problem in cuDNN's terms: x input activations, w filter, y output activations, whichever
// of them is being computed.
struct Problem {
  DType dtype;
  MemoryFormat fmt;
  Shape x, w, y;
  ConvParams p;
  bool accumulate = false;  // beta = 1: the computed operand is `+=`
};
std::string describe(ConvOp op, const Problem& pr) {
  return detail::str_cat("conv2d ", op_name(op), " ", dtype_name(pr.dtype),
                         pr.fmt == MemoryFormat::ChannelsLast ? " NHWC" : " NCHW", " x",
                         shape_str(pr.x), " w", shape_str(pr.w), " y", shape_str(pr.y), " stride (",
                         pr.p.stride_h, ",", pr.p.stride_w, ") pad (", pr.p.pad_h, ",", pr.p.pad_w,
                         ") dilation (", pr.p.dil_h, ",", pr.p.dil_w, ") groups ", pr.p.groups,
                         pr.accumulate ? " accumulate" : "");
}

struct Ptrs {
  void* x;
  void* w;
  void* y;
};

struct Descs {
  TensorDesc x, y;
  FilterDesc w;
  ConvDesc conv;
  explicit Descs(const Problem& pr)
      : x(pr.dtype, pr.x, format_strides(pr.x, pr.fmt)),
        y(pr.dtype, pr.y, format_strides(pr.y, pr.fmt)),
        w(pr.dtype, pr.w,
          pr.fmt == MemoryFormat::ChannelsLast ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW) {
    int pad[2] = {int(pr.p.pad_h), int(pr.p.pad_w)};
    int stride[2] = {int(pr.p.stride_h), int(pr.p.stride_w)};
    int dil[2] = {int(pr.p.dil_h), int(pr.p.dil_w)};
    cudnnDataType_t compute = pr.dtype == DType::f64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
    CUDNN_CHECK(cudnnSetConvolutionNdDescriptor(conv.d, 2, pad, stride, dil,
                                                CUDNN_CROSS_CORRELATION, compute));
    CUDNN_CHECK(cudnnSetConvolutionGroupCount(conv.d, int(pr.p.groups)));
  }
};

// alpha = 1, beta = 0 or 1 in the scaling type cuDNN expects for the data type.
const void* scalar_one(DType t) {
  static const float f = 1.0f;
  static const double d = 1.0;
  return t == DType::f64 ? static_cast<const void*>(&d) : &f;
}
const void* scalar_zero(DType t) {
  static const float f = 0.0f;
  static const double d = 0.0;
  return t == DType::f64 ? static_cast<const void*>(&d) : &f;
}

cudnnMathType_t preferred_math(DType t) {
  switch (t) {
    case DType::f16:
    case DType::bf16: return CUDNN_TENSOR_OP_MATH;
    case DType::f32: return CUDNN_FMA_MATH;
    default: return CUDNN_DEFAULT_MATH;
  }
}

// ---- the three operations, each as a set of cuDNN calls with one shape ----
struct Fwd {
  using Perf = cudnnConvolutionFwdAlgoPerf_t;
  using Algo = cudnnConvolutionFwdAlgo_t;
  static constexpr int kCount = CUDNN_CONVOLUTION_FWD_ALGO_COUNT;
  static constexpr ConvOp kOp = ConvOp::Forward;
  static cudnnStatus_t workspace(cudnnHandle_t h, const Descs& d, Algo a, size_t* s) {
    return cudnnGetConvolutionForwardWorkspaceSize(h, d.x.d, d.w.d, d.conv.d, d.y.d, a, s);
  }
  static cudnnStatus_t find(cudnnHandle_t h, const Descs& d, const Ptrs& p, int* n, Perf* perf,
                            void* ws, size_t bytes) {
    return cudnnFindConvolutionForwardAlgorithmEx(h, d.x.d, p.x, d.w.d, p.w, d.conv.d, d.y.d, p.y,
                                                  kCount, n, perf, ws, bytes);
  }
  static cudnnStatus_t heuristic(cudnnHandle_t h, const Descs& d, int* n, Perf* perf) {
    return cudnnGetConvolutionForwardAlgorithm_v7(h, d.x.d, d.w.d, d.conv.d, d.y.d, kCount, n,
                                                  perf);
  }
  static cudnnStatus_t run(cudnnHandle_t h, const Descs& d, const Ptrs& p, Algo a, void* ws,
                           size_t bytes, DType t, const void* beta) {
    return cudnnConvolutionForward(h, scalar_one(t), d.x.d, p.x, d.w.d, p.w, d.conv.d, a, ws,
                                   bytes, beta, d.y.d, p.y);
  }
};
struct BwdData {
  using Perf = cudnnConvolutionBwdDataAlgoPerf_t;
  using Algo = cudnnConvolutionBwdDataAlgo_t;
  static constexpr int kCount = CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT;
  static constexpr ConvOp kOp = ConvOp::BackwardData;
  static cudnnStatus_t workspace(cudnnHandle_t h, const Descs& d, Algo a, size_t* s) {
    return cudnnGetConvolutionBackwardDataWorkspaceSize(h, d.w.d, d.y.d, d.conv.d, d.x.d, a, s);
  }
  static cudnnStatus_t find(cudnnHandle_t h, const Descs& d, const Ptrs& p, int* n, Perf* perf,
                            void* ws, size_t bytes) {
    return cudnnFindConvolutionBackwardDataAlgorithmEx(h, d.w.d, p.w, d.y.d, p.y, d.conv.d, d.x.d,
                                                       p.x, kCount, n, perf, ws, bytes);
  }
  static cudnnStatus_t heuristic(cudnnHandle_t h, const Descs& d, int* n, Perf* perf) {
    return cudnnGetConvolutionBackwardDataAlgorithm_v7(h, d.w.d, d.y.d, d.conv.d, d.x.d, kCount,
                                                       n, perf);
  }
  static cudnnStatus_t run(cudnnHandle_t h, const Descs& d, const Ptrs& p, Algo a, void* ws,
                           size_t bytes, DType t, const void* beta) {
    return cudnnConvolutionBackwardData(h, scalar_one(t), d.w.d, p.w, d.y.d, p.y, d.conv.d, a, ws,
                                        bytes, beta, d.x.d, p.x);
  }
};
struct BwdFilter {
  using Perf = cudnnConvolutionBwdFilterAlgoPerf_t;
  using Algo = cudnnConvolutionBwdFilterAlgo_t;
  static constexpr int kCount = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
  static constexpr ConvOp kOp = ConvOp::BackwardFilter;
  static cudnnStatus_t workspace(cudnnHandle_t h, const Descs& d, Algo a, size_t* s) {
    return cudnnGetConvolutionBackwardFilterWorkspaceSize(h, d.x.d, d.y.d, d.conv.d, d.w.d, a, s);
  }
  static cudnnStatus_t find(cudnnHandle_t h, const Descs& d, const Ptrs& p, int* n, Perf* perf,
                            void* ws, size_t bytes) {
    return cudnnFindConvolutionBackwardFilterAlgorithmEx(h, d.x.d, p.x, d.y.d, p.y, d.conv.d,
                                                         d.w.d, p.w, kCount, n, perf, ws, bytes);
  }
  static cudnnStatus_t heuristic(cudnnHandle_t h, const Descs& d, int* n, Perf* perf) {
    return cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, d.x.d, d.y.d, d.conv.d, d.w.d, kCount,
                                                         n, perf);
  }
  static cudnnStatus_t run(cudnnHandle_t h, const Descs& d, const Ptrs& p, Algo a, void* ws,
                           size_t bytes, DType t, const void* beta) {
    return cudnnConvolutionBackwardFilter(h, scalar_one(t), d.x.d, p.x, d.y.d, p.y, d.conv.d, a,
                                          ws, bytes, beta, d.w.d, p.w);
  }
};

// ---- the plan cache ----
struct Choice {
  int algo;
  size_t memory;
  cudnnMathType_t math;
  float ms = -1;  // cudnnFind's time; -1 for an untimed fallback
};

// The whole problem, as plain integers: zero-initialised and without padding, so it hashes and
// compares bytewise.
struct Key {
  int64_t device = 0, op = 0, dtype = 0, fmt = 0, deterministic = 0, accumulate = 0;
  int64_t backend = 0, align = 0;  // backend API allowed; byte alignment of the operands (<= 16)
  int64_t stats = 0;  // forward with the statistics epilogue (plan_cache().stats_plans)
  int64_t x[4] = {}, w[4] = {}, y[4] = {};
  int64_t stride_h = 0, stride_w = 0, pad_h = 0, pad_w = 0, dil_h = 0, dil_w = 0, groups = 0;
  bool operator==(const Key& o) const { return std::memcmp(this, &o, sizeof(Key)) == 0; }
};
using KeyHash = WordsHash<Key>;

Problem problem_of(const Key& k) {
  Problem pr{DType(k.dtype), MemoryFormat(k.fmt), Shape(k.x, k.x + 4), Shape(k.w, k.w + 4),
             Shape(k.y, k.y + 4), ConvParams{}};
  pr.p.stride_h = k.stride_h;
  pr.p.stride_w = k.stride_w;
  pr.p.pad_h = k.pad_h;
  pr.p.pad_w = k.pad_w;
  pr.p.dil_h = k.dil_h;
  pr.p.dil_w = k.dil_w;
  pr.p.groups = k.groups;
  pr.accumulate = k.accumulate != 0;
  return pr;
}

// Everything a call needs besides the data pointers. `m` serialises users of the descriptors
// (the conv descriptor's math type changes between candidates).
struct Plan {
  explicit Plan(const Problem& pr) : d(pr) {}
  std::mutex m;
  Descs d;
  std::shared_ptr<ConvEngine> engine;  // the backend API's plan, when it beat the legacy API
  std::vector<Choice> candidates;  // best first; the one that last ran after failures moves up
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;  // currently set on d.conv
  // Accumulating weight gradients: whether beta = 0 into a fresh buffer plus an add beat
  // beta = 1 (decided on the first run; see fresh_beats_accumulate).
  bool fresh_checked = false, via_fresh = false;
};

// The plan's measured time (ms): its backend plan's, else the legacy API's best (cudnnFind's,
// timed with beta = 0); -1 when untimed.
float plan_ms(const Plan& plan) {
  return plan.engine ? conv_engine_ms(*plan.engine) : plan.candidates.front().ms;
}

// Forward convolutions with the statistics epilogue: the tuned plan, or null when no plan
// describes the problem (remembered, so it is not searched again).
struct StatsPlan {
  std::mutex m;  // serialises runs, as Plan::m does
  std::shared_ptr<ConvEngine> engine;
};

// The tuner's state, as PyTorch keeps its cuDNN BenchmarkCache: the plan chosen for each
// problem, the counters, and the two settings that are part of every key. One per process
// (keys hold the device), reached through plan_cache().
class ConvPlanCache {
 public:
  std::mutex mutex;  // guards the maps and the counters
  std::unordered_map<Key, std::shared_ptr<Plan>, KeyHash> plans;
  std::unordered_map<Key, std::shared_ptr<StatsPlan>, KeyHash> stats_plans;
  uint64_t hits = 0, misses = 0;
  std::atomic<bool> deterministic{false};
  std::atomic<int> backend{-1};  // a ConvBackend; -1: not yet read from the switches
  std::atomic<int> wgrad_accumulate{-1};  // a WgradAccumulate; -1: not yet read
};

ConvPlanCache& plan_cache() {
  static ConvPlanCache cache;
  return cache;
}

// ---- the plan file (set_conv_plan_file) ----
// Line 1: "kiln conv plans 1<TAB><GPU name><TAB>cudnn <version>". Then one record a line:
// "<kind> <the key's integers><TAB><choice>". Kinds: P a convolution (choice "engine E t=v ..."
// or "legacy A M": algorithm A, math type M), S the same with the statistics epilogue ("engine
// ..." or "none"), F an accumulating weight gradient's way ("fresh 1" or "fresh 0").
struct PlanFile {
  std::mutex m;
  std::string path;  // empty: off
  bool path_read = false;  // from the switch, once
  bool loaded = false;
  std::map<std::string, std::string> records;
  uint64_t taken = 0;  // choices read from the file since clear_conv_algo_cache
};
PlanFile& plan_file() {
  static PlanFile f;
  return f;
}

std::string plan_file_header() {
  return detail::str_cat("kiln conv plans 1\t", context().props.name, "\tcudnn ",
                         static_cast<unsigned long long>(cudnnGetVersion()));
}

std::string key_text(char kind, const Key& k) {
  std::ostringstream out;
  out << kind;
  auto add = [&](int64_t v) { out << ' ' << v; };
  for (int64_t v :
       {k.op, k.dtype, k.fmt, k.deterministic, k.accumulate, k.backend, k.align, k.stats})
    add(v);
  for (int d = 0; d < 4; ++d) add(k.x[d]);
  for (int d = 0; d < 4; ++d) add(k.w[d]);
  for (int d = 0; d < 4; ++d) add(k.y[d]);
  for (int64_t v : {k.stride_h, k.stride_w, k.pad_h, k.pad_w, k.dil_h, k.dil_w, k.groups}) add(v);
  return out.str();
}

// The path, from KILN_CONV_PLANS unless set_conv_plan_file came first (the caller holds f.m).
const std::string& plan_file_path(PlanFile& f) {
  if (!f.path_read) {
    f.path_read = true;
    if (f.path.empty()) f.path = switches().conv_plans;
  }
  return f.path;
}

// The file's records, read on first use (the caller holds f.m). A file that is not a plan file
// (its first line is not one of ours) is neither read nor written: the path is dropped.
void load_plan_file(PlanFile& f) {
  if (f.loaded || plan_file_path(f).empty()) return;
  f.loaded = true;
  std::ifstream in(f.path);
  if (!in) return;  // no file yet: written on the first choice
  std::string line;
  if (!std::getline(in, line)) return;
  if (line.rfind("kiln conv plans ", 0) != 0) {
    std::fprintf(stderr,
                 "kiln: '%s' (KILN_CONV_PLANS) is not a convolution plan file (its first line "
                 "does not begin \"kiln conv plans\"); it is neither read nor written\n",
                 f.path.c_str());
    f.path.clear();
    return;
  }
  if (line != plan_file_header()) {
    std::fprintf(stderr,
                 "kiln: the convolution plan file '%s' was written for another GPU or cuDNN "
                 "(\"%s\"); its plans are not used, and it is rewritten with this one's\n",
                 f.path.c_str(), line.c_str());
    return;
  }
  while (std::getline(in, line)) {
    const size_t tab = line.find('\t');
    if (tab == std::string::npos) continue;
    f.records[line.substr(0, tab)] = line.substr(tab + 1);
  }
}

// Deterministic mode chooses without timing already (the same plans in every process): it
// neither reads nor writes the file.
std::optional<std::string> plan_record(char kind, const Key& k) {
  if (k.deterministic) return std::nullopt;
  PlanFile& f = plan_file();
  std::lock_guard<std::mutex> lock(f.m);
  load_plan_file(f);
  if (f.path.empty()) return std::nullopt;
  auto it = f.records.find(key_text(kind, k));
  if (it == f.records.end()) return std::nullopt;
  return it->second;
}

void note_taken() {
  PlanFile& f = plan_file();
  std::lock_guard<std::mutex> lock(f.m);
  ++f.taken;
}

// Records a choice and rewrites the file (a failure to write is reported once, not fatal: the
// tuner's choice stands either way).
void save_record(char kind, const Key& k, const std::string& choice) {
  if (k.deterministic) return;
  PlanFile& f = plan_file();
  std::lock_guard<std::mutex> lock(f.m);
  load_plan_file(f);
  if (f.path.empty()) return;
  f.records[key_text(kind, k)] = choice;
  std::string out = plan_file_header() + "\n";
  for (const auto& [key, rec] : f.records) out += key + "\t" + rec + "\n";
  try {
    write_file_atomic(f.path, out);
  } catch (const Error& e) {
    static std::once_flag once;
    std::call_once(once, [&] {
      std::fprintf(stderr, "kiln: the convolution plan file is not written: %s\n", e.what());
    });
  }
}

std::string engine_record(const ConvEngine& e) {
  std::ostringstream out;
  out << "engine " << conv_engine_index(e);
  for (const auto& [type, value] : conv_engine_knobs(e)) out << ' ' << type << '=' << value;
  return out.str();
}

// "engine E t=v ..." parsed; false for another record or a malformed one.
bool parse_engine(const std::string& rec, int64_t& engine,
                  std::vector<std::pair<int, int64_t>>& knobs) {
  std::istringstream in(rec);
  std::string word;
  if (!(in >> word) || word != "engine" || !(in >> engine)) return false;
  knobs.clear();
  while (in >> word) {
    const size_t eq = word.find('=');
    if (eq == std::string::npos) return false;
    try {
      knobs.emplace_back(std::stoi(word.substr(0, eq)), std::stoll(word.substr(eq + 1)));
    } catch (const std::exception&) {
      return false;
    }
  }
  return true;
}

ConvBackend backend_mode() {
  int v = plan_cache().backend.load();
  if (v < 0) {
    const ConvBackend m = ConvBackend(switches().cudnn_backend);
    int expected = -1;
    plan_cache().backend.compare_exchange_strong(expected, int(m));
    v = plan_cache().backend.load();
  }
  return ConvBackend(v);
}

bool find_log_enabled() { return switches().cudnn_find_log; }

// Workspace from the caching allocator (null when bytes is 0). Freed on the current stream.
std::unique_ptr<Storage> workspace(size_t bytes, int device) {
  if (bytes == 0) return nullptr;
  return std::make_unique<Storage>(bytes, Device::cuda(device));
}

// Every algorithm cuDNN reports a workspace size for (≤ the cap), untimed, with `first` (a plan
// file's legacy choice) ahead of them when it is one of them.
template <class Op>
std::vector<Choice> untimed(cudnnHandle_t h, const Descs& d, const Problem& pr,
                            std::optional<std::pair<int, cudnnMathType_t>> first) {
  std::vector<Choice> out;
  if (first) {
    CUDNN_CHECK(cudnnSetConvolutionMathType(d.conv.d, first->second));
    size_t s = 0;
    if (Op::workspace(h, d, typename Op::Algo(first->first), &s) == CUDNN_STATUS_SUCCESS &&
        s <= kConvMaxWorkspaceBytes)
      out.push_back({first->first, s, first->second, -1.0f});
  }
  CUDNN_CHECK(cudnnSetConvolutionMathType(d.conv.d, preferred_math(pr.dtype)));
  for (int a = 0; a < Op::kCount; ++a) {
    size_t s = 0;
    if (Op::workspace(h, d, typename Op::Algo(a), &s) != CUDNN_STATUS_SUCCESS ||
        s > kConvMaxWorkspaceBytes)
      continue;
    if (!out.empty() && out.front().algo == a && out.front().math == preferred_math(pr.dtype))
      continue;
    out.push_back({a, s, preferred_math(pr.dtype), -1.0f});
  }
  return out;
}

// Times every algorithm with a workspace as large as the largest need (≤ the cap; halved while
// the allocation fails) and returns them fastest first, then, as untimed fallbacks, the other
// algorithms cuDNN reports a workspace size for.
template <class Op>
std::vector<Choice> search(cudnnHandle_t h, const Descs& d, const Ptrs& p, const Problem& pr,
                           int device, bool deterministic) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(current_stream(), &capture));
  KILN_CHECK(capture == cudaStreamCaptureStatusNone, describe(Op::kOp, pr),
             ": no cached algorithm, and cuDNN's search cannot run during graph capture (run an "
             "eager warm-up step first)");
  CUDNN_CHECK(cudnnSetConvolutionMathType(d.conv.d, preferred_math(pr.dtype)));
  std::vector<std::pair<int, size_t>> sizes;
  size_t max_ws = 0;
  for (int a = 0; a < Op::kCount; ++a) {
    size_t s = 0;
    if (Op::workspace(h, d, typename Op::Algo(a), &s) != CUDNN_STATUS_SUCCESS) continue;
    sizes.emplace_back(a, s);
    if (s <= kConvMaxWorkspaceBytes) max_ws = std::max(max_ws, s);
  }
  std::unique_ptr<Storage> ws;
  for (;;) {
    try {
      ws = workspace(max_ws, device);
      break;
    } catch (const OutOfMemoryError&) {
      if (max_ws == 0) throw;
      max_ws /= 2;
    }
  }
  typename Op::Perf perf[Op::kCount];
  int n = 0;
  cudnnStatus_t s = Op::find(h, d, p, &n, perf, ws ? ws->data() : nullptr, max_ws);
  if (find_log_enabled()) {
    std::fprintf(stderr, "[kiln conv find] %s: %s, %d results (workspace offered %zu bytes)\n",
                 describe(Op::kOp, pr).c_str(), cudnnGetErrorString(s), n, max_ws);
    for (int i = 0; s == CUDNN_STATUS_SUCCESS && i < n; ++i)
      std::fprintf(stderr, "    algo %d: %s, %.4f ms, %zu bytes, math %d, %s\n", int(perf[i].algo),
                   cudnnGetErrorString(perf[i].status), double(perf[i].time), perf[i].memory,
                   int(perf[i].mathType),
                   perf[i].determinism == CUDNN_DETERMINISTIC ? "deterministic" : "nondeterministic");
  }
  std::vector<Choice> out;

  if (s == CUDNN_STATUS_SUCCESS) {
    for (int i = 0; i < n; ++i) {
      if (perf[i].status != CUDNN_STATUS_SUCCESS || perf[i].memory > max_ws) continue;
      if (deterministic && perf[i].determinism != CUDNN_DETERMINISTIC) continue;
      out.push_back({int(perf[i].algo), perf[i].memory, perf[i].mathType, perf[i].time});
    }
  }
  if (!deterministic) {  // determinism of an untimed algorithm is unknown
    for (auto [a, bytes] : sizes) {
      bool have = std::any_of(out.begin(), out.end(), [&](const Choice& c) { return c.algo == a; });
      if (!have && bytes <= kConvMaxWorkspaceBytes)
        out.push_back({a, bytes, preferred_math(pr.dtype), -1.0f});
    }
  }
  if (deterministic) {
    // The same algorithm in every process, whatever the timings: the timed deterministic
    // algorithms in cuDNN's heuristic order (as cuBLASLt's first heuristic answer is taken in
    // this mode, cuda/blas.cpp); ties, and algorithms the heuristic does not list, by number.
    typename Op::Perf ranked[Op::kCount];
    int m = 0;
    if (Op::heuristic(h, d, &m, ranked) != CUDNN_STATUS_SUCCESS) m = 0;
    auto key = [&](const Choice& c) {
      int r = 2 * Op::kCount;  // not listed
      for (int i = 0; i < m; ++i) {
        if (int(ranked[i].algo) != c.algo) continue;
        if (ranked[i].mathType == c.math) {
          r = i;
          break;
        }
        r = std::min(r, Op::kCount + i);  // listed with another math type
      }
      return std::tuple(r, c.algo, int(c.math));
    };
    std::sort(out.begin(), out.end(),
              [&](const Choice& a, const Choice& b) { return key(a) < key(b); });
  }
  if (out.empty()) {
    detail::fail(ErrorKind::Cudnn, __FILE__, __LINE__, nullptr,
                 detail::str_cat(describe(Op::kOp, pr), ": cuDNN offers no usable algorithm",
                                 deterministic ? " (deterministic only)" : "",
                                 s != CUDNN_STATUS_SUCCESS ? "; search failed: " : "",
                                 s != CUDNN_STATUS_SUCCESS ? cudnnGetErrorString(s) : ""));
  }
  return out;
}

Key make_key(ConvOp op, DType dtype, MemoryFormat fmt, const Tensor& x, const Tensor& w,
             const Tensor& y, const ConvParams& p, int device, bool deterministic,
             bool accumulate) {
  Key k;
  k.accumulate = accumulate;
  k.backend = int64_t(backend_mode());
  k.align = std::min({pointer_alignment(x.raw_data()), pointer_alignment(w.raw_data()),
                      pointer_alignment(y.raw_data())});
  k.device = device;
  k.op = int64_t(op);
  k.dtype = int64_t(dtype);
  k.fmt = int64_t(fmt);
  k.deterministic = deterministic;
  for (int d = 0; d < 4; ++d) {
    k.x[d] = x.size(d);
    k.w[d] = w.size(d);
    k.y[d] = y.size(d);
  }
  k.stride_h = p.stride_h;
  k.stride_w = p.stride_w;
  k.pad_h = p.pad_h;
  k.pad_w = p.pad_w;
  k.dil_h = p.dil_h;
  k.dil_w = p.dil_w;
  k.groups = p.groups;
  return k;
}

// The operand an operation computes (y, dx = x or dw = w).
template <class Op>
void*& output_ptr(Ptrs& p) {
  if constexpr (Op::kOp == ConvOp::Forward) return p.y;
  else if constexpr (Op::kOp == ConvOp::BackwardData) return p.x;
  else return p.w;
}
template <class Op>
const Tensor& output_of(const Tensor& x, const Tensor& w, const Tensor& y) {
  if constexpr (Op::kOp == ConvOp::Forward) return y;
  else if constexpr (Op::kOp == ConvOp::BackwardData) return x;
  else return w;
}

template <class Op>
void execute(DType dtype, MemoryFormat fmt, const Tensor& x, const Tensor& w, const Tensor& y,
             const ConvParams& cp, bool accumulate, bool zeroed = false);

// A weight gradient added into .grad (beta = 1) reaches other engines than the same problem
// with beta = 0, sometimes much slower ones (ResNet-50's layer-1 3x3: 0.29 ms against 0.13 ms,
// docs/lab/accumulate-into.md, v13); the weights are small, so beta = 0 into a fresh buffer
// plus one add can win. On the accumulating plan's first run the beta = 0 problem is tuned too
// (on a scratch output) and the faster way is kept: the add is counted as 3 µs plus three passes
// over the weights at 2 TB/s.
template <class Op>
bool fresh_beats_accumulate(Plan& plan, DType dtype, MemoryFormat fmt, const Tensor& x,
                            const Tensor& w, const Tensor& y, const ConvParams& cp,
                            const Key& acc_key) {
  int m = plan_cache().wgrad_accumulate.load();
  if (m < 0) {  // not set by set_wgrad_accumulate: tuned
    int expected = -1;
    plan_cache().wgrad_accumulate.compare_exchange_strong(expected, int(WgradAccumulate::Tuned));
    m = plan_cache().wgrad_accumulate.load();
  }
  const auto mode = WgradAccumulate(m);
  if (mode != WgradAccumulate::Tuned) return mode == WgradAccumulate::FreshAndAdd;
  if (acc_key.deterministic) return false;  // not timed in deterministic mode: beta = 1
  std::lock_guard<std::mutex> lock(plan.m);
  if (plan.fresh_checked) return plan.via_fresh;
  plan.fresh_checked = true;
  if (const std::optional<std::string> rec = plan_record('F', acc_key)) {
    if (*rec == "fresh 1" || *rec == "fresh 0") {
      plan.via_fresh = *rec == "fresh 1";
      note_taken();
      return plan.via_fresh;
    }
  }
  Tensor scratch = empty(w.shape(), TensorOptions(dtype).with_device(w.device())
                                        .with_memory_format(fmt));
  execute<Op>(dtype, fmt, x, scratch, y, cp, false);  // tunes the beta = 0 problem
  Key key = acc_key;
  key.accumulate = false;
  key.align = std::min({pointer_alignment(x.raw_data()), pointer_alignment(scratch.raw_data()),
                        pointer_alignment(y.raw_data())});
  std::shared_ptr<Plan> fresh;
  {
    std::lock_guard<std::mutex> cache_lock(plan_cache().mutex);
    auto it = plan_cache().plans.find(key);
    if (it != plan_cache().plans.end()) fresh = it->second;
  }
  if (!fresh) return false;
  float fresh_ms;
  {
    std::lock_guard<std::mutex> fresh_lock(fresh->m);
    fresh_ms = plan_ms(*fresh);
  }
  const float acc_ms = plan_ms(plan);
  const float add_ms = 0.003f + 3.0f * float(w.nbytes()) / 2e9f;
  plan.via_fresh = fresh_ms >= 0 && acc_ms >= 0 && fresh_ms + add_ms < acc_ms;
  // Untimed plans (from the plan file) never compare: the file's own record decides then.
  if (fresh_ms >= 0 && acc_ms >= 0)
    save_record('F', acc_key, plan.via_fresh ? "fresh 1" : "fresh 0");
  if (find_log_enabled())
    std::fprintf(stderr, "[kiln conv] %s: beta = 1 %.4f ms, beta = 0 %.4f ms + add %.4f ms: %s\n",
                 describe(Op::kOp, problem_of(acc_key)).c_str(), double(acc_ms), double(fresh_ms),
                 double(add_ms), plan.via_fresh ? "fresh buffer and add" : "beta = 1");
  return plan.via_fresh;
}

// Runs one problem (x, w, y dense in fmt) with its cached plan, searching on first sight, and
// falls through to the next candidate when one fails. With accumulate the computed operand is
// `+=` (beta = 1): a separate problem in the cache, searched and tuned on a zeroed scratch
// output, since the timing runs would otherwise add into the real one several times.
template <class Op>
void execute(DType dtype, MemoryFormat fmt, const Tensor& x, const Tensor& w, const Tensor& y,
             const ConvParams& cp, bool accumulate, bool zeroed) {
  Context& ctx = context();
  cudnnHandle_t h = ctx.cudnn;
  CUDNN_CHECK(cudnnSetStream(h, current_stream()));
  const Ptrs p{x.raw_data(), w.raw_data(), y.raw_data()};
  const bool deterministic = plan_cache().deterministic.load();
  const Key key =
      make_key(Op::kOp, dtype, fmt, x, w, y, cp, ctx.device, deterministic, accumulate);
  const void* beta = accumulate ? scalar_one(dtype) : scalar_zero(dtype);
  std::shared_ptr<Plan> plan;
  {
    std::lock_guard<std::mutex> lock(plan_cache().mutex);
    auto it = plan_cache().plans.find(key);
    if (it != plan_cache().plans.end()) {
      ++plan_cache().hits;
      plan = it->second;
    } else {
      ++plan_cache().misses;
      const Problem pr = problem_of(key);
      Ptrs tp = p;  // the operands searched and tuned on
      Tensor scratch;
      if (accumulate) {
        const Tensor& out = output_of<Op>(x, w, y);
        scratch = zeros(out.shape(), TensorOptions(dtype).with_device(out.device())
                                         .with_memory_format(fmt));
        output_ptr<Op>(tp) = scratch.raw_data();
      }
      auto fresh = std::make_shared<Plan>(pr);
      const ConvProblem cp_be{Op::kOp, pr.dtype, pr.fmt, pr.x, pr.w, pr.y, pr.p, pr.accumulate};
      // A plan file's record, when it names a plan cuDNN takes here: nothing is timed.
      bool recorded = false;
      if (const std::optional<std::string> rec = plan_record('P', key)) {
        int64_t engine = -1;
        std::vector<std::pair<int, int64_t>> knobs;
        int algo = -1, math = -1;
        if (parse_engine(*rec, engine, knobs) && ConvBackend(key.backend) != ConvBackend::Off &&
            conv_engine_supports(cp_be)) {
          fresh->engine = load_conv_engine(h, cp_be, key.align, engine, knobs, deterministic);
          recorded = fresh->engine != nullptr;
          if (recorded) fresh->candidates = untimed<Op>(h, fresh->d, pr, std::nullopt);
        } else if (std::sscanf(rec->c_str(), "legacy %d %d", &algo, &math) == 2) {
          fresh->candidates =
              untimed<Op>(h, fresh->d, pr, std::pair(algo, cudnnMathType_t(math)));
          recorded = !fresh->candidates.empty() && fresh->candidates.front().algo == algo;
        }
        recorded = recorded && !fresh->candidates.empty();
        if (!recorded) fresh->engine.reset();
        fresh->math = preferred_math(dtype);  // what untimed left on the conv descriptor
        if (recorded) note_taken();
        if (find_log_enabled())
          std::fprintf(stderr, "[kiln conv] %s: %s the plan file's \"%s\"\n",
                       describe(Op::kOp, pr).c_str(), recorded ? "from" : "not taken:",
                       rec->c_str());
      }
      if (recorded) {
        plan = plan_cache().plans.emplace(key, std::move(fresh)).first->second;
      } else {
        // cudnnFind times beta = 0 (it overwrites the output); beta = 1 adds one read of it.
        fresh->candidates = search<Op>(h, fresh->d, tp, pr, ctx.device, deterministic);
        fresh->math = preferred_math(dtype);  // what search left on the conv descriptor
        if (ConvBackend(key.backend) != ConvBackend::Off && conv_engine_supports(cp_be)) {
          // In deterministic mode the backend API's plan is taken whenever one runs: a bar of
          // the legacy API's time would make the choice depend on timings.
          const float bar = ConvBackend(key.backend) == ConvBackend::Force || deterministic
                                ? -1.0f : fresh->candidates.front().ms;
          fresh->engine = tune_conv_engine(h, cp_be, key.align, tp.x, tp.w, tp.y, ctx.device,
                                           deterministic, bar,
                                           find_log_enabled(), describe(Op::kOp, pr));
          if (find_log_enabled())
            std::fprintf(
              stderr, "[kiln conv] %s: %s\n", describe(Op::kOp, pr).c_str(),
              fresh->engine ? ("backend API, " + conv_engine_name(*fresh->engine)).c_str()
                            : "legacy API");
        }
        save_record('P', key,
                    fresh->engine ? engine_record(*fresh->engine)
                                  : detail::str_cat("legacy ", fresh->candidates.front().algo, " ",
                                                    int(fresh->candidates.front().math)));
        plan = plan_cache().plans.emplace(key, std::move(fresh)).first->second;
      }
    }
  }
  if constexpr (Op::kOp == ConvOp::BackwardFilter) {
    if (accumulate && fresh_beats_accumulate<Op>(*plan, dtype, fmt, x, w, y, cp, key)) {
      // Into zeros (conv2d_backward_weight's `zeroed`) the fresh buffer is the output itself.
      if (zeroed) return execute<Op>(dtype, fmt, x, w, y, cp, false);
      NoGradGuard no_grad;
      Tensor fresh = empty(w.shape(), TensorOptions(dtype).with_device(w.device())
                                          .with_memory_format(fmt));
      execute<Op>(dtype, fmt, x, fresh, y, cp, false);
      binary(BinaryOp::AddScaled, w, w, fresh, 1.0);
      return;
    }
  }
  std::lock_guard<std::mutex> lock(plan->m);
  if (plan->engine) {
    const cudnnStatus_t s = run_conv_engine(h, *plan->engine, p.x, p.w, p.y, ctx.device);
    if (s == CUDNN_STATUS_SUCCESS) return;
    // Not expected once tuned; the legacy candidates take over for good.
    std::fprintf(stderr, "[kiln conv] %s: backend plan failed (%s); using the legacy API\n",
                 describe(Op::kOp, problem_of(key)).c_str(), cudnnGetErrorString(s));
    plan->engine.reset();
  }
  std::vector<Choice>& cands = plan->candidates;
  std::string tried;
  bool out_of_memory = false;
  for (size_t i = 0; i < cands.size(); ++i) {
    const Choice c = cands[i];
    const cudnnMathType_t math = dtype == DType::f32 ? CUDNN_FMA_MATH : c.math;
    if (math != plan->math) {
      CUDNN_CHECK(cudnnSetConvolutionMathType(plan->d.conv.d, math));
      plan->math = math;
    }
    std::unique_ptr<Storage> ws;
    try {
      ws = workspace(c.memory, ctx.device);
    } catch (const OutOfMemoryError&) {
      tried += detail::str_cat(" algo ", c.algo, ": no memory for ", c.memory, " bytes;");
      out_of_memory = true;
      continue;
    }
    cudnnStatus_t s = Op::run(h, plan->d, p, typename Op::Algo(c.algo),
                              ws ? ws->data() : nullptr, c.memory, dtype, beta);
    if (s == CUDNN_STATUS_SUCCESS) {
      // The ones before it failed outright (not for memory, which may come back): they would
      // fail again, so this one goes first from now on.
      if (i > 0 && !out_of_memory)
        std::rotate(cands.begin(), cands.begin() + ptrdiff_t(i), cands.begin() + ptrdiff_t(i) + 1);
      return;
    }
    tried += detail::str_cat(" algo ", c.algo, ": ", cudnnGetErrorString(s), ";");
  }
  detail::fail(ErrorKind::Cudnn, __FILE__, __LINE__, nullptr,
               detail::str_cat(describe(Op::kOp, problem_of(key)),
                               ": every algorithm failed:", tried));
}

// ---- stem channel padding ----
// A first layer with 1-3 input channels (RGB; grayscale such as Fashion-MNIST's) runs as 4
// channels, the last ones zero: cuDNN's NHWC FP16 engines want 4 or a multiple of 8, and 4 is
// what ResNet-50's stem runs on (padding to 8 was measured slower end to end: docs/lab/stem.md).
constexpr int64_t kStemChannels = 4;
bool pad_stem(DType t, int64_t c_in, int64_t groups) {
  return t == DType::f16 && c_in < kStemChannels && groups == 1;
}
Tensor padded_empty(const Tensor& like) {
  Shape s = like.shape();
  s[1] = kStemChannels;
  return empty(s, TensorOptions(like.dtype()).with_device(like.device())
                      .with_memory_format(MemoryFormat::ChannelsLast));
}
// dst = padded_empty(t) filled: channels C.. zero.
void pad_channels_into(const Tensor& dst, const Tensor& t) {
  NoGradGuard no_grad;
  if (pad_channels4(dst, t.detach())) return;
  dst.zero_();
  dst.narrow(1, 0, t.size(1)).copy_(t.detach());
}
// t (A, C, H, W), C < 4 -> (A, 4, H, W) NHWC with channels C.. zero.
Tensor pad_channels(const Tensor& t) {
  Tensor p = padded_empty(t);
  pad_channels_into(p, t);
  return p;
}

// y += bias broadcast over (N, H, W).
void add_bias(const Tensor& y, const Tensor& bias, MemoryFormat fmt) {
  NoGradGuard no_grad;
  Tensor b = bias.detach().to(y.dtype()).contiguous();
  const int64_t o = y.size(1);
  TensorDesc bd(y.dtype(), {1, o, 1, 1}, {o, 1, 1, 1});
  TensorDesc yd(y.dtype(), y.shape(), format_strides(y.shape(), fmt));
  Context& ctx = context();
  CUDNN_CHECK(cudnnSetStream(ctx.cudnn, current_stream()));
  CUDNN_CHECK(cudnnAddTensor(ctx.cudnn, scalar_one(y.dtype()), bd.d, b.raw_data(),
                             scalar_one(y.dtype()), yd.d, y.raw_data()));
}

MemoryFormat layout_of(const Tensor& t) { return t.suggest_memory_format(); }


}  // namespace

bool conv2d_forward_stats(const Tensor& y, const Tensor& sum, const Tensor& sqsum,
                          const Tensor& x, const Tensor& w, const ConvParams& p) {
  if (backend_mode() == ConvBackend::Off || x.dtype() != DType::f16 ||
      p.groups != 1 || y.numel() == 0 || x.numel() == 0 || w.numel() == 0 ||
      !y.is_contiguous(MemoryFormat::ChannelsLast))
    return false;
  const bool pad = pad_stem(x.dtype(), x.size(1), p.groups);
  if (!pad && !(x.is_contiguous(MemoryFormat::ChannelsLast) &&
                w.is_contiguous(MemoryFormat::ChannelsLast)))
    return false;
  KILN_CHECK(sum.dtype() == DType::f32 && sqsum.dtype() == DType::f32 && sum.is_contiguous() &&
                 sqsum.is_contiguous() && sum.numel() == y.size(1) && sqsum.numel() == y.size(1),
             "conv2d_forward_stats: sum and sqsum must be contiguous f32 (", y.size(1),
             "), got ", sum.desc(), " and ", sqsum.desc());
  if (stem_conv_mode() >= 1 && stem_conv_supported(y, x, w, p)) {
    stem_conv_forward_stats(y, sum, sqsum, x, w, p);
    return true;
  }
  const MemoryFormat fmt = MemoryFormat::ChannelsLast;
  // The stem's operands are padded only once a plan is going to run (usually none is found for
  // it, and F::conv2d's plain convolution pads them itself).
  Tensor xc = pad ? padded_empty(x) : x;
  Tensor wc = pad ? padded_empty(w) : w;
  Context& ctx = context();
  cudnnHandle_t h = ctx.cudnn;
  CUDNN_CHECK(cudnnSetStream(h, current_stream()));
  const bool deterministic = plan_cache().deterministic.load();
  const Key plain = make_key(ConvOp::Forward, x.dtype(), fmt, xc, wc, y, p, ctx.device,
                             deterministic, false);
  Key key = plain;
  key.stats = 1;
  key.align = std::min({key.align, pointer_alignment(sum.raw_data()),
                        pointer_alignment(sqsum.raw_data())});
  bool seen = false;
  std::shared_ptr<StatsPlan> known;
  {
    std::lock_guard<std::mutex> lock(plan_cache().mutex);
    auto it = plan_cache().stats_plans.find(key);
    seen = it != plan_cache().stats_plans.end();
    if (seen) known = it->second;
  }
  if (!seen) {  // a plan file's record: nothing is tuned or timed
    if (const std::optional<std::string> rec = plan_record('S', key)) {
      auto fresh = std::make_shared<StatsPlan>();
      int64_t engine = -1;
      std::vector<std::pair<int, int64_t>> knobs;
      bool taken = *rec == "none";
      if (!taken && parse_engine(*rec, engine, knobs)) {
        const Problem pr = problem_of(key);
        ConvProblem cp{ConvOp::Forward, pr.dtype, pr.fmt, pr.x, pr.w, pr.y, pr.p, false};
        cp.stats = true;
        fresh->engine = load_conv_engine(h, cp, key.align, engine, knobs, deterministic);
        taken = fresh->engine != nullptr;
      }
      if (find_log_enabled())
        std::fprintf(stderr, "[kiln conv] %s + statistics: %s the plan file's \"%s\"\n",
                     describe(ConvOp::Forward, problem_of(key)).c_str(),
                     taken ? "from" : "not taken:", rec->c_str());
      if (taken) {
        note_taken();
        std::lock_guard<std::mutex> lock(plan_cache().mutex);
        ++plan_cache().misses;
        known = plan_cache().stats_plans.emplace(key, std::move(fresh)).first->second;
        seen = true;
      }
    }
  }
  if (known) {
    std::lock_guard<std::mutex> lock(known->m);
    if (!known->engine) return false;
  }
  if (pad) {
    pad_channels_into(xc, x);
    pad_channels_into(wc, w);
  }
  // First sight: the plain convolution is tuned (and run) first; its time sets the bar.
  float bar = -1.0f;  // Force (tests): any plan that runs
  if (!seen && ConvBackend(key.backend) != ConvBackend::Force) {
    execute<Fwd>(x.dtype(), fmt, xc, wc, y, p, false);
    std::lock_guard<std::mutex> lock(plan_cache().mutex);
    auto it = plan_cache().plans.find(plain);
    if (it != plan_cache().plans.end()) {
      std::lock_guard<std::mutex> plan_lock(it->second->m);
      const Plan& pl = *it->second;
      const float plain_ms = pl.engine ? conv_engine_ms(*pl.engine)
                                       : (pl.candidates.empty() ? -1.0f : pl.candidates.front().ms);
      // The alternative is a separate statistics pass: one read of y at ~3 TB/s.
      if (plain_ms > 0) bar = plain_ms + float(double(y.nbytes()) / 3.0e9);
    }
  }
  std::shared_ptr<StatsPlan> plan;
  {
    std::lock_guard<std::mutex> lock(plan_cache().mutex);
    auto it = plan_cache().stats_plans.find(key);
    if (it != plan_cache().stats_plans.end()) {
      ++plan_cache().hits;
      plan = it->second;
    } else {
      ++plan_cache().misses;
      const Problem pr = problem_of(key);
      ConvProblem cp{ConvOp::Forward, pr.dtype, pr.fmt, pr.x, pr.w, pr.y, pr.p, false};
      cp.stats = true;
      const std::string what = describe(ConvOp::Forward, pr) + " + statistics";
      auto fresh = std::make_shared<StatsPlan>();
      fresh->engine = tune_conv_engine(h, cp, key.align, xc.raw_data(), wc.raw_data(),
                                       y.raw_data(), ctx.device, deterministic, bar,
                                       find_log_enabled(), what, sum.raw_data(), sqsum.raw_data());
      if (find_log_enabled())
        std::fprintf(stderr, "[kiln conv] %s: %s\n", what.c_str(),
                     fresh->engine ? conv_engine_name(*fresh->engine).c_str()
                                   : "no plan; unfused");
      save_record('S', key, fresh->engine ? engine_record(*fresh->engine) : std::string("none"));
      plan = plan_cache().stats_plans.emplace(key, std::move(fresh)).first->second;
    }
  }
  std::lock_guard<std::mutex> lock(plan->m);
  if (!plan->engine) return false;
  const cudnnStatus_t s = run_conv_engine(h, *plan->engine, xc.raw_data(), wc.raw_data(),
                                          y.raw_data(), ctx.device, sum.raw_data(),
                                          sqsum.raw_data());
  if (s == CUDNN_STATUS_SUCCESS) return true;
  std::fprintf(stderr, "[kiln conv] %s + statistics: plan failed (%s); unfused from now on\n",
               describe(ConvOp::Forward, problem_of(key)).c_str(), cudnnGetErrorString(s));
  plan->engine.reset();
  return false;
}

void conv2d_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias,
                    const ConvParams& p) {
  if (y.numel() == 0) return;
  if (x.numel() == 0 || w.numel() == 0) {  // empty reduction
    if (bias.defined()) y.copy_(bias.view({1, y.size(1), 1, 1}).broadcast_to(y.shape())); else y.zero_();
    return;
  }
  const bool pad = pad_stem(x.dtype(), x.size(1), p.groups);
  const MemoryFormat fmt = pad ? MemoryFormat::ChannelsLast : layout_of(x);
  Tensor xc = pad ? pad_channels(x) : dense_in(x, fmt);
  Tensor wc = pad ? pad_channels(w) : dense_in(w, fmt);
  Tensor yb = out_buffer(y, fmt);
  execute<Fwd>(x.dtype(), fmt, xc, wc, yb, p, false);
  if (bias.defined()) add_bias(yb, bias, fmt);
  finish_out(y, yb);
}

// accumulate runs with beta = 1 only when the output is dense in the problem's layout and not
// stem-padded: the result must land in the real operand. Otherwise a fresh result is added.
void conv2d_backward_data(const Tensor& dx, const Tensor& dy, const Tensor& w, const ConvParams& p,
                          bool accumulate) {
  if (dx.numel() == 0) return;
  if (dy.numel() == 0 || w.numel() == 0) {
    if (!accumulate) dx.zero_();
    return;
  }
  const bool pad = pad_stem(dx.dtype(), dx.size(1), p.groups);
  const MemoryFormat fmt = pad ? MemoryFormat::ChannelsLast : layout_of(dx);
  if (accumulate && (pad || !dx.is_contiguous(fmt))) {
    NoGradGuard no_grad;
    Tensor fresh = empty(dx.shape(), TensorOptions(dx.dtype()).with_device(dx.device())
                                         .with_memory_format(fmt));
    conv2d_backward_data(fresh, dy, w, p, false);
    binary(BinaryOp::AddScaled, dx, dx, fresh, 1.0);
    return;
  }
  Tensor dyc = dense_in(dy, fmt);
  Tensor wc = pad ? pad_channels(w) : dense_in(w, fmt);
  Tensor dxb = pad ? padded_empty(dx) : out_buffer(dx, fmt);
  execute<BwdData>(dx.dtype(), fmt, dxb, wc, dyc, p, accumulate);
  if (pad) dx.copy_(dxb.narrow(1, 0, dx.size(1))); else finish_out(dx, dxb);
}

void conv2d_backward_weight(const Tensor& dw, const Tensor& dy, const Tensor& x,
                            const ConvParams& p, bool accumulate, bool zeroed) {
  if (dw.numel() == 0) return;
  if (dy.numel() == 0 || x.numel() == 0) {
    if (!accumulate) dw.zero_();
    return;
  }
  if (stem_conv_mode() == 2 && stem_wgrad_supported(dw, dy, x, p)) {
    stem_conv_backward_weight(dw, dy, x, p, accumulate && !zeroed);  // zeroed: 0 + dW = dW
    return;
  }
  if (conv1x1_wgrad_supported(dw, dy, x, p)) {
    conv1x1_backward_weight(dw, dy, x, p, accumulate && !zeroed);
    return;
  }
  KILN_CHECK(dy.dtype() == x.dtype(), "conv2d_backward_weight (cuda): dy and x must have one dtype, "
             "got dy ", dy.desc(), " and x ", x.desc());
  if (dw.dtype() != x.dtype()) {
    // cuDNN writes the gradient in its operands' dtype (the kernels above also write f32): into
    // a buffer of x's dtype, then widened or narrowed into dw.
    NoGradGuard no_grad;
    Tensor own = empty(dw.shape(), TensorOptions(x.dtype()).with_device(dw.device()));
    conv2d_backward_weight(own, dy, x, p, false);
    const Tensor converted = own.to(dw.dtype());
    if (accumulate && !zeroed) binary(BinaryOp::AddScaled, dw, dw, converted, 1.0);
    else dw.copy_(converted);
    return;
  }
  const bool pad = pad_stem(x.dtype(), x.size(1), p.groups);
  const MemoryFormat fmt = pad ? MemoryFormat::ChannelsLast : layout_of(x);
  if (accumulate && (pad || !dw.is_contiguous(fmt))) {
    if (zeroed) return conv2d_backward_weight(dw, dy, x, p, false);  // 0 + fresh: fresh
    NoGradGuard no_grad;
    Tensor fresh = empty(dw.shape(), TensorOptions(dw.dtype()).with_device(dw.device())
                                         .with_memory_format(fmt));
    conv2d_backward_weight(fresh, dy, x, p, false);
    binary(BinaryOp::AddScaled, dw, dw, fresh, 1.0);
    return;
  }
  Tensor xc = pad ? pad_channels(x) : dense_in(x, fmt);
  Tensor dyc = dense_in(dy, fmt);
  Tensor dwb = pad ? padded_empty(dw) : out_buffer(dw, fmt);
  execute<BwdFilter>(x.dtype(), fmt, xc, dwb, dyc, p, accumulate, accumulate && zeroed);
  if (pad) dw.copy_(dwb.narrow(1, 0, dw.size(1))); else finish_out(dw, dwb);
}

ConvCacheStats conv_algo_cache_stats() {
  std::lock_guard<std::mutex> lock(plan_cache().mutex);
  size_t engines = 0;
  for (const auto& [key, plan] : plan_cache().plans) {
    std::lock_guard<std::mutex> plan_lock(plan->m);  // execute() may drop a failing engine
    engines += plan->engine != nullptr;
  }
  uint64_t taken = 0;
  {
    std::lock_guard<std::mutex> file_lock(plan_file().m);
    taken = plan_file().taken;
  }
  return {plan_cache().hits, plan_cache().misses, plan_cache().plans.size(), engines, taken};
}

void clear_conv_algo_cache() {
  std::lock_guard<std::mutex> lock(plan_cache().mutex);
  plan_cache().plans.clear();
  plan_cache().stats_plans.clear();
  plan_cache().hits = plan_cache().misses = 0;
  std::lock_guard<std::mutex> file_lock(plan_file().m);
  plan_file().taken = 0;
}

void set_conv_plan_file(const std::string& path) {
  PlanFile& f = plan_file();
  std::lock_guard<std::mutex> lock(f.m);
  f.path = path;
  f.path_read = true;
  f.loaded = false;
  f.records.clear();
}

std::string conv_plan_file() {
  PlanFile& f = plan_file();
  std::lock_guard<std::mutex> lock(f.m);
  return plan_file_path(f);
}

void set_conv_backend(ConvBackend mode) { plan_cache().backend.store(int(mode)); }
ConvBackend conv_backend() { return backend_mode(); }

void set_wgrad_accumulate(WgradAccumulate mode) {
  plan_cache().wgrad_accumulate.store(int(mode));
}

void set_conv_deterministic(bool on) { plan_cache().deterministic.store(on); }
bool conv_deterministic() { return plan_cache().deterministic.load(); }

}  // namespace kiln::cuda
