// Input-pipeline kernels: u8 NHWC -> normalised float NHWC, the gather + crop + flip + normalise
// of a device-resident dataset, and the synthetic source.
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

// One thread per output element, in x's memory order. The arithmetic mirrors
// data::crop_flip_normalize: output (h, w) reads source (h + top - pad, w' + left - pad) with
// w' = W - 1 - w when flipped; outside the image it reads pixel 0, or with `reflect` the pixel
// mirrored about the edge (data::reflect_index).
template <typename T, bool kChannelsLast>
__global__ void gather_crop_flip_normalize_kernel(T* __restrict__ x, int64_t* __restrict__ y,
                                                  const uint8_t* __restrict__ images,
                                                  const int64_t* __restrict__ labels,
                                                  const GatherJob* __restrict__ jobs,
                                                  const float* __restrict__ lut, int64_t B,
                                                  int64_t C, int64_t H, int64_t W, int64_t pad,
                                                  bool reflect) {
  const int64_t n = B * C * H * W;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < n; i += step) {
    int64_t b, c, h, w, r = i;
    if constexpr (kChannelsLast) {
      c = r % C, r /= C;
      w = r % W, r /= W;
      h = r % H, b = r / H;
    } else {
      w = r % W, r /= W;
      h = r % H, r /= H;
      c = r % C, b = r / C;
    }
    const GatherJob j = jobs[b];
    int64_t sh = h + j.top - pad;
    int64_t sw = (j.flip ? W - 1 - w : w) + j.left - pad;
    if (reflect) {
      sh = sh < 0 ? -sh : (sh >= H ? 2 * H - 2 - sh : sh);
      sw = sw < 0 ? -sw : (sw >= W ? 2 * W - 2 - sw : sw);
    }
    const bool inside = sh >= 0 && sh < H && sw >= 0 && sw < W;
    const uint8_t p = inside ? images[((int64_t(j.index) * C + c) * H + sh) * W + sw] : 0;
    x[i] = cvt<T>(lut[c * 256 + p]);
  }
  if (y)
    for (int64_t i = first; i < B; i += step) y[i] = labels[jobs[i].index];
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

void gather_crop_flip_normalize(const Tensor& x, const Tensor& y, const Tensor& images,
                                const Tensor& labels, const Tensor& jobs, int64_t pad,
                                const Tensor& lut, bool reflect) {
  const char* op = "gather_crop_flip_normalize";
  KILN_CHECK(x.defined() && images.defined() && labels.defined() && jobs.defined() && lut.defined(),
             op, ": undefined tensor");
  KILN_CHECK(images.dtype() == DType::u8 && images.dim() == 4 && images.is_contiguous() &&
                 images.device().is_cuda(),
             op, ": images must be u8 (N, C, H, W) contiguous on a CUDA device, got ",
             images.desc());
  const int64_t N = images.size(0), C = images.size(1), H = images.size(2), W = images.size(3);
  KILN_CHECK(x.dtype() == DType::f32 || x.dtype() == DType::f16, op, ": x must be f32 or f16, got ",
             x.desc());
  const bool channels_last =
      x.dim() == 4 && !x.is_contiguous() && x.is_contiguous(MemoryFormat::ChannelsLast);
  KILN_CHECK(x.dim() == 4 && x.size(1) == C && x.size(2) == H && x.size(3) == W &&
                 (channels_last || x.is_contiguous()),
             op, ": x must be (B, ", C, ", ", H, ", ", W,
             ") contiguous or channels-last to match images ", images.desc(), ", got ", x.desc());
  const int64_t B = x.size(0);
  KILN_CHECK(jobs.dtype() == DType::i32 && jobs.dim() == 2 && jobs.size(0) == B &&
                 jobs.size(1) == 4 && jobs.is_contiguous(),
             op, ": jobs must be i32 (", B, ", 4) contiguous for x ", x.desc(), ", got ",
             jobs.desc());
  KILN_CHECK(labels.dtype() == DType::i64 && labels.dim() == 1 && labels.size(0) == N &&
                 labels.is_contiguous(),
             op, ": labels must be i64 (", N, ") contiguous for images ", images.desc(), ", got ",
             labels.desc());
  KILN_CHECK(!y.defined() ||
                 (y.dtype() == DType::i64 && y.dim() == 1 && y.size(0) == B && y.is_contiguous()),
             op, ": y must be i64 (", B, ") contiguous for x ", x.desc(), ", got ", y.desc());
  KILN_CHECK(
      lut.dtype() == DType::f32 && lut.dim() == 1 && lut.size(0) == C * 256 && lut.is_contiguous(),
      op, ": lut must be f32 (", C * 256, ") contiguous (C x 256 for images ", images.desc(),
      "), got ", lut.desc());
  KILN_CHECK(pad >= 0, op, ": pad must be >= 0, got ", pad);
  KILN_CHECK(!reflect || (pad < H && pad < W), op, ": reflect padding of ", pad,
             " needs images larger than it, got ", images.desc());
  for (const Tensor* t : {&x, &y, &labels, &jobs, &lut})
    KILN_CHECK(!t->defined() || t->device() == images.device(), op,
               ": all tensors must be on images' device ", images.device().str(), ", got ",
               t->desc());
  const int64_t n = x.numel();
  if (n == 0) return;
  auto launch = [&]<typename T, bool kChannelsLast>() {
    gather_crop_flip_normalize_kernel<T, kChannelsLast>
        <<<grid_for(n), kBlock, 0, current_stream()>>>(
            static_cast<T*>(x.raw_data()),
            y.defined() ? static_cast<int64_t*>(y.raw_data()) : nullptr,
            static_cast<const uint8_t*>(images.raw_data()),
            static_cast<const int64_t*>(labels.raw_data()),
            static_cast<const GatherJob*>(jobs.raw_data()),
            static_cast<const float*>(lut.raw_data()), B, C, H, W, pad, reflect);
  };
  if (x.dtype() == DType::f32)
    channels_last ? launch.operator()<float, true>() : launch.operator()<float, false>();
  else
    channels_last ? launch.operator()<__half, true>() : launch.operator()<__half, false>();
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
