#pragma once
// Convolution through cuDNN's backend graph API (cuda/cudnn_graph.h), the path cuda/conv.cpp
// prefers for f16 and bf16 when it is faster than the legacy API's best algorithm. Internal to
// cuda/.
//
// Why: for NHWC FP16 problems, the legacy cudnnFind* API offers a handful of algorithms, and for
// the 1x1 convolutions of ResNet-50 its best is 2-3x slower than the engines the backend API's
// heuristics offer (docs/lab/convolution.md). Each problem is tuned once: the top-ranked
// execution plans run on the real operands, timed with CUDA events, and the fastest is kept.
#include <cudnn.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "cuda/cudnn_graph.h"
#include "core/kinds.h"

namespace kiln::cuda {

enum class ConvOp : int { Forward, BackwardData, BackwardFilter };

// One problem in cuDNN's terms: x input activations, w filter, y output activations, whichever
// of them is being computed; all dense in `fmt`. accumulate: the computed operand is `+=`
// (the operation's beta = 1), else `=` (beta = 0).
struct ConvProblem {
  ConvOp op;
  DType dtype;
  MemoryFormat fmt;
  Shape x, w, y;
  ConvParams p;
  bool accumulate = false;
  // Forward only: the same kernel also writes the per-channel sum and sum of squares of y
  // (f32, O values each) — cuDNN's GenStats epilogue, for the batch norm that follows.
  bool stats = false;
};

struct ConvEngine;  // a tuned execution plan

// A finalised operation node computing `op`'s output (y, dx = x, or dw = w) from the other two,
// alpha 1 and `beta` (0: `=`, 1: `+=`), on the convolution descriptor `conv`.
be::Desc conv_operation(ConvOp op, const be::Desc& x, const be::Desc& w, const be::Desc& y,
                        const be::Desc& conv, float beta);

// Whether the backend path can describe the problem: f16/bf16, 4-D, one group, and pointers
// aligned to at least `alignment` bytes (the descriptors promise it).
bool conv_engine_supports(const ConvProblem& pr);

// Tunes the problem on the given operands: each candidate runs several times, so the output
// operand is overwritten — or, with accumulate, added to repeatedly — and must be a scratch
// buffer or one the caller computes afterwards (the caller runs the chosen plan then). Returns null when no plan runs, or none beats `beat_ms` (the legacy API's best time;
// negative: no bar). Must run outside graph capture. `log` prints every candidate's time.
std::shared_ptr<ConvEngine> tune_conv_engine(cudnnHandle_t h, const ConvProblem& pr,
                                             int64_t alignment, void* x, void* w, void* y,
                                             int device, bool deterministic, float beat_ms,
                                             bool log, const std::string& what,
                                             void* sum = nullptr, void* sqsum = nullptr);

// Runs the tuned plan on the handle's stream (sum and sqsum: the stats outputs of a stats
// problem). Returns cuDNN's status (the caller falls back to the legacy path on failure).
cudnnStatus_t run_conv_engine(cudnnHandle_t h, const ConvEngine& e, void* x, void* w, void* y,
                              int device, void* sum = nullptr, void* sqsum = nullptr);

// What a plan file records of a tuned plan (set_conv_plan_file, cuda/conv.h): cuDNN's global
// engine index and the knob choices of its configuration.
int64_t conv_engine_index(const ConvEngine& e);
std::vector<std::pair<int, int64_t>> conv_engine_knobs(const ConvEngine& e);

// The plan of `engine` with `knobs` for the problem, built from such a record without timing
// anything (its time reads -1); null when cuDNN does not take it or it is nondeterministic in
// deterministic mode.
std::shared_ptr<ConvEngine> load_conv_engine(cudnnHandle_t h, const ConvProblem& pr,
                                             int64_t alignment, int64_t engine,
                                             const std::vector<std::pair<int, int64_t>>& knobs,
                                             bool deterministic);

// The chosen plan's measured time (ms).
float conv_engine_ms(const ConvEngine& e);

// Description of the chosen plan for logs ("engine 3 k1=2 ..., 0.081 ms").
std::string conv_engine_name(const ConvEngine& e);

// Byte alignment of a device pointer, capped at 16.
int64_t pointer_alignment(const void* p);

}  // namespace kiln::cuda
