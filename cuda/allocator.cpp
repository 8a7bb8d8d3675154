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
//
// Private pools: a captured graph replays fixed addresses, so every block it touched must stay
// out of other hands while the graph lives. During a capture on stream S (pool open on S):
// allocations on S come from the pool's free list, then from S's general free list (its pending
// work is ordered before the graph on S), then from cudaMalloc; S's blocks freed during the
// capture join the pool whatever their origin, because the graph may read them. Pool blocks
// freed later go back to the pool, not to the general cache. cudaMalloc runs in relaxed capture
// mode: it is not stream work, and a thread-local capture would otherwise refuse it.
//
// KILN_ALLOC_TRACE=PATH (core/switches.h) logs every event, one per line, for replaying the
// policy offline (tools/alloc_replay.py): `a PTR BYTES STREAM` allocate (STREAM: 0, 1, ... in
// order of first use), `f PTR` free, `o POOL STREAM` / `c POOL` / `r POOL` a private pool
// opened / closed / released, `e` empty_cache, `m BYTES` a cudaMalloc.
#include "cuda/allocator.h"

#include <array>
#include <cstdio>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/switches.h"
#include "cuda/check.h"
#include "cuda/profiler.h"
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
  uint64_t pool = 0;  // 0: the general cache
};

// Free lists ordered by (stream, size): lower_bound gives the best fit on one stream.
using FreeKey = std::pair<uintptr_t, size_t>;
using FreeList = std::multimap<FreeKey, Block>;

struct Pool {
  FreeList free;
  size_t bytes = 0;       // blocks belonging to the pool, live or cached
  bool released = false;  // the graph is gone; live blocks leave the pool when freed
};

// Removes and returns the best fit for `size` on `stream` (at most 2x), if any.
bool take_best_fit(FreeList& list, cudaStream_t stream, size_t size, Block* out) {
  auto it = list.lower_bound({uintptr_t(stream), size});
  if (it == list.end() || it->first.first != uintptr_t(stream) || it->first.second > 2 * size)
    return false;
  *out = it->second;
  list.erase(it);
  return true;
}

class DeviceAllocator final : public Allocator {
 public:
  explicit DeviceAllocator(int device) : device_(device) {}

  void* allocate(size_t nbytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.num_allocs;
    if (nbytes == 0) return nullptr;
    const size_t size = round_size(nbytes);
    cudaStream_t stream = stream_for_device();
    void* p = allocate_locked(size, nbytes, stream);
    if (trace_) std::fprintf(trace_, "a %p %zu %d\n", p, nbytes, stream_id(stream));
    return p;
  }

  void* allocate_locked(size_t size, size_t nbytes, cudaStream_t stream) {
    const uint64_t pool_id = open_pool_of(stream);
    Block b;
    if (pool_id != 0) {
      Pool& pool = pools_.at(pool_id);
      if (take_best_fit(pool.free, stream, size, &b)) return hand_out(b);
      if (!take_best_fit(free_, stream, size, &b)) b = new_block(size, nbytes, stream, true);
      join_pool(b, pool_id);
      return hand_out(b);
    }
    if (take_best_fit(free_, stream, size, &b)) return hand_out(b);
    if (take_from_other_stream(stream, size, &b)) return hand_out(b);
    return hand_out(new_block(size, nbytes, stream, false));
  }

  // Before growing: a fitting block cached by another stream (eager work on the compute stream,
  // then a GraphStep's warm-up on its own stream, say) is reused once the device is
  // synchronised, which orders every use of it before this stream's work. Not while this thread
  // captures (a sync would end the capture); a device that cannot be synchronised now (another
  // thread's global capture) means a new block instead.
  bool take_from_other_stream(cudaStream_t stream, size_t size, Block* out) {
    if (is_capturing()) return false;
    FreeList::iterator best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      const size_t have = it->first.second;
      if (it->second.stream == stream || have < size || have > 2 * size) continue;
      if (best == free_.end() || have < best->first.second) best = it;
    }
    if (best == free_.end()) return false;
    DeviceScope scope(device_);
    if (cudaDeviceSynchronize() != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    *out = best->second;
    out->stream = stream;
    free_.erase(best);
    ++stats_.cross_stream_reuses;
    return true;
  }

  void deallocate(void* ptr, size_t) override {
    if (!ptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (trace_) std::fprintf(trace_, "f %p\n", ptr);
    auto it = live_.find(ptr);
    KILN_CHECK(it != live_.end(), "cuda allocator (cuda:", device_, "): freeing ", ptr,
               ", which it did not allocate");
    Block b = it->second;
    live_.erase(it);
    stats_.allocated_bytes -= b.size;
    const FreeKey key{uintptr_t(b.stream), b.size};
    if (b.pool != 0) {
      Pool& pool = pools_.at(b.pool);
      if (!pool.released) {
        pool.free.emplace(key, b);
        return;
      }
      leave_pool(b);
    }
    if (const uint64_t id = open_pool_of(b.stream); id != 0) {
      join_pool(b, id);  // freed during a capture on its stream: the graph may read it
      pools_.at(id).free.emplace(key, b);
      return;
    }
    free_.emplace(key, b);
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
    check_not_capturing("cuda::empty_cache()", "it synchronises the device");
    std::lock_guard<std::mutex> lock(mutex_);
    if (trace_) std::fprintf(trace_, "e\n");
    release_cached();
  }

  uint64_t create_pool() {
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t id = next_pool_++;
    pools_.emplace(id, Pool{});
    return id;
  }

  void open_pool(uint64_t id, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pools_.find(id);
    KILN_CHECK(it != pools_.end() && !it->second.released, "cuda allocator (cuda:", device_,
               "): private pool ", id, " does not exist or was released");
    KILN_CHECK(open_pool_of(stream) == 0, "cuda allocator (cuda:", device_,
               "): a private pool is already open on stream ", static_cast<void*>(stream));
    open_.emplace_back(stream, id);
    if (trace_) std::fprintf(trace_, "o %llu %d\n", (unsigned long long)id, stream_id(stream));
  }

  void close_pool(uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (trace_) std::fprintf(trace_, "c %llu\n", (unsigned long long)id);
    std::erase_if(open_, [id](const auto& e) { return e.second == id; });
  }

  void release_pool(uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (trace_) std::fprintf(trace_, "r %llu\n", (unsigned long long)id);
    std::erase_if(open_, [id](const auto& e) { return e.second == id; });
    auto it = pools_.find(id);
    if (it == pools_.end() || it->second.released) return;
    if (it->second.bytes == 0) {
      pools_.erase(it);
      return;
    }
    it->second.released = true;
    FreeList cached = std::move(it->second.free);
    it->second.free.clear();
    for (auto& [key, b] : cached) {
      leave_pool(b);  // erases the pool with its last block: `it` is dead from here
      free_.emplace(key, b);
    }
  }

 private:
  void* hand_out(const Block& b) {
    live_.emplace(b.ptr, b);
    stats_.allocated_bytes += b.size;
    if (stats_.allocated_bytes > stats_.peak_allocated_bytes)
      stats_.peak_allocated_bytes = stats_.allocated_bytes;
    return b.ptr;
  }

  Block new_block(size_t size, size_t requested, cudaStream_t stream, bool capturing) {
    void* p = cuda_malloc_or_retry(size, requested, capturing);
    if (trace_) std::fprintf(trace_, "m %zu\n", size);
    stats_.reserved_bytes += size;
    ++stats_.num_cuda_mallocs;
    return Block{p, size, stream, 0};
  }

  void join_pool(Block& b, uint64_t id) {
    b.pool = id;
    pools_.at(id).bytes += b.size;
    stats_.graph_pool_bytes += b.size;
  }

  // The block leaves its (released) pool for the general cache; the pool is forgotten once
  // it holds nothing.
  void leave_pool(Block& b) {
    auto it = pools_.find(b.pool);
    it->second.bytes -= b.size;
    stats_.graph_pool_bytes -= b.size;
    if (it->second.released && it->second.bytes == 0) pools_.erase(it);
    b.pool = 0;
  }

  uint64_t open_pool_of(cudaStream_t stream) const {
    for (const auto& [s, id] : open_)
      if (s == stream) return id;
    return 0;
  }

  // The device's current stream when it is the current device, else its compute stream.
  cudaStream_t stream_for_device() {
    return current_device() == device_ ? current_stream() : context(device_).compute;
  }

  // Frees every block of the general cache. Cached blocks may still be read by queued work on
  // their stream, so the device is synchronised first.
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

  // During a capture the cache cannot be released (that synchronises the device and would
  // invalidate the capture), so running out of memory then is reported at once.
  void* cuda_malloc_or_retry(size_t size, size_t requested, bool capturing) {
    DeviceScope scope(device_);
    void* p = nullptr;
    cudaError_t e = relaxed_malloc(&p, size);
    if (e == cudaErrorMemoryAllocation && !capturing && !is_capturing()) {
      cudaGetLastError();  // clear it; the retry decides
      release_cached();
      e = relaxed_malloc(&p, size);
    }
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) cudaGetLastError();
      ::kiln::detail::fail(
          ErrorKind::OutOfMemory, __FILE__, __LINE__, nullptr,
          detail::str_cat("CUDA out of memory on cuda:", device_, ": tried to allocate ", requested,
                          " bytes (", size, " rounded); kiln has ", stats_.allocated_bytes,
                          " bytes allocated and ", stats_.reserved_bytes,
                          " bytes reserved; the device has ", free_b, " of ", total_b,
                          " bytes free",
                          current_op() ? std::string(", in op ") + current_op() : std::string(),
                          capturing ? " (during CUDA graph capture, when the cache cannot be "
                                      "released: give the warm-up room, or free memory first)"
                                    : ""));
    }
    CUDA_CHECK(e);
    return p;
  }

  static cudaError_t relaxed_malloc(void** p, size_t size) {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    const cudaError_t e = cudaMalloc(p, size);
    cudaThreadExchangeStreamCaptureMode(&mode);  // restores the caller's mode; cannot fail here
    return e;
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

  int stream_id(cudaStream_t s) {
    for (size_t i = 0; i < trace_streams_.size(); ++i)
      if (trace_streams_[i] == s) return int(i);
    trace_streams_.push_back(s);
    return int(trace_streams_.size() - 1);
  }
  static std::FILE* open_trace(int device) {
    const std::string& path = switches().alloc_trace;
    if (path.empty()) return nullptr;
    const std::string name = device == 0 ? path : path + "." + std::to_string(device);
    std::FILE* f = std::fopen(name.c_str(), "w");
    KILN_CHECK(f, "KILN_ALLOC_TRACE: cannot open '", name, "' for writing");
    return f;  // never closed: exit() flushes it
  }

  const int device_;
  std::FILE* trace_ = open_trace(device_);
  std::vector<cudaStream_t> trace_streams_;
  std::mutex mutex_;
  FreeList free_;  // the general cache
  std::unordered_map<void*, Block> live_;
  std::unordered_map<uint64_t, Pool> pools_;
  std::vector<std::pair<cudaStream_t, uint64_t>> open_;  // (stream, pool) being captured
  uint64_t next_pool_ = 1;
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
uint64_t create_pool(int device) { return device_allocator(device).create_pool(); }
void open_pool(int device, uint64_t pool, cudaStream_t stream) {
  device_allocator(device).open_pool(pool, stream);
}
void close_pool(int device, uint64_t pool) { device_allocator(device).close_pool(pool); }
void release_pool(int device, uint64_t pool) { device_allocator(device).release_pool(pool); }

}  // namespace kiln::cuda
