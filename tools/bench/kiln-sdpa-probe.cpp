// kiln-sdpa-probe: can kiln run cuDNN's fused flash attention (SDPA), forward and backward,
// through the backend graph API alone (cuda/cudnn_graph.h; no cudnn-frontend), at ViT-B/16's
// attention shape, and how fast is it against kiln's own fused attention kernels?
//
//   kiln-sdpa-probe [--batch N] [--seq L] [--embed E] [--head-dims 64,128] [--dtype f16|bf16|both]
//                   [--layout packed|bhsd] [--configs N] [--plans K] [--reps R] [--no-f32-ref]
//                   [--print-graphs]
//
// For each dtype and head dim D (heads = E / D: ViT-B/16's 12 × 64, or 6 × 128 at the same
// width), no mask, no dropout, scale 1/sqrt(D):
//  1. the forward graph: S = Q·Kᵀ, S·scale, the softmax as reduction max / sub / exp / reduction
//     sum / div with the row statistics (max + log Σ, f32 [B, H, L, 1]) as an output, O = P·V;
//  2. cuDNN's heuristics (modes A, B, fallback): for each engine configuration whether its plan
//     finalises, in how long, with which workspace; the first --plans that do are timed (CUDA
//     events, warm-up, --reps runs, median);
//  3. the backward graph (dQ, dK, dV from Q, K, V, O, dO and the statistics), in the two forms
//     cuDNN matches: dQ through an f32 accumulator (non-deterministic engines) and dQ written
//     directly (deterministic); O and the statistics it reads are kiln's, so its gradients and
//     kiln's answer the same question;
//  4. kiln's F::scaled_dot_product_attention on the same operands (its autograd gradients),
//     kiln's per-call times, and max |diff| / relative L2 between the two and against the f32
//     composition, as one table per case; one summary line at the end.
// The graphs are the composite pattern cuDNN's runtime-fusion SDPA engines match (the one
// cudnn-frontend lowers its sdpa nodes to for cuDNN before 9.21), built by kiln's own
// cuda/cudnn_attention.h, which kiln's attention path runs (the direct dQ form); --print-graphs
// lists every node and tensor (the first case always does).
// --layout packed (the default) is what kiln's ViT passes: q, k, v strided views of the
// in-projection's (B, L, 3, H, D) output, out and dout (B, L, H, D), the backward's dq, dk, dv
// written into one (B, L, 3, H, D) gradient; --layout bhsd makes every tensor contiguous
// (B, H, L, D).
//
// Every failure is printed with the node or step and cuDNN's status and message, and the probe
// goes on to the next stage. Why cuDNN rejects a graph: run with
// CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG=stderr (cuDNN reads them itself; 3 logs every call).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/version.h"
#include "tools/cli/cli.h"

namespace {

struct ProbeArgs {
  int64_t batch = 128;
  int64_t seq = 197;
  int64_t embed = 768;
  std::vector<int64_t> head_dims{64, 128};
  std::string dtype = "both";
  std::string layout = "packed";
  int configs = 8;
  int plans = 4;
  int reps = 50;
  bool no_f32_ref = false;
  bool print_graphs = false;
};

// False for --help or --version (printed). Throws cli::UsageError.
bool parse_probe_args(int argc, char** argv, ProbeArgs& a) {
  kiln::cli::Parser p("kiln-sdpa-probe",
                      "[--batch N] [--seq L] [--embed E] [--head-dims 64,128] "
                      "[--dtype f16|bf16|both] [--layout packed|bhsd] [--configs N] [--plans K] "
                      "[--reps R] [--no-f32-ref] [--print-graphs]",
                      "Whether cuDNN's fused flash attention runs forward and backward through "
                      "the backend graph API, and how fast against kiln's attention kernels. "
                      "CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG=stderr shows why cuDNN rejects a "
                      "graph.");
  p.version(kiln::version_line("kiln-sdpa-probe"));
  p.value("--batch", "N", &a.batch, "batch size", 1);
  p.value("--seq", "L", &a.seq, "sequence length (ViT-B/16: 196 patches + the class token)", 1);
  p.value("--embed", "E", &a.embed, "model width; heads = E / head_dim", 1);
  p.list("--head-dims", "D,...", &a.head_dims, "head dims to probe, each 64 or 128", 1);
  p.choice("--dtype", &a.dtype, {"f16", "bf16", "both"}, "input and output dtype");
  p.choice("--layout", &a.layout, {"packed", "bhsd"},
           "packed: q, k, v views of the ViT's (B, L, 3, H, D) projection; bhsd: contiguous");
  p.value("--configs", "N", &a.configs, "engine configurations whose plans are built per graph", 1);
  p.value("--plans", "K", &a.plans, "plans timed per graph (the first that finalise)", 1);
  p.value("--reps", "R", &a.reps, "timed calls per measurement (the median is reported)", 1);
  p.flag("--no-f32-ref", &a.no_f32_ref, "skip the f32 composition (the third reference)");
  p.flag("--print-graphs", &a.print_graphs, "list every case's graphs (default: the first's)");
  if (p.parse(argc, argv)) {
    for (int64_t d : a.head_dims) {
      if (d != 64 && d != 128)
        kiln::cli::usage_error("--head-dims: ", d, ": kiln's fused attention takes 64 or 128");
      if (a.embed % d != 0)
        kiln::cli::usage_error("--embed ", a.embed, " is not a multiple of head dim ", d);
    }
    return true;
  }
  std::fputs(p.info().c_str(), stdout);
  return false;
}

}  // namespace

#ifndef KILN_WITH_CUDA
int main(int argc, char** argv) {
  return kiln::cli::run_tool("kiln-sdpa-probe", [&] {
    ProbeArgs a;
    if (!parse_probe_args(argc, argv, a)) return 0;
    kiln::cli::usage_error("this build has no CUDA backend");
  });
}
#else
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <stdexcept>

#include "core/backend.h"
#include "core/error.h"
#include "core/generator.h"
#include "cuda/cudnn_attention.h"
#include "cuda/cudnn_graph.h"
#include "cuda/runtime.h"
#include "ops/ops.h"

namespace be = kiln::cuda::be;
namespace sdpa = kiln::cuda::sdpa;
namespace F = kiln::F;
using kiln::DType;
using kiln::Shape;
using kiln::Tensor;
using kiln::TensorOptions;

namespace {

const cudnnDataType_t kF32 = CUDNN_DATA_FLOAT;

// One step of a stage failed: the step, and cuDNN's or CUDA's words. The stage ends; the probe
// goes on.
class StageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A CUDA error after work ran on the device: the context may be unusable, so the probe stops.
class DeviceLost : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

std::string cudnn_words(cudnnStatus_t s) {
  char buf[1024] = {0};
  cudnnGetLastErrorString(buf, sizeof buf);
  std::string t = cudnnGetErrorString(s);
  if (buf[0]) t += std::string(": ") + buf;
  return t;
}

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw DeviceLost(std::string(what) + ": " + cudaGetErrorString(e));
}

// Runs fn. Returns "" or, when it failed (printed as "FAILED <what>: ..."), the failure; a CUDA
// error ends the probe (DeviceLost), anything else only this step.
std::string guarded(const char* what, const std::function<void()>& fn) {
  try {
    fn();
    return "";
  } catch (const DeviceLost&) {
    throw;
  } catch (const kiln::CudaError& e) {
    throw DeviceLost(e.what());
  } catch (const std::exception& e) {
    std::printf("   FAILED %s: %s\n", what, e.what());
    return e.what();
  }
}

std::string bytes_str(int64_t b) {
  char buf[32];
  if (b >= (int64_t(1) << 20))
    std::snprintf(buf, sizeof buf, "%.1f MiB", double(b) / double(1 << 20));
  else
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(b));
  return buf;
}

// Sets one attribute; a failure names the node and the attribute.
void set_attr(be::Desc& d, const std::string& node, cudnnBackendAttributeName_t attr,
              const char* attr_name, cudnnBackendAttributeType_t type, int64_t count,
              const void* values) {
  const cudnnStatus_t s = cudnnBackendSetAttribute(d.get(), attr, type, count, values);
  if (s != CUDNN_STATUS_SUCCESS)
    throw StageError(node + ": setting " + attr_name + ": " + cudnn_words(s));
}
#define PROBE_SET(desc, node, attr, type, count, values) \
  set_attr(desc, node, attr, #attr, type, count, values)
#define PROBE_SET_DESC(desc, node, attr, value)                                 \
  do {                                                                          \
    cudnnBackendDescriptor_t raw_ = (value).get();                              \
    set_attr(desc, node, attr, #attr, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw_); \
  } while (0)

void finalize(be::Desc& d, const std::string& what) {
  const cudnnStatus_t s = cudnnBackendFinalize(d.get());
  if (s != CUDNN_STATUS_SUCCESS) throw StageError(what + ": finalize: " + cudnn_words(s));
}

// ---- the problem and its operands ----

struct Problem {
  DType dtype = DType::f16;
  cudnnDataType_t io = CUDNN_DATA_HALF;
  int64_t b = 0, h = 0, s = 0, d = 0;
  bool packed = true;

  float scale() const { return float(1.0 / std::sqrt(double(d))); }
  // Q·Kᵀ and P·V: 2 GEMMs of 2·s·s·d each per (batch, head); the backward 5 (S recomputed, dV,
  // dP, dK, dQ).
  double fwd_gflop() const { return 4.0 * double(b * h) * double(s * s) * double(d) / 1e9; }
  double bwd_gflop() const { return 2.5 * fwd_gflop(); }
  std::string label() const {
    return std::string(kiln::dtype_name(dtype)) + " d" + std::to_string(d);
  }
};

// All (B, H, L, D) tensors are views with the problem's layout; cuDNN's descriptors take their
// strides as they are.
struct Operands {
  Tensor qkv;       // packed: (B, L, 3, H, D); q, k, v view it
  Tensor q, k, v;   // (B, H, L, D)
  Tensor dout;      // (B, H, L, D): packed, a view of (B, L, H, D) memory
  Tensor out, lse;  // kiln's forward (backend entry): out viewing (B, L, H, D), lse (B, H, L)
  Tensor out_bwd;   // the O cuDNN's backward reads: kiln's out in the problem's layout
  Tensor c_out;     // cuDNN's forward: (B, H, L, D) in the problem's layout
  Tensor c_stats;   // (B, H, L) f32
  Tensor c_dq, c_dk, c_dv;  // cuDNN's gradients (views of one (B, L, 3, H, D) tensor if packed)
  Tensor softmax_sum;       // the backward's Σ dO·O per row, (B, H, L) f32
  Tensor dq_accum;          // the backward's f32 dQ accumulator, (B, H, L, D) contiguous
};

Operands make_operands(const Problem& p, kiln::Generator& gen) {
  const kiln::Device gpu = kiln::Device::cuda(0);
  const TensorOptions io = TensorOptions(p.dtype).with_device(gpu);
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(gpu);
  // Drawing 58 M normals on the host takes long: 8 batch items are drawn and repeated.
  const int64_t drawn = p.b % 8 == 0 ? 8 : p.b;
  auto draw = [&](const Shape& item) {
    Shape one{drawn}, rep{p.b / drawn, drawn}, full{p.b};
    for (int64_t n : item) {
      one.push_back(n);
      rep.push_back(n);
      full.push_back(n);
    }
    Tensor t = kiln::randn(one, DType::f32, &gen).to(p.dtype).to(gpu);
    return t.unsqueeze(0).expand(rep).contiguous().reshape(full);
  };
  auto part = [](const Tensor& t, int64_t i) { return t.select(2, i).transpose(1, 2); };
  Operands x;
  if (p.packed) {
    x.qkv = draw({p.s, 3, p.h, p.d});
    x.q = part(x.qkv, 0);
    x.k = part(x.qkv, 1);
    x.v = part(x.qkv, 2);
    x.dout = draw({p.s, p.h, p.d}).transpose(1, 2);
    x.c_out = kiln::empty({p.b, p.s, p.h, p.d}, io).transpose(1, 2);
    Tensor dqkv = kiln::empty({p.b, p.s, 3, p.h, p.d}, io);
    x.c_dq = part(dqkv, 0);
    x.c_dk = part(dqkv, 1);
    x.c_dv = part(dqkv, 2);
  } else {
    x.q = draw({p.h, p.s, p.d});
    x.k = draw({p.h, p.s, p.d});
    x.v = draw({p.h, p.s, p.d});
    x.dout = draw({p.h, p.s, p.d});
    x.c_out = kiln::empty({p.b, p.h, p.s, p.d}, io);
    x.c_dq = kiln::empty({p.b, p.h, p.s, p.d}, io);
    x.c_dk = kiln::empty({p.b, p.h, p.s, p.d}, io);
    x.c_dv = kiln::empty({p.b, p.h, p.s, p.d}, io);
  }
  x.c_stats = kiln::empty({p.b, p.h, p.s}, f32);
  x.softmax_sum = kiln::empty({p.b, p.h, p.s}, f32);
  x.dq_accum = kiln::zeros({p.b, p.h, p.s, p.d}, f32);
  // kiln's forward as F::scaled_dot_product_attention runs it: out (B, L, H, D) seen as
  // (B, H, L, D), and the rows' log-sum-exp (natural log), the backward's inputs.
  x.out = kiln::empty({p.b, p.s, p.h, p.d}, io).transpose(1, 2);
  x.lse = kiln::empty({p.b, p.h, p.s}, f32);
  kiln::backend(x.q).attention->forward(x.out, x.lse, x.q, x.k, x.v, double(p.scale()), false);
  x.out_bwd = p.packed ? x.out : x.out.contiguous();
  return x;
}

// ---- the graphs ----
// kiln's own (cuda/cudnn_attention.h, the graphs kiln's attention path runs); the probe binds
// its operands to them.

sdpa::Problem graph_problem(const Problem& p) {
  sdpa::Problem gp;
  gp.io = p.io;
  gp.b = p.b;
  gp.h = p.h;
  gp.s = p.s;
  gp.d = p.d;
  gp.scale = p.scale();
  return gp;
}

// The training forward: O = softmax(scale·Q·Kᵀ)·V and the rows' statistics max + log Σ exp.
void build_forward(sdpa::Graph& g, const Problem& p, const Operands& x) {
  sdpa::ForwardOperands io;
  io.q = sdpa::operand_of(x.q);
  io.k = sdpa::operand_of(x.k);
  io.v = sdpa::operand_of(x.v);
  io.o = sdpa::operand_of(x.c_out);
  io.stats = x.c_stats.raw_data();
  sdpa::build_forward(g, graph_problem(p), io);
}

struct BwdVariant {
  sdpa::DqForm dq;
  cudnnDataType_t k_dtype;  // the virtual K that dQ = dS·K reads (reshaped from Kᵀ)
  const char* tag;          // for the table
  const char* what;
};

// dQ, dK, dV from Q, K, V, O, dO and the forward's statistics (kiln's lse):
//   Σ = rowsum(dO ∘ O); P = exp(scale·Q·Kᵀ - stats); dV = Pᵀ·dO; dP = dO·Vᵀ;
//   dS = scale·P ∘ (dP - Σ); dK = dSᵀ·Q; dQ = dS·K.
void build_backward(sdpa::Graph& g, const Problem& p, const Operands& x, const BwdVariant& var) {
  sdpa::BackwardOperands io;
  io.q = sdpa::operand_of(x.q);
  io.k = sdpa::operand_of(x.k);
  io.v = sdpa::operand_of(x.v);
  io.o = sdpa::operand_of(x.out_bwd);
  io.dout = sdpa::operand_of(x.dout);
  io.dq = sdpa::operand_of(x.c_dq);
  io.dk = sdpa::operand_of(x.c_dk);
  io.dv = sdpa::operand_of(x.c_dv);
  io.stats = x.lse.raw_data();
  io.softmax_sum = x.softmax_sum.raw_data();
  io.dq_accum = x.dq_accum.raw_data();
  sdpa::build_backward(g, graph_problem(p), io, var.dq, var.k_dtype);
}

// ---- running a graph ----

// Median milliseconds per call of `fn` on kiln's stream: 3 warm-up calls, then `reps` calls
// each between two events, queued back to back (the host's launch time hides behind the
// device's work) and read after one synchronisation.
float median_ms(int reps, const std::function<void()>& fn) {
  cudaStream_t s = kiln::cuda::current_stream();
  for (int i = 0; i < 3; ++i) fn();
  std::vector<cudaEvent_t> ev(size_t(2 * reps), nullptr);
  for (cudaEvent_t& e : ev) cuda_ok(cudaEventCreate(&e), "cudaEventCreate");
  for (int i = 0; i < reps; ++i) {
    cuda_ok(cudaEventRecord(ev[size_t(2 * i)], s), "cudaEventRecord");
    fn();
    cuda_ok(cudaEventRecord(ev[size_t(2 * i + 1)], s), "cudaEventRecord");
  }
  cuda_ok(cudaEventSynchronize(ev.back()), "timed calls");
  std::vector<float> t(static_cast<size_t>(reps), 0.0f);
  for (int i = 0; i < reps; ++i)
    cuda_ok(cudaEventElapsedTime(&t[size_t(i)], ev[size_t(2 * i)], ev[size_t(2 * i + 1)]),
            "cudaEventElapsedTime");
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Diff {
  double max_abs = NAN, rel_l2 = NAN;
};

// One checked output of a stage: against kiln, against the f32 composition, and kiln's own
// distance from that composition.
struct CheckRow {
  std::string name;
  Diff vs_kiln, vs_ref, kiln_vs_ref;
  bool grad = false;
  bool compared = false;  // cuDNN's and kiln's both exist
};

struct StageResult {
  std::string title;
  bool ran = false;
  float ms = -1;
  std::string plan;
  std::string failure;  // why not, when !ran
  std::vector<CheckRow> checks;
};

struct Config {
  be::Desc cfg;
  be::ConfigInfo info;
};

// Heuristics modes A, B and fallback, each configuration once (by engine and knobs).
std::vector<Config> list_configs(const be::Desc& graph) {
  std::vector<Config> out;
  for (auto [mode, mname] : {std::pair{CUDNN_HEUR_MODE_A, "A"}, std::pair{CUDNN_HEUR_MODE_B, "B"},
                             std::pair{CUDNN_HEUR_MODE_FALLBACK, "fallback"}}) {
    be::Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    const std::string what = std::string("heuristics ") + mname;
    PROBE_SET_DESC(heur, what, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
    PROBE_SET(heur, what, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    cudnnStatus_t st = cudnnBackendFinalize(heur.get());
    if (st != CUDNN_STATUS_SUCCESS) {
      std::printf("   heuristics %s: does not finalise: %s\n", mname, cudnn_words(st).c_str());
      continue;
    }
    int64_t n = 0;
    st = cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, nullptr);
    if (st != CUDNN_STATUS_SUCCESS || n <= 0) {
      std::printf("   heuristics %s: no configurations%s\n", mname,
                  st != CUDNN_STATUS_SUCCESS ? (": " + cudnn_words(st)).c_str() : "");
      continue;
    }
    std::vector<be::Desc> cfgs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < n; ++i) {
      cfgs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
      raw.push_back(cfgs.back().get());
    }
    int64_t got = 0;
    st = cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &got, raw.data());
    if (st != CUDNN_STATUS_SUCCESS) {
      std::printf("   heuristics %s: reading %lld results: %s\n", mname, static_cast<long long>(n),
                  cudnn_words(st).c_str());
      continue;
    }
    cfgs.resize(size_t(std::clamp<int64_t>(got, 0, n)));
    std::printf("   heuristics %s: %zu configurations:", mname, cfgs.size());
    for (be::Desc& c : cfgs) {
      be::ConfigInfo info = be::describe_config(c);
      std::printf(" [%s%s%s%s]", info.name.c_str(), info.runtime_compiled ? " rtc" : "",
                  info.deterministic ? "" : " nondet", info.reduced_precision ? " reduced" : "");
      const bool seen = std::any_of(out.begin(), out.end(),
                                    [&](const Config& o) { return o.info.name == info.name; });
      if (!seen) out.push_back({std::move(c), std::move(info)});
    }
    std::printf("\n");
  }
  return out;
}

// The variant pack binding g's tensors and `workspace`.
be::Desc variant_pack(const sdpa::Graph& g, void* workspace, const std::string& what) {
  be::Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  std::vector<void*> ptrs = g.ptrs();
  PROBE_SET(pack, what, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
            int64_t(ptrs.size()), ptrs.data());
  PROBE_SET(pack, what, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
            int64_t(g.uids().size()), g.uids().data());
  PROBE_SET(pack, what, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  finalize(pack, what);
  return pack;
}

// Builds the graph, asks the heuristics, builds up to --configs plans, times up to --plans of
// them, and leaves the fastest one's outputs in the operands (`before_final` runs just before
// that last call: zeroing an accumulator).
StageResult run_stage(cudnnHandle_t h, const std::string& title, bool print_graph,
                      const ProbeArgs& a, double gflop,
                      const std::function<void(sdpa::Graph&)>& build,
                      const std::function<void()>& before_final) {
  StageResult res;
  res.title = title;
  std::printf("\n== %s\n", title.c_str());
  sdpa::Graph g;
  be::Desc graph;
  try {
    build(g);
    if (print_graph) std::fputs(g.listing().c_str(), stdout);
    graph = g.finalize(h);
  } catch (const kiln::CudnnError& e) {
    if (print_graph) std::fputs(g.listing().c_str(), stdout);
    const std::string why = kiln::strip_location(e.what());
    res.failure = "graph: " + why;
    std::printf("   FAILED building the graph: %s\n", why.c_str());
    return res;
  }
  int64_t engines = 0, n = 0;
  if (cudnnBackendGetAttribute(graph.get(), CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT,
                               CUDNN_TYPE_INT64, 1, &n, &engines) == CUDNN_STATUS_SUCCESS)
    std::printf("   graph of %zu operations finalises; cuDNN's global engine count: %lld\n",
                g.op_count(), static_cast<long long>(engines));
  std::vector<Config> cfgs = list_configs(graph);
  if (cfgs.empty()) {
    res.failure = "no engine configuration for the graph";
    std::printf("   FAILED: no engine configuration (CUDNN_LOGLEVEL_DBG=2 says why)\n");
    return res;
  }
  struct Plan {
    std::string name;
    be::Desc plan;
    int64_t workspace = 0;
    float ms = -1;
  };
  std::vector<Plan> plans;
  std::string last_failure;
  for (size_t i = 0; i < cfgs.size() && i < size_t(a.configs); ++i) {
    Plan p;
    p.name = cfgs[i].info.name + (cfgs[i].info.deterministic ? "" : " nondet");
    p.plan = be::Desc(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      PROBE_SET(p.plan, p.name, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
      PROBE_SET_DESC(p.plan, p.name, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfgs[i].cfg);
      finalize(p.plan, p.name + ": plan");
    } catch (const StageError& e) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      last_failure = e.what();
      std::printf("   %s (after %.2f s)\n", e.what(), s);
      continue;
    }
    const double build_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    int64_t cnt = 0;
    cudnnBackendGetAttribute(p.plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                             CUDNN_TYPE_INT64, 1, &cnt, &p.workspace);
    std::printf("   %s: plan finalises in %.2f s, workspace %s\n", p.name.c_str(), build_s,
                bytes_str(p.workspace).c_str());
    plans.push_back(std::move(p));
  }
  if (plans.empty()) {
    res.failure = last_failure.empty() ? "no plan finalises" : last_failure;
    std::printf("   FAILED: no plan finalises\n");
    return res;
  }
  const TensorOptions bytes = TensorOptions(DType::u8).with_device(kiln::Device::cuda(0));
  auto workspace = [&](const Plan& p) {
    return p.workspace > 0 ? kiln::empty({p.workspace}, bytes) : Tensor();
  };
  size_t best = SIZE_MAX;
  for (size_t i = 0; i < plans.size() && i < size_t(a.plans); ++i) {
    Plan& p = plans[i];
    try {
      const Tensor ws = workspace(p);
      const be::Desc pack =
          variant_pack(g, ws.defined() ? ws.raw_data() : nullptr, p.name + ": variant pack");
      auto execute = [&] {
        const cudnnStatus_t st = cudnnBackendExecute(h, p.plan.get(), pack.get());
        if (st != CUDNN_STATUS_SUCCESS) throw StageError(p.name + ": execute: " + cudnn_words(st));
      };
      execute();
      cuda_ok(cudaStreamSynchronize(kiln::cuda::current_stream()), "the first run");
      p.ms = median_ms(a.reps, execute);
    } catch (const StageError& e) {
      cuda_ok(cudaStreamSynchronize(kiln::cuda::current_stream()), "after a failed run");
      last_failure = e.what();
      std::printf("   %s\n", e.what());
      continue;
    }
    std::printf("   %s: %.4f ms/call (median of %d), %.0f TFLOP/s\n", p.name.c_str(), double(p.ms),
                a.reps, gflop / double(p.ms));
    if (best == SIZE_MAX || p.ms < plans[best].ms) best = i;
  }
  if (best == SIZE_MAX) {
    res.failure = last_failure;
    std::printf("   FAILED: no plan runs\n");
    return res;
  }
  // The fastest plan's outputs are the ones checked.
  const Plan& p = plans[best];
  try {
    const Tensor ws = workspace(p);
    const be::Desc pack = variant_pack(g, ws.defined() ? ws.raw_data() : nullptr, p.name);
    before_final();
    const cudnnStatus_t st = cudnnBackendExecute(h, p.plan.get(), pack.get());
    cuda_ok(cudaStreamSynchronize(kiln::cuda::current_stream()), "the checked run");
    if (st != CUDNN_STATUS_SUCCESS) throw StageError("the checked run: " + cudnn_words(st));
  } catch (const StageError& e) {
    res.failure = e.what();
    std::printf("   FAILED: %s\n", e.what());
    return res;
  }
  res.ran = true;
  res.ms = p.ms;
  res.plan = p.name;
  std::printf("   fastest: %s, %.4f ms/call\n", p.name.c_str(), double(p.ms));
  return res;
}

// ---- checks ----

// max |got - want| and ||got - want|| / ||want||, in f32 on the GPU; NaN when either is missing.
Diff compare(const Tensor& got, const Tensor& want) {
  Diff r;
  if (!got.defined() || !want.defined()) return r;
  kiln::NoGradGuard ng;
  const Tensor g = got.to(DType::f32), w = want.to(DType::f32);
  const Tensor d = F::sub(g, w);
  const Tensor d2 = F::mul(d, d);
  r.max_abs = std::sqrt(F::max(d2).item());
  r.rel_l2 = std::sqrt(F::sum(d2).item() / std::max(F::sum(F::mul(w, w)).item(), 1e-30));
  return r;
}

std::string diff_str(const Diff& d) {
  if (std::isnan(d.max_abs) && std::isnan(d.rel_l2)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2e / %.2e", d.max_abs, d.rel_l2);
  return buf;
}

std::string ms_str(float v) {
  if (v < 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4f", double(v));
  return buf;
}

struct CaseResult {
  std::string label;
  StageResult fwd;
  std::vector<StageResult> bwd;  // one per backward form tried
  float kiln_fwd = -1, kiln_bwd = -1;
  bool checked = false, agree = true;

  const StageResult* best_bwd() const {
    const StageResult* b = nullptr;
    for (const StageResult& r : bwd)
      if (r.ran && (!b || r.ms < b->ms)) b = &r;
    return b;
  }
};

// kiln's side of a case: its times and its autograd gradients.
struct KilnSide {
  float fwd_ms = -1, bwd_ms = -1;
  Tensor dq, dk, dv;
};

KilnSide run_kiln(const Problem& p, const Operands& x, const ProbeArgs& a) {
  KilnSide k;
  const kiln::Backend& kb = kiln::backend(x.q);
  if (!kiln::supports(kb, kiln::FastPath::Attention, {&x.q, &x.k, &x.v}))
    std::printf("   note: kiln's fused attention does not take these operands (it composes)\n");
  k.fwd_ms = median_ms(a.reps, [&] {
    kiln::NoGradGuard ng;
    if (p.packed)
      (void)F::packed_attention(x.qkv);  // what the ViT calls
    else
      (void)F::scaled_dot_product_attention(x.q, x.k, x.v);
  });
  // The backward's kernels through the backend entry kiln's autograd node calls, writing (in
  // the packed layout) into one (B, L, 3, H, D) gradient as the ViT's node does.
  Tensor gq, gk, gv;
  if (p.packed) {
    const Tensor g = kiln::empty(x.qkv.shape(), TensorOptions(p.dtype).with_device(x.q.device()));
    gq = g.select(2, 0).transpose(1, 2);
    gk = g.select(2, 1).transpose(1, 2);
    gv = g.select(2, 2).transpose(1, 2);
  } else {
    gq = kiln::empty_like(x.q);
    gk = kiln::empty_like(x.k);
    gv = kiln::empty_like(x.v);
  }
  const double scale = double(p.scale());
  k.bwd_ms = median_ms(a.reps, [&] {
    kb.attention->backward(gq, gk, gv, x.dout, x.q, x.k, x.v, x.out, x.lse, scale, false);
  });
  std::printf(
      "\n== kiln: forward %.4f ms/call (%.0f TFLOP/s), backward %.4f ms/call "
      "(%.0f TFLOP/s)\n",
      double(k.fwd_ms), p.fwd_gflop() / double(k.fwd_ms), double(k.bwd_ms),
      p.bwd_gflop() / double(k.bwd_ms));
  // The gradients compared: F::scaled_dot_product_attention and autograd, the public API.
  Tensor ql = x.q.detach(), kl = x.k.detach(), vl = x.v.detach();
  ql.set_requires_grad(true);
  kl.set_requires_grad(true);
  vl.set_requires_grad(true);
  F::scaled_dot_product_attention(ql, kl, vl).backward(x.dout);
  k.dq = ql.grad();
  k.dk = kl.grad();
  k.dv = vl.grad();
  cuda_ok(cudaStreamSynchronize(kiln::cuda::current_stream()), "kiln's attention");
  return k;
}

// The f32 composition (F::scaled_dot_product_attention takes it for f32) from the same 16-bit
// values: out, the rows' log-sum-exp, dq, dk, dv.
struct Reference {
  Tensor out, lse, dq, dk, dv;
};

Reference run_reference(const Problem& p, const Operands& x) {
  Reference r;
  Tensor q32 = x.q.to(DType::f32), k32 = x.k.to(DType::f32), v32 = x.v.to(DType::f32);
  q32.set_requires_grad(true);
  k32.set_requires_grad(true);
  v32.set_requires_grad(true);
  const Tensor out = F::scaled_dot_product_attention(q32, k32, v32);
  out.backward(x.dout.to(DType::f32));
  r.out = out.detach();
  r.dq = q32.grad();
  r.dk = k32.grad();
  r.dv = v32.grad();
  kiln::NoGradGuard ng;
  const Tensor s =
      F::mul(F::matmul(q32.detach(), k32.detach().transpose(-2, -1)), double(p.scale()));
  const Tensor m = F::max(s, -1, true);
  r.lse = F::add(F::log(F::sum(F::exp(F::sub(s, m)), {-1}, true)), m).squeeze(-1);
  return r;
}

CheckRow check_row(const char* name, const Tensor& c, const Tensor& k, const Tensor& r, bool grad) {
  return {name, compare(c, k), compare(c, r), compare(k, r), grad, c.defined() && k.defined()};
}

// One dtype and head dim: operands, kiln, the f32 reference, the cuDNN stages, the table.
CaseResult probe_case(cudnnHandle_t h, const Problem& p, const ProbeArgs& a, bool print_graphs) {
  CaseResult cr;
  cr.label = p.label();
  std::printf("\n######## %s: batch %lld, heads %lld, seq %lld, head dim %lld, %s\n",
              kiln::dtype_name(p.dtype), static_cast<long long>(p.b), static_cast<long long>(p.h),
              static_cast<long long>(p.s), static_cast<long long>(p.d),
              p.packed ? "q, k, v views of (B, L, 3, H, D); out, dout (B, L, H, D)"
                       : "every tensor contiguous (B, H, L, D)");
  kiln::Generator gen(uint64_t(1000 * p.d + (p.dtype == DType::bf16 ? 1 : 0)));
  Operands x;
  const std::string no_operands = guarded("making the operands and kiln's forward", [&] {
    x = make_operands(p, gen);
    cuda_ok(cudaStreamSynchronize(kiln::cuda::current_stream()), "kiln's forward");
  });
  if (!no_operands.empty()) {
    cr.fwd.failure = "no operands: " + no_operands;
    return cr;
  }
  KilnSide k;
  guarded("running kiln's attention", [&] {
    k = run_kiln(p, x, a);
    cr.kiln_fwd = k.fwd_ms;
    cr.kiln_bwd = k.bwd_ms;
  });
  Reference ref;
  if (!a.no_f32_ref &&
      !guarded("computing the f32 composition", [&] { ref = run_reference(p, x); }).empty())
    ref = Reference{};

  const std::string fwd_failure = guarded("in the forward stage", [&] {
    cr.fwd = run_stage(
        h, "cuDNN SDPA forward (training: O and the softmax statistics)", print_graphs, a,
        p.fwd_gflop(), [&](sdpa::Graph& g) { build_forward(g, p, x); }, [] {});
    if (cr.fwd.ran)
      cr.fwd.checks = {check_row("out", x.c_out, x.out, ref.out, false),
                       check_row("lse (stats)", x.c_stats, x.lse, ref.lse, false)};
  });
  if (!fwd_failure.empty()) {
    cr.fwd.ran = false;
    cr.fwd.failure = fwd_failure;
  }

  const BwdVariant variants[] = {
      {sdpa::DqForm::Accumulator, kF32, "accum",
       "dQ through an f32 accumulator (non-deterministic)"},
      {sdpa::DqForm::Direct, kF32, "direct", "dQ written directly (deterministic)"},
      {sdpa::DqForm::Accumulator, p.io, "accum, K io",
       "fallback: dQ through the accumulator, K reshaped to the I/O dtype"}};
  for (const BwdVariant& v : variants) {
    if (v.k_dtype != kF32 && cr.best_bwd()) break;  // the fallback only when nothing ran
    StageResult r;
    const std::string failure = guarded("in the backward stage", [&] {
      r = run_stage(
          h, std::string("cuDNN SDPA backward: ") + v.what, print_graphs, a, p.bwd_gflop(),
          [&](sdpa::Graph& g) { build_backward(g, p, x, v); }, [&] { x.dq_accum.zero_(); });
      if (r.ran)
        r.checks = {check_row("dQ", x.c_dq, k.dq, ref.dq, true),
                    check_row("dK", x.c_dk, k.dk, ref.dk, true),
                    check_row("dV", x.c_dv, k.dv, ref.dv, true)};
    });
    if (!failure.empty()) {
      r.ran = false;
      r.failure = failure;
    }
    r.title = v.tag;
    cr.bwd.push_back(std::move(r));
  }

  // ---- the table ----
  auto ratio = [](float c, float kv) {
    if (c < 0 || kv < 0) return std::string("-");
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2fx", double(c / kv));
    return std::string(buf);
  };
  std::printf(
      "\n-- %s side by side (ms/call, median of %d; cuDNN's backward reads kiln's out and "
      "log-sum-exp)\n",
      cr.label.c_str(), a.reps);
  std::printf("   %-22s %-10s %-10s %-11s %s\n", "", "cuDNN", "kiln", "cuDNN/kiln", "cuDNN plan");
  auto time_row = [&](const std::string& name, const StageResult& r, float kv) {
    std::printf("   %-22s %-10s %-10s %-11s %s\n", name.c_str(), ms_str(r.ms).c_str(),
                ms_str(kv).c_str(), ratio(r.ms, kv).c_str(),
                r.ran ? r.plan.c_str() : ("FAILED: " + r.failure).c_str());
  };
  time_row("forward", cr.fwd, cr.kiln_fwd);
  for (const StageResult& r : cr.bwd) time_row("backward (" + r.title + ")", r, cr.kiln_bwd);
  std::printf("   %-22s %-22s %-22s %-22s\n", "max |diff| / rel L2", "cuDNN vs kiln",
              "cuDNN vs f32 ref", "kiln vs f32 ref");
  const double f = p.dtype == DType::bf16 ? 4.0 : 1.0;
  std::vector<const StageResult*> stages{&cr.fwd};
  for (const StageResult& r : cr.bwd) stages.push_back(&r);
  for (const StageResult* s : stages)
    for (const CheckRow& row : s->checks) {
      const std::string name = (s == &cr.fwd ? std::string("fwd") : s->title) + " " + row.name;
      std::printf("   %-22s %-22s %-22s %-22s", name.c_str(), diff_str(row.vs_kiln).c_str(),
                  diff_str(row.vs_ref).c_str(), diff_str(row.kiln_vs_ref).c_str());
      // Two 16-bit results differ by about their rounding; NaN fails the test too.
      const bool ok = row.vs_kiln.rel_l2 <= (row.grad ? 3e-2 : 5e-3) * f;
      if (row.compared) {
        cr.checked = true;
        cr.agree = cr.agree && ok;
      }
      std::printf("%s\n", row.compared && !ok ? "  MISMATCH" : "");
    }
  return cr;
}

// cudnnHandle_t owned, on kiln's stream.
struct Handle {
  cudnnHandle_t h = nullptr;
  Handle() {
    const cudnnStatus_t s = cudnnCreate(&h);
    if (s != CUDNN_STATUS_SUCCESS) throw StageError("cudnnCreate: " + cudnn_words(s));
    cudnnSetStream(h, kiln::cuda::current_stream());
  }
  ~Handle() {
    if (h) cudnnDestroy(h);
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
};

int probe(const ProbeArgs& a) {
  if (kiln::cuda::device_count() == 0) {
    std::fprintf(stderr, "kiln-sdpa-probe: no CUDA device\n");
    return 2;
  }
  // The "kiln" side is kiln's own kernels: the attention table's entries would otherwise run
  // cuDNN's plans themselves.
  kiln::cuda::set_cudnn_attention_enabled(false);
  const cudaDeviceProp& prop = kiln::cuda::context().props;
  std::printf("kiln-sdpa-probe: %s (sm_%d%d, %d SMs), cuDNN %zu (built against %d)\n", prop.name,
              prop.major, prop.minor, prop.multiProcessorCount, cudnnGetVersion(), CUDNN_VERSION);
  const char* log = std::getenv("CUDNN_LOGLEVEL_DBG");
  std::printf(
      "CUDNN_LOGLEVEL_DBG=%s (2 with CUDNN_LOGDEST_DBG=stderr says why a graph is "
      "rejected)\n",
      log ? log : "unset");
  Handle handle;
  std::vector<DType> dtypes;
  if (a.dtype != "bf16") dtypes.push_back(DType::f16);
  if (a.dtype != "f16") dtypes.push_back(DType::bf16);
  std::vector<CaseResult> results;
  std::string stopped;
  bool first = true;
  try {
    for (int64_t d : a.head_dims)
      for (DType dt : dtypes) {
        Problem p;
        p.dtype = dt;
        p.io = dt == DType::bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
        p.b = a.batch;
        p.h = a.embed / d;
        p.s = a.seq;
        p.d = d;
        p.packed = a.layout == "packed";
        results.push_back(probe_case(handle.h, p, a, first || a.print_graphs));
        first = false;
      }
  } catch (const DeviceLost& e) {
    stopped = e.what();
    std::printf("\nSTOPPED: the device reported an error (%s); no further GPU work is safe\n",
                e.what());
  }
  // One line: what ran and how it compares.
  int fwd_ok = 0, bwd_ok = 0;
  std::string parts;
  auto pair = [](float c, float k) {
    char buf[96];
    if (c < 0)
      std::snprintf(buf, sizeof buf, "failed (kiln %.3f ms)", double(k));
    else
      std::snprintf(buf, sizeof buf, "%.3f vs kiln %.3f ms (%.2fx)", double(c), double(k),
                    k > 0 ? double(c / k) : 0.0);
    return std::string(buf);
  };
  for (const CaseResult& r : results) {
    const StageResult* b = r.best_bwd();
    fwd_ok += r.fwd.ran;
    bwd_ok += b != nullptr;
    parts += "; " + r.label + " fwd " + pair(r.fwd.ms, r.kiln_fwd) + ", bwd " +
             pair(b ? b->ms : -1, r.kiln_bwd) + (b ? " [" + b->title + "]" : "") +
             (!r.checked ? ""
              : r.agree  ? ", numbers agree"
                         : ", numbers DISAGREE");
  }
  std::printf(
      "\nsummary: cuDNN SDPA through the backend API (%s layout): forward ran %d/%zu, "
      "backward %d/%zu%s%s%s\n",
      a.layout.c_str(), fwd_ok, results.size(), bwd_ok, results.size(), parts.c_str(),
      stopped.empty() ? "" : "; STOPPED: ", stopped.c_str());
  return stopped.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return kiln::cli::run_tool("kiln-sdpa-probe", [&] {
    ProbeArgs a;
    if (!parse_probe_args(argc, argv, a)) return 0;
    return probe(a);
  });
}
#endif
