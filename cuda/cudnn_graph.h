#pragma once
// A thin RAII layer over cuDNN's backend graph API (cudnn_graph.h): descriptors, engine
// heuristics, execution plans, and timed selection among them. Internal to cuda/.
//
// The backend API describes work as an operation graph of tensors (named by unique ids) and
// operations; cuDNN's heuristics rank engine configurations for it; each configuration that
// finalises becomes an execution plan with a workspace size; a plan runs on a variant pack that
// binds the ids to device pointers. kiln builds one operation graph per problem, times the
// top-ranked plans on the real operands once (outside graph capture), and caches the fastest.
//
//   be::Desc x = be::tensor(kX, CUDNN_DATA_HALF, dims, strides, 16);
//   ... be::Desc op(CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR); op.set(...) ...
//   be::Desc graph = be::operation_graph(handle, {&op});
//   std::vector<be::Candidate> c = be::candidates(handle, graph, 8, !deterministic);
//   be::run(handle, c[0], {kX, kW, kY}, {x_ptr, w_ptr, y_ptr}, workspace);
#include <cudnn.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kiln::cuda::be {

// Owns one cudnnBackendDescriptor_t. Setters throw kiln::Error naming the attribute.
class Desc {
 public:
  Desc() = default;
  explicit Desc(cudnnBackendDescriptorType_t type);
  ~Desc();
  Desc(Desc&& o) noexcept : d_(o.d_) { o.d_ = nullptr; }
  Desc& operator=(Desc&& o) noexcept;
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;

  cudnnBackendDescriptor_t get() const { return d_; }

  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
            const void* values);
  Desc& set_i64(cudnnBackendAttributeName_t name, int64_t v);
  Desc& set_i64s(cudnnBackendAttributeName_t name, const std::vector<int64_t>& v);
  Desc& set_desc(cudnnBackendAttributeName_t name, const Desc& v);
  // Throws on failure; try_finalize returns the status instead (plans that do not support the
  // problem fail here, which is normal).
  Desc& finalize(const char* what);
  cudnnStatus_t try_finalize();

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

// A finalised tensor descriptor: dims and strides in elements, in NCHW order for 4-D tensors
// whatever the memory layout; `alignment` in bytes (the smallest of the pointers it will see).
// A virtual tensor lives only inside a fused kernel (no pointer in the variant pack).
Desc tensor(int64_t uid, cudnnDataType_t dtype, const std::vector<int64_t>& dims,
            const std::vector<int64_t>& strides, int64_t alignment, bool is_virtual = false);

// A finalised 2-D cross-correlation descriptor with f32 compute; each argument is {h, w}.
Desc convolution_2d(const std::vector<int64_t>& stride, const std::vector<int64_t>& pad,
                    const std::vector<int64_t>& dilation);

// A finalised GenStats operation: per-channel Σx and Σx² of x, in f32, into sum and sqsum
// ([1, C, 1, 1] f32 tensors).
Desc genstats(const Desc& x, const Desc& sum, const Desc& sqsum);

// A finalised operation graph of `ops` (each finalised) on `handle`.
Desc operation_graph(cudnnHandle_t handle, const std::vector<const Desc*>& ops);

// One runnable execution plan.
struct Candidate {
  Desc config;            // the engine configuration the plan was made from
  Desc plan;
  int64_t workspace = 0;  // bytes
  int64_t engine = -1;    // cuDNN's global engine index
  bool deterministic = true;
  std::string name;       // "engine 12" plus knob choices, for logs
  float ms = -1;          // measured time, when timed
  float cold_ms = -1;     // the same with L2 overwritten before each run, when timed so
};

// What cuDNN says of one engine configuration.
struct ConfigInfo {
  int64_t engine = -1;
  bool deterministic = true;
  bool reduced_precision = false;
  bool runtime_compiled = false;
  std::string name;
};
ConfigInfo describe_config(const Desc& cfg);

// The knob choices of a finalised engine configuration, as (knob type, value) pairs.
std::vector<std::pair<int, int64_t>> knob_choices(const Desc& cfg);

// The configuration of engine `engine` (cuDNN's global index) for `graph` with `knobs` chosen,
// finalised, as a runnable plan under the filters of candidates() (its `ms` unset); false when
// cuDNN does not take it (another cuDNN or GPU than the one it was chosen on).
bool plan_from_knobs(cudnnHandle_t handle, const Desc& graph, int64_t engine,
                     const std::vector<std::pair<int, int64_t>>& knobs,
                     bool allow_nondeterministic, Candidate& out);

// Engine configurations that heuristics `mode` ranks for `graph` (empty when it has none).
std::vector<Desc> heuristic_configs(const Desc& graph, cudnnBackendHeurMode_t mode);

// Up to `max` execution plans for `graph`, in the order of heuristics mode A (then the fallback
// list, without repeats), skipping configurations that do not finalise, that reduce in reduced
// precision or down-convert inputs, that compile at runtime (NVRTC, seconds per plan), and —
// unless `allow_nondeterministic` — nondeterministic ones.
std::vector<Candidate> candidates(cudnnHandle_t handle, const Desc& graph, size_t max,
                                  bool allow_nondeterministic);

// Runs `c` on the handle's stream; `uids` and `ptrs` pair up. Returns cuDNN's status.
cudnnStatus_t run(cudnnHandle_t handle, const Candidate& c, const std::vector<int64_t>& uids,
                  const std::vector<void*>& ptrs, void* workspace);

}  // namespace kiln::cuda::be
