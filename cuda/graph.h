#pragma once
// The whole-step CUDA Graph executor: a training step captured once and replayed.
//
//   Tensor x = empty({256, 3, 224, 224}, opts), y = empty({256}, i64_opts);  // static inputs
//   Tensor loss_out = zeros({}, f32_opts);                                    // static output
//   cuda::GraphStep step([&] {
//     opt.zero_grad();
//     Tensor loss = F::cross_entropy(model->forward(x), y);
//     loss.backward();
//     opt.step();
//     loss_out.copy_(loss.detach());
//   }, {.warmup_steps = 3});
//   for (...) { step.stage_input(x, pinned_x); step.stage_input(y, pinned_y); step.run(fp); }
//
// One run() is exactly one step, whatever it does inside:
//  * the first `warmup_steps` calls run the step eagerly on the GraphStep's own stream (a
//    non-default stream made current with StreamGuard), so cuDNN's algorithm search, cuBLASLt's
//    heuristics, optimizer-state creation and allocator growth happen there, outside capture;
//  * the next call captures the step (cudaStreamCaptureModeThreadLocal) into a private memory
//    pool and instantiates it. Capture records work without executing it, so this call then
//    launches the graph once: it performs its step like every other call;
//  * later calls replay the graph.
// Replays are bit-identical to eager steps provided every kernel of the step is deterministic
// (set_conv_deterministic(true) for cuDNN convolutions).
//
// What the step may do: launch work on the current stream only (kiln ops do), read and write
// tensors that outlive the GraphStep or are registered with keep(), and update state in place
// (parameters, optimizer state, BN statistics: a replay writes exactly the addresses captured).
// Host-side values are frozen at capture: a learning rate held in a host double and changed later
// is not seen by replays (keep such values in device memory). Host synchronisation inside the step
// (Tensor::item(), copies to the host, cuda::synchronize(), empty_cache()) and host-to-device
// copies (a replay would re-read that host memory) are kiln::Errors during capture; the error
// names the operation, and the GraphStep stays usable. A failed capture executes nothing on the
// device, but host-side effects of the step that ran up to the failure remain.
//
// Shapes: run(fingerprint) takes a caller-made description of the work (shape_fingerprint()
// of the inputs, say). When it differs from the captured one: OnNewShape::Recapture runs
// `rewarmup_steps` eager steps with the new work, then captures again (cudaGraphExecUpdate is
// tried first, re-instantiation when it refuses); OnNewShape::Eager runs those steps eagerly
// and keeps the graph for the captured fingerprint. The graph reads the static tensors it saw
// at capture: keep the tensors of each shape if you come back to it.
//
// Memory: during capture the step's allocations come from the GraphStep's private pool
// (cuda/allocator.h), and so do blocks of its stream freed meanwhile; all stay reserved while
// the GraphStep lives, so replays find them untouched. Tensors the captured step leaves behind
// (the gradients) live there and are rewritten by every replay; after an eager step (warm-up,
// fallback) such handles refer to that step's tensors instead, while the graph keeps its own.
//
// Streams: run() is ordered after the work already queued on the caller's current stream and
// makes that stream wait for the step, so the step behaves like one op on the caller's stream
// (and tensors used on both sides need no extra synchronisation). Not thread-safe; use one
// GraphStep from one thread. The destructor synchronises the GraphStep's stream, then returns
// the private pool's memory to the general cache (reserved memory does not grow when graphs
// are created and destroyed repeatedly).
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "cuda/runtime.h"

namespace kiln::cuda {

enum class OnNewShape { Recapture, Eager };

struct GraphOptions {
  int warmup_steps = 3;    // eager steps before the first capture (>= 1)
  int rewarmup_steps = 1;  // eager steps with new work before a re-capture (>= 1)
  OnNewShape on_new_shape = OnNewShape::Recapture;
};

struct GraphStepStats {
  int64_t eager_steps = 0;     // warm-up and fallback steps
  int64_t replays = 0;         // graph launches (the capturing call's launch included)
  int64_t captures = 0;        // successful captures
  int64_t exec_updates = 0;    // re-captures applied with cudaGraphExecUpdate
  int64_t instantiations = 0;  // cudaGraphInstantiate calls
};

class GraphStep {
 public:
  using StepFn = std::function<void()>;
  // Binds to the current device.
  explicit GraphStep(StepFn step, GraphOptions opts = {});
  ~GraphStep();
  GraphStep(const GraphStep&) = delete;
  GraphStep& operator=(const GraphStep&) = delete;

  // Runs one step (see the header comment). `fingerprint` describes the work. When the capture
  // fails it throws kiln::Error and the call performed no step; the next call captures again.
  void run(const std::string& fingerprint = "");

  // Keeps `t` alive as long as the GraphStep (static inputs and outputs). Returns t.
  const Tensor& keep(const Tensor& t);

  // Queues the upload of `host` (a CPU tensor in pinned memory, same shape, dtype and dense
  // layout as `input`) into the static tensor `input` for the next run(). The transfer runs on
  // the context's copy stream into a device staging buffer and overlaps the previous step; the
  // next run() moves it into `input` on the step's stream (a device-to-device copy) before the
  // step. `host` is read asynchronously: rewrite it only after wait_input_copies().
  void stage_input(const Tensor& input, const Tensor& host);
  // Blocks until every staged upload has left host memory.
  void wait_input_copies();

  // Blocks until the GraphStep's work is done.
  void synchronize();

  cudaStream_t stream() const { return stream_; }
  bool has_graph() const { return exec_ != nullptr; }
  const std::string& captured_fingerprint() const { return graph_fingerprint_; }
  const GraphStepStats& stats() const { return stats_; }

 private:
  struct Staged;
  void run_step(const std::string& fingerprint);
  void run_eager();
  void capture_and_launch();
  void apply_staged_inputs();

  StepFn step_;
  GraphOptions opts_;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t caller_done_ = nullptr;  // joins the caller's stream into ours
  cudaEvent_t step_done_ = nullptr;    // joins ours back into the caller's
  uint64_t pool_ = 0;
  cudaGraphExec_t exec_ = nullptr;
  std::string graph_fingerprint_;  // the work exec_ replays
  std::string warm_fingerprint_;   // the work being warmed up
  int warm_left_ = 0;              // eager steps left before capturing warm_fingerprint_
  bool started_ = false;           // run() was called before
  std::vector<Tensor> kept_;
  std::vector<std::unique_ptr<Staged>> staged_;
  GraphStepStats stats_;
};

// "f32[8, 3, 32, 32]NHWC|i64[8]": dtype, shape and layout of each tensor, for run()'s fingerprint.
std::string shape_fingerprint(const std::vector<Tensor>& tensors);

// is_capturing() and check_not_capturing() live in cuda/runtime.h.

}  // namespace kiln::cuda
