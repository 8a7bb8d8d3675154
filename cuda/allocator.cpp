// The caching device allocator. Sizes are rounded (512 B below 1 MiB, 2 MiB granularity
// above) so that a training step's repeated requests land on the same buckets; blocks are never
// split, and a cached block is reused only when it is at most twice the rounded request, so a
// small request cannot pin a huge block.
//
// Stream order: a block belongs to the stream current at its allocation. Freeing it returns it
// to that stream's free list, and only later allocations on the same stream reuse it, which is
// safe without a sync because the stream runs its work in order. Cross-stream use: a block
// used on another stream than its own must be freed only after that stream's work is ordered
// before the owning stream (cudaEventRecord on the user stream + cudaStreamWaitEvent on the
// owner), or after a synchronisation; otherwise a later allocation may overwrite it early.
#include "cuda/allocator.h"

#include <array>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "cuda/check.h"
#include "cuda/runtime.h"

namespace kiln::cuda {
namespace {

constexpr size_t kSmallLimit = size_t(1) << 20;  // requests up to 1 MiB are "small"
constexpr size_t kSmallRound = 512;
constexpr size_t kLargeRound = size_t(2) << 20;
constexpr int kMaxDevices = 64;

size_t round_size(size_t n) {
  if (n <= kSmallLimit) return (n + kSmallRound - 1) / kSmallRound * kSmallRound;
  return (n + kLargeRound - 1) / kLargeRound * kLargeRound;
}

struct Block {
  void* ptr = nullptr;
  size_t size = 0;
  cudaStream_t stream = nullptr;
};

// Free lists ordered by (stream, size): lower_bound gives the best fit on one stream.
using FreeKey = std::pair<uintptr_t, size_t>;

class DeviceAllocator final : public Allocator {
 public:
  explicit DeviceAllocator(int device) : device_(device) {}

  void* allocate(size_t nbytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.num_allocs;
    if (nbytes == 0) return nullptr;
    const size_t size = round_size(nbytes);
    cudaStream_t stream = stream_for_device();
    auto it = free_.lower_bound({uintptr_t(stream), size});
    if (it != free_.end() && it->first.first == uintptr_t(stream) &&
        it->first.second <= 2 * size) {
      Block b = it->second;
      free_.erase(it);
      return hand_out(b);
    }
    void* p = cuda_malloc_or_retry(size, nbytes);
    stats_.reserved_bytes += size;
    ++stats_.num_cuda_mallocs;
    return hand_out(Block{p, size, stream});
  }

  void deallocate(void* ptr, size_t) override {
    if (!ptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(ptr);
    KILN_CHECK(it != live_.end(), "cuda allocator (cuda:", device_, "): freeing ", ptr,
               ", which it did not allocate");
    Block b = it->second;
    live_.erase(it);
    stats_.allocated_bytes -= b.size;
    free_.emplace(FreeKey{uintptr_t(b.stream), b.size}, b);
  }

  AllocatorStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.peak_allocated_bytes = stats_.allocated_bytes;
  }

  void empty_cache() {
    std::lock_guard<std::mutex> lock(mutex_);
    release_cached();
  }

 private:
  void* hand_out(const Block& b) {
    live_.emplace(b.ptr, b);
    stats_.allocated_bytes += b.size;
    if (stats_.allocated_bytes > stats_.peak_allocated_bytes)
      stats_.peak_allocated_bytes = stats_.allocated_bytes;
    return b.ptr;
  }

  // The device's current stream when it is the current device, else its compute stream.
  cudaStream_t stream_for_device() {
    return current_device() == device_ ? current_stream() : context(device_).compute;
  }

  // Frees every cached block. Cached blocks may still be read by queued work on their stream,
  // so the device is synchronised first.
  void release_cached() {
    if (free_.empty()) return;
    DeviceScope scope(device_);
    CUDA_CHECK(cudaDeviceSynchronize());
    for (auto& [key, b] : free_) {
      CUDA_CHECK(cudaFree(b.ptr));
      stats_.reserved_bytes -= b.size;
    }
    free_.clear();
  }

  void* cuda_malloc_or_retry(size_t size, size_t requested) {
    DeviceScope scope(device_);
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, size);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear it; the retry decides
      release_cached();
      e = cudaMalloc(&p, size);
    }
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) cudaGetLastError();
      ::kiln::detail::fail(
          ErrorKind::OutOfMemory, __FILE__, __LINE__, nullptr,
          detail::str_cat("CUDA out of memory on cuda:", device_, ": tried to allocate ",
                          requested, " bytes (", size, " rounded); kiln has ",
                          stats_.allocated_bytes, " bytes allocated and ", stats_.reserved_bytes,
                          " bytes reserved; the device has ", free_b, " of ", total_b,
                          " bytes free"));
    }
    CUDA_CHECK(e);
    return p;
  }

  class DeviceScope {
   public:
    explicit DeviceScope(int d) {
      CUDA_CHECK(cudaGetDevice(&prev_));
      if (prev_ != d) CUDA_CHECK(cudaSetDevice(d));
      switched_ = prev_ != d;
    }
    ~DeviceScope() {
      if (switched_) cudaSetDevice(prev_);  // best effort in a destructor
    }

   private:
    int prev_ = 0;
    bool switched_ = false;
  };

  const int device_;
  std::mutex mutex_;
  std::multimap<FreeKey, Block> free_;
  std::unordered_map<void*, Block> live_;
  AllocatorStats stats_;
};

// Never destroyed: tensors released during static destruction still deallocate into them.
std::array<DeviceAllocator*, kMaxDevices> g_allocators{};
std::mutex g_allocators_mutex;

DeviceAllocator& device_allocator(int device) {
  if (device < 0) device = current_device();
  KILN_CHECK(device < device_count() && device < kMaxDevices, "cuda allocator: device ", device,
             " out of range (", device_count(), " CUDA devices visible)");
  std::lock_guard<std::mutex> lock(g_allocators_mutex);
  auto& a = g_allocators[size_t(device)];
  if (!a) a = new DeviceAllocator(device);
  return *a;
}

}  // namespace

Allocator* caching_allocator(int device) { return &device_allocator(device); }
AllocatorStats allocator_stats(int device) { return device_allocator(device).stats(); }
void reset_peak_stats(int device) { device_allocator(device).reset_peak(); }
void empty_cache(int device) { device_allocator(device).empty_cache(); }

}  // namespace kiln::cuda
