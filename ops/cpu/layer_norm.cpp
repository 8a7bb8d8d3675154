// CPU layer norm over the trailing `cols` elements of each row: the reference for the CUDA
// kernels. Statistics are accumulated in double, then kept in the compute type (f32, or f64 for
// f64 data) as the CUDA kernels keep them in f32.
#include <cmath>
#include <vector>

#include "ops/cpu/kernels.h"

namespace kiln::cpu {
namespace {

constexpr int64_t kParallelGrain = 32768;

}  // namespace

void layer_norm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                        const Tensor& weight, const Tensor& bias, int64_t rows, int64_t cols,
                        double eps) {
  dispatch_float(x.dtype(), "layer_norm", [&]<typename T>() {
    const T* px = x.data<T>();
    T* py = y.data<T>();
    T* pm = mean.data<T>();
    T* pr = rstd.data<T>();
    const T* w = weight.defined() ? weight.data<T>() : nullptr;
    const T* b = bias.defined() ? bias.data<T>() : nullptr;
#pragma omp parallel for if (rows * cols > kParallelGrain) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = px + r * cols;
      double s = 0;
      for (int64_t j = 0; j < cols; ++j) s += double(row[j]);
      const double mu = s / double(cols);
      double v = 0;  // two passes: no cancellation for rows far from zero
      for (int64_t j = 0; j < cols; ++j) v += (double(row[j]) - mu) * (double(row[j]) - mu);
      const double rs = 1.0 / std::sqrt(v / double(cols) + eps);
      pm[r] = T(mu);
      pr[r] = T(rs);
      T* out = py + r * cols;
      for (int64_t j = 0; j < cols; ++j) {
        const double xh = (double(row[j]) - mu) * rs;
        out[j] = T(xh * (w ? double(w[j]) : 1.0) + (b ? double(b[j]) : 0.0));
      }
    }
  });
}

void layer_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& weight,
                         const Tensor& mean, const Tensor& rstd, int64_t rows, int64_t cols,
                         GradientMode mode, GradientMode dx_mode) {
  const bool dx_add = dx_mode != GradientMode::Set;
  dispatch_float(x.dtype(), "layer_norm_backward", [&]<typename T>() {
    const T* px = x.data<T>();
    const T* pg = dy.data<T>();
    const T* pm = mean.data<T>();
    const T* pr = rstd.data<T>();
    const T* w = weight.defined() ? weight.data<T>() : nullptr;
    if (dx.defined()) {
      T* pdx = dx.data<T>();
#pragma omp parallel for if (rows * cols > kParallelGrain) schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        const T* row = px + r * cols;
        const T* g = pg + r * cols;
        const double mu = double(pm[r]), rs = double(pr[r]);
        // dx = rstd·(gw - mean(gw) - x̂·mean(gw·x̂)), gw = dy·w.
        double sg = 0, sgx = 0;
        for (int64_t j = 0; j < cols; ++j) {
          const double gw = double(g[j]) * (w ? double(w[j]) : 1.0);
          sg += gw;
          sgx += gw * (double(row[j]) - mu) * rs;
        }
        sg /= double(cols);
        sgx /= double(cols);
        T* d = pdx + r * cols;
        for (int64_t j = 0; j < cols; ++j) {
          const double gw = double(g[j]) * (w ? double(w[j]) : 1.0);
          const double xh = (double(row[j]) - mu) * rs;
          const T v = T(rs * (gw - sg - xh * sgx));
          d[j] = dx_add ? T(double(d[j]) + double(v)) : v;  // v rounded first, as an add's
        }
      }
    }
    if (!dweight.defined() && !dbias.defined()) return;
    // dweight = Σ_rows dy·x̂, dbias = Σ_rows dy: column sums, one thread per column block.
    const bool add = mode == GradientMode::Accumulate;
    T* dw = dweight.defined() ? dweight.data<T>() : nullptr;
    T* db = dbias.defined() ? dbias.data<T>() : nullptr;
#pragma omp parallel for if (rows * cols > kParallelGrain) schedule(static)
    for (int64_t j = 0; j < cols; ++j) {
      double sw = 0, sb = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const double g = double(pg[r * cols + j]);
        sw += g * (double(px[r * cols + j]) - double(pm[r])) * double(pr[r]);
        sb += g;
      }
      // `+=` adds the sum rounded to T, as adding a separately computed gradient would.
      if (dw) dw[j] = add ? T(double(dw[j]) + double(T(sw))) : T(sw);
      if (db) db[j] = add ? T(double(db[j]) + double(T(sb))) : T(sb);
    }
  });
}

}  // namespace kiln::cpu
