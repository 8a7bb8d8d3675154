// cuDNN backend graph API wrapper (contract in cuda/cudnn_graph.h).
#include "cuda/cudnn_graph.h"

#include <algorithm>
#include <set>
#include <utility>

#include "cuda/check.h"

namespace kiln::cuda::be {
namespace {

std::string last_error() {
  char buf[512] = {0};
  cudnnGetLastErrorString(buf, sizeof(buf));
  return buf;
}

[[noreturn]] void fail(cudnnStatus_t s, const char* what, int64_t attr) {
  const std::string detail = last_error();
  ::kiln::detail::fail(ErrorKind::Cudnn, __FILE__, __LINE__, nullptr,
                       ::kiln::detail::str_cat("cuDNN backend: ", what,
                                               attr >= 0 ? " (attribute " : "",
                                               attr >= 0 ? std::to_string(attr) : "",
                                               attr >= 0 ? ")" : "", ": ", cudnnGetErrorString(s),
                                               detail.empty() ? "" : ": ", detail));
}

}  // namespace

std::vector<std::pair<int, int64_t>> knob_choices(const Desc& cfg) {
  std::vector<std::pair<int, int64_t>> out;
  std::vector<Desc> knobs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int i = 0; i < CUDNN_KNOB_TYPE_COUNTS; ++i) {
    knobs.emplace_back(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR);
    raw.push_back(knobs.back().get());
  }
  int64_t nk = 0;
  if (cudnnBackendGetAttribute(cfg.get(), CUDNN_ATTR_ENGINECFG_KNOB_CHOICES,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(raw.size()), &nk,
                               raw.data()) != CUDNN_STATUS_SUCCESS)
    return out;
  for (int64_t i = 0; i < std::min<int64_t>(nk, int64_t(raw.size())); ++i) {
    cudnnBackendKnobType_t type{};
    int64_t value = 0, c = 0;
    if (cudnnBackendGetAttribute(raw[size_t(i)], CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE,
                                 CUDNN_TYPE_KNOB_TYPE, 1, &c, &type) != CUDNN_STATUS_SUCCESS ||
        cudnnBackendGetAttribute(raw[size_t(i)], CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE,
                                 CUDNN_TYPE_INT64, 1, &c, &value) != CUDNN_STATUS_SUCCESS)
      continue;
    out.emplace_back(int(type), value);
  }
  return out;
}

std::vector<Desc> heuristic_configs(const Desc& graph, cudnnBackendHeurMode_t mode) {
  Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
  heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
  if (heur.try_finalize() != CUDNN_STATUS_SUCCESS) return {};
  int64_t n = 0;
  if (cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, nullptr) != CUDNN_STATUS_SUCCESS ||
      n <= 0)
    return {};
  std::vector<Desc> cfgs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < n; ++i) {
    cfgs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    raw.push_back(cfgs.back().get());
  }
  int64_t got = 0;
  if (cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &got, raw.data()) !=
      CUDNN_STATUS_SUCCESS)
    return {};
  cfgs.resize(size_t(std::clamp<int64_t>(got, 0, n)));
  return cfgs;
}

ConfigInfo describe_config(const Desc& cfg) {
  ConfigInfo info;
  Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  cudnnBackendDescriptor_t e = engine.get();
  int64_t n = 0;
  if (cudnnBackendGetAttribute(cfg.get(), CUDNN_ATTR_ENGINECFG_ENGINE,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &e) != CUDNN_STATUS_SUCCESS)
    return info;
  cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n,
                           &info.engine);
  cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
  int64_t nn = 0;
  if (cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                               CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &nn, notes) == CUDNN_STATUS_SUCCESS) {
    for (int64_t i = 0; i < nn; ++i) {
      if (notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) info.deterministic = false;
      if (notes[i] == CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION ||
          notes[i] == CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS)
        info.reduced_precision = true;
    }
  }
  cudnnBackendBehaviorNote_t behavior[CUDNN_BEHAVIOR_NOTE_TYPE_COUNT];
  int64_t nb = 0;
  if (cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, CUDNN_TYPE_BEHAVIOR_NOTE,
                               CUDNN_BEHAVIOR_NOTE_TYPE_COUNT, &nb, behavior) == CUDNN_STATUS_SUCCESS) {
    for (int64_t i = 0; i < nb; ++i)
      if (behavior[i] == CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION) info.runtime_compiled = true;
  }
  info.name = "engine " + std::to_string(info.engine);
  // Knob choices tell apart configurations of one engine.
  for (const auto& [type, value] : knob_choices(cfg))
    info.name += " k" + std::to_string(type) + "=" + std::to_string(value);
  return info;
}

Desc::Desc(cudnnBackendDescriptorType_t type) {
  cudnnStatus_t s = cudnnBackendCreateDescriptor(type, &d_);
  if (s != CUDNN_STATUS_SUCCESS) fail(s, "creating a descriptor", -1);
}

Desc::~Desc() {
  if (d_) cudnnBackendDestroyDescriptor(d_);
}

Desc& Desc::operator=(Desc&& o) noexcept {
  if (this != &o) {
    if (d_) cudnnBackendDestroyDescriptor(d_);
    d_ = std::exchange(o.d_, nullptr);
  }
  return *this;
}

Desc& Desc::set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
                const void* values) {
  cudnnStatus_t s = cudnnBackendSetAttribute(d_, name, type, count, values);
  if (s != CUDNN_STATUS_SUCCESS) fail(s, "setting an attribute", int64_t(name));
  return *this;
}

Desc& Desc::set_i64(cudnnBackendAttributeName_t name, int64_t v) {
  return set(name, CUDNN_TYPE_INT64, 1, &v);
}

Desc& Desc::set_i64s(cudnnBackendAttributeName_t name, const std::vector<int64_t>& v) {
  return set(name, CUDNN_TYPE_INT64, int64_t(v.size()), v.data());
}

Desc& Desc::set_desc(cudnnBackendAttributeName_t name, const Desc& v) {
  cudnnBackendDescriptor_t raw = v.get();
  return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw);
}

Desc& Desc::finalize(const char* what) {
  cudnnStatus_t s = cudnnBackendFinalize(d_);
  if (s != CUDNN_STATUS_SUCCESS) fail(s, what, -1);
  return *this;
}

cudnnStatus_t Desc::try_finalize() { return cudnnBackendFinalize(d_); }

Desc tensor(int64_t uid, cudnnDataType_t dtype, const std::vector<int64_t>& dims,
            const std::vector<int64_t>& strides, int64_t alignment, bool is_virtual) {
  Desc t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dtype);
  t.set_i64s(CUDNN_ATTR_TENSOR_DIMENSIONS, dims);
  t.set_i64s(CUDNN_ATTR_TENSOR_STRIDES, strides);
  t.set_i64(CUDNN_ATTR_TENSOR_UNIQUE_ID, uid);
  t.set_i64(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, alignment);
  if (is_virtual) {
    const bool v = true;
    t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &v);
  }
  t.finalize("tensor descriptor");
  return t;
}

Desc convolution_2d(const std::vector<int64_t>& stride, const std::vector<int64_t>& pad,
                    const std::vector<int64_t>& dilation) {
  Desc c(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
  const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  c.set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
  c.set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode);
  c.set_i64(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, 2);
  c.set_i64s(CUDNN_ATTR_CONVOLUTION_DILATIONS, dilation);
  c.set_i64s(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, stride);
  c.set_i64s(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, pad);
  c.set_i64s(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, pad);
  c.finalize("convolution descriptor");
  return c;
}

Desc genstats(const Desc& x, const Desc& sum, const Desc& sqsum) {
  Desc op(CUDNN_BACKEND_OPERATION_GEN_STATS_DESCRIPTOR);
  const cudnnGenStatsMode_t mode = CUDNN_GENSTATS_SUM_SQSUM;
  const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
  op.set(CUDNN_ATTR_OPERATION_GENSTATS_MODE, CUDNN_TYPE_GENSTATS_MODE, 1, &mode)
      .set(CUDNN_ATTR_OPERATION_GENSTATS_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &f32)
      .set_desc(CUDNN_ATTR_OPERATION_GENSTATS_XDESC, x)
      .set_desc(CUDNN_ATTR_OPERATION_GENSTATS_SUMDESC, sum)
      .set_desc(CUDNN_ATTR_OPERATION_GENSTATS_SQSUMDESC, sqsum);
  op.finalize("genstats operation");
  return op;
}

Desc operation_graph(cudnnHandle_t handle, const std::vector<const Desc*>& ops) {
  Desc g(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  std::vector<cudnnBackendDescriptor_t> raw;
  for (const Desc* op : ops) raw.push_back(op->get());
  g.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(raw.size()),
        raw.data());
  g.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  g.finalize("operation graph");
  return g;
}

namespace {

// `cfg` as a runnable plan appended to `out`, unless a filter of candidates() drops it, its name
// is in `seen` already, or it does not finalise.
void add_plan(cudnnHandle_t handle, Desc cfg, bool allow_nondeterministic,
              std::set<std::string>& seen, std::vector<Candidate>& out) {
  ConfigInfo info = describe_config(cfg);
  // Runtime-compiled engines take NVRTC seconds to finalise, per problem and process.
  if (info.reduced_precision || info.runtime_compiled ||
      (!allow_nondeterministic && !info.deterministic))
    return;
  if (!seen.insert(info.name).second) return;
  Desc plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
  plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  plan.set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfg);
  if (plan.try_finalize() != CUDNN_STATUS_SUCCESS) return;
  int64_t ws = 0, n = 0;
  if (cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                               CUDNN_TYPE_INT64, 1, &n, &ws) != CUDNN_STATUS_SUCCESS)
    return;
  Candidate c;
  c.config = std::move(cfg);
  c.plan = std::move(plan);
  c.workspace = ws;
  c.engine = info.engine;
  c.deterministic = info.deterministic;
  c.name = std::move(info.name);
  out.push_back(std::move(c));
}

}  // namespace

std::vector<Candidate> candidates(cudnnHandle_t handle, const Desc& graph, size_t max,
                                  bool allow_nondeterministic) {
  std::vector<Candidate> out;
  std::set<std::string> seen;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    for (Desc& cfg : heuristic_configs(graph, mode)) {
      if (out.size() >= max) return out;
      add_plan(handle, std::move(cfg), allow_nondeterministic, seen, out);
    }
  }
  return out;
}

bool plan_from_knobs(cudnnHandle_t handle, const Desc& graph, int64_t engine_index,
                     const std::vector<std::pair<int, int64_t>>& knobs,
                     bool allow_nondeterministic, Candidate& out) {
  Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  cudnnBackendDescriptor_t g = graph.get();
  if (cudnnBackendSetAttribute(engine.get(), CUDNN_ATTR_ENGINE_OPERATION_GRAPH,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &g) != CUDNN_STATUS_SUCCESS ||
      cudnnBackendSetAttribute(engine.get(), CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1,
                               &engine_index) != CUDNN_STATUS_SUCCESS ||
      engine.try_finalize() != CUDNN_STATUS_SUCCESS)
    return false;
  std::vector<Desc> choices;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (const auto& [type, value] : knobs) {
    choices.emplace_back(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR);
    const auto t = cudnnBackendKnobType_t(type);
    const int64_t v = value;
    if (cudnnBackendSetAttribute(choices.back().get(), CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE,
                                 CUDNN_TYPE_KNOB_TYPE, 1, &t) != CUDNN_STATUS_SUCCESS ||
        cudnnBackendSetAttribute(choices.back().get(), CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE,
                                 CUDNN_TYPE_INT64, 1, &v) != CUDNN_STATUS_SUCCESS ||
        choices.back().try_finalize() != CUDNN_STATUS_SUCCESS)
      return false;
    raw.push_back(choices.back().get());
  }
  Desc cfg(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
  cudnnBackendDescriptor_t e = engine.get();
  if (cudnnBackendSetAttribute(cfg.get(), CUDNN_ATTR_ENGINECFG_ENGINE,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &e) != CUDNN_STATUS_SUCCESS ||
      (!raw.empty() &&
       cudnnBackendSetAttribute(cfg.get(), CUDNN_ATTR_ENGINECFG_KNOB_CHOICES,
                                CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(raw.size()),
                                raw.data()) != CUDNN_STATUS_SUCCESS) ||
      cfg.try_finalize() != CUDNN_STATUS_SUCCESS)
    return false;
  std::set<std::string> seen;
  std::vector<Candidate> one;
  add_plan(handle, std::move(cfg), allow_nondeterministic, seen, one);
  if (one.empty()) return false;
  out = std::move(one.front());
  return true;
}

cudnnStatus_t run(cudnnHandle_t handle, const Candidate& c, const std::vector<int64_t>& uids,
                  const std::vector<void*>& ptrs, void* workspace) {
  KILN_CHECK(uids.size() == ptrs.size(), "cuDNN backend: ", uids.size(), " ids for ",
             ptrs.size(), " pointers");
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, int64_t(ptrs.size()),
           ptrs.data());
  pack.set_i64s(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, uids);
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  cudnnStatus_t s = pack.try_finalize();
  if (s != CUDNN_STATUS_SUCCESS) return s;
  return cudnnBackendExecute(handle, c.plan.get(), pack.get());
}

}  // namespace kiln::cuda::be
