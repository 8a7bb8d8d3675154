// Dropout on Philox (core/philox.h): element i of a call keeps its value when its uniform from
// the stream (seed, base + i) is >= p — the CPU kernel's draw, so the two agree mask for mask.
// base is read from device memory, where philox_advance_kernel put it: a captured graph reads
// the offset each replay, so every replay draws fresh elements with no host work.
#include "core/philox.h"
#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"

namespace kiln::cuda {
namespace {

__global__ void philox_advance_kernel(int64_t* base, int64_t* offset, int64_t n) {
  pdl_start();
  *base = *offset;
  *offset += (n + 3) / 4 * 4;  // whole blocks: each call's stream starts on a block of its own
}

// One Philox block (four elements) per thread per step.
template <typename T>
__global__ void dropout_kernel(T* out, const T* in, int64_t n, float p, double scale,
                               uint64_t seed, const int64_t* base) {
  pdl_start();
  using C = acc_t<T>;
  const uint64_t b = uint64_t(*base);  // a multiple of 4 (philox_advance)
  const int64_t blocks = (n + 3) / 4;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < blocks; k += step) {
    const philox::Block r = philox::stream_block(seed, (b >> 2) + uint64_t(k));
    for (int j = 0; j < 4; ++j) {
      const int64_t i = 4 * k + j;
      if (i >= n) break;
      out[i] = philox::to_uniform(r.w[j]) >= p ? cvt<T>(cvt<C>(in[i]) * C(scale)) : cvt<T>(C(0));
    }
  }
}

}  // namespace

void philox_advance(const Tensor& base, const Tensor& offset, int64_t n) {
  KILN_CHECK(base.dtype() == DType::i64 && offset.dtype() == DType::i64 && base.is_cuda() &&
                 offset.device() == base.device(),
             "philox_advance (cuda): base and offset must be i64 on one device, got ",
             base.desc(), ", ", offset.desc());
  launch(philox_advance_kernel, 1, 1, 0, current_stream(), static_cast<int64_t*>(base.raw_data()),
         static_cast<int64_t*>(offset.raw_data()), n);
}

void dropout(const Tensor& out, const Tensor& in, double p, uint64_t seed, const Tensor& base) {
  const int64_t n = in.numel();
  if (n == 0) return;
  dispatch_device_float(in.dtype(), "dropout", [&]<typename T>() {
    // The keep test compares f32 uniforms with p rounded to f32, on both backends.
    launch(dropout_kernel<T>, grid_for((n + 3) / 4), kBlock, 0, current_stream(),
           static_cast<T*>(out.raw_data()), static_cast<const T*>(in.raw_data()), n, float(p),
           1.0 / (1.0 - p), seed, static_cast<const int64_t*>(base.raw_data()));
  });
}

}  // namespace kiln::cuda
