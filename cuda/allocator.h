#pragma once
// Stream-ordered caching allocator for device memory. Blocks are rounded to size buckets and
// kept after free for reuse, so the training step makes no cudaMalloc after warm-up. A block
// freed on a stream is reused by later allocations on that same stream without a sync.
// A block used on another stream must not be freed before that stream's work is ordered before
// its own stream (event record + cudaStreamWaitEvent) or synchronised. Thread-safe.
//
// Private pools (for CUDA graphs, cuda/graph.h): while a pool is open on a stream, every
// allocation on that stream is served from the pool, and every block of that stream freed then
// joins the pool (a graph being captured may still read it). Pool blocks are never handed to
// anyone else while the pool lives, so a graph's replays find its memory untouched. Releasing
// the pool returns its cached blocks to the general cache of their stream; its blocks still in
// use join the general cache when freed.
//
// Before it grows, the allocator synchronises the device (never during a capture), then takes
// over a fitting block cached by another stream, or returns wholly free segments to the driver:
// so eager work on one stream and a graph's warm-up on another share their memory instead of
// each holding its own, and the first steps' pattern does not fix the footprint.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/storage.h"

namespace kiln::cuda {

struct AllocatorStats {
  size_t allocated_bytes = 0;       // in live blocks handed out
  size_t reserved_bytes = 0;        // obtained from cudaMalloc (live + cached)
  size_t peak_allocated_bytes = 0;  // max of allocated_bytes since the last reset
  size_t peak_reserved_bytes = 0;   // max of reserved_bytes since the last reset
  uint64_t num_cuda_mallocs = 0;
  uint64_t num_allocs = 0;      // allocate() calls
  size_t graph_pool_bytes = 0;  // part of reserved_bytes held by private pools (live + cached)
  uint64_t cross_stream_reuses = 0;  // cached blocks of one stream taken over by another
  uint64_t num_segment_frees = 0;    // segments returned to the driver (cudaFree)
};

Allocator* caching_allocator(int device);
AllocatorStats allocator_stats(int device = -1);
void reset_peak_stats(int device = -1);
// Returns the cache's wholly free segments to the driver (not those of private pools; a segment
// with a live block stays). An error during graph capture, because it synchronises the device.
void empty_cache(int device = -1);

// Private pools (see above). Ids are never reused. open/close bracket a capture on `stream`;
// at most one pool is open per stream. release_pool: the caller guarantees that no work
// using the pool's memory is pending (the graph executor synchronises its stream first).
uint64_t create_pool(int device);
void open_pool(int device, uint64_t pool, cudaStream_t stream);
void close_pool(int device, uint64_t pool);
void release_pool(int device, uint64_t pool);

}  // namespace kiln::cuda
