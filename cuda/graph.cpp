// The graph executor. Capture streams are recycled per device: the caching allocator keys its
// free lists by stream, so a GraphStep that reuses its predecessor's stream reuses that
// stream's cached blocks too, and creating and destroying graphs does not grow reserved memory.
#include "cuda/graph.h"

#include <array>
#include <mutex>

#include "cuda/allocator.h"
#include "cuda/check.h"
#include "cuda/profiler.h"
#include "cuda/runtime.h"

namespace kiln::cuda {
namespace {



std::mutex g_streams_mutex;
std::array<std::vector<cudaStream_t>, kMaxDevices> g_idle_streams;  // guarded by the mutex

cudaStream_t acquire_stream(int device) {
  {
    std::lock_guard<std::mutex> lock(g_streams_mutex);
    auto& idle = g_idle_streams[size_t(device)];
    if (!idle.empty()) {
      cudaStream_t s = idle.back();
      idle.pop_back();
      return s;
    }
  }
  cudaStream_t s = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

void return_stream(int device, cudaStream_t s) {
  std::lock_guard<std::mutex> lock(g_streams_mutex);
  g_idle_streams[size_t(device)].push_back(s);
}

cudaEvent_t make_event() {
  cudaEvent_t e = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

bool same_dense_layout(const Tensor& a, const Tensor& b) {
  if (a.is_contiguous() && b.is_contiguous()) return true;
  return a.dim() == 4 && a.is_contiguous(MemoryFormat::ChannelsLast) &&
         b.is_contiguous(MemoryFormat::ChannelsLast);
}

}  // namespace

struct GraphStep::Staged {
  Tensor input;   // the static tensor
  Tensor buffer;  // device staging buffer, input's layout; owned by the copy stream
  cudaEvent_t uploaded = nullptr;
  cudaEvent_t consumed = nullptr;
  bool pending = false;  // uploaded but not yet moved into input
  bool consumed_recorded = false;
};

GraphStep::GraphStep(StepFn step, GraphOptions opts) : step_(std::move(step)), opts_(opts) {
  KILN_CHECK(step_, "GraphStep: the step function is empty");
  KILN_CHECK(opts_.warmup_steps >= 1 && opts_.rewarmup_steps >= 1,
             "GraphStep: warmup_steps and rewarmup_steps must be >= 1 (got ", opts_.warmup_steps,
             " and ", opts_.rewarmup_steps,
             "); cuDNN's algorithm search and cuBLASLt's heuristics cannot run during capture");
  device_ = current_device();
  context(device_);  // create the context (and its streams) outside any capture
  stream_ = acquire_stream(device_);
  caller_done_ = make_event();
  step_done_ = make_event();
  pool_ = create_pool(device_);
}

GraphStep::~GraphStep() {
  // A destructor must not throw: teardown is best effort once the stream is idle.
  if (cudaStreamSynchronize(stream_) != cudaSuccess) cudaGetLastError();
  for (auto& s : staged_) {
    cudaEventSynchronize(s->uploaded);
    cudaEventDestroy(s->uploaded);
    cudaEventDestroy(s->consumed);
  }
  if (exec_) cudaGraphExecDestroy(exec_);
  try {
    release_pool(device_, pool_);
  } catch (const Error&) {
  }
  cudaEventDestroy(caller_done_);
  cudaEventDestroy(step_done_);
  return_stream(device_, stream_);
}

const Tensor& GraphStep::keep(const Tensor& t) {
  kept_.push_back(t);
  return t;
}

void GraphStep::run(const std::string& fingerprint) {
  KILN_CHECK(current_device() == device_, "GraphStep::run: bound to cuda:", device_,
             " but the current device is cuda:", current_device());
  KILN_CHECK(!graph_capture_active(), "GraphStep::run: called inside a step being captured");
  // Join the caller's stream in and, whatever happens, back out: the step acts as one op on it.
  const cudaStream_t caller = current_stream();
  CUDA_CHECK(cudaEventRecord(caller_done_, caller));
  CUDA_CHECK(cudaStreamWaitEvent(stream_, caller_done_, 0));
  try {
    apply_staged_inputs();
    run_step(fingerprint);
  } catch (...) {
    if (cudaEventRecord(step_done_, stream_) != cudaSuccess ||
        cudaStreamWaitEvent(caller, step_done_, 0) != cudaSuccess)
      cudaGetLastError();
    throw;
  }
  CUDA_CHECK(cudaEventRecord(step_done_, stream_));
  CUDA_CHECK(cudaStreamWaitEvent(caller, step_done_, 0));
}

void GraphStep::run_step(const std::string& fingerprint) {
  if (exec_ && fingerprint == graph_fingerprint_) {
    CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
    ++stats_.replays;
    return;
  }
  if (exec_ && opts_.on_new_shape == OnNewShape::Eager) {
    run_eager();
    return;
  }
  if (!started_ || fingerprint != warm_fingerprint_) {
    warm_left_ = started_ ? opts_.rewarmup_steps : opts_.warmup_steps;
    warm_fingerprint_ = fingerprint;
    started_ = true;
  }
  if (warm_left_ > 0) {
    run_eager();
    --warm_left_;
    return;
  }
  capture_and_launch();
}

void GraphStep::run_eager() {
  StreamGuard guard(stream_);
  step_();
  ++stats_.eager_steps;
}

void GraphStep::capture_and_launch() {
  open_pool(device_, pool_, stream_);
  set_last_profiled_op(nullptr);
  const cudaError_t begin = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
  if (begin != cudaSuccess) close_pool(device_, pool_);
  CUDA_CHECK(begin);
  set_graph_capture_active(true);
  std::string failure;
  ErrorKind kind = ErrorKind::Generic;
  try {
    StreamGuard guard(stream_);
    step_();
  } catch (const OutOfMemoryError& e) {
    failure = e.what();
    kind = ErrorKind::OutOfMemory;
  } catch (const CudaError& e) {
    failure = e.what();
    kind = ErrorKind::Cuda;
  } catch (const std::exception& e) {
    failure = e.what();
  } catch (...) {
    failure = "a non-standard exception";
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
  set_graph_capture_active(false);
  close_pool(device_, pool_);
  if (failure.empty() && end != cudaSuccess) {
    failure = detail::str_cat("CUDA error ", cudaGetErrorName(end), ": ", cudaGetErrorString(end),
                              " at the end of the capture: a call in the step is not capturable "
                              "(it synchronises, or uses the legacy default stream)");
  }
  if (!failure.empty()) {
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();  // capture errors are not sticky; leave no trace for the next check
    const char* op = last_profiled_op();
    detail::fail(kind, __FILE__, __LINE__, nullptr,
                 detail::str_cat("GraphStep: the step cannot be captured as a CUDA graph",
                                 op ? " (last op entered: " : "", op ? op : "", op ? ")" : "", ": ",
                                 failure));
  }
  // A re-capture first tries to patch the existing executable in place.
  if (exec_) {
    cudaGraphExecUpdateResultInfo info{};
    if (cudaGraphExecUpdate(exec_, graph, &info) == cudaSuccess) {
      ++stats_.exec_updates;
    } else {
      cudaGetLastError();
      cudaGraphExecDestroy(exec_);
      exec_ = nullptr;
      graph_fingerprint_.clear();
    }
  }
  if (!exec_) {
    const cudaError_t e = cudaGraphInstantiate(&exec_, graph, 0);
    if (e != cudaSuccess) {
      exec_ = nullptr;
      cudaGraphDestroy(graph);
      CUDA_CHECK(e);
    }
    ++stats_.instantiations;
  }
  CUDA_CHECK(cudaGraphDestroy(graph));
  graph_fingerprint_ = warm_fingerprint_;
  ++stats_.captures;
  // Capture recorded the step without running it: launch it once so this call is a step too.
  CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
  ++stats_.replays;
}

void GraphStep::stage_input(const Tensor& input, const Tensor& host) {
  KILN_CHECK(input.defined() && input.is_cuda() && input.device().index == device_,
             "GraphStep::stage_input: the static input must be a tensor on cuda:", device_,
             ", got ", input.defined() ? input.desc() : std::string("an undefined tensor"));
  KILN_CHECK(host.defined() && host.is_cpu(),
             "GraphStep::stage_input: the source must be a host tensor, got ",
             host.defined() ? host.desc() : std::string("an undefined tensor"));
  KILN_CHECK(host.shape() == input.shape() && host.dtype() == input.dtype() &&
                 same_dense_layout(host, input),
             "GraphStep::stage_input: source ", host.desc(), " and static input ", input.desc(),
             " must have the same shape, dtype and dense layout");
  if (input.numel() == 0) return;
  cudaPointerAttributes attr{};
  CUDA_CHECK(cudaPointerGetAttributes(&attr, host.raw_data()));
  KILN_CHECK(
      attr.type == cudaMemoryTypeHost, "GraphStep::stage_input: ", host.desc(),
      " is in pageable memory; the overlapped upload needs pinned memory (cuda::alloc_pinned)");
  Staged* s = nullptr;
  for (auto& st : staged_)
    if (st->input.raw_data() == input.raw_data() && st->input.nbytes() == input.nbytes())
      s = st.get();
  const cudaStream_t copy = context(device_).copy;
  if (!s) {
    auto st = std::make_unique<Staged>();
    st->input = input;
    {
      StreamGuard guard(copy);
      st->buffer = empty_like(input);
    }
    st->uploaded = make_event();
    st->consumed = make_event();
    s = st.get();
    staged_.push_back(std::move(st));
  }
  if (s->consumed_recorded) CUDA_CHECK(cudaStreamWaitEvent(copy, s->consumed, 0));
  CUDA_CHECK(cudaMemcpyAsync(s->buffer.raw_data(), host.raw_data(), input.nbytes(),
                             cudaMemcpyHostToDevice, copy));
  CUDA_CHECK(cudaEventRecord(s->uploaded, copy));
  s->pending = true;
}

void GraphStep::apply_staged_inputs() {
  for (auto& s : staged_) {
    if (!s->pending) continue;
    CUDA_CHECK(cudaStreamWaitEvent(stream_, s->uploaded, 0));
    CUDA_CHECK(cudaMemcpyAsync(s->input.raw_data(), s->buffer.raw_data(), s->input.nbytes(),
                               cudaMemcpyDeviceToDevice, stream_));
    CUDA_CHECK(cudaEventRecord(s->consumed, stream_));
    s->consumed_recorded = true;
    s->pending = false;
  }
}

void GraphStep::wait_input_copies() {
  for (auto& s : staged_) CUDA_CHECK(cudaEventSynchronize(s->uploaded));
}

void GraphStep::synchronize() {
  check_not_capturing("GraphStep::synchronize()", "it waits for the device");
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::string shape_fingerprint(const std::vector<Tensor>& tensors) {
  std::string out;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (i) out += '|';
    if (!t.defined()) {
      out += "undefined";
      continue;
    }
    out += dtype_name(t.dtype());
    out += t.shape_str();
    if (t.dim() == 4 && t.suggest_memory_format() == MemoryFormat::ChannelsLast) out += "NHWC";
  }
  return out;
}

}  // namespace kiln::cuda
