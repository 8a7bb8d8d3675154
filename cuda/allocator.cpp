// The caching device allocator. Device memory is obtained in segments (cudaMalloc) and handed
// out as blocks carved from them: a request is rounded up to 512 B and served by the smallest
// cached block that fits, which is split when the rest is worth keeping (512 B in small
// segments, 1 MiB in large ones); a freed block merges with free neighbours of its segment that
// have the same stream and pool. Requests up to 1 MiB come from 2 MiB segments, larger ones from
// segments of their own size rounded to 2 MiB (at least 20 MiB below 10 MiB), so small blocks
// never pin a large segment.
//
// Stream order: a block belongs to the stream current at its allocation. Freeing it returns it
// to that stream's free set, and only later allocations on the same stream reuse it, which is
// safe without a sync because the stream runs its work in order. Cross-stream use: a block
// used on another stream than its own must be freed only after that stream's work is ordered
// before the owning stream (cudaEventRecord on the user stream + cudaStreamWaitEvent on the
// owner), or after a synchronisation; otherwise a later allocation may overwrite it early.
//
// Before it grows (outside a capture) the allocator synchronises the device once, then takes a
// fitting block cached by another stream, or else returns every wholly free segment to the
// driver when together they are at least the new segment's size. Measured on ResNet-50 b256's
// trace (tools/bench/alloc_replay.py, docs/lab/allocator.md): whole blocks without splitting reserved
// 13.3 GiB for 10.65 GiB of peak requests, splitting 12.3, splitting with this release 11.2.
// Growing happens in the first steps only, so the syncs cost warm-up time, not step time.
//
// Private pools: a captured graph replays fixed addresses, so every block it touched must stay
// out of other hands while the graph lives. During a capture on stream S (pool open on S):
// allocations on S come from the pool's free set, then from S's general free set (its pending
// work is ordered before the graph on S), then from a new segment; S's blocks freed during the
// capture join the pool whatever their origin, because the graph may read them. Pool blocks
// freed later go back to the pool, not to the general cache. The rest of a split pool block
// stays in the pool: an earlier block of the capture may have covered that memory, and the graph
// replays its work there (handing such a rest to another stream broke replay's bit-identity in
// tests/gpu/test_graph.cpp). cudaMalloc runs in relaxed capture mode: it is not stream work, and
// a thread-local capture would otherwise refuse it.
//
// KILN_ALLOC_TRACE=PATH (core/switches.h) logs every event, one per line, for replaying the
// policy offline (tools/bench/alloc_replay.py): `a PTR BYTES STREAM` allocate (STREAM: 0, 1, ... in
// order of first use), `f PTR` free, `o POOL STREAM` / `c POOL` / `r POOL` a private pool
// opened / closed / released, `e` empty_cache, `m BYTES` a cudaMalloc.
#include "cuda/allocator.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/switches.h"
#include "cuda/check.h"
#include "cuda/profiler.h"
#include "cuda/runtime.h"

namespace kiln::cuda {
namespace {

// "1.5 GiB", "12.0 MiB": sizes in an error message a person reads.
std::string mib(size_t bytes) {
  char buf[48];
  if (bytes >= (size_t(1) << 30))
    std::snprintf(buf, sizeof buf, "%.1f GiB", double(bytes) / double(size_t(1) << 30));
  else
    std::snprintf(buf, sizeof buf, "%.1f MiB", double(bytes) / double(size_t(1) << 20));
  return buf;
}

constexpr size_t kSmallLimit = size_t(1) << 20;  // requests up to 1 MiB are "small"
constexpr size_t kRound = 512;
constexpr size_t kSmallSegment = size_t(2) << 20;
constexpr size_t kLargeRound = size_t(2) << 20;
constexpr size_t kMidLimit = size_t(10) << 20;    // large requests below this share segments
constexpr size_t kMidSegment = size_t(20) << 20;  // of this size
constexpr size_t kMinLargeRest = size_t(1) << 20;  // a large block's rest below this stays attached

size_t round_size(size_t n) { return (n + kRound - 1) / kRound * kRound; }

size_t segment_size(size_t size) {
  if (size <= kSmallLimit) return kSmallSegment;
  const size_t s = (size + kLargeRound - 1) / kLargeRound * kLargeRound;
  return size < kMidLimit ? std::max(s, kMidSegment) : s;
}

// A piece of a segment. Blocks of one segment form a list in address order (prev/next).
struct Block {
  char* ptr = nullptr;
  size_t size = 0;
  cudaStream_t stream = nullptr;
  uint64_t pool = 0;  // 0: the general cache
  bool small = false;  // from a small segment
  bool free = false;
  Block* prev = nullptr;
  Block* next = nullptr;
  bool whole_segment() const { return !prev && !next; }
};

// Free blocks ordered by (stream, small, size, address): lower_bound gives the best fit.
struct FreeOrder {
  bool operator()(const Block* a, const Block* b) const {
    return std::tuple(uintptr_t(a->stream), a->small, a->size, uintptr_t(a->ptr)) <
           std::tuple(uintptr_t(b->stream), b->small, b->size, uintptr_t(b->ptr));
  }
};
using FreeSet = std::set<Block*, FreeOrder>;

struct Pool {
  FreeSet free;
  size_t bytes = 0;       // blocks belonging to the pool, live or cached
  bool released = false;  // the graph is gone; live blocks leave the pool when freed
};

// Removes and returns the smallest block in `set` on `stream` that holds `size`, if any.
Block* take_best_fit(FreeSet& set, cudaStream_t stream, size_t size) {
  Block key;
  key.stream = stream;
  key.small = size <= kSmallLimit;
  key.size = size;
  auto it = set.lower_bound(&key);
  if (it == set.end() || (*it)->stream != stream || (*it)->small != key.small) return nullptr;
  Block* b = *it;
  set.erase(it);
  return b;
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
    Block* b = find_block(size, nbytes, stream);
    b->free = false;  // before split: the rest must not merge straight back into it
    b = split(b, size);
    live_.emplace(b->ptr, b);
    stats_.allocated_bytes += b->size;
    stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
    if (trace_) std::fprintf(trace_, "a %p %zu %d\n", static_cast<void*>(b->ptr), nbytes, stream_id(stream));
    return b->ptr;
  }

  void deallocate(void* ptr, size_t) override {
    if (!ptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (trace_) std::fprintf(trace_, "f %p\n", ptr);
    auto it = live_.find(ptr);
    KILN_CHECK(it != live_.end(), "cuda allocator (cuda:", device_, "): freeing ", ptr,
               ", which it did not allocate");
    Block* b = it->second;
    live_.erase(it);
    stats_.allocated_bytes -= b->size;
    if (b->pool != 0 && pools_.at(b->pool).released) leave_pool(b);
    if (b->pool == 0) {
      if (const uint64_t id = open_pool_of(b->stream); id != 0)
        join_pool(b, id);  // freed during a capture on its stream: the graph may read it
    }
    b->free = true;
    cache(merge(b));
  }

  AllocatorStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.peak_allocated_bytes = stats_.allocated_bytes;
    stats_.peak_reserved_bytes = stats_.reserved_bytes;
  }

  void empty_cache() {
    check_not_capturing("cuda::empty_cache()", "it synchronises the device");
    std::lock_guard<std::mutex> lock(mutex_);
    if (trace_) std::fprintf(trace_, "e\n");
    synchronize_device();
    release_free_segments(0);
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
    it->second.released = true;
    // A copy: merging changes the blocks' sizes, the set's order.
    const std::vector<Block*> cached(it->second.free.begin(), it->second.free.end());
    it->second.free.clear();
    for (Block* b : cached) {
      leave_pool(b);  // may erase the pool with its last block: `it` is dead from here
      cache(merge(b));
    }
    if (auto p = pools_.find(id); p != pools_.end() && p->second.bytes == 0) pools_.erase(p);
  }

 private:
  // The block to serve `size` bytes on `stream`, unsplit; out of every free set.
  Block* find_block(size_t size, size_t requested, cudaStream_t stream) {
    if (const uint64_t id = open_pool_of(stream); id != 0) {
      Pool& pool = pools_.at(id);
      if (Block* b = take_best_fit(pool.free, stream, size)) return b;
      Block* b = take_best_fit(free_, stream, size);
      if (!b) b = new_segment(size, requested, stream, true);
      join_pool(b, id);
      return b;
    }
    if (Block* b = take_best_fit(free_, stream, size)) return b;
    if (!is_capturing() && synchronize_for_growth()) {
      if (Block* b = take_from_other_stream(stream, size)) return b;
      release_free_segments(segment_size(size));
    }
    return new_segment(size, requested, stream, false);
  }

  // Growing outside a capture: one device sync, after which every cached block is idle. False
  // when the device cannot be synchronised now (another thread's global capture), or must not
  // be (cuda::stream_stuck: the sync would never return; the cache then grows instead).
  bool synchronize_for_growth() {
    if (stream_stuck()) return false;
    DeviceScope scope(device_);
    if (cudaDeviceSynchronize() == cudaSuccess) return true;
    cudaGetLastError();
    return false;
  }

  // A fitting general block cached by another stream (after synchronize_for_growth).
  Block* take_from_other_stream(cudaStream_t stream, size_t size) {
    Block* best = nullptr;
    const bool small = size <= kSmallLimit;
    for (Block* b : free_)
      if (b->stream != stream && b->small == small && b->size >= size &&
          (!best || b->size < best->size))
        best = b;
    if (!best) return nullptr;
    free_.erase(best);
    best->stream = stream;
    ++stats_.cross_stream_reuses;
    return best;
  }

  // Returns the general cache's wholly free segments to the driver: all of them when
  // `at_least` is 0, else the large ones when together they hold at least `at_least` bytes.
  // Cached blocks may still be read by queued work, so the caller has synchronised the device.
  void release_free_segments(size_t at_least) {
    size_t total = 0;
    std::vector<Block*> whole;
    for (Block* b : free_)
      if (b->whole_segment() && (at_least == 0 || !b->small)) {
        whole.push_back(b);
        total += b->size;
      }
    if (total < at_least) return;
    DeviceScope scope(device_);
    for (Block* b : whole) {
      free_.erase(b);
      CUDA_CHECK(cudaFree(b->ptr));
      stats_.reserved_bytes -= b->size;
      ++stats_.num_segment_frees;
      delete b;
    }
  }

  // For empty_cache and the out-of-memory retry (never during a capture).
  void synchronize_device() {
    DeviceScope scope(device_);
    CUDA_CHECK(cudaDeviceSynchronize());
  }

  Block* new_segment(size_t size, size_t requested, cudaStream_t stream, bool capturing) {
    const size_t seg = segment_size(size);
    void* p = cuda_malloc_or_retry(seg, requested, capturing);
    if (trace_) std::fprintf(trace_, "m %zu\n", seg);
    stats_.reserved_bytes += seg;
    stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
    ++stats_.num_cuda_mallocs;
    Block* b = new Block;
    b->ptr = static_cast<char*>(p);
    b->size = seg;
    b->stream = stream;
    b->small = size <= kSmallLimit;
    return b;
  }

  // Cuts `b` to `size` when the rest is worth keeping; the rest is cached beside it, in the same
  // pool (see the top of the file) or the general cache.
  Block* split(Block* b, size_t size) {
    const size_t rest = b->size - size;
    if (rest < (b->small ? kRound : kMinLargeRest)) return b;
    Block* r = new Block;
    r->ptr = b->ptr + size;
    r->size = rest;
    r->stream = b->stream;
    r->small = b->small;
    r->free = true;
    r->prev = b;
    r->next = b->next;
    if (b->next) b->next->prev = r;
    b->next = r;
    r->pool = b->pool;
    b->size = size;
    cache(merge(r));
    return b;
  }

  static bool mergeable(const Block* a, const Block* b) {
    return b && b->free && b->stream == a->stream && b->pool == a->pool;
  }

  // Joins free block `b` with its free neighbours of the same stream and pool (they leave their
  // free sets); returns the joined block, in no free set.
  Block* merge(Block* b) {
    if (Block* n = b->next; mergeable(b, n)) {
      uncache(n);
      b->size += n->size;
      b->next = n->next;
      if (n->next) n->next->prev = b;
      delete n;
    }
    if (Block* p = b->prev; mergeable(b, p)) {
      uncache(p);
      p->size += b->size;
      p->next = b->next;
      if (b->next) b->next->prev = p;
      delete b;
      b = p;
    }
    return b;
  }

  FreeSet& free_set_of(const Block* b) { return b->pool != 0 ? pools_.at(b->pool).free : free_; }
  void cache(Block* b) { free_set_of(b).insert(b); }
  void uncache(Block* b) { free_set_of(b).erase(b); }

  void join_pool(Block* b, uint64_t id) {
    b->pool = id;
    pools_.at(id).bytes += b->size;
    stats_.graph_pool_bytes += b->size;
  }

  // The block leaves its (released) pool for the general cache; the pool is forgotten once it
  // holds nothing.
  void leave_pool(Block* b) {
    auto it = pools_.find(b->pool);
    it->second.bytes -= b->size;
    stats_.graph_pool_bytes -= b->size;
    if (it->second.released && it->second.bytes == 0 && it->second.free.empty()) pools_.erase(it);
    b->pool = 0;
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

  // During a capture the cache cannot be released (that synchronises the device and would
  // invalidate the capture), so running out of memory then is reported at once.
  void* cuda_malloc_or_retry(size_t size, size_t requested, bool capturing) {
    DeviceScope scope(device_);
    void* p = nullptr;
    cudaError_t e = relaxed_malloc(&p, size);
    if (e == cudaErrorMemoryAllocation && !capturing && !is_capturing()) {
      cudaGetLastError();  // clear it; the retry decides
      synchronize_device();
      release_free_segments(0);
      e = relaxed_malloc(&p, size);
    }
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) cudaGetLastError();
      ::kiln::detail::fail(
          ErrorKind::OutOfMemory, __FILE__, __LINE__, nullptr,
          detail::str_cat(
          "CUDA out of memory on cuda:", device_,
          current_op() ? std::string(" in op ") + current_op() : std::string(),
          current_op_input().empty() ? std::string() : " (input " + current_op_input() + ")",
          ": tried to allocate ", requested, " bytes (", size, " rounded; ", mib(requested),
          "); kiln has ", stats_.allocated_bytes, " bytes allocated (", mib(stats_.allocated_bytes),
          ", peak ", mib(stats_.peak_allocated_bytes), ") and ", stats_.reserved_bytes,
          " bytes reserved (", mib(stats_.reserved_bytes), ", of which ",
          mib(stats_.reserved_bytes - stats_.allocated_bytes), " cached, ",
          mib(stats_.graph_pool_bytes), " in CUDA graph pools); the device has ", free_b,
          " of ", total_b, " bytes free (", mib(free_b), " of ", mib(total_b), ")",
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
  FreeSet free_;  // the general cache
  std::unordered_map<void*, Block*> live_;
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
