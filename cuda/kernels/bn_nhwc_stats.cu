// Batch norm on f16 NHWC activations, the forward statistics: per-channel Σx and Σx² in a fixed
// order, when the convolution did not produce them (contract in cuda/kernels.h; the sums kernel
// and its finishing reduction in bn_nhwc.cuh).
#include "cuda/kernels/bn_nhwc.cuh"

namespace kiln::cuda {
namespace {

// sum and sqsum (C) from the kStatsOfX partials.
__global__ void stats_finish_kernel(float* __restrict__ sum, float* __restrict__ sqsum,
                                    const float* __restrict__ partial, int64_t C, int parts) {
  pdl_start();
  float sums[2];
  if (!finish_sums(partial, C, parts, sums)) return;
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  sum[c] = sums[0];
  sqsum[c] = sums[1];
}

}  // namespace

bool bn_nhwc_supported(const Tensor& x) {
  return x.defined() && x.is_cuda() && x.dtype() == DType::f16 && x.dim() == 4 &&
         x.size(1) % kVec == 0 && x.size(1) > 0 && x.is_contiguous(MemoryFormat::ChannelsLast);
}

void bn_nhwc_stats(const Tensor& sum, const Tensor& sqsum, const Tensor& x) {
  const char* op = "bn_nhwc_stats";
  check_x(x, op);
  const int64_t C = x.size(1), G = C / kVec, rows = x.numel() / C;
  float* s = required(f32_ptr(sum, C, x, op, "sum"), op, "sum");
  float* q = required(f32_ptr(sqsum, C, x, op, "sqsum"), op, "sqsum");
  KILN_CHECK(rows > 0, op, " (cuda): x has no values, got ", x.desc());
  const SumsLaunch L =
      sums_launch(rows, G, reinterpret_cast<const void*>(backward_sums_kernel<kStatsOfX>));
  Tensor partial =
      empty({int64_t(L.parts) * 2 * C}, TensorOptions(DType::f32).with_device(x.device()));
  float* pp = static_cast<float*>(partial.raw_data());
  cudaStream_t st = current_stream();
  launch(backward_sums_kernel<kStatsOfX>, L.grid, L.block, 0, st, nullptr, vec_in(x), nullptr,
         nullptr, nullptr, pp, rows, G, C, L.parts);
  KILN_CUDA_CHECK_LAUNCH();
  launch(stats_finish_kernel, finish_grid(C), kFinishBlock, 0, st, s, q, pp, C, L.parts);
  KILN_CUDA_CHECK_LAUNCH();
}

void bn_nhwc_stats_finish(const Tensor& sum, const Tensor& sqsum, const Tensor& partial,
                          const Tensor& x, int parts) {
  const char* op = "bn_nhwc_stats_finish";
  check_x(x, op);
  const int64_t C = x.size(1);
  float* s = required(f32_ptr(sum, C, x, op, "sum"), op, "sum");
  float* q = required(f32_ptr(sqsum, C, x, op, "sqsum"), op, "sqsum");
  KILN_CHECK(parts > 0 && partial.defined() && partial.dtype() == DType::f32 &&
                 partial.is_contiguous() && partial.numel() >= int64_t(parts) * 2 * C,
             op, " (cuda): partial must hold ", int64_t(parts) * 2 * C, " f32 values, got ",
             partial.defined() ? partial.desc() : "undefined");
  launch(stats_finish_kernel, finish_grid(C), kFinishBlock, 0, current_stream(), s, q,
         static_cast<const float*>(partial.raw_data()), C, parts);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda
