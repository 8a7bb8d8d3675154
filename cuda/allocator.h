#pragma once
// Stream-ordered caching allocator for device memory. Blocks are rounded to size buckets and
// kept after free for reuse, so the training step makes no cudaMalloc after warm-up. A block
// freed on a stream is reused by later allocations on that same stream without a sync.
// A block used on another stream must not be freed before that stream's work is ordered before
// its own stream (event record + cudaStreamWaitEvent) or synchronised. Thread-safe.
#include <cstddef>
#include <cstdint>

#include "core/storage.h"

namespace kiln::cuda {

struct AllocatorStats {
  size_t allocated_bytes = 0;       // in live blocks handed out
  size_t reserved_bytes = 0;        // obtained from cudaMalloc (live + cached)
  size_t peak_allocated_bytes = 0;  // max of allocated_bytes since the last reset
  uint64_t num_cuda_mallocs = 0;
  uint64_t num_allocs = 0;          // allocate() calls
};

Allocator* caching_allocator(int device);
AllocatorStats allocator_stats(int device = -1);
void reset_peak_stats(int device = -1);
// Returns cached, unused blocks to the driver.
void empty_cache(int device = -1);

}  // namespace kiln::cuda
