// CPU GEMM on Eigen. Row-major maps over kiln's storage; a transposed operand is an Eigen
// transpose expression, which the GEMM kernel packs directly (no copy).
#include <algorithm>

#include <Eigen/Dense>

#include "ops/cpu/kernels.h"

namespace kiln::cpu {
namespace {

template <typename T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Eigen's own threads are off (EIGEN_DONT_PARALLELIZE, CMakeLists.txt): a GEMM Eigen split over
// threads blocked its summed dimension by another formula than one on a single thread, so a
// product's bits depended on the thread count. Large products are split here instead, into fixed
// tiles of the output, each one single-threaded Eigen GEMM whose blocks over k depend on k alone:
// the same tiles, and so the same bits, on any number of threads.
constexpr int64_t kTileRows = 128, kTileCols = 256;
constexpr int64_t kSplitWork = int64_t(1) << 21;  // n·k·m from which a product is tiled

// Rows [r0, r0 + rn) × columns [c0, c0 + cn) of c (n × m, row-major) = op(a) · op(b).
template <typename T>
void gemm_tile(T* c, const T* a, bool trans_a, const T* b, bool trans_b, int64_t n, int64_t k,
               int64_t m, int64_t r0, int64_t rn, int64_t c0, int64_t cn) {
  using Map = Eigen::Map<RowMat<T>>;
  using CMap = Eigen::Map<const RowMat<T>>;
  auto out = Map(c, n, m).block(r0, c0, rn, cn);
  // Stored shapes: a is (n, k) or, transposed, (k, n); b is (k, m) or (m, k).
  CMap A(a, trans_a ? k : n, trans_a ? n : k);
  CMap B(b, trans_b ? m : k, trans_b ? k : m);
  if (!trans_a && !trans_b)
    out.noalias() = A.middleRows(r0, rn) * B.middleCols(c0, cn);
  else if (!trans_a)
    out.noalias() = A.middleRows(r0, rn) * B.transpose().middleCols(c0, cn);
  else if (!trans_b)
    out.noalias() = A.transpose().middleRows(r0, rn) * B.middleCols(c0, cn);
  else
    out.noalias() = A.transpose().middleRows(r0, rn) * B.transpose().middleCols(c0, cn);
}

}  // namespace

GemmCacheSizes gemm_cache_sizes() {
  std::ptrdiff_t l1 = 0, l2 = 0, l3 = 0;
  Eigen::internal::manage_caching_sizes(Eigen::GetAction, &l1, &l2, &l3);
  int q1 = 0, q2 = 0, q3 = 0;
  Eigen::internal::queryCacheSizes(q1, q2, q3);
  return {l1, l2, l3, q1, Eigen::nbThreads()};
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
    // Tasks: each product whole, or a large one's fixed tiles; spread over the threads.
    const bool tiled = n * k * m >= kSplitWork;
    const int64_t tr = tiled ? (n + kTileRows - 1) / kTileRows : 1;
    const int64_t tc = tiled ? (m + kTileCols - 1) / kTileCols : 1;
    const int64_t rows = tiled ? kTileRows : n, cols = tiled ? kTileCols : m;
    const int64_t tasks = batch * tr * tc;
#pragma omp parallel for if (tasks > 1 && batch * n * k * m >= kSplitWork) schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t i = t / (tr * tc), r0 = (t / tc) % tr * rows, c0 = t % tc * cols;
      gemm_tile<T>(c + i * n * m, pa + i * n * k, trans_a, pb + i * k * m, trans_b, n, k, m, r0,
                   std::min(rows, n - r0), c0, std::min(cols, m - c0));
    }
  });
}

}  // namespace kiln::cpu
