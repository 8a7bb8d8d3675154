// CPU dropout on Philox (core/philox.h): the same draws as the CUDA kernel, element for element.
#include "core/philox.h"
#include "ops/cpu/kernels.h"

namespace kiln::cpu {

void philox_advance(const Tensor& base, const Tensor& offset, int64_t n) {
  int64_t* o = offset.data<int64_t>();
  *base.data<int64_t>() = *o;
  *o += (n + 3) / 4 * 4;  // whole Philox blocks: each stream starts on a block of its own
}

void dropout(const Tensor& out, const Tensor& in, double p, uint64_t seed, const Tensor& base) {
  dispatch_float(in.dtype(), "dropout", [&]<typename T>() {
    const T* x = in.data<T>();
    T* y = out.data<T>();
    const uint64_t b = uint64_t(*base.data<int64_t>());
    const int64_t n = in.numel();
    const float keep = float(p);  // an element is kept when its uniform is >= p
    const T scale = T(1.0 / (1.0 - p));
#pragma omp parallel for if (n > 65536) schedule(static)
    for (int64_t i = 0; i < n; ++i)
      y[i] = philox::uniform(seed, b + uint64_t(i)) >= keep ? x[i] * scale : T(0);
  });
}

}  // namespace kiln::cpu
