// Per-device runtime context, the thread-local current stream, and pinned host memory.
#include "cuda/runtime.h"

#include <array>
#include <atomic>
#include <memory>
#include <mutex>

#include "core/device_query.h"
#include "core/switches.h"
#include "core/version.h"
#include "cuda/check.h"

namespace kiln::cuda {
namespace {

constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;

// Contexts are created once and deliberately never destroyed: tearing down streams and
// library handles during static destruction races the driver's own shutdown.
std::array<Context*, kMaxDevices> g_contexts{};
std::mutex g_context_mutex;

// The StreamGuard override for this thread; `set` distinguishes "no override" from stream 0.
struct StreamOverride {
  bool set = false;
  cudaStream_t stream = nullptr;
};
thread_local StreamOverride t_stream;

// Restores the calling thread's current device on scope exit.
class DeviceRestore {
 public:
  explicit DeviceRestore(int device) {
    CUDA_CHECK(cudaGetDevice(&prev_));
    if (device != prev_) CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceRestore() { cudaSetDevice(prev_); }  // best effort in a destructor

 private:
  int prev_ = 0;
};

Context* create_context(int device) {
  DeviceRestore restore(device);
  auto ctx = std::make_unique<Context>();
  ctx->device = device;
  CUDA_CHECK(cudaGetDeviceProperties(&ctx->props, device));
  // A GPU this build has no code for would fail at the first kernel with "no kernel image";
  // say instead what to rebuild with (KILN_CUDA_ARCHITECTURES: what CMake compiled for).
  const std::string mismatch = cuda_arch_mismatch(KILN_CUDA_ARCHITECTURES, ctx->props.major,
                                                  ctx->props.minor, ctx->props.name);
  KILN_CHECK(mismatch.empty(), "CUDA device ", device, ": ", mismatch);
  // Non-blocking: kiln's streams never serialise against the legacy default stream.
  CUDA_CHECK(cudaStreamCreateWithFlags(&ctx->compute, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&ctx->copy, cudaStreamNonBlocking));
  CUDNN_CHECK(cudnnCreate(&ctx->cudnn));
  CUDNN_CHECK(cudnnSetStream(ctx->cudnn, ctx->compute));
  CUBLAS_CHECK(cublasLtCreate(&ctx->lt));
  CUDA_CHECK(cudaMalloc(&ctx->lt_workspace, kLtWorkspaceBytes));
  ctx->lt_workspace_bytes = kLtWorkspaceBytes;
  return ctx.release();
}

}  // namespace

int device_count() { return cuda_device_count(); }

bool is_available() { return device_count() > 0; }

int current_device() {
  int d = 0;
  CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

void set_device(int device) {
  KILN_CHECK(device >= 0 && device < device_count(), "set_device: device ", device,
             " out of range (", device_count(), " CUDA devices visible)");
  CUDA_CHECK(cudaSetDevice(device));
}

Context& context(int device) {
  if (device < 0) device = current_device();
  KILN_CHECK(device < device_count() && device < kMaxDevices, "cuda context: device ", device,
             " out of range (", device_count(), " CUDA devices visible)");
  std::lock_guard<std::mutex> lock(g_context_mutex);
  if (!g_contexts[size_t(device)]) g_contexts[size_t(device)] = create_context(device);
  return *g_contexts[size_t(device)];
}

namespace {
constinit RuntimeSwitch g_pdl{&Switches::pdl};  // KILN_PDL
}  // namespace

bool pdl_enabled() { return g_pdl.get() && context().props.major >= 9; }
void set_pdl_enabled(bool on) { g_pdl.set(on); }

cudaStream_t current_stream() {
  if (t_stream.set) return t_stream.stream;
  return context().compute;
}

StreamGuard::StreamGuard(cudaStream_t s) : prev_(t_stream.stream), prev_set_(t_stream.set) {
  t_stream.set = true;
  t_stream.stream = s;
}

StreamGuard::~StreamGuard() {
  t_stream.set = prev_set_;
  t_stream.stream = prev_;
}

void synchronize() {
  check_not_capturing("cuda::synchronize()", "it waits for the whole device");
  CUDA_CHECK(cudaDeviceSynchronize());
}

void* alloc_pinned(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocDefault));
  return p;
}

void free_pinned(void* p) {
  // cudaFreeHost waits for the whole device, so after a stuck stream it would wait for ever
  // (kiln-train's ~Trainer did, in its AsyncScalars): the memory is leaked instead.
  if (p && !stream_stuck()) CUDA_CHECK(cudaFreeHost(p));
}

namespace {
std::atomic<bool> g_stream_stuck{false};
}  // namespace
void mark_stream_stuck() { g_stream_stuck.store(true); }
bool stream_stuck() { return g_stream_stuck.load(std::memory_order_relaxed); }

namespace {
thread_local bool t_capturing = false;  // inside a GraphStep's capture on this thread
}  // namespace

bool graph_capture_active() { return t_capturing; }
void set_graph_capture_active(bool on) { t_capturing = on; }

bool is_capturing() {
  if (t_capturing) return true;
  if (device_count() == 0) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(current_stream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

void check_not_capturing(const char* op, const char* why) {
  KILN_CHECK(!is_capturing(), op,
             " cannot run while a CUDA graph is being captured (inside a GraphStep's step): ", why,
             ". Do it outside the step (fill inputs before run(), read results after it)");
}

}  // namespace kiln::cuda
