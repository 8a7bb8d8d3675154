// kiln-fusion-probe: which fused convolution + batch-norm operation graphs the installed cuDNN
// can run on this GPU, how long their plans take to build, how fast the best one runs against
// the plain convolution, and whether its results match the unfused computation.
//
//   kiln-fusion-probe [--batch N] [--plans K] [--half-scale] [--tail-gemm] [--dual-tail] [--stem]
//                     [--conv1x1] [--wgrad1x1] [--conv3x3] [--dgrad3x3] [--shape K,C,HW]
//
// A developer's tool for deciding what cuda/ can fuse (docs/lab/batch-norm.md and
// docs/lab/tail-gemm.md record its output); it exercises ResNet-50 bottleneck shapes: conv +
// statistics epilogue, scale-bias-ReLU prologue + conv + statistics, the same prologue on the
// weight gradient, and the data gradient with the ReLU backward (mask recomputed from the saved
// pre-BN tensor) and per-channel reductions.
// --half-scale gives the prologue f16 scale and bias (and f16 intermediates), the form cuDNN's
// precompiled ConvBNfprop / ConvBNwgrad engines are documented for, instead of f32.
// --tail-gemm instead times kiln's own GEMM with the block tail's batch-norm backward in its
// epilogue (cuda::bn_nhwc_backward_dgrad) against what it replaces, on ResNet-50's four
// identity-block tails; --dual-tail the same for the four downsample-block tails, whose two
// batch norms' backward (cuda::bn_nhwc_dual_backward_dgrad) takes the next conv1's data gradient.
// --conv1x1 times kiln's 1x1 forward GEMM with the batch-norm statistics in its epilogue
// (cuda::conv1x1_forward_stats) against cuDNN's path (the GenStats plan the tuner keeps, else
// the plain convolution and kiln's statistics pass), on ResNet-50's stride-1 1x1 convolutions.
// --wgrad1x1 times kiln's 1x1 weight gradient (cuda::conv1x1_backward_weight) against cuDNN's
// tuned plan on the same shapes.
// --conv3x3 times kiln's 3x3 implicit GEMM with the statistics in its epilogue
// (cuda::conv3x3_forward_stats, TMA im2col loads) against cuDNN's path (as --conv1x1), on
// ResNet-50's stride-1 3x3 convolutions.
// --dgrad3x3 times a bottleneck's conv2 data gradient with bn1's ReLU backward (mask from x):
// kiln's 3x3 implicit GEMM with the sums in its epilogue (cuda::bn_nhwc_backward_dgrad with a
// 3x3 w) against cuDNN's data gradient then kiln's two batch-norm passes, on the same shapes.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/version.h"
#include "tools/cli/cli.h"

namespace {

struct ProbeArgs {
  int64_t batch = 256;
  int plans = 4;
  bool tail_gemm = false;
  bool dual_tail = false;
  bool half_scale = false;
  bool stem = false;
  bool conv1x1 = false;
  bool wgrad1x1 = false;
  bool conv3x3 = false;
  bool dgrad3x3 = false;
  // --shape K,C,HW: --conv1x1, --wgrad1x1, --conv3x3 or --dgrad3x3 on this one shape only (the
  // text, then its three numbers).
  std::string shape;
  long long shape_k = 0, shape_c = 0, shape_hw = 0;
};

// False for --help (printed). Throws cli::UsageError.
bool parse_probe_args(int argc, char** argv, ProbeArgs& a) {
  kiln::cli::Parser p("kiln-fusion-probe",
                      "[--batch N] [--plans K] [--half-scale] [--tail-gemm] [--dual-tail] [--stem] "
                      "[--conv1x1] [--wgrad1x1] [--conv3x3] [--dgrad3x3] [--shape K,C,HW]",
                      "Which fused convolution + batch-norm graphs cuDNN runs on this GPU, and "
                      "how fast.");
  p.version(kiln::version_line("kiln-fusion-probe"));
  p.value("--batch", "N", &a.batch, "batch size of the probed problems", 1);
  p.value("--plans", "K", &a.plans, "engine plans built and timed per graph", 1);
  p.flag("--half-scale", &a.half_scale,
         "the scale-bias-ReLU prologue with f16 scale, bias and intermediates (default f32)");
  p.flag("--tail-gemm", &a.tail_gemm,
         "time kiln's dgrad GEMM with the block tail's BN backward against cuDNN + kiln's BN");
  p.flag("--dual-tail", &a.dual_tail,
         "time the downsample tails' dual BN backward with the next conv1's data gradient in "
         "kiln's GEMM against cuDNN's dgrad + kiln's dual BN backward");
  p.flag("--stem", &a.stem,
         "time kiln's ResNet stem convolution (forward with BN statistics, weight gradient; "
         "then the batch norm + ReLU + max pool forward, both kernels) "
         "against cuDNN's");
  p.flag("--conv1x1", &a.conv1x1,
         "time kiln's 1x1 forward GEMM with BN statistics against cuDNN's path");
  p.flag("--wgrad1x1", &a.wgrad1x1,
         "time kiln's 1x1 weight-gradient kernel against cuDNN's tuned plan");
  p.flag("--conv3x3", &a.conv3x3,
         "time kiln's 3x3 implicit GEMM with BN statistics against cuDNN's path");
  p.flag("--dgrad3x3", &a.dgrad3x3,
         "time kiln's 3x3 data gradient with the BN ReLU backward's sums against cuDNN + kiln's "
         "BN");
  p.value("--shape", "K,C,HW", &a.shape,
          "with --conv1x1, --wgrad1x1, --conv3x3 or --dgrad3x3: this shape only (K input and C "
          "output channels at HW x HW), for "
          "example to profile one kernel under ncu");
  if (!p.parse(argc, argv)) {
    std::fputs(p.info().c_str(), stdout);
    return false;
  }
  if (!a.shape.empty()) {
    long long &k = a.shape_k, &c = a.shape_c, &hw = a.shape_hw;
    char end = 0;
    if (std::sscanf(a.shape.c_str(), "%lld,%lld,%lld%c", &k, &c, &hw, &end) != 3 || k < 1 ||
        c < 1 || hw < 1)
      kiln::cli::usage_error("--shape: expected K,C,HW (three positive integers), got '",
                             a.shape, "'");
  }
  return true;
}

}  // namespace

#ifndef KILN_WITH_CUDA
int main(int argc, char** argv) {
  return kiln::cli::run_tool("kiln-fusion-probe", [&] {
    ProbeArgs a;
    if (!parse_probe_args(argc, argv, a)) return 0;
    kiln::cli::usage_error("this build has no CUDA backend");
  });
}
#else
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "core/error.h"
#include "cuda/conv_engine.h"
#include "cuda/cudnn_graph.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"
#include "ops/ops.h"

namespace be = kiln::cuda::be;
using kiln::cuda::ConvOp;

namespace {

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

using Dims = std::vector<int64_t>;

// NHWC strides for NCHW-ordered dims.
Dims nhwc(const Dims& d) { return {d[1] * d[2] * d[3], 1, d[3] * d[1], d[1]}; }

// A device buffer per non-virtual tensor id.
struct Buf {
  cudnnDataType_t dt;
  Dims dims;
  size_t count = 0;
  void* dev = nullptr;
};

struct Graph {
  explicit Graph(cudnnHandle_t handle) : h(handle) {}
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  cudnnHandle_t h;
  std::vector<std::unique_ptr<be::Desc>> keep;
  std::vector<const be::Desc*> ops;
  std::map<int64_t, Buf> bufs;
  int64_t next_uid = 1;

  const be::Desc& hold(be::Desc d) {
    keep.push_back(std::make_unique<be::Desc>(std::move(d)));
    return *keep.back();
  }
  // Real tensor (allocated) or virtual; returns its uid via out.
  const be::Desc& tensor(int64_t& uid, cudnnDataType_t dt, const Dims& d, bool is_virtual) {
    uid = next_uid++;
    Dims st = nhwc(d);
    if (!is_virtual) {
      size_t n = size_t(d[0] * d[1] * d[2] * d[3]);
      Buf b{dt, d, n, nullptr};
      CK(cudaMalloc(&b.dev, n * (dt == CUDNN_DATA_HALF ? 2 : 4)));
      bufs[uid] = b;
    }
    return hold(be::tensor(uid, dt, d, st, 16, is_virtual));
  }
  const be::Desc& pointwise(cudnnPointwiseMode_t mode) {
    be::Desc p(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    const cudnnDataType_t f = CUDNN_DATA_FLOAT;
    p.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    p.set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &f);
    p.finalize("pointwise");
    return hold(std::move(p));
  }
  // y = mode(x [, b]).
  void pw(cudnnPointwiseMode_t mode, const be::Desc& x, const be::Desc* b, const be::Desc& y) {
    be::Desc op(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pointwise(mode));
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    op.finalize("pointwise op");
    ops.push_back(&hold(std::move(op)));
  }
  // dx = dy where x > 0, else 0.
  void relu_bwd(const be::Desc& dy, const be::Desc& x, const be::Desc& dx) {
    be::Desc op(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pointwise(CUDNN_POINTWISE_RELU_BWD));
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_DYDESC, dy);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_DXDESC, dx);
    op.finalize("relu bwd op");
    ops.push_back(&hold(std::move(op)));
  }
  // A k x k convolution (padding k/2) in direction `op`: x, w, y as cuDNN names them.
  void conv(ConvOp op, const be::Desc& x, const be::Desc& w, const be::Desc& y, int64_t k,
            int64_t stride) {
    const be::Desc& cd = hold(be::convolution_2d({stride, stride}, {k / 2, k / 2}, {1, 1}));
    ops.push_back(&hold(kiln::cuda::conv_operation(op, x, w, y, cd, 0.0f)));
  }
  // relu(x * scale + bias) with per-channel scale and bias of type `pt` (their uids out), `pt`
  // inside (pointwise math in f32 either way), an f16 virtual result.
  const be::Desc& scale_bias_relu(const be::Desc& x, const Dims& xd, int64_t& scale,
                                  int64_t& bias, cudnnDataType_t pt) {
    const Dims ci{1, xd[1], 1, 1};
    int64_t u1, u2, u3;
    const be::Desc& S = tensor(scale, pt, ci, false);
    const be::Desc& B = tensor(bias, pt, ci, false);
    const be::Desc& T1 = tensor(u1, pt, xd, true);
    const be::Desc& T2 = tensor(u2, pt, xd, true);
    const be::Desc& T3 = tensor(u3, CUDNN_DATA_HALF, xd, true);
    pw(CUDNN_POINTWISE_MUL, x, &S, T1);
    pw(CUDNN_POINTWISE_ADD, T1, &B, T2);
    pw(CUDNN_POINTWISE_RELU_FWD, T2, nullptr, T3);
    return T3;
  }
  void genstats(const be::Desc& x, const be::Desc& sum, const be::Desc& sq) {
    ops.push_back(&hold(be::genstats(x, sum, sq)));
  }
  void reduce(const be::Desc& x, const be::Desc& y) {
    be::Desc r(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    cudnnReduceTensorOp_t mode = CUDNN_REDUCE_TENSOR_ADD;
    cudnnDataType_t f = CUDNN_DATA_FLOAT;
    r.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    r.set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f);
    r.finalize("reduction desc");
    const be::Desc& rd = hold(std::move(r));
    be::Desc op(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd);
    op.finalize("reduction op");
    ops.push_back(&hold(std::move(op)));
  }
  ~Graph() {
    for (auto& [uid, b] : bufs) cudaFree(b.dev);
  }
};

// Host copies.
std::vector<float> download(const Buf& b) {
  std::vector<float> out(b.count);
  if (b.dt == CUDNN_DATA_HALF) {
    std::vector<__half> tmp(b.count);
    CK(cudaMemcpy(tmp.data(), b.dev, b.count * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < b.count; ++i) out[i] = __half2float(tmp[i]);
  } else {
    CK(cudaMemcpy(out.data(), b.dev, b.count * 4, cudaMemcpyDeviceToHost));
  }
  return out;
}
void upload(const Buf& b, const std::vector<float>& v) {
  if (b.dt == CUDNN_DATA_HALF) {
    std::vector<__half> tmp(b.count);
    for (size_t i = 0; i < b.count; ++i) tmp[i] = __float2half(v[i]);
    CK(cudaMemcpy(b.dev, tmp.data(), b.count * 2, cudaMemcpyHostToDevice));
  } else {
    CK(cudaMemcpy(b.dev, v.data(), b.count * 4, cudaMemcpyHostToDevice));
  }
}
std::vector<float> random_values(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

struct Result {
  bool ran = false;
  float ms = -1;
  std::string plan;
};

// Builds the graph, lists heuristics' configurations, finalises up to `max_plans` (timing the
// build), runs and times each; leaves the best plan's outputs in the buffers.
Result run_graph(Graph& g, const char* label, int max_plans) {
  Result res;
  std::printf("\n== %s\n", label);
  be::Desc graph;
  try {
    graph = be::operation_graph(g.h, g.ops);
  } catch (const std::exception& e) {
    std::printf("   operation graph does not finalise: %s\n", e.what());
    return res;
  }
  std::vector<be::Desc> cfgs;
  std::vector<std::string> names;
  for (auto [mode, mname] : {std::pair{CUDNN_HEUR_MODE_A, "A"}, std::pair{CUDNN_HEUR_MODE_B, "B"},
                             std::pair{CUDNN_HEUR_MODE_FALLBACK, "fallback"}}) {
    std::vector<be::Desc> got = be::heuristic_configs(graph, mode);
    std::printf("   heuristics %s: %zu configurations:", mname, got.size());
    for (be::Desc& c : got) {
      be::ConfigInfo info = be::describe_config(c);
      std::printf(" [%s%s%s]", info.name.c_str(), info.runtime_compiled ? " rtc" : "",
                  info.deterministic ? "" : " nondet");
      if (std::find(names.begin(), names.end(), info.name) == names.end()) {
        names.push_back(info.name);
        cfgs.push_back(std::move(c));
      }
    }
    std::printf("\n");
  }
  std::vector<int64_t> uids;
  std::vector<void*> ptrs;
  for (auto& [uid, b] : g.bufs) {
    uids.push_back(uid);
    ptrs.push_back(b.dev);
  }
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  int tried = 0;
  size_t best = SIZE_MAX;
  std::vector<be::Candidate> plans;
  for (size_t i = 0; i < cfgs.size() && tried < max_plans; ++i) {
    ++tried;
    be::Candidate c;
    c.name = names[i];
    c.plan = be::Desc(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    c.plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &g.h);
    c.plan.set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfgs[i]);
    auto t0 = std::chrono::steady_clock::now();
    cudnnStatus_t st = c.plan.try_finalize();
    double build_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (st != CUDNN_STATUS_SUCCESS) {
      char buf[512] = {0};
      cudnnGetLastErrorString(buf, sizeof buf);
      std::printf("   %s: plan does not finalise (%.2f s): %s %s\n", c.name.c_str(), build_s,
                  cudnnGetErrorString(st), buf);
      continue;
    }
    int64_t n = 0;
    cudnnBackendGetAttribute(c.plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                             CUDNN_TYPE_INT64, 1, &n, &c.workspace);
    void* ws = nullptr;
    if (c.workspace > 0) CK(cudaMalloc(&ws, size_t(c.workspace)));
    st = be::run(g.h, c, uids, ptrs, ws);
    cudaError_t ce = cudaDeviceSynchronize();
    if (st != CUDNN_STATUS_SUCCESS || ce != cudaSuccess) {
      char buf[512] = {0};
      cudnnGetLastErrorString(buf, sizeof buf);
      std::printf("   %s: does not run: %s / %s %s\n", c.name.c_str(), cudnnGetErrorString(st),
                  cudaGetErrorString(ce), buf);
      if (ws) cudaFree(ws);
      continue;
    }
    CK(cudaEventRecord(a));
    for (int r = 0; r < 10; ++r) be::run(g.h, c, uids, ptrs, ws);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    c.ms = ms / 10;
    std::printf("   %s: %.4f ms (plan build %.2f s, workspace %lld)\n", c.name.c_str(),
                double(c.ms), build_s, static_cast<long long>(c.workspace));
    if (ws) cudaFree(ws);
    plans.push_back(std::move(c));
    if (best == SIZE_MAX || plans.back().ms < plans[best].ms) best = plans.size() - 1;
  }
  if (best != SIZE_MAX) {
    // Leave the best plan's outputs behind for the checks.
    void* ws = nullptr;
    if (plans[best].workspace > 0) CK(cudaMalloc(&ws, size_t(plans[best].workspace)));
    be::run(g.h, plans[best], uids, ptrs, ws);
    CK(cudaDeviceSynchronize());
    if (ws) cudaFree(ws);
    res.ran = true;
    res.ms = plans[best].ms;
    res.plan = plans[best].name;
    std::printf("   best: %s %.4f ms\n", res.plan.c_str(), double(res.ms));
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return res;
}

double max_rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  double scale = 1e-6, err = 0;
  for (float w : want) scale = std::max(scale, double(std::fabs(w)));
  for (size_t i = 0; i < got.size(); ++i) err = std::max(err, double(std::fabs(got[i] - want[i])));
  return err / scale;
}

// Per-channel sums of an NHWC tensor (and of squares).
void channel_sums(const std::vector<float>& v, int64_t c, std::vector<double>& s,
                  std::vector<double>& sq) {
  s.assign(size_t(c), 0);
  sq.assign(size_t(c), 0);
  for (size_t i = 0; i < v.size(); ++i) {
    s[i % size_t(c)] += v[i];
    sq[i % size_t(c)] += double(v[i]) * v[i];
  }
}
double max_rel_err_d(const std::vector<float>& got, const std::vector<double>& want) {
  double scale = 1e-6, err = 0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  for (size_t i = 0; i < got.size(); ++i) err = std::max(err, std::fabs(got[i] - want[i]));
  return err / scale;
}

struct Problem {
  const char* name;
  int64_t cin, cout, hw, k, stride;
};

constexpr auto F = CUDNN_DATA_FLOAT;
constexpr auto H = CUDNN_DATA_HALF;

// Per-channel prologue parameters as a buffer of type pt holds them.
std::vector<float> as_stored(std::vector<float> v, cudnnDataType_t pt) {
  if (pt == H)
    for (float& x : v) x = __half2float(__float2half(x));
  return v;
}

// pt: the prologue's scale and bias type (F, or H with --half-scale).
void probe_forward(cudnnHandle_t h, int64_t N, const Problem& p, bool prologue, int plans,
                   cudnnDataType_t pt) {
  const int64_t ho = (p.hw + 2 * (p.k / 2) - p.k) / p.stride + 1;
  const Dims xd{N, p.cin, p.hw, p.hw}, wd{p.cout, p.cin, p.k, p.k}, yd{N, p.cout, ho, ho};
  const Dims co{1, p.cout, 1, 1};
  // Plain convolution: the baseline, and the reference for the fused results.
  Graph g0(h);
  int64_t x0, w0, y0;
  const be::Desc& X0 = g0.tensor(x0, H, xd, false);
  const be::Desc& W0 = g0.tensor(w0, H, wd, false);
  const be::Desc& Y0 = g0.tensor(y0, H, yd, false);
  g0.conv(ConvOp::Forward, X0, W0, Y0, p.k, p.stride);
  std::vector<float> xv = random_values(size_t(N * p.cin * p.hw * p.hw), -1, 2, 1);
  std::vector<float> wv = random_values(size_t(p.cout * p.cin * p.k * p.k), -0.1f, 0.1f, 2);
  const std::vector<float> sc = as_stored(random_values(size_t(p.cin), 0.5f, 1.5f, 3), pt);
  const std::vector<float> bi = as_stored(random_values(size_t(p.cin), -0.5f, 0.5f, 4), pt);
  std::vector<float> xin = xv;
  if (prologue)
    for (size_t i = 0; i < xin.size(); ++i) {
      const size_t c = i % size_t(p.cin);
      xin[i] = std::max(0.0f, __half2float(__float2half(xv[i])) * sc[c] + bi[c]);
    }
  upload(g0.bufs[x0], xin);
  upload(g0.bufs[w0], wv);
  std::string label = std::string(p.name) + ": plain conv fprop";
  Result r0 = run_graph(g0, label.c_str(), plans);
  std::vector<float> yref = r0.ran ? download(g0.bufs[y0]) : std::vector<float>{};

  Graph g(h);
  int64_t x, w, y, s, q, sc_id = 0, bi_id = 0;
  const be::Desc& X = g.tensor(x, H, xd, false);
  const be::Desc* conv_in = prologue ? &g.scale_bias_relu(X, xd, sc_id, bi_id, pt) : &X;
  const be::Desc& W = g.tensor(w, H, wd, false);
  const be::Desc& Y = g.tensor(y, H, yd, false);
  const be::Desc& S = g.tensor(s, F, co, false);
  const be::Desc& Q = g.tensor(q, F, co, false);
  g.conv(ConvOp::Forward, *conv_in, W, Y, p.k, p.stride);
  g.genstats(Y, S, Q);
  upload(g.bufs[x], xv);
  upload(g.bufs[w], wv);
  if (prologue) {
    upload(g.bufs[sc_id], sc);
    upload(g.bufs[bi_id], bi);
  }
  const std::string sbr = pt == H ? "scale-bias-relu (f16)" : "scale-bias-relu";
  label = std::string(p.name) + (prologue ? ": " + sbr + " + conv fprop + genstats"
                                          : std::string(": conv fprop + genstats"));
  Result r = run_graph(g, label.c_str(), plans);
  if (r.ran && r0.ran) {
    std::vector<float> yv = download(g.bufs[y]);
    std::vector<double> rs, rq;
    channel_sums(yv, p.cout, rs, rq);
    std::printf("   check: y vs unfused %.2e, sum %.2e, sqsum %.2e (relative to max)\n",
                max_rel_err(yv, yref), max_rel_err_d(download(g.bufs[s]), rs),
                max_rel_err_d(download(g.bufs[q]), rq));
    std::printf("   fused/plain time: %.3f\n", double(r.ms / r0.ms));
  }
}

void probe_wgrad(cudnnHandle_t h, int64_t N, const Problem& p, int plans, cudnnDataType_t pt) {
  const int64_t ho = (p.hw + 2 * (p.k / 2) - p.k) / p.stride + 1;
  const Dims xd{N, p.cin, p.hw, p.hw}, wd{p.cout, p.cin, p.k, p.k}, yd{N, p.cout, ho, ho};
  std::vector<float> xv = random_values(size_t(N * p.cin * p.hw * p.hw), -1, 2, 5);
  std::vector<float> dyv = random_values(size_t(N * p.cout * ho * ho), -1, 1, 6);
  const std::vector<float> sc = as_stored(random_values(size_t(p.cin), 0.5f, 1.5f, 7), pt);
  const std::vector<float> bi = as_stored(random_values(size_t(p.cin), -0.5f, 0.5f, 8), pt);
  std::vector<float> xin = xv;
  for (size_t i = 0; i < xin.size(); ++i) {
    const size_t c = i % size_t(p.cin);
    xin[i] = std::max(0.0f, __half2float(__float2half(xv[i])) * sc[c] + bi[c]);
  }
  Graph g0(h);
  int64_t x0, w0, y0;
  const be::Desc& X0 = g0.tensor(x0, H, xd, false);
  const be::Desc& W0 = g0.tensor(w0, H, wd, false);
  const be::Desc& Y0 = g0.tensor(y0, H, yd, false);
  g0.conv(ConvOp::BackwardFilter, X0, W0, Y0, p.k,
          p.stride);
  upload(g0.bufs[x0], xin);
  upload(g0.bufs[y0], dyv);
  Result r0 = run_graph(g0, (std::string(p.name) + ": plain wgrad").c_str(), plans);
  Graph g(h);
  int64_t x, w, y, s, b;
  const be::Desc& X = g.tensor(x, H, xd, false);
  const be::Desc& T3 = g.scale_bias_relu(X, xd, s, b, pt);
  const be::Desc& W = g.tensor(w, H, wd, false);
  const be::Desc& Y = g.tensor(y, H, yd, false);
  g.conv(ConvOp::BackwardFilter, T3, W, Y, p.k, p.stride);
  upload(g.bufs[x], xv);
  upload(g.bufs[y], dyv);
  upload(g.bufs[s], sc);
  upload(g.bufs[b], bi);
  const std::string sbr = pt == H ? ": scale-bias-relu (f16)" : ": scale-bias-relu";
  Result r = run_graph(g, (std::string(p.name) + sbr + " + wgrad").c_str(), plans);
  if (r.ran && r0.ran) {
    std::printf("   check: dw vs unfused %.2e\n",
                max_rel_err(download(g.bufs[w]), download(g0.bufs[w0])));
    std::printf("   fused/plain time: %.3f\n", double(r.ms / r0.ms));
  }
}

// dgrad of a conv whose input was relu(scale * yprev + bias): dz = dgrad(dy) * [bn(yprev) > 0],
// with `reductions` per-channel sums: 1 = sum(dz), 2 = also sum(dz * yprev).
void probe_dgrad(cudnnHandle_t h, int64_t N, const Problem& p, int reductions, int plans) {
  const int64_t ho = (p.hw + 2 * (p.k / 2) - p.k) / p.stride + 1;
  const Dims xd{N, p.cin, p.hw, p.hw}, wd{p.cout, p.cin, p.k, p.k}, yd{N, p.cout, ho, ho};
  const Dims ci{1, p.cin, 1, 1};
  std::vector<float> dyv = random_values(size_t(N * p.cout * ho * ho), -1, 1, 9);
  std::vector<float> wv = random_values(size_t(p.cout * p.cin * p.k * p.k), -0.1f, 0.1f, 10);
  std::vector<float> ypv = random_values(size_t(N * p.cin * p.hw * p.hw), -1, 2, 11);
  std::vector<float> sc = random_values(size_t(p.cin), 0.5f, 1.5f, 12);
  std::vector<float> bi = random_values(size_t(p.cin), -0.5f, 0.5f, 13);
  Graph g0(h);
  int64_t x0, w0, y0;
  const be::Desc& X0 = g0.tensor(x0, H, xd, false);
  const be::Desc& W0 = g0.tensor(w0, H, wd, false);
  const be::Desc& Y0 = g0.tensor(y0, H, yd, false);
  g0.conv(ConvOp::BackwardData, X0, W0, Y0, p.k, p.stride);
  upload(g0.bufs[w0], wv);
  upload(g0.bufs[y0], dyv);
  Result r0 = run_graph(g0, (std::string(p.name) + ": plain dgrad").c_str(), plans);
  Graph g(h);
  int64_t dx, w, dy, yp, s, b, u0, u1, u2, dz, r1 = 0, r2 = 0, u4 = 0;
  const be::Desc& DY = g.tensor(dy, H, yd, false);
  const be::Desc& W = g.tensor(w, H, wd, false);
  const be::Desc& DX = g.tensor(dx, F, xd, true);
  g.conv(ConvOp::BackwardData, DX, W, DY, p.k, p.stride);
  const be::Desc& YP = g.tensor(yp, H, xd, false);
  const be::Desc& S = g.tensor(s, F, ci, false);
  const be::Desc& B = g.tensor(b, F, ci, false);
  const be::Desc& T0 = g.tensor(u0, F, xd, true);
  const be::Desc& T1 = g.tensor(u1, F, xd, true);
  g.pw(CUDNN_POINTWISE_MUL, YP, &S, T0);
  g.pw(CUDNN_POINTWISE_ADD, T0, &B, T1);
  const be::Desc& DZ = g.tensor(dz, H, xd, false);
  (void)u2;
  g.relu_bwd(DX, T1, DZ);
  if (reductions >= 1) {
    const be::Desc& R1 = g.tensor(r1, F, ci, false);
    g.reduce(DZ, R1);
  }
  if (reductions >= 2) {
    const be::Desc& T4 = g.tensor(u4, F, xd, true);
    g.pw(CUDNN_POINTWISE_MUL, DZ, &YP, T4);
    const be::Desc& R2 = g.tensor(r2, F, ci, false);
    g.reduce(T4, R2);
  }
  upload(g.bufs[dy], dyv);
  upload(g.bufs[w], wv);
  upload(g.bufs[yp], ypv);
  upload(g.bufs[s], sc);
  upload(g.bufs[b], bi);
  std::string label = std::string(p.name) + ": dgrad + relu bwd (recomputed mask)" +
                      (reductions == 1 ? " + sum" : reductions == 2 ? " + sum + sum(dz*y)" : "");
  Result r = run_graph(g, label.c_str(), plans);
  if (r.ran && r0.ran) {
    std::vector<float> ref = download(g0.bufs[x0]);
    for (size_t i = 0; i < ref.size(); ++i) {
      const size_t c = i % size_t(p.cin);
      if (__half2float(__float2half(ypv[i])) * sc[c] + bi[c] <= 0) ref[i] = 0;
    }
    std::vector<float> got = download(g.bufs[dz]);
    std::printf("   check: dz vs unfused %.2e", max_rel_err(got, ref));
    if (reductions >= 1) {
      std::vector<double> rs(size_t(p.cin), 0), rp(size_t(p.cin), 0);
      for (size_t i = 0; i < got.size(); ++i) {
        rs[i % size_t(p.cin)] += got[i];
        rp[i % size_t(p.cin)] += double(got[i]) * __half2float(__float2half(ypv[i]));
      }
      std::printf(", sum %.2e", max_rel_err_d(download(g.bufs[r1]), rs));
      if (reductions >= 2) std::printf(", sum(dz*y) %.2e", max_rel_err_d(download(g.bufs[r2]), rp));
    }
    std::printf("\n   fused/plain time: %.3f\n", double(r.ms / r0.ms));
  }
}

// ---- --tail-gemm ----

// Median milliseconds of `reps` runs of f, each timed with events on kiln's stream.
template <class F>
double median_ms(F&& f, int reps = 15) {
  cudaStream_t s = kiln::cuda::current_stream();
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  f();  // warm-up (and the tuner's first sight)
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a, s));
    f();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return double(t[t.size() / 2]);
}

// An f16 channels-last activation (n, ch, hw, hw) of normal values on the GPU. The host draws 8
// images' worth (layer 1's four 205 M-element tensors drawn whole took over a minute) and the
// GPU repeats them over the batch.
kiln::Tensor repeated_randn(int64_t n, int64_t ch, int64_t hw) {
  using namespace kiln;
  const int64_t drawn = n % 8 == 0 ? 8 : n;
  return randn({drawn, ch, hw, hw})
      .to(DType::f16)
      .to(Device::cuda(0))
      .unsqueeze(0)
      .expand({n / drawn, drawn, ch, hw, hw})
      .contiguous()
      .reshape({n, ch, hw, hw})
      .contiguous(MemoryFormat::ChannelsLast);
}

// A batch norm of v (f16 channels-last) with its sums as the training step computes them, weight
// 1 and bias 0, to be finalized by the call that takes it.
kiln::BnStatsFinalize stats_of(const kiln::Tensor& v) {
  using namespace kiln;
  const int64_t c = v.size(1);
  const TensorOptions f32 = TensorOptions().with_device(v.device());
  BnStatsFinalize f;
  f.save_mean = empty({c}, f32);
  f.save_invstd = empty({c}, f32);
  f.scale_shift = empty({2 * c}, f32);
  f.sum = empty({c}, f32);
  f.sqsum = empty({c}, f32);
  cuda::bn_nhwc_stats(f.sum, f.sqsum, v);
  f.weight = ones({c}, f32);
  f.bias = zeros({c}, f32);
  f.count = v.numel() / c;
  return f;
}

// One identity-block tail at batch n: C channels at hw × hw, the next conv1 from C to K.
void probe_tail_gemm(int64_t n, int64_t c, int64_t k, int64_t hw) {
  using namespace kiln;
  const Device gpu = Device::cuda(0);
  auto act = [&](int64_t ch) { return repeated_randn(n, ch, hw); };
  Tensor y3 = act(c), z = act(c), r = act(c), dy1 = act(k);
  Tensor w1 = F::mul(randn({k, c, 1, 1}), 0.05).to(DType::f16).to(gpu);
  const TensorOptions f32 = TensorOptions().with_device(gpu);
  BnStatsFinalize f = stats_of(y3);
  Tensor mask = empty({y3.numel() / 8}, TensorOptions(DType::u8).with_device(gpu));
  Tensor out = empty_like(y3);
  cuda::bn_nhwc_apply(out, y3, z, f, Activation::Relu, mask);
  out = Tensor();
  z = Tensor();
  Tensor grad = r.clone(), dx = empty_like(y3), g = empty_like(y3);
  Tensor dw = empty({c}, f32), db = empty({c}, f32);
  Tensor partial = empty({int64_t(cuda::dgrad1x1_bn_parts(n * hw * hw, c, k)) * 2 * c}, f32);
  const double t_dgrad = median_ms(
      [&] { cuda::conv2d_backward_data(grad, dy1, w1, ConvParams{}, /*accumulate=*/true); });
  const double t_unfused = median_ms([&] {
    cuda::conv2d_backward_data(grad, dy1, w1, ConvParams{}, true);
    cuda::bn_nhwc_backward(dx, g, dw, db, grad, y3, mask, f.weight, f.save_mean, f.save_invstd,
                           f.scale_shift, Activation::Relu);
  });
  const double gb = double(y3.nbytes()) / 1e9;
  const double gflop = 2.0 * double(n * hw * hw) * double(c) * double(k) / 1e9;
  std::printf("tail %4lld ch @%lldx%lld, conv1 -> %lld (T = %.0f MB, %.1f GFLOP)\n",
              static_cast<long long>(c), static_cast<long long>(hw), static_cast<long long>(hw),
              static_cast<long long>(k), gb * 1e3, gflop);
  std::printf("   cuDNN dgrad (beta 1) %.3f ms; + bn_nhwc_backward %.3f ms\n", t_dgrad, t_unfused);
  if (!cuda::dgrad1x1_bn_supported(dy1, w1, y3)) {
    std::printf("   kiln GEMM: not for K = %lld\n", static_cast<long long>(k));
    return;
  }
  const double t_gemm =
      median_ms([&] { cuda::dgrad1x1_bn_sums(g, partial, dy1, w1, r, mask, y3, f.save_mean); });
  const double t_fused = median_ms([&] {
    cuda::bn_nhwc_backward_dgrad(dx, g, dw, db, dy1, w1, r, mask, y3, f.weight, f.save_mean,
                                 f.save_invstd);
  });
  std::printf("   kiln GEMM + sums     %.3f ms (%.2f TB/s, %.0f TFLOP/s); + finish, apply %.3f ms "
              "(%.2fx the unfused)\n",
              t_gemm, (gb * 3.0 + gb / 16.0 + gb * double(k) / double(c)) / t_gemm,
              gflop / t_gemm, t_fused, t_fused / t_unfused);
}

// One downsample-block tail at batch n: relu(bn(x) + bn(u)) with C channels at hw × hw, the next
// conv1 from C to K: cuDNN's dgrad added onto the other gradient, then bn_nhwc_dual_backward,
// against bn_nhwc_dual_backward_dgrad (the GEMM with all three sums, finish, apply).
void probe_dual_tail(int64_t n, int64_t c, int64_t k, int64_t hw) {
  using namespace kiln;
  const Device gpu = Device::cuda(0);
  auto act = [&](int64_t ch) { return repeated_randn(n, ch, hw); };
  Tensor x = act(c), u = act(c), rest = act(c), dy1 = act(k);
  Tensor w1 = F::mul(randn({k, c, 1, 1}), 0.05).to(DType::f16).to(gpu);
  const TensorOptions f32 = TensorOptions().with_device(gpu);
  BnStatsFinalize fx = stats_of(x), fu = stats_of(u);
  Tensor mask = empty({x.numel() / 8}, TensorOptions(DType::u8).with_device(gpu));
  {
    Tensor out = empty_like(x);
    cuda::bn_nhwc_dual_apply(out, x, fx, u, fu, mask);
  }
  Tensor grad = rest.clone(), dx = empty_like(x), du = empty_like(x);
  Tensor dwx = empty({c}, f32), dbx = empty({c}, f32), dwu = empty({c}, f32), dbu = empty({c}, f32);
  const double t_dgrad = median_ms(
      [&] { cuda::conv2d_backward_data(grad, dy1, w1, ConvParams{}, /*accumulate=*/true); });
  const double t_unfused = median_ms([&] {
    cuda::conv2d_backward_data(grad, dy1, w1, ConvParams{}, true);
    cuda::bn_nhwc_dual_backward(dx, du, dwx, dbx, dwu, dbu, grad, mask, x, fx.weight,
                                fx.save_mean, fx.save_invstd, u, fu.weight, fu.save_mean,
                                fu.save_invstd);
  });
  const double gb = double(x.nbytes()) / 1e9;
  std::printf("dual tail %4lld ch @%lldx%lld, conv1 -> %lld (T = %.0f MB)\n",
              static_cast<long long>(c), static_cast<long long>(hw), static_cast<long long>(hw),
              static_cast<long long>(k), gb * 1e3);
  std::printf("   cuDNN dgrad (beta 1) %.3f ms; + bn_nhwc_dual_backward %.3f ms\n", t_dgrad,
              t_unfused);
  if (!cuda::dual_dgrad_supported(dy1, w1, x)) {
    std::printf("   kiln's dual form: not for this shape or GPU\n");
    return;
  }
  const double t_fused = median_ms([&] {
    cuda::bn_nhwc_dual_backward_dgrad(dx, du, dwx, dbx, dwu, dbu, dy1, w1, rest, mask, x,
                                      fx.weight, fx.save_mean, fx.save_invstd, u, fu.weight,
                                      fu.save_mean, fu.save_invstd);
  });
  std::printf("   kiln GEMM + 3 sums, finish, apply %.3f ms (%.2fx the unfused)\n", t_fused,
              t_fused / t_unfused);
}

// ResNet-50's stem at batch n (224 × 224): kiln's kernels (KILN_STEM_CONV's mode 2) against
// cuDNN's path (mode 0: the 3 → 4 channel pad, the convolution, kiln's statistics pass; the pad
// and cuDNN's weight gradient).
void probe_stem(int64_t n) {
  using namespace kiln;
  const Device gpu = Device::cuda(0);
  Tensor x = repeated_randn(n, 3, 224);
  Tensor dy = repeated_randn(n, 64, 112);
  Tensor w = F::mul(randn({64, 3, 7, 7}), 0.08).to(DType::f16).to(gpu);
  ConvParams p;
  p.stride_h = p.stride_w = 2;
  p.pad_h = p.pad_w = 3;
  const TensorOptions f32 = TensorOptions().with_device(gpu);
  const TensorOptions f16 = TensorOptions(DType::f16).with_device(gpu);
  Tensor y = empty({n, 64, 112, 112}, f16.with_memory_format(MemoryFormat::ChannelsLast));
  Tensor sum = empty({64}, f32), sqsum = empty({64}, f32), dw = empty({64, 3, 7, 7}, f16);
  auto fwd = [&] {
    if (!cuda::conv2d_forward_stats(y, sum, sqsum, x, w, p)) {
      cuda::conv2d_forward(y, x, w, Tensor(), p);
      cuda::bn_nhwc_stats(sum, sqsum, y);
    }
  };
  auto wgrad = [&] { cuda::conv2d_backward_weight(dw, dy, x, p); };
  const int mode = cuda::stem_conv_mode();
  double t[2][2];
  for (int m : {0, 2}) {
    cuda::set_stem_conv_mode(m);
    t[m / 2][0] = median_ms(fwd);
    t[m / 2][1] = median_ms(wgrad);
  }
  cuda::set_stem_conv_mode(mode);
  const double gflop = 2.0 * double(n) * 112 * 112 * 64 * 147 / 1e9;
  std::printf("stem 7x7/2 3 -> 64 @224, batch %lld (%.1f GFLOP each way)\n",
              static_cast<long long>(n), gflop);
  std::printf("   forward + statistics: cuDNN path %.3f ms, kiln %.3f ms (%.0f TFLOP/s)\n",
              t[0][0], t[1][0], gflop / t[1][0]);
  std::printf("   weight gradient:      cuDNN path %.3f ms, kiln %.3f ms (%.0f TFLOP/s)\n",
              t[0][1], t[1][1], gflop / t[1][1]);
  // Two rounds of `run` timed with a switch off, then on (kiln's kernels, stem mode 2), each
  // round printed by `report`; the switch and the mode restored.
  auto both_ways = [&](bool (*get)(), void (*set)(bool), auto&& run, auto&& report) {
    const bool before = get();
    cuda::set_stem_conv_mode(2);
    for (int round = 0; round < 2; ++round) {
      double t2[2];
      for (int on : {0, 1}) {
        set(on == 1);
        t2[on] = median_ms(run);
      }
      report(round + 1, t2[0], t2[1]);
    }
    set(before);
    cuda::set_stem_conv_mode(mode);
  };
  // kiln's forward on wgmma both ways: the patch by 2-byte loads and A from ldmatrix fragments
  // (KILN_STEM_A_SMEM=0), or the patch by 16-byte copies and A read from it by descriptor (the
  // default).
  if (cuda::stem_wgmma_mode() >= 1)
    both_ways(cuda::stem_a_smem_enabled, cuda::set_stem_a_smem_enabled, fwd,
              [](int round, double off, double on) {
                std::printf("   round %d, forward: patch by 2-byte loads, A from registers %.3f "
                            "ms; by 16-byte copies, A from shared memory %.3f ms\n",
                            round, off, on);
              });
  // The weight gradient both ways (KILN_STEM_WGRAD_A_SMEM): A from registers by ldmatrix.trans,
  // or read from the patch by descriptor (the default). Two rounds.
  if (cuda::stem_wgmma_mode() == 2)
    both_ways(cuda::stem_wgrad_a_smem_enabled, cuda::set_stem_wgrad_a_smem_enabled, wgrad,
              [](int round, double off, double on) {
                std::printf("   round %d, weight gradient: A from registers %.3f ms, A from "
                            "shared memory %.3f ms\n",
                            round, off, on);
              });
  // The batch norm + ReLU + max pool forward after it, both kernels (KILN_STEM_POOL_TILE), on
  // the convolution's y with a batch norm's factors: reads y, writes the pooled f16 and the u8
  // positions.
  Tensor ss = F::cat({uniform({64}, 0.5, 1.5), uniform({64}, -0.5, 0.5)}, 0).to(gpu);
  const TensorOptions cl = f16.with_memory_format(MemoryFormat::ChannelsLast);
  Tensor pooled = empty({n, 64, 56, 56}, cl);
  Tensor idx = empty({n, 64, 56, 56}, cl.with_dtype(DType::u8));
  Tensor at_max = empty({n, 64, 56, 56}, cl);
  const bool tiled = cuda::stem_pool_tile_enabled();
  double tp[2];
  for (int on : {0, 1}) {
    cuda::set_stem_pool_tile_enabled(on == 1);
    tp[on] = median_ms([&] { cuda::bn_nhwc_relu_max_pool(pooled, idx, Tensor(), y, ss); });
  }
  cuda::set_stem_pool_tile_enabled(tiled);
  // The tiled kernel again, also writing x at each maximum (KILN_STEM_POOL_AT_MAX's forward),
  // gathered from global memory and from the raw tile (KILN_STEM_POOL_RAW_TILE).
  const bool raw_tile = cuda::stem_pool_raw_tile_enabled();
  double tpa_raw[2];
  for (int on : {0, 1}) {
    cuda::set_stem_pool_raw_tile_enabled(on == 1);
    tpa_raw[on] =
        median_ms([&] { cuda::bn_nhwc_relu_max_pool(pooled, idx, at_max, y, ss); });
  }
  cuda::set_stem_pool_raw_tile_enabled(raw_tile);
  const double tpa = tpa_raw[0];
  const double gb = double(y.nbytes() + pooled.nbytes() + idx.nbytes()) / 1e9;
  std::printf(
      "   bn + relu + max pool: per output %.3f ms (%.2f TB/s), 8x8 tiles %.3f ms "
      "(%.2f TB/s), 8x8 tiles + at_max %.3f ms (from the raw tile %.3f ms)\n",
      tp[0], gb / tp[0], tp[1], gb / tp[1],
      tpa, tpa_raw[1]);  // GB per ms = TB/s
  // Its backward: dx and the batch norm's parameter gradients from the pool's output gradient,
  // the sums over every input pixel (reading x) or over the outputs (reading at_max).
  Tensor dpool = repeated_randn(n, 64, 56), dx = empty_like(y);
  Tensor dwt = empty({64}, f32), dbt = empty({64}, f32);
  Tensor mean = uniform({64}, -0.2, 0.2).to(gpu), invstd = uniform({64}, 0.5, 2.0).to(gpu);
  double tb[2];
  for (int on : {0, 1})
    tb[on] = median_ms([&] {
      cuda::bn_nhwc_relu_max_pool_backward(dx, dwt, dbt, dpool, idx, on ? at_max : Tensor(), y,
                                           Tensor(), mean, invstd, ss);
    });
  std::printf(
      "   its backward (sums, finish, apply): sums over x %.3f ms, over the outputs "
      "from at_max %.3f ms\n",
      tb[0], tb[1]);
}

// One stride-1 1x1 convolution at batch n: k → c channels at hw × hw. cuDNN's path is what
// cuda/backend.cpp conv_stats runs when kiln's kernel is off.
void probe_conv1x1(int64_t n, int64_t k, int64_t c, int64_t hw) {
  using namespace kiln;
  const Device gpu = Device::cuda(0);
  Tensor x = repeated_randn(n, k, hw);
  Tensor w = F::mul(randn({c, k, 1, 1}), 1.0 / std::sqrt(double(k))).to(DType::f16).to(gpu);
  const TensorOptions f32 = TensorOptions().with_device(gpu);
  Tensor y = empty({n, c, hw, hw},
                   TensorOptions(DType::f16).with_device(gpu).with_memory_format(
                       MemoryFormat::ChannelsLast));
  Tensor sum = empty({c}, f32), sqsum = empty({c}, f32);
  bool epilogue = false;
  const double t_cudnn = median_ms([&] {
    epilogue = cuda::conv2d_forward_stats(y, sum, sqsum, x, w, ConvParams{});
    if (!epilogue) {
      cuda::conv2d_forward(y, x, w, Tensor(), ConvParams{});
      cuda::bn_nhwc_stats(sum, sqsum, y);
    }
  });
  const double gb = double(x.nbytes() + y.nbytes()) / 1e9;
  const double gflop = 2.0 * double(n * hw * hw) * double(c) * double(k) / 1e9;
  std::printf("1x1 %4lld -> %4lld @%lldx%lld (%.0f MB, %.1f GFLOP): cuDNN %s %.3f ms (%.2f TB/s)",
              static_cast<long long>(k), static_cast<long long>(c), static_cast<long long>(hw),
              static_cast<long long>(hw), gb * 1e3, gflop,
              epilogue ? "GenStats" : "conv + statistics pass", t_cudnn, gb / t_cudnn);
  if (!cuda::conv1x1_stats_supported(y, x, w, ConvParams{})) {
    std::printf("; kiln: not for this shape\n");
    return;
  }
  const double t_kiln =
      median_ms([&] { cuda::conv1x1_forward_stats(y, sum, sqsum, x, w, ConvParams{}); });
  std::printf("; kiln %.3f ms (%.2f TB/s, %.0f TFLOP/s), %.2fx\n", t_kiln, gb / t_kiln,
              gflop / t_kiln, t_kiln / t_cudnn);
}

// The weight gradient of the same stride-1 1x1 convolution (k → c at hw × hw, dw (c, k)): cuDNN's
// tuned plan (KILN_WGRAD1X1's path off) against kiln's kernel.
void probe_wgrad1x1(int64_t n, int64_t k, int64_t c, int64_t hw) {
  using namespace kiln;
  const Device gpu = Device::cuda(0);
  Tensor x = repeated_randn(n, k, hw), dy = repeated_randn(n, c, hw);
  Tensor dw = empty({c, k, 1, 1}, TensorOptions(DType::f16).with_device(gpu));
  const bool before = cuda::conv1x1_wgrad_enabled();
  cuda::set_conv1x1_wgrad_enabled(false);
  const double t_cudnn =
      median_ms([&] { cuda::conv2d_backward_weight(dw, dy, x, ConvParams{}); });
  cuda::set_conv1x1_wgrad_enabled(true);
  const bool ours = cuda::conv1x1_wgrad_supported(dw, dy, x, ConvParams{});
  const double t_kiln =
      ours ? median_ms([&] { cuda::conv2d_backward_weight(dw, dy, x, ConvParams{}); }) : 0.0;
  cuda::set_conv1x1_wgrad_enabled(before);
  const double gb = double(x.nbytes() + dy.nbytes()) / 1e9;
  const double gflop = 2.0 * double(n * hw * hw) * double(c) * double(k) / 1e9;
  std::printf("wgrad 1x1 %4lld -> %4lld @%lldx%lld (%.0f MB, %.1f GFLOP): cuDNN %.3f ms (%.2f "
              "TB/s)",
              static_cast<long long>(k), static_cast<long long>(c), static_cast<long long>(hw),
              static_cast<long long>(hw), gb * 1e3, gflop, t_cudnn, gb / t_cudnn);
  if (!ours) {
    std::printf("; kiln: not for this shape\n");
    return;
  }
  std::printf("; kiln %.3f ms (%.2f TB/s, %.0f TFLOP/s), %.2fx\n", t_kiln, gb / t_kiln,
              gflop / t_kiln, t_kiln / t_cudnn);
}

// One stride-1, padding-1 3x3 convolution at batch n: k → c channels at hw × hw, its statistics
// with it. cuDNN's path is what cuda/backend.cpp conv_stats runs with KILN_CONV3X3 off.
void probe_conv3x3(int64_t n, int64_t k, int64_t c, int64_t hw) {
  using namespace kiln;
  const Device gpu = Device::cuda(0);
  const ConvParams p{1, 1, 1, 1, 1, 1, 1};
  Tensor x = repeated_randn(n, k, hw);
  Tensor w = F::mul(randn({c, k, 3, 3}), 1.0 / std::sqrt(9.0 * double(k)))
                 .to(DType::f16)
                 .to(gpu)
                 .contiguous(MemoryFormat::ChannelsLast);
  const TensorOptions f32 = TensorOptions().with_device(gpu);
  Tensor y = empty({n, c, hw, hw},
                   TensorOptions(DType::f16).with_device(gpu).with_memory_format(
                       MemoryFormat::ChannelsLast));
  Tensor sum = empty({c}, f32), sqsum = empty({c}, f32);
  const bool before = cuda::conv3x3_enabled();
  cuda::set_conv3x3_enabled(false);
  bool epilogue = false;
  const double t_cudnn = median_ms([&] {
    epilogue = cuda::conv2d_forward_stats(y, sum, sqsum, x, w, p);
    if (!epilogue) {
      cuda::conv2d_forward(y, x, w, Tensor(), p);
      cuda::bn_nhwc_stats(sum, sqsum, y);
    }
  });
  cuda::set_conv3x3_enabled(true);
  const int64_t rows_before = cuda::conv3x3_max_rows();
  cuda::set_conv3x3_max_rows(std::numeric_limits<int>::max());  // every size, to compare
  const double gflop = 2.0 * double(n * hw * hw) * double(c) * double(k) * 9.0 / 1e9;
  std::printf("3x3 %4lld -> %4lld @%lldx%lld (%.1f GFLOP): cuDNN %s %.3f ms (%.0f TFLOP/s)",
              static_cast<long long>(k), static_cast<long long>(c), static_cast<long long>(hw),
              static_cast<long long>(hw), gflop,
              epilogue ? "GenStats" : "conv + statistics pass", t_cudnn, gflop / t_cudnn);
  if (!cuda::conv3x3_stats_supported(y, x, w, p)) {
    cuda::set_conv3x3_enabled(before);
    cuda::set_conv3x3_max_rows(rows_before);
    std::printf("; kiln: not for this shape\n");
    return;
  }
  const double t_kiln = median_ms([&] { cuda::conv3x3_forward_stats(y, sum, sqsum, x, w, p); });
  cuda::set_conv3x3_enabled(before);
  cuda::set_conv3x3_max_rows(rows_before);
  std::printf("; kiln %.3f ms (%.0f TFLOP/s), %.2fx\n", t_kiln, gflop / t_kiln,
              t_kiln / t_cudnn);
}

// A bottleneck's conv2 data gradient at batch n (k → c channels at hw × hw, stride 1, padding
// 1) into bn1's backward with the ReLU mask recomputed from y1: cuDNN's data gradient, then kiln's
// sums and apply passes, against kiln's 3x3 implicit GEMM with the sums in its epilogue, then
// the apply pass.
void probe_dgrad3x3(int64_t n, int64_t k, int64_t c, int64_t hw) {
  using namespace kiln;
  const Device gpu = Device::cuda(0);
  const ConvParams p{1, 1, 1, 1, 1, 1, 1};
  Tensor y1 = repeated_randn(n, k, hw), dy = repeated_randn(n, c, hw);
  Tensor w = F::mul(randn({c, k, 3, 3}), 1.0 / std::sqrt(9.0 * double(c)))
                 .to(DType::f16)
                 .to(gpu)
                 .contiguous(MemoryFormat::ChannelsLast);
  const TensorOptions f32 = TensorOptions().with_device(gpu);
  BnStatsFinalize f = stats_of(y1);
  cuda::bn_nhwc_finalize(f);
  Tensor grad = empty_like(y1), dx = empty_like(y1), g = empty_like(y1);
  Tensor dw = empty({k}, f32), db = empty({k}, f32);
  const double t_dgrad =
      median_ms([&] { cuda::conv2d_backward_data(grad, dy, w, p, /*accumulate=*/false); });
  const double t_unfused = median_ms([&] {
    cuda::conv2d_backward_data(grad, dy, w, p, false);
    cuda::bn_nhwc_backward(dx, Tensor(), dw, db, grad, y1, Tensor(), f.weight, f.save_mean,
                           f.save_invstd, f.scale_shift, Activation::Relu);
  });
  const double gflop = 2.0 * double(n * hw * hw) * double(c) * double(k) * 9.0 / 1e9;
  std::printf(
      "dgrad 3x3 %4lld <- %4lld @%lldx%lld (%.1f GFLOP): cuDNN dgrad %.3f ms (%.0f "
      "TFLOP/s); + bn_nhwc_backward %.3f ms",
      static_cast<long long>(k), static_cast<long long>(c), static_cast<long long>(hw),
      static_cast<long long>(hw), gflop, t_dgrad, gflop / t_dgrad, t_unfused);
  // kiln's form (KILN_DGRAD3X3, which may be off) is what this probe times: on for the call.
  const bool before = cuda::dgrad3x3_enabled();
  cuda::set_dgrad3x3_enabled(true);
  struct Restore {
    bool on;
    ~Restore() { cuda::set_dgrad3x3_enabled(on); }
  } restore{before};
  if (!cuda::dgrad3x3_bn_supported(dy, w, y1)) {
    std::printf("; kiln: not for this shape\n");
    return;
  }
  Tensor partial = empty({int64_t(cuda::dgrad3x3_bn_parts(n * hw * hw, k)) * 2 * k}, f32);
  const double t_gemm = median_ms([&] {
    cuda::dgrad1x1_bn_sums(g, partial, dy, w, Tensor(), Tensor(), y1, f.save_mean, f.scale_shift);
  });
  const double t_fused = median_ms([&] {
    cuda::bn_nhwc_backward_dgrad(dx, g, dw, db, dy, w, Tensor(), Tensor(), y1, f.weight,
                                 f.save_mean, f.save_invstd, false, f.scale_shift);
  });
  std::printf(
      "; kiln GEMM + sums %.3f ms (%.0f TFLOP/s, %.2fx cuDNN's dgrad, %d parts); + finish, "
      "apply %.3f ms (%.2fx the unfused)\n",
      t_gemm, gflop / t_gemm, t_gemm / t_dgrad, cuda::dgrad3x3_bn_parts(n * hw * hw, k), t_fused,
      t_fused / t_unfused);
}

}  // namespace

int main(int argc, char** argv) {
  ProbeArgs args;
  const int rc = kiln::cli::run_tool("kiln-fusion-probe",
                                     [&] { return parse_probe_args(argc, argv, args) ? -1 : 0; });
  if (rc >= 0) return rc;  // --help, or a usage error
  const int64_t N = args.batch;
  const int plans = args.plans;
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::fprintf(stderr, "kiln-fusion-probe: no CUDA device\n");
    return 2;
  }
  cudnnHandle_t h;
  if (cudnnCreate(&h) != CUDNN_STATUS_SUCCESS) return 1;
  std::printf("cuDNN %zu, batch %lld\n", cudnnGetVersion(), static_cast<long long>(N));
  const Problem conv1{"l1.conv1 1x1 256->64 @56", 256, 64, 56, 1, 1};
  const Problem conv2{"l1.conv2 3x3 64->64 @56", 64, 64, 56, 3, 1};
  const Problem conv3{"l1.conv3 1x1 64->256 @56", 64, 256, 56, 1, 1};
  const Problem l3c2{"l3.conv2 3x3 256->256 @14", 256, 256, 14, 3, 1};
  try {
    if (args.stem) {
      probe_stem(N);
      cudnnDestroy(h);
      return 0;
    }
    if (args.dgrad3x3) {
      if (!args.shape.empty()) {
        probe_dgrad3x3(N, args.shape_k, args.shape_c, args.shape_hw);
      } else {
        for (auto [k, hw] : {std::pair<int64_t, int64_t>{64, 56}, {128, 28}, {256, 14}, {512, 7}})
          probe_dgrad3x3(N, k, k, hw);
      }
      cudnnDestroy(h);
      return 0;
    }
    if (args.conv3x3) {
      // ResNet-50's stride-1 3x3 convolutions (conv2 of every block but each layer's first in
      // layers 2-4; layer 1's C 64 is not taken).
      if (!args.shape.empty()) {
        probe_conv3x3(N, args.shape_k, args.shape_c, args.shape_hw);
      } else {
        for (auto [k, hw] : {std::pair<int64_t, int64_t>{64, 56}, {128, 28}, {256, 14}, {512, 7}})
          probe_conv3x3(N, k, k, hw);
      }
      cudnnDestroy(h);
      return 0;
    }
    if (args.conv1x1 || args.wgrad1x1) {
      // ResNet-50's stride-1 1x1 convolutions: each layer's conv3 (and layer 1's downsample),
      // its blocks' conv1, and the first block's conv1 from the layer before.
      const int64_t shapes[][3] = {{64, 256, 56},   {256, 64, 56},   {256, 128, 56},
                                   {128, 512, 28},  {512, 128, 28},  {512, 256, 28},
                                   {256, 1024, 14}, {1024, 256, 14}, {1024, 512, 14},
                                   {512, 2048, 7},  {2048, 512, 7}};
      auto probe = [&](int64_t k, int64_t c, int64_t hw) {
        if (args.conv1x1) probe_conv1x1(N, k, c, hw);
        if (args.wgrad1x1) probe_wgrad1x1(N, k, c, hw);
      };
      if (!args.shape.empty()) {
        probe(args.shape_k, args.shape_c, args.shape_hw);
      } else {
        for (const auto& s : shapes) probe(s[0], s[1], s[2]);
      }
      cudnnDestroy(h);
      return 0;
    }
    if (args.dual_tail) {
      // ResNet-50's four downsample tails (each layer's first block) and the next block's conv1;
      // kiln's dual form (KILN_DUAL_DGRAD, which may be off) on for the call.
      kiln::cuda::set_dual_dgrad_enabled(true);
      for (auto [c, hw] : {std::pair<int64_t, int64_t>{256, 56}, {512, 28}, {1024, 14}, {2048, 7}})
        probe_dual_tail(N, c, c / 4, hw);
      cudnnDestroy(h);
      return 0;
    }
    if (args.tail_gemm) {
      // ResNet-50's identity tails: layer l's C channels, its blocks' conv1 to C / 4.
      for (auto [c, hw] : {std::pair<int64_t, int64_t>{256, 56}, {512, 28}, {1024, 14}, {2048, 7}})
        probe_tail_gemm(N, c, c / 4, hw);
      cudnnDestroy(h);
      return 0;
    }
    const cudnnDataType_t pt = args.half_scale ? H : F;
    probe_forward(h, N, conv1, false, plans, pt);
    probe_forward(h, N, conv2, true, plans, pt);
    probe_forward(h, N, conv3, true, plans, pt);
    probe_forward(h, N, l3c2, true, plans, pt);
    probe_wgrad(h, N, conv2, plans, pt);
    probe_wgrad(h, N, conv3, plans, pt);
    probe_dgrad(h, N, conv2, 0, plans);
    probe_dgrad(h, N, conv2, 1, plans);
    probe_dgrad(h, N, conv2, 2, plans);
    probe_dgrad(h, N, conv3, 2, plans);
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 1;
  }
  cudnnDestroy(h);
  return 0;
}
#endif
