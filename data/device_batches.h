#pragma once
// Normalised image batches where training runs: DeviceFeeder turns an ImageLoader epoch's u8
// batches (data/image_loader.h) into float tensors on a device; SyntheticImages makes random
// batches of the same form for benchmarks, without files or decoding.
//
//   ImageEpoch ep = loader.epoch(e);
//   DeviceFeeder feed(ep, Device::cuda(0), DType::f16);
//   while (std::optional<DeviceBatch> b = feed.next()) train_step(b->x, b->y);
//
// Output: x (B, 3, H, W) = (pixel / 255 - mean[c]) / stddev[c] (ImageNet statistics by default);
//   CUDA: f32 or f16, channels-last (NHWC in memory), y i64 (B) on the device;
//   CPU:  f32, contiguous NCHW, y i64 (B).
//
// CUDA overlap: next() returns batch k after queuing (a) on the current stream, a wait for the
// copy of batch k, the normalise kernel (cuda/normalize.h) and the label copy, then (b) fetches
// host batch k + 1 from the epoch (waiting for the workers if it is not ready) and queues its
// pinned-memory upload on the context's copy stream. So the upload of k + 1 runs while the
// GPU computes on k; the host never waits for the device except, at worst, for the upload
// issued two calls earlier before its host buffer is recycled. Two device staging buffers
// alternate; the copy into one waits (an event, on the device) until the normalise kernel
// that read it has run. Use one feeder from one thread, on the device's current stream.
#include <cstdint>
#include <memory>
#include <optional>

#include "core/tensor.h"
#include "data/image_loader.h"

namespace kiln::data {

struct DeviceBatch {
  Tensor x;  // (B, 3, H, W) normalised; see above for dtype and layout
  Tensor y;  // i64 (B)
  int64_t index = 0;
};

struct NormalizeStats {
  float mean[3] = {kImageNetMean[0], kImageNetMean[1], kImageNetMean[2]};
  float stddev[3] = {kImageNetStd[0], kImageNetStd[1], kImageNetStd[2]};
};

class DeviceFeeder {
 public:
  // `epoch` must outlive the feeder. dtype: f32 or f16 on CUDA, f32 on the CPU. Throws
  // kiln::Error for other dtypes, or a CUDA device in a build without CUDA.
  DeviceFeeder(ImageEpoch& epoch, Device device, DType dtype = DType::f32,
               NormalizeStats stats = {});
  ~DeviceFeeder();
  DeviceFeeder(const DeviceFeeder&) = delete;
  DeviceFeeder& operator=(const DeviceFeeder&) = delete;

  std::optional<DeviceBatch> next();

  struct Gpu;  // CUDA staging state (data/device_batches.cpp)

 private:
  ImageEpoch* epoch_;
  Device device_;
  DType dtype_;
  NormalizeStats stats_;
  std::unique_ptr<Gpu> gpu_;
};

// Random batches of a fixed shape generated on `device` (on the GPU by a kernel, so no host
// work or copy is involved): u8 pixels from the counter hash of core/hash.h
// (identical bytes on CPU and GPU for a seed), normalised as DeviceFeeder does, and labels
// uniform in [0, classes). Batch k uses seed mix(seed, k).
class SyntheticImages {
 public:
  SyntheticImages(int64_t batch_size, int64_t image_size, int64_t classes, Device device,
                  DType dtype = DType::f32, uint64_t seed = 0, NormalizeStats stats = {});
  DeviceBatch next();
  // The u8 (B, H, W, 3) pixels of batch k on the CPU (what next() normalises), for tests.
  Tensor pixels_cpu(int64_t k) const;
  uint64_t batch_seed(int64_t k) const;

 private:
  int64_t batch_size_, image_size_, classes_;
  Device device_;
  DType dtype_;
  uint64_t seed_;
  NormalizeStats stats_;
  int64_t k_ = 0;
};

}  // namespace kiln::data
