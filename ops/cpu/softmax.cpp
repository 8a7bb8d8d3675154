// CPU softmax, log-softmax and fused softmax-cross-entropy kernels, one row at a time.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops/cpu/kernels.h"

namespace kiln::cpu {
namespace {

constexpr int64_t kParallelGrain = 32768;

// Writes the log-probabilities of row x[0..cols) into out. Subtracting
// the row max first keeps exp() in (0, 1]: logits of 1000 neither overflow nor give inf-inf.
template <typename T>
void log_softmax_row(const T* x, int64_t cols, double* out) {
  double mx = -INFINITY;
  for (int64_t j = 0; j < cols; ++j) mx = std::max(mx, double(x[j]));
  double s = 0;
  for (int64_t j = 0; j < cols; ++j) s += std::exp(double(x[j]) - mx);
  const double lse = mx + std::log(s);
  for (int64_t j = 0; j < cols; ++j) out[j] = double(x[j]) - lse;
}

}  // namespace

void softmax_forward(const Tensor& y, const Tensor& x, int64_t rows, int64_t cols, bool log) {
  dispatch_float(x.dtype(), "softmax", [&]<typename T>() {
    const T* px = x.data<T>();
    T* py = y.data<T>();
#pragma omp parallel for if (rows * cols > kParallelGrain) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<double> lp(static_cast<size_t>(cols));
      log_softmax_row(px + r * cols, cols, lp.data());
      for (int64_t j = 0; j < cols; ++j) py[r * cols + j] = T(log ? lp[size_t(j)] : std::exp(lp[size_t(j)]));
    }
  });
}

void softmax_backward(const Tensor& dx, const Tensor& dy, const Tensor& y, int64_t rows,
                      int64_t cols, bool log) {
  dispatch_float(y.dtype(), "softmax_backward", [&]<typename T>() {
    const T* pdy = dy.data<T>();
    const T* py = y.data<T>();
    T* pdx = dx.data<T>();
#pragma omp parallel for if (rows * cols > kParallelGrain) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* g = pdy + r * cols;
      const T* o = py + r * cols;
      T* d = pdx + r * cols;
      double s = 0;
      if (log) {
        for (int64_t j = 0; j < cols; ++j) s += double(g[j]);
        for (int64_t j = 0; j < cols; ++j) d[j] = T(double(g[j]) - std::exp(double(o[j])) * s);
      } else {
        for (int64_t j = 0; j < cols; ++j) s += double(g[j]) * double(o[j]);
        for (int64_t j = 0; j < cols; ++j) d[j] = T(double(o[j]) * (double(g[j]) - s));
      }
    }
  });
}

void cross_entropy_forward(const Tensor& loss, const Tensor& grad, const Tensor& correct,
                           const Tensor& logits, const Tensor& target, double label_smoothing,
                           double grad_scale) {
  const int64_t n = logits.size(0), c = logits.size(1);
  dispatch_float(logits.dtype(), "cross_entropy", [&]<typename T>() {
    const T* px = logits.data<T>();
    T* pg = grad.data<T>();
    const bool i64 = target.dtype() == DType::i64;
    const int64_t* t64 = i64 ? target.data<int64_t>() : nullptr;
    const int32_t* t32 = i64 ? nullptr : target.data<int32_t>();
    const double eps = label_smoothing, off = eps / double(c), inv_n = 1.0 / double(n);
    const double g_mul = grad_scale * inv_n;
    // Each row's loss kept and the rows added in order afterwards: an OpenMP reduction adds the
    // threads' partial sums in an order of the runtime's, so the loss would depend on the thread
    // count.
    std::vector<double> rows(static_cast<size_t>(n));
    int64_t hits = 0;
#pragma omp parallel for if (n * c > kParallelGrain) schedule(static) reduction(+ : hits)
    for (int64_t r = 0; r < n; ++r) {
      const int64_t t = i64 ? t64[r] : int64_t(t32[r]);
      std::vector<double> lp(static_cast<size_t>(c));
      log_softmax_row(px + r * c, c, lp.data());
      double row = 0;  // Σ_c q_c·(-log p_c)
      int64_t best = 0;
      for (int64_t j = 0; j < c; ++j) {
        const double q = off + (j == t ? 1.0 - eps : 0.0);
        row -= q * lp[size_t(j)];
        pg[r * c + j] = T((std::exp(lp[size_t(j)]) - q) * g_mul);
        if (px[r * c + j] > px[r * c + best]) best = j;
      }
      rows[size_t(r)] = row;
      hits += best == t;
    }
    double total = 0;
    for (const double row : rows) total += row;
    loss.data<T>()[0] = T(total * inv_n);
    if (correct.defined()) correct.data<int64_t>()[0] = hits;
  });
}

}  // namespace kiln::cpu
