#include "data/device_batches.h"

#include <exception>

#include "core/error.h"
#include "core/hash.h"
#ifdef KILN_WITH_CUDA
#include "cuda/check.h"
#include "cuda/normalize.h"
#include "cuda/runtime.h"
#endif

namespace kiln::data {
namespace {

// The host batch normalised on the CPU: x f32 (B, 3, H, W) contiguous, y i64 (B) owned.
DeviceBatch normalize_on_cpu(const ImageBatch& b, const NormalizeStats& st) {
  const int64_t B = b.images.size(0), H = b.images.size(1), W = b.images.size(2);
  DeviceBatch out;
  out.index = b.index;
  out.x = empty({B, 3, H, W}, DType::f32);
  normalize_nhwc_to_nchw(b.images.data<uint8_t>(), B, H, W, st.mean, st.stddev,
                         out.x.data<float>());
  out.y = b.labels.clone();  // detach from the recycled batch buffer
  return out;
}

}  // namespace

#ifdef KILN_WITH_CUDA
struct DeviceFeeder::Gpu {
  struct Slot {
    Tensor staging;   // u8 on the device: the host batch's whole buffer (pixels, labels)
    ImageBatch host;  // kept until its upload is known to be complete
    cudaEvent_t copied = nullptr;    // on the copy stream, after the upload
    cudaEvent_t consumed = nullptr;  // on the compute stream, after the last read of staging
    bool pending = false;            // holds a batch not yet returned
  };
  Slot slots[2];
  int cur = 0;
  bool primed = false;
  std::exception_ptr deferred;  // an error fetching the next batch, raised on the next call
  cudaStream_t copy = nullptr;
  Device device;

  explicit Gpu(Device d) : device(d) {
    KILN_CHECK(cuda::current_device() == d.index, "DeviceFeeder: ", d.str(),
               " is not the current device (", cuda::current_device(), ")");
    copy = cuda::context(d.index).copy;
    for (Slot& s : slots) {
      CUDA_CHECK(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming));
      CUDA_CHECK(cudaEventCreateWithFlags(&s.consumed, cudaEventDisableTiming));
      CUDA_CHECK(cudaEventRecord(s.consumed, cuda::current_stream()));
    }
  }
  ~Gpu() {
    // Pinned host buffers go back to the pool (and may be refilled) only after their upload.
    for (Slot& s : slots) {
      if (s.copied) cudaEventSynchronize(s.copied);
      if (s.consumed) cudaEventSynchronize(s.consumed);
      if (s.copied) cudaEventDestroy(s.copied);
      if (s.consumed) cudaEventDestroy(s.consumed);
    }
  }

  void upload(Slot& s, ImageBatch b) {
    const Storage& hs = *b.images.storage();
    const auto bytes = int64_t(hs.nbytes());
    if (s.host.images.defined()) CUDA_CHECK(cudaEventSynchronize(s.copied));
    s.host = ImageBatch{};
    if (!s.staging.defined() || s.staging.numel() < bytes) {
      s.staging = empty({bytes}, TensorOptions(DType::u8).with_device(device));
      // The block may have been in use on the compute stream: order the upload after it.
      CUDA_CHECK(cudaEventRecord(s.consumed, cuda::current_stream()));
    }
    CUDA_CHECK(cudaStreamWaitEvent(copy, s.consumed, 0));
    CUDA_CHECK(cudaMemcpyAsync(s.staging.raw_data(), hs.data(), size_t(bytes),
                               cudaMemcpyHostToDevice, copy));
    CUDA_CHECK(cudaEventRecord(s.copied, copy));
    s.host = std::move(b);
    s.pending = true;
  }

  void fetch_into(ImageEpoch& ep, Slot& s) {
    try {
      if (std::optional<ImageBatch> b = ep.next()) upload(s, std::move(*b));
    } catch (...) {
      deferred = std::current_exception();
    }
  }

  std::optional<DeviceBatch> next(ImageEpoch& ep, DType dtype, const NormalizeStats& st) {
    if (!primed) {
      primed = true;
      if (std::optional<ImageBatch> b = ep.next()) upload(slots[0], std::move(*b));
    }
    if (deferred) std::rethrow_exception(std::exchange(deferred, nullptr));
    Slot& s = slots[cur];
    if (!s.pending) return std::nullopt;
    const Tensor& hi = s.host.images;
    const int64_t B = hi.size(0), H = hi.size(1), W = hi.size(2);
    cudaStream_t stream = cuda::current_stream();
    CUDA_CHECK(cudaStreamWaitEvent(stream, s.copied, 0));
    // The staging buffer mirrors the host buffer byte for byte: same offsets for both views.
    const int64_t label_off = s.host.labels.offset() * int64_t(sizeof(int64_t));
    Tensor pixels = s.staging.narrow(0, 0, B * H * W * 3).view({B, H, W, 3});
    Tensor labels = make_tensor(s.staging.storage(), label_off / int64_t(sizeof(int64_t)), {B}, {1},
                                DType::i64);
    DeviceBatch out;
    out.index = s.host.index;
    out.x = empty({B, 3, H, W}, TensorOptions(dtype).with_device(device).with_memory_format(
                                    MemoryFormat::ChannelsLast));
    cuda::normalize_images(out.x, pixels, st.mean, st.stddev);
    out.y = empty({B}, TensorOptions(DType::i64).with_device(device));
    out.y.copy_(labels);
    CUDA_CHECK(cudaEventRecord(s.consumed, stream));
    s.pending = false;
    cur ^= 1;
    fetch_into(ep, slots[cur]);
    return out;
  }
};
#else
struct DeviceFeeder::Gpu {};
#endif

DeviceFeeder::DeviceFeeder(ImageEpoch& epoch, Device device, DType dtype, NormalizeStats stats)
    : epoch_(&epoch), device_(device), dtype_(dtype), stats_(stats) {
  for (int c = 0; c < 3; ++c)
    KILN_CHECK(stats.stddev[c] > 0.0f, "DeviceFeeder: stddev[", c, "] must be > 0");
  if (device.is_cpu()) {
    KILN_CHECK(dtype == DType::f32, "DeviceFeeder: the CPU output is f32, got ", dtype_name(dtype));
    return;
  }
#ifdef KILN_WITH_CUDA
  KILN_CHECK(dtype == DType::f32 || dtype == DType::f16,
             "DeviceFeeder: the CUDA output is f32 or f16, got ", dtype_name(dtype));
  gpu_ = std::make_unique<Gpu>(device);
#else
  KILN_FAIL("DeviceFeeder: ", device.str(), " requested, but kiln was built without CUDA");
#endif
}

DeviceFeeder::~DeviceFeeder() = default;

std::optional<DeviceBatch> DeviceFeeder::next() {
#ifdef KILN_WITH_CUDA
  if (gpu_) return gpu_->next(*epoch_, dtype_, stats_);
#endif
  std::optional<ImageBatch> b = epoch_->next();
  if (!b) return std::nullopt;
  return normalize_on_cpu(*b, stats_);
}

// ---------------------------------------------------------------------------------------------

SyntheticImages::SyntheticImages(int64_t batch_size, int64_t image_size, int64_t classes,
                                 Device device, DType dtype, uint64_t seed, NormalizeStats stats)
    : batch_size_(batch_size),
      image_size_(image_size),
      classes_(classes),
      device_(device),
      dtype_(dtype),
      seed_(seed),
      stats_(stats) {
  KILN_CHECK(batch_size >= 1 && image_size >= 1 && classes >= 1, "SyntheticImages: batch_size (",
             batch_size, "), image_size (", image_size, ") and classes (", classes,
             ") must be >= 1");
  KILN_CHECK(dtype == DType::f32 || (device.is_cuda() && dtype == DType::f16),
             "SyntheticImages: output dtype must be f32 (or f16 on CUDA), got ", dtype_name(dtype));
#ifndef KILN_WITH_CUDA
  KILN_CHECK(device.is_cpu(), "SyntheticImages: ", device.str(),
             " requested, but kiln was built without CUDA");
#endif
}

uint64_t SyntheticImages::batch_seed(int64_t k) const {
  return splitmix64(seed_ ^ splitmix64(uint64_t(k)));
}

Tensor SyntheticImages::pixels_cpu(int64_t k) const {
  const int64_t S = image_size_;
  Tensor px = empty({batch_size_, S, S, 3}, DType::u8);
  uint8_t* p = px.data<uint8_t>();
  const uint64_t seed = batch_seed(k);
  for (int64_t i = 0; i < px.numel(); ++i) p[i] = synthetic_byte(seed, i);
  return px;
}

DeviceBatch SyntheticImages::next() {
  const int64_t k = k_++, B = batch_size_;
  const uint64_t seed = batch_seed(k);
  if (device_.is_cpu()) {
    ImageBatch b;
    b.index = k;
    b.images = pixels_cpu(k);
    b.labels = empty({B}, DType::i64);
    int64_t* y = b.labels.data<int64_t>();
    for (int64_t i = 0; i < B; ++i) y[i] = synthetic_label(seed, i, classes_);
    return normalize_on_cpu(b, stats_);
  }
#ifdef KILN_WITH_CUDA
  const int64_t S = image_size_;
  Tensor px = empty({B, S, S, 3}, TensorOptions(DType::u8).with_device(device_));
  cuda::fill_synthetic_bytes(px, seed);
  DeviceBatch out;
  out.index = k;
  out.x = empty({B, 3, S, S}, TensorOptions(dtype_).with_device(device_).with_memory_format(
                                  MemoryFormat::ChannelsLast));
  cuda::normalize_images(out.x, px, stats_.mean, stats_.stddev);
  out.y = empty({B}, TensorOptions(DType::i64).with_device(device_));
  cuda::fill_synthetic_labels(out.y, seed, classes_);
  return out;
#else
  KILN_FAIL("SyntheticImages: built without CUDA");
#endif
}

}  // namespace kiln::data
