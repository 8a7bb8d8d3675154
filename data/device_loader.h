#pragma once
// DeviceLoader: a DataLoader's batches made on the GPU from a copy of the dataset held there, for
// small-image datasets (MNIST, Fashion-MNIST) whose whole u8 pixel array fits in device memory.
// The host only draws each batch's plan (DataLoader::batch_plan: indices, crop offsets, flips)
// and uploads it, a few bytes per sample; one kernel (cuda::gather_crop_flip_normalize)
// gathers, crops, flips and normalises the pixels and gathers the labels.
//
//   DataLoader cpu(TensorDataset(images, labels), opts);
//   DeviceLoader gpu(cpu, Device::cuda(0), DType::f16, MemoryFormat::ChannelsLast);
//   for (int64_t e = 0; e < epochs; ++e) {
//     DeviceEpoch ep = gpu.epoch(e);
//     while (std::optional<DeviceBatch> b = ep.next()) train_step(b->x, b->y);
//   }
//
// Batches: batch k of epoch e holds the samples and augmentation of the DataLoader's batch k of
// epoch e (same options: shuffle, sampler, drop_last, crop_padding, padding, horizontal_flip,
// alternating_flip, fixed_transform, seed, mean and stddev through its lut()). x (B, C, H, W)
// in the dtype and memory format asked for (its exact strides, also for C = 1, so that
// suggest_memory_format() says so and the network follows): f32
// is bit-identical to the DataLoader's batch, f16 is that value rounded once; so f32 Contiguous
// and f16 ChannelsLast are exactly what amp::prepare_input makes of the CPU batch for FP32 and
// Mixed16. y i64 (B). Both are fresh tensors on the device.
// The DataLoader's `workers`, `prefetch` and `on_batch` do not apply (on_batch is refused).
//
// Streams: next() queues, on kiln::cuda::current_stream(), the upload of the batch's plan from a
// pinned ring of kSlots slots and the gather kernel, then records the slot's event; it returns
// without waiting for the device. The host waits only when it reuses a slot, for the kernel of
// the batch kSlots calls earlier. The dataset is uploaded once, by the constructor.
//
// Threads: one consumer thread. A loader's epochs share its ring (and may outlive the loader);
// use them, and the loader, from that thread, with the loader's device current.
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "data/device_batches.h"
#include "data/loader.h"

namespace kiln::data {

class DeviceEpoch;

class DeviceLoader {
 public:
  static constexpr int kSlots = 4;  // plans in flight: the host may run this far ahead

  // Copies `loader` (its options and a reference to its dataset) and uploads the dataset's
  // images, labels and the normalisation table to `device`. Throws kiln::Error when `device`
  // is not a CUDA device (or kiln was built without CUDA, or there is no such device), for a
  // dtype other than f32 or f16, a memory format other than Contiguous or ChannelsLast, or a
  // loader with an on_batch hook.
  DeviceLoader(const DataLoader& loader, Device device, DType dtype = DType::f32,
               MemoryFormat format = MemoryFormat::Contiguous);
  ~DeviceLoader();

  const DataLoader& host() const;  // the plan's source
  int64_t num_batches() const;
  // Epoch e from batch `first` (DataLoader::epoch's rule; kiln::Error outside [0, num_batches()]).
  DeviceEpoch epoch(int64_t e, int64_t first = 0) const;

  struct Gpu;  // device copies and the pinned plan ring (data/device_loader.cpp)

 private:
  std::shared_ptr<Gpu> gpu_;
};

class DeviceEpoch {
 public:
  // Batch k = first, first + 1, ... in order; std::nullopt after the last.
  std::optional<DeviceBatch> next();
  int64_t size() const;  // batches this epoch hands out (from its first)

 private:
  friend class DeviceLoader;
  DeviceEpoch(std::shared_ptr<DeviceLoader::Gpu> gpu, int64_t epoch, int64_t first);
  std::shared_ptr<DeviceLoader::Gpu> gpu_;
  int64_t epoch_ = 0, first_ = 0, k_ = 0, num_batches_ = 0;
  std::vector<int64_t> order_;
  BatchPlan plan_;  // reused from batch to batch
};

}  // namespace kiln::data
