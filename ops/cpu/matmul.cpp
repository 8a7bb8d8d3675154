// CPU GEMM on Eigen. Row-major maps over kiln's storage; a transposed operand is an Eigen
// transpose expression, which the GEMM kernel packs directly (no copy).
#include <Eigen/Dense>

#include "ops/cpu/kernels.h"

namespace kiln::cpu {
namespace {

template <typename T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <typename T>
void gemm(T* c, const T* a, bool trans_a, const T* b, bool trans_b, int64_t n, int64_t k,
          int64_t m) {
  using Map = Eigen::Map<RowMat<T>>;
  using CMap = Eigen::Map<const RowMat<T>>;
  Map out(c, n, m);
  // Stored shapes: a is (n, k) or, transposed, (k, n); b is (k, m) or (m, k).
  CMap A(a, trans_a ? k : n, trans_a ? n : k);
  CMap B(b, trans_b ? m : k, trans_b ? k : m);
  if (!trans_a && !trans_b) out.noalias() = A * B;
  else if (!trans_a) out.noalias() = A * B.transpose();
  else if (!trans_b) out.noalias() = A.transpose() * B;
  else out.noalias() = A.transpose() * B.transpose();
}

}  // namespace

GemmCacheSizes gemm_cache_sizes() {
  std::ptrdiff_t l1 = 0, l2 = 0, l3 = 0;
  Eigen::internal::manage_caching_sizes(Eigen::GetAction, &l1, &l2, &l3);
  int q1 = 0, q2 = 0, q3 = 0;
  Eigen::internal::queryCacheSizes(q1, q2, q3);
  return {l1, l2, l3, q1};
}

void matmul(const Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b) {
  const bool batched = out.dim() == 3;
  const int64_t batch = batched ? out.size(0) : 1;
  const int64_t n = out.size(-2), m = out.size(-1);
  const int64_t k = trans_a ? a.size(-2) : a.size(-1);
  dispatch_float(out.dtype(), "matmul", [&]<typename T>() {
    T* c = out.data<T>();
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    if (n * m == 0) return;
    if (k == 0) {
      Eigen::Map<RowMat<T>>(c, batch * n, m).setZero();
      return;
    }
    // Many small products: one per thread (Eigen does not nest its own threads inside an
    // OpenMP region). Few large ones: Eigen parallelises each GEMM.
    const bool over_batch = batch > 1 && n * m * k < (int64_t(1) << 21);
#pragma omp parallel for if (over_batch) schedule(static)
    for (int64_t i = 0; i < batch; ++i)
      gemm<T>(c + i * n * m, pa + i * n * k, trans_a, pb + i * k * m, trans_b, n, k, m);
  });
}

}  // namespace kiln::cpu
