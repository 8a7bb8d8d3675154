// matmul and linear on cuBLASLt (declared in cuda/kernels.h).
//
// kiln's matrices are row-major; cuBLASLt's are column-major. A row-major (r × c) buffer is the
// column-major (c × r) matrix, i.e. its transpose, so out = op(a)·op(b) is computed as
// outᵀ = op(b)ᵀ·op(a)ᵀ: cuBLAS's A is kiln's b, its B is kiln's a, transposes carried over.
//
// Compute type is CUBLAS_COMPUTE_32F for f32 and f16 alike: f16 inputs accumulate in f32, and
// f32 stays exact f32 (no TF32; that would need CUBLAS_COMPUTE_32F_FAST_TF32).
// The algorithm is chosen once per problem (shape, leading dims, batch, dtype, transposes,
// epilogue, pointer alignment) and cached: cublasLtMatmulAlgoGetHeuristic's first
// kGemmCandidates answers are each timed on the problem's own operands and the fastest kept,
// as cuDNN's convolutions are (cuda/conv.cpp). The heuristic's first answer is taken untimed
// during graph capture, in deterministic mode (the same algorithm in every process), for
// beta != 0 (a rerun would add twice) and with KILN_GEMM_TUNE=0. When no algorithm supports an
// epilogue, the bias (gradient) is computed without it.
#include <array>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "core/autograd.h"
#include "core/switches.h"
#include "cuda/check.h"
#include "cuda/conv.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"

namespace kiln::cuda {
namespace {

cudaDataType_t lt_dtype(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: KILN_FAIL("cuBLASLt: unsupported dtype ", dtype_name(t), " (f32, f16 or bf16)");
  }
}

// RAII holders for the three cuBLASLt descriptor kinds.
struct MatmulDesc {
  cublasLtMatmulDesc_t d = nullptr;
  MatmulDesc() { CUBLAS_CHECK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F)); }
  ~MatmulDesc() { cublasLtMatmulDescDestroy(d); }
  MatmulDesc(const MatmulDesc&) = delete;
  MatmulDesc& operator=(const MatmulDesc&) = delete;
  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attr, const T& v) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v)));
  }
};
struct MatrixLayout {
  cublasLtMatrixLayout_t l = nullptr;
  MatrixLayout(cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
               int64_t batch_stride) {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, t, uint64_t(rows), uint64_t(cols), ld));
    if (batch > 1) {
      int32_t count = int32_t(batch);
      CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                    sizeof(count)));
      CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
          l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &batch_stride, sizeof(batch_stride)));
    }
  }
  ~MatrixLayout() { cublasLtMatrixLayoutDestroy(l); }
  MatrixLayout(const MatrixLayout&) = delete;
  MatrixLayout& operator=(const MatrixLayout&) = delete;
};
struct Preference {
  cublasLtMatmulPreference_t p = nullptr;
  Preference() { CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&p)); }
  ~Preference() { cublasLtMatmulPreferenceDestroy(p); }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
  template <typename T>
  void set(cublasLtMatmulPreferenceAttributes_t attr, const T& v) {
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, attr, &v, sizeof(v)));
  }
};

// Largest power of two (≤ 256) dividing the address: cuBLASLt picks vectorised kernels by it.
uint32_t alignment_of(const void* p) {
  auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 1;
  while (a < 256 && v % (a * 2) == 0) a *= 2;
  return a;
}

// One GEMM in cuBLAS's column-major terms: d (m×n) = op(a) (m×k) · op(b) (k×n) [+ beta·d].
struct Gemm {
  int64_t m = 0, n = 0, k = 0, batch = 1;
  bool trans_a = false, trans_b = false;
  const void* a = nullptr;
  int64_t lda = 0, stride_a = 0;
  const void* b = nullptr;
  int64_t ldb = 0, stride_b = 0;
  void* d = nullptr;
  int64_t ldd = 0, stride_d = 0;
  DType dtype = DType::f32;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  void* bias = nullptr;  // bias (EPILOGUE_BIAS, length m) or bias gradient (BGRADB, length n)
  float beta = 0.0f;
};

using HeuristicKey = std::array<int64_t, 20>;
std::mutex g_heuristic_mutex;
std::map<HeuristicKey, std::optional<cublasLtMatmulAlgo_t>> g_heuristics;

constexpr int kGemmCandidates = 8;
constexpr int kGemmTimedRuns = 3;
constinit RuntimeSwitch g_tuning{&Switches::gemm_tune};  // KILN_GEMM_TUNE

// Whether a problem met now is tuned (see the top of this file).
bool tuning_now() { return g_tuning.get() && !conv_deterministic() && !is_capturing(); }

const char* epilogue_name(cublasLtEpilogue_t e) {
  switch (e) {
    case CUBLASLT_EPILOGUE_DEFAULT: return "";
    case CUBLASLT_EPILOGUE_BIAS: return " +bias";
    case CUBLASLT_EPILOGUE_BGRADB: return " +bias-grad";
    default: return " +epilogue";
  }
}

// The descriptors of one Gemm, made once and used for the heuristic query, tuning and the run.
struct GemmDescs {
  MatmulDesc desc;
  MatrixLayout la, lb, ld;
  explicit GemmDescs(const Gemm& g)
      : la(lt_dtype(g.dtype), g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda, g.batch,
           g.stride_a),
        lb(lt_dtype(g.dtype), g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb, g.batch,
           g.stride_b),
        ld(lt_dtype(g.dtype), g.m, g.n, g.ldd, g.batch, g.stride_d) {
    desc.set(CUBLASLT_MATMUL_DESC_TRANSA, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
    desc.set(CUBLASLT_MATMUL_DESC_TRANSB, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
    if (g.epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
      desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, g.epilogue);
      desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
    }
  }
};

cublasStatus_t launch(const Gemm& g, GemmDescs& d, const cublasLtMatmulAlgo_t& algo) {
  Context& ctx = context();
  const float alpha = 1.0f;
  return cublasLtMatmul(ctx.lt, d.desc.d, &alpha, g.a, d.la.l, g.b, d.lb.l, &g.beta, g.d, d.ld.l,
                        g.d, d.ld.l, &algo, ctx.lt_workspace, ctx.lt_workspace_bytes,
                        current_stream());
}

// Index of the fastest of `found` on g's operands (each run once untimed, then kGemmTimedRuns
// times between two events); g.d (and the bias gradient) end up holding some run's result,
// which the caller's own run overwrites.
int fastest(const Gemm& g, GemmDescs& d, const cublasLtMatmulHeuristicResult_t* found, int count) {
  cudaStream_t s = current_stream();
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> ms(size_t(count), -1.0f);
  int best = 0;
  for (int i = 0; i < count; ++i) {
    if (launch(g, d, found[i].algo) != CUBLAS_STATUS_SUCCESS) continue;
    CUDA_CHECK(cudaEventRecord(a, s));
    for (int r = 0; r < kGemmTimedRuns; ++r) CUBLAS_CHECK(launch(g, d, found[i].algo));
    CUDA_CHECK(cudaEventRecord(b, s));
    CUDA_CHECK(cudaEventSynchronize(b));
    CUDA_CHECK(cudaEventElapsedTime(&ms[size_t(i)], a, b));
    ms[size_t(i)] /= kGemmTimedRuns;
    if (ms[size_t(best)] < 0 || ms[size_t(i)] < ms[size_t(best)]) best = i;
  }
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  if (switches().gemm_tune_log) {
    std::fprintf(stderr,
                 "[kiln gemm] %s m=%lld n=%lld k=%lld batch=%lld %c%c%s: heuristic %.4f ms, "
                 "picked #%d of %d %.4f ms\n",
                 dtype_name(g.dtype), static_cast<long long>(g.m), static_cast<long long>(g.n),
                 static_cast<long long>(g.k), static_cast<long long>(g.batch),
                 g.trans_a ? 'T' : 'N', g.trans_b ? 'T' : 'N', epilogue_name(g.epilogue),
                 double(ms[0]), best, count, double(ms[size_t(best)]));
  }
  return best;
}

// Runs g; false (nothing launched) when no algorithm supports it, which only happens with an
// epilogue in practice.
bool run_gemm(const Gemm& g) {
  Context& ctx = context();
  GemmDescs d(g);
  uint32_t al_a = alignment_of(g.a), al_b = alignment_of(g.b), al_d = alignment_of(g.d);
  uint32_t al_bias = g.bias ? alignment_of(g.bias) : 0;
  HeuristicKey key{ctx.device, g.m, g.n, g.k, g.batch, g.lda, g.ldb, g.ldd, g.stride_a,
                   g.stride_b, g.stride_d, g.trans_a, g.trans_b, int64_t(g.dtype),
                   int64_t(g.epilogue), al_a, al_b, al_d, al_bias, g.beta != 0.0f};
  std::optional<cublasLtMatmulAlgo_t> algo;
  {
    std::lock_guard<std::mutex> lock(g_heuristic_mutex);
    auto it = g_heuristics.find(key);
    if (it != g_heuristics.end()) {
      algo = it->second;
    } else {
      Preference pref;
      uint64_t ws = ctx.lt_workspace_bytes;
      pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws);
      pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al_a);
      pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al_b);
      pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al_d);
      pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al_d);
      const bool tune = g.beta == 0.0f && tuning_now();
      std::array<cublasLtMatmulHeuristicResult_t, kGemmCandidates> found{};
      int count = 0;
      cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(ctx.lt, d.desc.d, d.la.l, d.lb.l, d.ld.l,
                                                        d.ld.l, pref.p, tune ? kGemmCandidates : 1,
                                                        found.data(), &count);
      if (s != CUBLAS_STATUS_NOT_SUPPORTED) CUBLAS_CHECK(s);
      if (s == CUBLAS_STATUS_SUCCESS && count > 0)
        algo = found[size_t(count > 1 ? fastest(g, d, found.data(), count) : 0)].algo;
      g_heuristics.emplace(key, algo);
    }
  }
  if (!algo) {
    KILN_CHECK(g.epilogue != CUBLASLT_EPILOGUE_DEFAULT, "cuBLASLt: no algorithm for a ",
               dtype_name(g.dtype), " GEMM m=", g.m, " n=", g.n, " k=", g.k, " batch=", g.batch);
    return false;
  }
  CUBLAS_CHECK(launch(g, d, *algo));
  return true;
}

// Row-major out (.., M×N) = op(a)·op(b) for contiguous 2-D or 3-D (batched) tensors.
bool gemm_row_major(const Tensor& out, const Tensor& a, bool trans_a, const Tensor& b,
                    bool trans_b, cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT,
                    void* bias = nullptr, float beta = 0.0f) {
  const int64_t ra = a.size(-2), ca = a.size(-1), rb = b.size(-2), cb = b.size(-1);
  Gemm g;
  g.m = out.size(-1);
  g.n = out.size(-2);
  g.k = trans_a ? ra : ca;
  g.batch = out.dim() == 3 ? out.size(0) : 1;
  g.a = b.raw_data();
  g.trans_a = trans_b;
  g.lda = cb;
  g.stride_a = rb * cb;
  g.b = a.raw_data();
  g.trans_b = trans_a;
  g.ldb = ca;
  g.stride_b = ra * ca;
  g.d = out.raw_data();
  g.ldd = g.m;
  g.stride_d = g.m * g.n;
  g.dtype = out.dtype();
  g.epilogue = epilogue;
  g.bias = bias;
  g.beta = beta;
  return run_gemm(g);
}

// The dense row-major version of t (t itself when already so), never recorded by autograd.
Tensor dense(const Tensor& t) {
  if (t.is_contiguous()) return t;
  NoGradGuard no_grad;
  return t.detach().contiguous();
}

// Calls f(o) with a contiguous tensor o that ends up in out: out itself when contiguous, else a
// temporary copied into out afterwards.
template <typename F>
void with_dense_out(const Tensor& out, F&& f) {
  if (out.is_contiguous()) {
    f(out);
    return;
  }
  Tensor tmp = empty(out.shape(), TensorOptions(out.dtype()).with_device(out.device()));
  f(tmp);
  out.copy_(tmp);
}

// A (1, n) row of ones of `dtype` on `device`. Kept per device and dtype (the longest asked for
// so far) once made outside capture, and made ready on every stream before it is handed out, so
// the bias gradients of a step fill nothing; during capture a longer one is made for the call.
Tensor ones_row(int64_t n, DType dtype, Device device) {
  static std::mutex mutex;
  static auto* rows = new std::map<std::pair<int, int>, Tensor>;  // never freed, as contexts
  const TensorOptions opts = TensorOptions(dtype).with_device(device);
  std::lock_guard<std::mutex> lock(mutex);
  Tensor& kept = (*rows)[{device.index, int(dtype)}];
  if (!kept.defined() || kept.numel() < n) {
    Tensor fresh = full({n}, 1.0, opts);
    if (is_capturing()) return fresh.view({1, n});
    CUDA_CHECK(cudaStreamSynchronize(current_stream()));
    kept = fresh;
  }
  return kept.narrow(0, 0, n).view({1, n});
}

// db (out) = Σ_n dy[n, :], as the GEMM ones(1×N)·dy (used when BGRADB is unavailable).
void bias_grad_by_gemm(const Tensor& db, const Tensor& dy) {
  const Tensor ones = ones_row(dy.size(0), dy.dtype(), dy.device());
  with_dense_out(db, [&](const Tensor& o) {
    gemm_row_major(o.view({1, dy.size(1)}), ones, false, dy, false);
  });
}

}  // namespace

void set_gemm_tuning_enabled(bool on) { g_tuning.set(on); }

void matmul(const Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b) {
  Tensor da = dense(a), db = dense(b);
  with_dense_out(out, [&](const Tensor& o) {
    if (o.numel() == 0) return;
    const int64_t k = trans_a ? da.size(-2) : da.size(-1);
    if (k == 0) {
      o.zero_();
      return;
    }
    gemm_row_major(o, da, trans_a, db, trans_b);
  });
}

void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias) {
  Tensor dx = dense(x), dw = dense(w);
  Tensor db = bias.defined() ? dense(bias) : Tensor();
  with_dense_out(y, [&](const Tensor& o) {
    if (o.numel() == 0) return;
    if (x.size(1) == 0) {  // empty reduction: y = bias (or 0)
      if (db.defined()) o.copy_(db.broadcast_to(o.shape())); else o.zero_();
      return;
    }
    if (!db.defined()) {
      gemm_row_major(o, dx, false, dw, true);
    } else if (!gemm_row_major(o, dx, false, dw, true, CUBLASLT_EPILOGUE_BIAS, db.raw_data())) {
      o.copy_(db.broadcast_to(o.shape()));
      gemm_row_major(o, dx, false, dw, true, CUBLASLT_EPILOGUE_DEFAULT, nullptr, 1.0f);
    }
  });
}

namespace {

// How linear_backward computes db beside dw = dyᵀ·x: inside the weight-gradient GEMM (cuBLASLt's
// BGRADB epilogue) or as a GEMM of its own (ones·dy) after a plain one. The epilogue saves a
// read of dy but narrows cuBLASLt's algorithms: on an H200 it takes ViT-B/16's weight gradients
// from ~0.15 to ~0.24 ms (tools/bench/kiln-gemm-probe.cpp). Which is faster is measured once per
// problem, as the GEMMs' algorithms are.
enum class BiasGradForm { Epilogue, Separate };

using BiasGradKey = std::array<int64_t, 6>;
std::mutex g_bias_grad_mutex;
std::map<BiasGradKey, BiasGradForm> g_bias_grad_forms;

// dw (out, in) = dyᵀ·x and db = Σ_n dy in `form`; false when the epilogue form has no algorithm.
bool weight_and_bias_grad(const Tensor& dw, const Tensor& db, const Tensor& dy, const Tensor& x,
                          BiasGradForm form) {
  if (form == BiasGradForm::Epilogue)
    return gemm_row_major(dw, dy, true, x, false, CUBLASLT_EPILOGUE_BGRADB, db.raw_data());
  gemm_row_major(dw, dy, true, x, false);
  bias_grad_by_gemm(db, dy);
  return true;
}

// The form for this problem: measured on its operands the first time (each form run once to
// tune its GEMMs, then twice more, alternating, between events), else the epilogue.
BiasGradForm bias_grad_form(const Tensor& dw, const Tensor& db, const Tensor& dy,
                            const Tensor& x) {
  const BiasGradKey key{context().device, dy.size(0), dy.size(1), x.size(1),
                        int64_t(dy.dtype()), alignment_of(db.raw_data())};
  std::lock_guard<std::mutex> lock(g_bias_grad_mutex);
  if (auto it = g_bias_grad_forms.find(key); it != g_bias_grad_forms.end()) return it->second;
  if (!tuning_now()) return BiasGradForm::Epilogue;
  const BiasGradForm forms[2] = {BiasGradForm::Epilogue, BiasGradForm::Separate};
  float ms[2] = {0, 0};
  bool ran[2] = {false, false};
  cudaStream_t s = current_stream();
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  for (int rep = 0; rep < 3; ++rep)
    for (int i = 0; i < 2; ++i) {
      if (rep > 0 && !ran[i]) continue;
      CUDA_CHECK(cudaEventRecord(a, s));
      ran[i] = weight_and_bias_grad(dw, db, dy, x, forms[i]);
      CUDA_CHECK(cudaEventRecord(b, s));
      CUDA_CHECK(cudaEventSynchronize(b));
      float t = 0;
      CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
      if (rep > 0) ms[i] += t;  // the first run tunes
    }
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  const BiasGradForm pick =
      ran[0] && ms[0] <= ms[1] ? BiasGradForm::Epilogue : BiasGradForm::Separate;
  if (switches().gemm_tune_log)
    std::fprintf(stderr,
                 "[kiln gemm] linear weight+bias gradient %s n=%lld in=%lld out=%lld: epilogue "
                 "%.4f ms, separate %.4f ms: %s\n",
                 dtype_name(dy.dtype()), static_cast<long long>(dy.size(0)),
                 static_cast<long long>(x.size(1)), static_cast<long long>(dy.size(1)),
                 ran[0] ? double(ms[0]) / 2 : -1.0, double(ms[1]) / 2,
                 pick == BiasGradForm::Epilogue ? "epilogue" : "separate");
  g_bias_grad_forms.emplace(key, pick);
  return pick;
}

}  // namespace

void linear_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy,
                     const Tensor& x, const Tensor& w) {
  Tensor ddy = dense(dy);
  const int64_t batch = dy.size(0);
  if (dx.defined() && dx.numel() > 0) {  // dx (N, in) = dy (N, out) · w (out, in)
    Tensor dw_in = dense(w);
    with_dense_out(dx, [&](const Tensor& o) {
      if (dy.size(1) == 0) o.zero_(); else gemm_row_major(o, ddy, false, dw_in, false);
    });
  }
  if (batch == 0) {  // empty batch: the sums are zero
    if (dw.defined()) dw.zero_();
    if (db.defined()) db.zero_();
    return;
  }
  bool db_done = false;
  if (dw.defined() && dw.numel() > 0) {  // dw (out, in) = dyᵀ (out, N) · x (N, in)
    Tensor dx_in = dense(x);
    Tensor db_dense;
    if (db.defined())
      db_dense = db.is_contiguous()
                     ? db
                     : empty(db.shape(), TensorOptions(db.dtype()).with_device(db.device()));
    with_dense_out(dw, [&](const Tensor& o) {
      if (db_dense.defined())
        db_done = weight_and_bias_grad(o, db_dense, ddy, dx_in,
                                       bias_grad_form(o, db_dense, ddy, dx_in));
      if (!db_done) gemm_row_major(o, ddy, true, dx_in, false);
    });
    if (db_done && !db_dense.is_same(db)) db.copy_(db_dense);
  }
  if (db.defined() && !db_done) bias_grad_by_gemm(db, ddy);
}

}  // namespace kiln::cuda
