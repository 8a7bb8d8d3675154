// kiln-gemm-probe: how fast does cuBLASLt run a transformer's Linear GEMMs in each form kiln
// could ask for them, and which form is worth building?
//
//   kiln-gemm-probe [--tokens T] [--shapes IN:OUT,...] [--dtype f16|bf16] [--candidates N]
//                   [--reps R]
//
// For each Linear (in → out) over T tokens (default ViT-B/16 at batch 128: 25,216 tokens; the
// block's four Linears), every GEMM of its training step in kiln's row-major tensors:
//   forward  y (T, out) = x (T, in) · wᵀ           as cuda/blas.cpp asks (TN, +bias epilogue),
//                                                   without the epilogue, and in row order;
//   dgrad    dx (T, in) = dy (T, out) · w           (NN);
//   wgrad    dw (out, in) = dyᵀ · x, db = Σ_t dy    (NT, +bias-gradient epilogue), without the
//                                                   epilogue, and split along T into S parts
//                                                   (one strided batched GEMM into f32 partials;
//                                                   the sum of the parts is not timed).
// Each form: cublasLtMatmulAlgoGetHeuristic's first N answers, each timed (CUDA events, two
// warm-up runs, R timed runs, mean), and one line: the heuristic's first answer, the fastest
// and its TFLOP/s. Forms cuBLASLt cannot run say so.
#include <cstdio>
#include <string>
#include <vector>

#include "core/version.h"
#include "tools/cli/cli.h"

namespace {

struct ProbeArgs {
  int64_t tokens = 128 * 197;
  std::string shapes = "768:2304,768:768,768:3072,3072:768";
  std::string dtype = "f16";
  int candidates = 16;
  int reps = 10;
};

bool parse_probe_args(int argc, char** argv, ProbeArgs& a) {
  kiln::cli::Parser p("kiln-gemm-probe",
                      "[--tokens T] [--shapes IN:OUT,...] [--dtype f16|bf16] [--candidates N] "
                      "[--reps R]",
                      "cuBLASLt's speed on a transformer's Linear GEMMs (forward, data and "
                      "weight gradient) in each form kiln could ask for them.");
  p.version(kiln::version_line("kiln-gemm-probe"));
  p.value("--tokens", "T", &a.tokens, "rows of x (batch × sequence length)", 1);
  p.value("--shapes", "IN:OUT,...", &a.shapes, "the Linears' in and out features");
  p.choice("--dtype", &a.dtype, {"f16", "bf16"}, "operand dtype (f32 accumulation)");
  p.value("--candidates", "N", &a.candidates, "heuristic answers timed per form", 1);
  p.value("--reps", "R", &a.reps, "timed runs per answer", 1);
  if (p.parse(argc, argv)) return true;
  std::fputs(p.info().c_str(), stdout);
  return false;
}

}  // namespace

#ifndef KILN_WITH_CUDA
int main(int argc, char** argv) {
  return kiln::cli::run_tool("kiln-gemm-probe", [&] {
    ProbeArgs a;
    if (!parse_probe_args(argc, argv, a)) return 0;
    kiln::cli::usage_error("this build has no CUDA backend");
  });
}
#else
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace {

void cuda_ok(cudaError_t e, const char* what) {
  KILN_CHECK(e == cudaSuccess, what, ": ", cudaGetErrorString(e));
}
void lt_ok(cublasStatus_t s, const char* what) {
  KILN_CHECK(s == CUBLAS_STATUS_SUCCESS, what, ": cuBLAS status ", int(s));
}

struct Buffer {
  void* p = nullptr;
  explicit Buffer(size_t bytes) { cuda_ok(cudaMalloc(&p, bytes), "cudaMalloc"); }
  ~Buffer() { cudaFree(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

// One matrix operand in cuBLASLt's terms: rows × cols stored with leading dim ld (column order
// unless row_order), batch copies stride elements apart.
struct Mat {
  cudaDataType_t type;
  int64_t rows, cols, ld;
  bool row_order = false;
  int batch = 1;
  int64_t stride = 0;
};

struct Form {
  std::string name;
  cublasOperation_t op_a, op_b;
  Mat a, b, d;
  const void* pa;
  const void* pb;
  void* pd;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  void* bias = nullptr;
  double flops = 0;
};

struct Layout {
  cublasLtMatrixLayout_t l = nullptr;
  explicit Layout(const Mat& m) {
    lt_ok(cublasLtMatrixLayoutCreate(&l, m.type, uint64_t(m.rows), uint64_t(m.cols), m.ld),
          "cublasLtMatrixLayoutCreate");
    if (m.row_order) {
      cublasLtOrder_t o = CUBLASLT_ORDER_ROW;
      lt_ok(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ORDER, &o, sizeof o),
            "layout order");
    }
    if (m.batch > 1) {
      int32_t n = m.batch;
      lt_ok(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof n),
            "batch count");
      lt_ok(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                             &m.stride, sizeof m.stride),
            "batch stride");
    }
  }
  ~Layout() { cublasLtMatrixLayoutDestroy(l); }
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;
};

struct Probe {
  cublasLtHandle_t lt = nullptr;
  void* ws = nullptr;
  size_t ws_bytes = size_t(32) << 20;  // kiln's cuBLASLt workspace (cuda/runtime.cpp)
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  int candidates = 16, reps = 10;
};

void run_form(Probe& pr, const Form& f) {
  cublasLtMatmulDesc_t desc = nullptr;
  lt_ok(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &f.op_a, sizeof f.op_a);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &f.op_b, sizeof f.op_b);
  if (f.epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &f.epilogue,
                                   sizeof f.epilogue);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &f.bias,
                                   sizeof f.bias);
  }
  Layout la(f.a), lb(f.b), ld(f.d);
  cublasLtMatmulPreference_t pref = nullptr;
  lt_ok(cublasLtMatmulPreferenceCreate(&pref), "preference");
  uint64_t ws = pr.ws_bytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                       sizeof ws);
  std::vector<cublasLtMatmulHeuristicResult_t> found(size_t(pr.candidates));
  int count = 0;
  cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(pr.lt, desc, la.l, lb.l, ld.l, ld.l, pref,
                                                    pr.candidates, found.data(), &count);
  std::printf("  %-34s", f.name.c_str());
  if (s != CUBLAS_STATUS_SUCCESS || count == 0) {
    std::printf(" no algorithm (status %d)\n", int(s));
  } else {
    const float alpha = 1.0f, beta = 0.0f;
    float first = -1, best = -1;
    int best_i = -1;
    for (int i = 0; i < count; ++i) {
      auto launch = [&] {
        return cublasLtMatmul(pr.lt, desc, &alpha, f.pa, la.l, f.pb, lb.l, &beta, f.pd, ld.l,
                              f.pd, ld.l, &found[size_t(i)].algo, pr.ws, pr.ws_bytes, nullptr);
      };
      if (launch() != CUBLAS_STATUS_SUCCESS || launch() != CUBLAS_STATUS_SUCCESS) continue;
      cuda_ok(cudaEventRecord(pr.e0), "event");
      for (int r = 0; r < pr.reps; ++r) launch();
      cuda_ok(cudaEventRecord(pr.e1), "event");
      cuda_ok(cudaEventSynchronize(pr.e1), "event sync");
      float ms = 0;
      cuda_ok(cudaEventElapsedTime(&ms, pr.e0, pr.e1), "elapsed");
      ms /= float(pr.reps);
      if (i == 0) first = ms;
      if (best < 0 || ms < best) {
        best = ms;
        best_i = i;
      }
    }
    if (best < 0)
      std::printf(" %d answers, none ran\n", count);
    else
      std::printf(" heuristic %.4f ms | best #%-2d of %-2d %.4f ms  %6.1f TFLOP/s\n", double(first),
                  best_i, count, double(best), f.flops / (double(best) * 1e-3) / 1e12);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatmulDescDestroy(desc);
  cuda_ok(cudaGetLastError(), "cuBLASLt launch");
}

int probe(const ProbeArgs& a) {
  const cudaDataType_t t = a.dtype == "bf16" ? CUDA_R_16BF : CUDA_R_16F;
  int64_t max_in = 0, max_out = 0;
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (size_t at = 0; at <= a.shapes.size();) {
    size_t end = a.shapes.find(',', at);
    if (end == std::string::npos) end = a.shapes.size();
    const std::string s = a.shapes.substr(at, end - at);
    at = end + 1;
    const size_t colon = s.find(':');
    const int64_t in = std::atoll(s.c_str());
    const int64_t out = colon == std::string::npos ? 0 : std::atoll(s.c_str() + colon + 1);
    if (in <= 0 || out <= 0) kiln::cli::usage_error("--shapes: '", s, "' is not IN:OUT");
    shapes.emplace_back(in, out);
    max_in = std::max(max_in, in);
    max_out = std::max(max_out, out);
  }
  const int64_t T = a.tokens;
  constexpr int kMaxSplit = 4;
  // Operands hold a repeating pattern of small values (0, ±1/64, ...): the GEMMs' time does
  // not depend on them, and nothing overflows.
  const size_t big = size_t(T) * size_t(std::max(max_in, max_out));
  std::vector<uint16_t> host(big);
  for (size_t i = 0; i < big; ++i) {
    const int v = int(i * 2654435761u >> 28) - 8;  // -8..7
    // f16 and bf16 bit patterns of v/64, built from the value's exponent and mantissa.
    const float f = float(v) / 64.0f;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    host[i] = t == CUDA_R_16BF ? uint16_t(bits >> 16) : 0;
    if (t == CUDA_R_16F && v != 0) {
      const uint32_t sign = bits >> 31, exp = (bits >> 23) & 0xff, man = bits & 0x7fffff;
      host[i] = uint16_t(sign << 15 | (exp - 127 + 15) << 10 | man >> 13);
    }
  }
  Buffer x(big * 2), dy(big * 2), y(big * 2), dx(big * 2);
  cuda_ok(cudaMemcpy(x.p, host.data(), big * 2, cudaMemcpyHostToDevice), "upload");
  cuda_ok(cudaMemcpy(dy.p, host.data(), big * 2, cudaMemcpyHostToDevice), "upload");
  const size_t wn = size_t(max_in) * size_t(max_out);
  Buffer w(wn * 2), dw(wn * 2), partial(wn * 4 * kMaxSplit), bias(size_t(max_out) * 4),
      dbias(size_t(max_out) * 4);
  cuda_ok(cudaMemcpy(w.p, host.data(), wn * 2, cudaMemcpyHostToDevice), "upload");
  cuda_ok(cudaMemset(bias.p, 0, size_t(max_out) * 4), "memset");

  Probe pr;
  pr.candidates = a.candidates;
  pr.reps = a.reps;
  lt_ok(cublasLtCreate(&pr.lt), "cublasLtCreate");
  Buffer ws(pr.ws_bytes);
  pr.ws = ws.p;
  cuda_ok(cudaEventCreate(&pr.e0), "event");
  cuda_ok(cudaEventCreate(&pr.e1), "event");
  cudaDeviceProp props{};
  cuda_ok(cudaGetDeviceProperties(&props, 0), "device properties");
  std::printf("kiln-gemm-probe: %s, %s, %lld tokens, %d candidates, %d runs each\n", props.name,
              a.dtype.c_str(), static_cast<long long>(T), a.candidates, a.reps);

  for (auto [in, out] : shapes) {
    const double flops = 2.0 * double(T) * double(in) * double(out);
    std::printf("Linear %lld -> %lld (%.1f GFLOP per GEMM)\n", static_cast<long long>(in),
                static_cast<long long>(out), flops / 1e9);
    // Row-major (r × c) is column-order (c × r): kiln's product out = p·q is computed as
    // outᵀ = qᵀ·pᵀ (cuda/blas.cpp).
    Form fwd{"forward TN +bias (kiln)", CUBLAS_OP_T, CUBLAS_OP_N, {t, in, out, in},
             {t, in, T, in}, {t, out, T, out}, w.p, x.p, y.p, CUBLASLT_EPILOGUE_BIAS, bias.p,
             flops};
    run_form(pr, fwd);
    Form fwd_plain = fwd;
    fwd_plain.name = "forward TN, no epilogue";
    fwd_plain.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    run_form(pr, fwd_plain);
    // Row order: y (T × out) = x (T × in) · w (out × in)ᵀ as stored.
    Form fwd_row{"forward NT, row order, no epilogue", CUBLAS_OP_N, CUBLAS_OP_T,
                 {t, T, in, in, true}, {t, out, in, in, true}, {t, T, out, out, true},
                 x.p, w.p, y.p, CUBLASLT_EPILOGUE_DEFAULT, nullptr, flops};
    run_form(pr, fwd_row);
    Form dgrad{"dgrad NN (kiln)", CUBLAS_OP_N, CUBLAS_OP_N, {t, in, out, in}, {t, out, T, out},
               {t, in, T, in}, w.p, dy.p, dx.p, CUBLASLT_EPILOGUE_DEFAULT, nullptr, flops};
    run_form(pr, dgrad);
    Form wgrad{"wgrad NT +bias-grad (kiln)", CUBLAS_OP_N, CUBLAS_OP_T, {t, in, T, in},
               {t, out, T, out}, {t, in, out, in}, x.p, dy.p, dw.p, CUBLASLT_EPILOGUE_BGRADB,
               dbias.p, flops};
    run_form(pr, wgrad);
    Form wgrad_plain = wgrad;
    wgrad_plain.name = "wgrad NT, no epilogue";
    wgrad_plain.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    run_form(pr, wgrad_plain);
    for (int split = 2; split <= kMaxSplit; split *= 2) {
      if (T % split != 0) continue;
      const int64_t kc = T / split;
      Form sk = wgrad_plain;
      sk.name = "wgrad NT, split " + std::to_string(split) + ", f32 parts";
      sk.a = {t, in, kc, in, false, split, kc * in};
      sk.b = {t, out, kc, out, false, split, kc * out};
      sk.d = {CUDA_R_32F, in, out, in, false, split, in * out};
      sk.pd = partial.p;
      run_form(pr, sk);
    }
  }
  cudaEventDestroy(pr.e0);
  cudaEventDestroy(pr.e1);
  cublasLtDestroy(pr.lt);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return kiln::cli::run_tool("kiln-gemm-probe", [&] {
    ProbeArgs a;
    if (!parse_probe_args(argc, argv, a)) return 0;
    return probe(a);
  });
}
#endif
