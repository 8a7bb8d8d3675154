// The fused crop + resize + flip + normalise kernel of the GPU input path (cuda/crop_resize.h).
#include "cuda/crop_resize.h"
#include "cuda/kernels/common.cuh"

namespace kiln::cuda {
namespace {

struct ChannelAffine {
  float mean[3];
  float stddev[3];
};

// The taps of one output coordinate, as data/transforms.cpp's plan_axis computes them: output i
// covers source [origin + i * scale, origin + (i + 1) * scale); a triangle of half-width
// support = max(scale, 1) around its centre, restricted to [lo, hi), weights normalised.
struct Taps {
  int first, last;  // inclusive
  float center, inv_support, inv_total;
};

__device__ inline Taps taps_for(int i, float origin, float scale, int lo, int hi) {
  Taps t;
  const float support = fmaxf(scale, 1.0f);
  t.center = origin + (float(i) + 0.5f) * scale;
  t.inv_support = 1.0f / support;
  t.first = max(lo, int(floorf(t.center - support - 0.5f)));
  t.last = min(hi - 1, int(ceilf(t.center + support - 0.5f)));
  float total = 0.0f;
  for (int j = t.first; j <= t.last; ++j)
    total += fmaxf(0.0f, 1.0f - fabsf((float(j) + 0.5f - t.center) * t.inv_support));
  if (total <= 0.0f) {  // a centre outside [lo, hi): nearest pixel, as the CPU's guard
    t.first = t.last = min(max(int(t.center), lo), hi - 1);
    t.inv_support = 0.0f;  // weight 1 below
    total = 1.0f;
  }
  t.inv_total = 1.0f / total;
  return t;
}

__device__ inline float weight(const Taps& t, int j) {
  return fmaxf(0.0f, 1.0f - fabsf((float(j) + 0.5f - t.center) * t.inv_support)) * t.inv_total;
}

// grid (ceil(S * S / kBlock), N): one thread per output pixel, three channels.
template <typename T>
__global__ void crop_resize_kernel(T* __restrict__ out, const CropResizeJob* __restrict__ jobs,
                                   int S, ChannelAffine a) {
  const int n = blockIdx.y;
  const int pix = blockIdx.x * blockDim.x + threadIdx.x;
  if (pix >= S * S) return;
  const CropResizeJob job = jobs[n];
  const int oy = pix / S, ox = pix % S;
  const int sx = job.flip ? S - 1 - ox : ox;
  const Taps ty = taps_for(oy, job.box_top, job.box_height / float(S), job.lim_top,
                           job.lim_top + job.lim_height);
  const Taps tx = taps_for(sx, job.box_left, job.box_width / float(S), job.lim_left,
                           job.lim_left + job.lim_width);
  float acc[3] = {0.0f, 0.0f, 0.0f};
  for (int r = ty.first; r <= ty.last; ++r) {
    const float wy = weight(ty, r);
    if (wy == 0.0f) continue;
    const uint8_t* row = job.src + int64_t(r) * job.pitch;
    float racc[3] = {0.0f, 0.0f, 0.0f};
    for (int c = tx.first; c <= tx.last; ++c) {
      const float wx = weight(tx, c);
      racc[0] += wx * float(row[3 * c]);
      racc[1] += wx * float(row[3 * c + 1]);
      racc[2] += wx * float(row[3 * c + 2]);
    }
    for (int k = 0; k < 3; ++k) acc[k] += wy * racc[k];
  }
  T* o = out + (int64_t(n) * S * S + pix) * 3;
  for (int k = 0; k < 3; ++k) {
    const float v = fminf(fmaxf(acc[k], 0.0f), 255.0f);
    o[k] = cvt<T>((v / 255.0f - a.mean[k]) / a.stddev[k]);
  }
}

}  // namespace

void crop_resize_normalize(const Tensor& out, const CropResizeJob* jobs, int64_t n,
                           const float mean[3], const float stddev[3]) {
  KILN_CHECK(out.defined() && (out.dtype() == DType::f32 || out.dtype() == DType::f16),
             "crop_resize_normalize: output must be f32 or f16, got ",
             out.defined() ? out.desc() : "undefined");
  KILN_CHECK(out.dim() == 4 && out.size(0) == n && out.size(1) == 3 && out.size(2) == out.size(3) &&
                 out.is_contiguous(MemoryFormat::ChannelsLast) && out.device().is_cuda(),
             "crop_resize_normalize: output must be (", n, ", 3, S, S) channels-last on a CUDA "
             "device, got ", out.desc());
  for (int c = 0; c < 3; ++c)
    KILN_CHECK(stddev[c] > 0.0f, "crop_resize_normalize: stddev[", c, "] must be > 0");
  if (n == 0) return;
  KILN_CHECK(n <= 65535, "crop_resize_normalize: at most 65535 samples per call, got ", n);
  ChannelAffine a{};
  for (int c = 0; c < 3; ++c) {
    a.mean[c] = mean[c];
    a.stddev[c] = stddev[c];
  }
  const int S = int(out.size(2));
  const dim3 grid(unsigned((int64_t(S) * S + kBlock - 1) / kBlock), unsigned(n));
  cudaStream_t stream = current_stream();
  if (out.dtype() == DType::f32)
    crop_resize_kernel<float>
        <<<grid, kBlock, 0, stream>>>(static_cast<float*>(out.raw_data()), jobs, S, a);
  else
    crop_resize_kernel<__half>
        <<<grid, kBlock, 0, stream>>>(static_cast<__half*>(out.raw_data()), jobs, S, a);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda
