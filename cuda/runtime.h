#pragma once
// The per-device runtime context: streams, library handles and workspaces, created on first
// use and reached through one accessor. Not thread-safe to create concurrently; after creation
// it is read-only except for the current stream, which is thread-local.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <cstddef>

namespace kiln::cuda {

// Number of visible CUDA devices; 0 (never an error) when there is no driver or device. The same
// as kiln::cuda_device_count() (core/device_query.h), which needs none of the headers here.
int device_count();
// Devices kiln keeps per-device state for (contexts, allocators, idle streams, kernel attributes).
inline constexpr int kMaxDevices = 64;
bool is_available();
int current_device();
void set_device(int device);

struct Context {
  int device = 0;
  cudaStream_t compute = nullptr;  // default stream for kiln's work on this device
  cudaStream_t copy = nullptr;     // host<->device copies that overlap compute
  cudnnHandle_t cudnn = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* lt_workspace = nullptr;  // 32 MiB, for cuBLASLt on the compute stream
  size_t lt_workspace_bytes = 0;
  cudaDeviceProp props{};
};
// The context of `device` (the current device when -1).
Context& context(int device = -1);

// The stream kiln launches on for the current device: the context's compute stream unless a
// StreamGuard on this thread says otherwise (the graph executor captures on its own stream).
cudaStream_t current_stream();
class StreamGuard {
 public:
  explicit StreamGuard(cudaStream_t s);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  cudaStream_t prev_;
  bool prev_set_;  // whether an outer guard was active (stream 0 is a valid override)
};

// Programmatic dependent launch (sm_90 and later): kiln's own kernels on the training step's
// path are launched through cuda::launch (cuda/kernels/common.cuh) so that the next one can be
// placed on the SMs while the one before it drains; each of them waits for its predecessor's
// results before it touches memory. True when the current device supports it and neither
// KILN_PDL=0 nor set_pdl_enabled(false) turned it off.
bool pdl_enabled();
void set_pdl_enabled(bool on);

// Waits for all of the current device's work.
void synchronize();

// True while the calling thread captures a graph: inside a GraphStep's capture, or while its
// current stream is being captured by anyone.
bool is_capturing();
// Throws kiln::Error naming `op` and saying `why` when is_capturing(): for operations that
// synchronise the host with the device (they would invalidate the capture) or that a graph
// cannot replay faithfully.
void check_not_capturing(const char* op, const char* why);
// The calling thread's GraphStep capture flag (set by cuda/graph.cpp around a capture).
bool graph_capture_active();
void set_graph_capture_active(bool on);

// Pinned (page-locked) host memory for fast asynchronous copies.
void* alloc_pinned(size_t bytes);
// Frees alloc_pinned's memory; after mark_stream_stuck() it leaks it instead (cudaFreeHost
// would wait for the stuck stream).
void free_pinned(void* p);

// A stream of this process holds work that may never run: an nvJPEG decode stream that stopped
// draining, left behind by the GPU JPEG loader's failover (data/gpu_jpeg.h). Everything that
// waits for the whole device would then wait for ever: cudaDeviceSynchronize, and allocating or
// freeing pinned memory. From the mark on, the code with another way takes it (pageable batch
// buffers, the allocator growing without first synchronising the device, leaks instead of
// frees); the rest (cuda::synchronize, empty_cache, the out-of-memory retry) still waits.
void mark_stream_stuck();
bool stream_stuck();

}  // namespace kiln::cuda
