// CPU kernels of max/argmax along rows and of their backward scatter.
#include <cmath>
#include <cstring>

#include "ops/cpu/kernels.h"

namespace kiln::cpu {
namespace {
constexpr int64_t kParallelGrain = 32768;  // below this, one thread is faster
}  // namespace

void max_rows(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t rows,
              int64_t inner) {
  dispatch_float(x.dtype(), "max", [&]<typename T>() {
    const T* p = x.data<T>();
    T* v = values.data<T>();
    int64_t* ix = indices.data<int64_t>();
#pragma omp parallel for if (rows * inner > kParallelGrain) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = p + r * inner;
      T m = row[0];
      int64_t best = 0;
      // Strict `>` keeps the first of tied maxima; the first NaN wins and ends the search,
      // so values propagate NaN as PyTorch does.
      for (int64_t i = 1; i < inner && !std::isnan(m); ++i) {
        if (row[i] > m || std::isnan(row[i])) {
          m = row[i];
          best = i;
        }
      }
      v[r] = m;
      ix[r] = best;
    }
  });
}

void scatter_rows(const Tensor& dx, const Tensor& g, const Tensor& indices, int64_t rows,
                  int64_t inner) {
  dispatch_float(dx.dtype(), "max backward", [&]<typename T>() {
    T* d = dx.data<T>();
    const T* gp = g.data<T>();
    const int64_t* ix = indices.data<int64_t>();
    if (rows * inner > 0) std::memset(static_cast<void*>(d), 0, size_t(rows * inner) * sizeof(T));
    for (int64_t r = 0; r < rows; ++r) d[r * inner + ix[r]] = gp[r];
  });
}

}  // namespace kiln::cpu
