// Input-pipeline kernels: u8 NHWC -> normalised float NHWC, and the synthetic source.
#include "cuda/kernels/common.cuh"
#include "cuda/normalize.h"
#include "core/hash.h"

namespace kiln::cuda {
namespace {

struct ChannelAffine {
  float mean[3];
  float stddev[3];
};

// Elements are visited in memory order; in and out share the NHWC layout, so element i has
// channel i % 3. Division (not a reciprocal multiply) keeps the result equal to the CPU's.
template <typename T>
__global__ void normalize_kernel(T* __restrict__ out, const uint8_t* __restrict__ in,
                                 ChannelAffine a, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(i % 3);
    const float v = (float(in[i]) / 255.0f - a.mean[c]) / a.stddev[c];
    out[i] = cvt<T>(v);
  }
}

__global__ void synthetic_bytes_kernel(uint8_t* __restrict__ out, uint64_t seed, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = synthetic_byte(seed, i);
}

__global__ void synthetic_labels_kernel(int64_t* __restrict__ out, uint64_t seed, int64_t classes,
                                        int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = synthetic_label(seed, i, classes);
}

}  // namespace

void normalize_images(const Tensor& out, const Tensor& in, const float mean[3],
                      const float stddev[3]) {
  KILN_CHECK(in.defined() && out.defined(), "normalize_images: undefined tensor");
  KILN_CHECK(in.dtype() == DType::u8 && in.dim() == 4 && in.size(3) == 3 && in.is_contiguous(),
             "normalize_images: input must be u8 (N, H, W, 3) contiguous, got ", in.desc());
  KILN_CHECK(out.dtype() == DType::f32 || out.dtype() == DType::f16,
             "normalize_images: output must be f32 or f16, got ", out.desc());
  KILN_CHECK(out.dim() == 4 && out.shape() == Shape({in.size(0), 3, in.size(1), in.size(2)}) &&
                 out.is_contiguous(MemoryFormat::ChannelsLast),
             "normalize_images: output must be (N, 3, H, W) channels-last matching input ",
             in.desc(), ", got ", out.desc());
  KILN_CHECK(in.device().is_cuda() && out.device() == in.device(),
             "normalize_images: tensors must be on one CUDA device, got ", in.desc(), " and ",
             out.desc());
  for (int c = 0; c < 3; ++c)
    KILN_CHECK(stddev[c] > 0.0f, "normalize_images: stddev[", c, "] must be > 0");
  const int64_t n = in.numel();
  if (n == 0) return;
  ChannelAffine a{};
  for (int c = 0; c < 3; ++c) {
    a.mean[c] = mean[c];
    a.stddev[c] = stddev[c];
  }
  cudaStream_t stream = current_stream();
  const auto* src = static_cast<const uint8_t*>(in.raw_data());
  if (out.dtype() == DType::f32)
    normalize_kernel<float>
        <<<grid_for(n), kBlock, 0, stream>>>(static_cast<float*>(out.raw_data()), src, a, n);
  else
    normalize_kernel<__half>
        <<<grid_for(n), kBlock, 0, stream>>>(static_cast<__half*>(out.raw_data()), src, a, n);
  KILN_CUDA_CHECK_LAUNCH();
}

void fill_synthetic_bytes(const Tensor& out, uint64_t seed) {
  KILN_CHECK(out.dtype() == DType::u8 && out.is_contiguous() && out.device().is_cuda(),
             "fill_synthetic_bytes: need a contiguous u8 CUDA tensor, got ", out.desc());
  const int64_t n = out.numel();
  if (n == 0) return;
  synthetic_bytes_kernel<<<grid_for(n), kBlock, 0, current_stream()>>>(
      static_cast<uint8_t*>(out.raw_data()), seed, n);
  KILN_CUDA_CHECK_LAUNCH();
}

void fill_synthetic_labels(const Tensor& labels, uint64_t seed, int64_t classes) {
  KILN_CHECK(labels.dtype() == DType::i64 && labels.dim() == 1 && labels.is_contiguous() &&
                 labels.device().is_cuda(),
             "fill_synthetic_labels: need contiguous i64 (N) on CUDA, got ", labels.desc());
  KILN_CHECK(classes >= 1, "fill_synthetic_labels: classes must be >= 1, got ", classes);
  const int64_t n = labels.numel();
  if (n == 0) return;
  synthetic_labels_kernel<<<grid_for(n), kBlock, 0, current_stream()>>>(
      static_cast<int64_t*>(labels.raw_data()), seed, classes, n);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda
