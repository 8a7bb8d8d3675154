// matmul and linear on cuBLASLt (declared in cuda/kernels.h).
//
// kiln's matrices are row-major; cuBLASLt's are column-major. A row-major (r × c) buffer is the
// column-major (c × r) matrix, i.e. its transpose, so out = op(a)·op(b) is computed as
// outᵀ = op(b)ᵀ·op(a)ᵀ: cuBLAS's A is kiln's b, its B is kiln's a, transposes carried over.
//
// Compute type is CUBLAS_COMPUTE_32F for f32 and f16 alike: f16 inputs accumulate in f32, and
// f32 stays exact f32 (no TF32; that would need CUBLAS_COMPUTE_32F_FAST_TF32).
// The algorithm comes from cublasLtMatmulAlgoGetHeuristic, asked once per problem (shape,
// leading dims, batch, dtype, transposes, epilogue, pointer alignment) and cached. When no
// algorithm supports an epilogue, the bias (gradient) is computed without it.
#include <array>
#include <map>
#include <mutex>
#include <optional>

#include "core/autograd.h"
#include "cuda/check.h"
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

// Runs g; false (nothing launched) when no algorithm supports it, which only happens with an
// epilogue in practice.
bool run_gemm(const Gemm& g) {
  Context& ctx = context();
  cudaDataType_t t = lt_dtype(g.dtype);
  MatmulDesc desc;
  cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, op_a);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, op_b);
  if (g.epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, g.epilogue);
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  }
  // Stored shapes: op(a) is (m×k), so a itself is (k×m) when transposed.
  MatrixLayout la(t, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda, g.batch, g.stride_a);
  MatrixLayout lb(t, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb, g.batch, g.stride_b);
  MatrixLayout ld(t, g.m, g.n, g.ldd, g.batch, g.stride_d);

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
      cublasLtMatmulHeuristicResult_t result{};
      int count = 0;
      cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(ctx.lt, desc.d, la.l, lb.l, ld.l, ld.l,
                                                        pref.p, 1, &result, &count);
      if (s != CUBLAS_STATUS_NOT_SUPPORTED) CUBLAS_CHECK(s);
      if (s == CUBLAS_STATUS_SUCCESS && count > 0) algo = result.algo;
      g_heuristics.emplace(key, algo);
    }
  }
  if (!algo) {
    KILN_CHECK(g.epilogue != CUBLASLT_EPILOGUE_DEFAULT, "cuBLASLt: no algorithm for a ",
               dtype_name(g.dtype), " GEMM m=", g.m, " n=", g.n, " k=", g.k, " batch=", g.batch);
    return false;
  }
  const float alpha = 1.0f;
  CUBLAS_CHECK(cublasLtMatmul(ctx.lt, desc.d, &alpha, g.a, la.l, g.b, lb.l, &g.beta, g.d, ld.l,
                              g.d, ld.l, &*algo, ctx.lt_workspace, ctx.lt_workspace_bytes,
                              current_stream()));
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

// db (out) = Σ_n dy[n, :], as the GEMM ones(1×N)·dy (used when BGRADB is unavailable).
void bias_grad_by_gemm(const Tensor& db, const Tensor& dy) {
  Tensor ones = full({1, dy.size(0)}, 1.0, TensorOptions(dy.dtype()).with_device(dy.device()));
  with_dense_out(db, [&](const Tensor& o) {
    gemm_row_major(o.view({1, dy.size(1)}), ones, false, dy, false);
  });
}

}  // namespace

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
        db_done = gemm_row_major(o, ddy, true, dx_in, false, CUBLASLT_EPILOGUE_BGRADB,
                                 db_dense.raw_data());
      if (!db_done) gemm_row_major(o, ddy, true, dx_in, false);
    });
    if (db_done && !db_dense.is_same(db)) db.copy_(db_dense);
  }
  if (db.defined() && !db_done) bias_grad_by_gemm(db, ddy);
}

}  // namespace kiln::cuda
