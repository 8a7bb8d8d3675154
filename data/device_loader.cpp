#include "data/device_loader.h"

#include <cstdint>
#include <limits>

#include "core/device_query.h"
#include "core/error.h"
#ifdef KILN_WITH_CUDA
#include "cuda/check.h"
#include "cuda/normalize.h"
#include "cuda/runtime.h"
#endif

namespace kiln::data {

#ifdef KILN_WITH_CUDA
namespace {

// Owners of the ring's CUDA resources, so a constructor that throws half-way leaks nothing.
struct Event {
  cudaEvent_t e = nullptr;
  Event() { CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); }
  ~Event() {
    if (e) cudaEventDestroy(e);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};
struct PinnedJobs {
  cuda::GatherJob* p;
  explicit PinnedJobs(size_t n)
      : p(static_cast<cuda::GatherJob*>(cuda::alloc_pinned(n * sizeof(cuda::GatherJob)))) {}
  ~PinnedJobs() {
    // Not free_pinned: a destructor must not throw. Leaked after a stuck stream, as there.
    if (p && !cuda::stream_stuck()) cudaFreeHost(p);
  }
  PinnedJobs(const PinnedJobs&) = delete;
  PinnedJobs& operator=(const PinnedJobs&) = delete;
};

}  // namespace

struct DeviceLoader::Gpu {
  DataLoader host;
  Device device;
  DType dtype;
  MemoryFormat format;
  Tensor images, labels, lut;  // u8 (N, C, H, W), i64 (N), f32 (C * 256), on the device
  // The plan ring: slot s holds batch_size jobs at pinned.p + s * batch_size and at
  // jobs.select(0, s) on the device; done[s] is recorded after the kernel that read slot s.
  PinnedJobs pinned;
  Tensor jobs;  // i32 (kSlots, batch_size, 4)
  Event done[kSlots];
  bool used[kSlots] = {};
  int next_slot = 0;

  Gpu(const DataLoader& loader, Device dev, DType dt, MemoryFormat fmt)
      : host(loader),
        device(dev),
        dtype(dt),
        format(fmt),
        pinned(size_t(kSlots * loader.options().batch_size)) {
    KILN_CHECK(cuda::current_device() == dev.index, "DeviceLoader: ", dev.str(),
               " is not the current device (cuda:", cuda::current_device(), ")");
    const TensorDataset& ds = host.dataset();
    const auto opts = TensorOptions(DType::f32).with_device(dev);
    images = ds.images().to(dev);
    labels = ds.labels().to(dev);
    lut = from_vector(host.lut(), {ds.channels() * 256}, opts);
    jobs = empty({kSlots, host.options().batch_size, 4}, opts.with_dtype(DType::i32));
  }
  ~Gpu() {
    // The pinned ring is freed with the object: the copies reading it must have finished.
    for (int s = 0; s < kSlots; ++s)
      if (used[s]) cudaEventSynchronize(done[s].e);
  }

  // Queues batch `plan` on the current stream into fresh out.x and out.y.
  void gather(const BatchPlan& plan, DeviceBatch& out) {
    cuda::check_not_capturing("DeviceEpoch::next", "it uploads from a pinned ring reused later");
    const int s = next_slot;
    next_slot = (next_slot + 1) % kSlots;
    // The only wait on the device: for the kernel of the batch kSlots calls back.
    if (used[s]) CUDA_CHECK(cudaEventSynchronize(done[s].e));
    const auto B = int64_t(plan.indices.size());
    cuda::GatherJob* job = pinned.p + s * host.options().batch_size;
    for (int64_t i = 0; i < B; ++i) {
      const SampleTransform& t = plan.transforms[size_t(i)];
      job[i] = {int32_t(plan.indices[size_t(i)]), int32_t(t.top), int32_t(t.left), int32_t(t.flip)};
    }
    cudaStream_t stream = cuda::current_stream();
    const Tensor slot_jobs = jobs.select(0, s).narrow(0, 0, B);
    CUDA_CHECK(cudaMemcpyAsync(slot_jobs.raw_data(), job, size_t(B) * sizeof(cuda::GatherJob),
                               cudaMemcpyHostToDevice, stream));
    const TensorDataset& ds = host.dataset();
    out.x = empty({B, ds.channels(), ds.height(), ds.width()},
                  TensorOptions(dtype).with_device(device).with_memory_format(format));
    out.y = empty({B}, TensorOptions(DType::i64).with_device(device));
    cuda::gather_crop_flip_normalize(out.x, out.y, images, labels, slot_jobs,
                                     host.options().crop_padding, lut,
                                     host.options().padding == Padding::Reflect);
    CUDA_CHECK(cudaEventRecord(done[s].e, stream));
    used[s] = true;
  }
};
#else
struct DeviceLoader::Gpu {
  DataLoader host;
  void gather(const BatchPlan&, DeviceBatch&) { KILN_FAIL("DeviceLoader: built without CUDA"); }
};
#endif

DeviceLoader::DeviceLoader(const DataLoader& loader, Device device, DType dtype,
                           MemoryFormat format) {
  KILN_CHECK(dtype == DType::f32 || dtype == DType::f16,
             "DeviceLoader: the output dtype must be f32 or f16, got ", dtype_name(dtype));
  KILN_CHECK(format == MemoryFormat::Contiguous || format == MemoryFormat::ChannelsLast,
             "DeviceLoader: the output memory format must be Contiguous or ChannelsLast");
  KILN_CHECK(!loader.options().on_batch,
             "DeviceLoader: the loader has an on_batch hook, which runs on CPU batches; the "
             "device path cannot call it");
  KILN_CHECK(loader.dataset().size() <= std::numeric_limits<int32_t>::max(),
             "DeviceLoader: ", loader.dataset().size(),
             " samples; the gather kernel indexes them with 32 bits");
  KILN_CHECK(device.is_cuda(), "DeviceLoader: needs a CUDA device, got ", device.str(),
             " (use the DataLoader itself on the CPU)");
  KILN_CHECK(built_with_cuda(), "DeviceLoader: ", device.str(),
             " requested, but kiln was built without CUDA");
  KILN_CHECK(device.index < cuda_device_count(), "DeviceLoader: ", device.str(), " requested, but ",
             cuda_device_count(), " CUDA device(s) are visible");
#ifdef KILN_WITH_CUDA
  gpu_ = std::make_shared<Gpu>(loader, device, dtype, format);
#endif
}

DeviceLoader::~DeviceLoader() = default;

const DataLoader& DeviceLoader::host() const { return gpu_->host; }
int64_t DeviceLoader::num_batches() const { return gpu_->host.num_batches(); }
DeviceEpoch DeviceLoader::epoch(int64_t e, int64_t first) const {
  KILN_CHECK(first >= 0 && first <= num_batches(), "DeviceLoader::epoch: first batch ", first,
             " of an epoch of ", num_batches(), " batches");
  return DeviceEpoch(gpu_, e, first);
}

DeviceEpoch::DeviceEpoch(std::shared_ptr<DeviceLoader::Gpu> gpu, int64_t epoch, int64_t first)
    : gpu_(std::move(gpu)), epoch_(epoch), first_(first), k_(first) {
  order_ = gpu_->host.order(epoch);
  num_batches_ = gpu_->host.num_batches();
}

int64_t DeviceEpoch::size() const { return num_batches_ - first_; }

std::optional<DeviceBatch> DeviceEpoch::next() {
  if (k_ == num_batches_) return std::nullopt;
  gpu_->host.batch_plan(epoch_, k_, order_, plan_);
  DeviceBatch out;
  out.index = k_++;
  gpu_->gather(plan_, out);
  return out;
}

}  // namespace kiln::data
