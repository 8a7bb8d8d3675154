#pragma once
// Controls and statistics of the cuDNN convolution wrapper (cuda/conv.cpp; the entry points are
// declared in cuda/kernels.h).
//
// Each distinct problem (device, op, dtype, layout, all sizes, padding, stride, dilation, groups,
// determinism, backend mode, operand alignment) is timed once — cudnnFind*AlgorithmEx, and for
// f16/bf16 the backend API's top plans — and the choice is cached; later calls run it. A search
// cannot run inside CUDA graph capture: run one eager step first (the graph executor's warm-up
// does).
#include <cstddef>
#include <cstdint>
#include <string>

namespace kiln::cuda {

struct ConvCacheStats {
  uint64_t hits = 0;    // calls whose problem was already cached
  uint64_t misses = 0;  // calls that ran an algorithm search
  size_t entries = 0;   // problems cached
  size_t engine_plans = 0;  // of which run on a backend-API plan
  uint64_t from_file = 0;   // choices taken from the plan file since the cache was last cleared
};
ConvCacheStats conv_algo_cache_stats();
// Forgets every cached choice and zeroes the counters (tests; after changing determinism).
void clear_conv_algo_cache();

// When on, only algorithms cuDNN reports as deterministic are used, and none is chosen by timing:
// the legacy API's in cuDNN's heuristic order, the backend API's first plan that runs (taken
// over the legacy API whenever one does), weight gradients added with beta = 1. So reruns in one
// process and runs in different processes (the same GPU, cuDNN and kiln) give the same bits.
// Off by default. Part of the cache key, so toggling it never reuses the other mode's choice.
// cuBLASLt (cuda/blas.cpp), cuDNN attention and kiln's batch-norm paths (cuda/backend.cpp) read
// it too; kiln-train --deterministic sets it.
void set_conv_deterministic(bool on);
bool conv_deterministic();

// Whether f16 and bf16 problems are also tuned on cuDNN's backend graph API
// (cuda/conv_engine.h). Auto (the default) uses its fastest plan when that beats the legacy
// API's best algorithm; Force uses it whenever one runs (tests); Off never. The environment sets
// the default: KILN_CUDNN_BACKEND=0 (Off), =force (Force). Part of the cache key.
enum class ConvBackend : int { Off = 0, Auto = 1, Force = 2 };
void set_conv_backend(ConvBackend mode);
ConvBackend conv_backend();

// The plan file: when set, a problem seen for the first time takes the choice recorded for it
// there (the backend API's engine and knob choices, or the legacy API's algorithm and math type;
// with the statistics epilogue, its plan or none; for an accumulating weight gradient, whether
// beta = 0 plus an add is used) instead of timing candidates, and every choice the tuner makes is
// added to the file (rewritten whole, atomically). So processes that share the file run the same
// kernels: A/B pairs and profilers (whose own timings would steer the tuner elsewhere,
// docs/lab/step-profiles.md) see the plans a plain run uses, and a run skips its tuning.
// - The first line names the GPU and cuDNN: a file written on another pair is ignored and
//   rewritten (one warning); a file that is not a plan file is neither read nor overwritten, and
//   the plan file is off (one warning; conv_plan_file() then reads empty).
// - A recorded plan cuDNN refuses is tuned again.
// - Processes that add to one file at the same time (data-parallel ranks) may drop each other's
//   new records, never tear the file: a dropped record is tuned again by the next process.
// Keys are the cache's less the device index. Empty path: off (the default; KILN_CONV_PLANS sets
// it). Clears nothing: call clear_conv_algo_cache() to make cached problems read the file.
void set_conv_plan_file(const std::string& path);
std::string conv_plan_file();

// How a weight gradient added into an existing one (accumulate) runs: Tuned (the default)
// times beta = 1 against beta = 0 into a fresh buffer plus an add and keeps the faster; the
// other two force one way (tests). Not part of the cache key:
// a Tuned plan decides once.
enum class WgradAccumulate : int { Tuned = 0, FreshAndAdd = 1, BetaOne = 2 };
void set_wgrad_accumulate(WgradAccumulate mode);

// The largest workspace an algorithm search offers cuDNN (bytes).
inline constexpr size_t kConvMaxWorkspaceBytes = size_t(1) << 30;

}  // namespace kiln::cuda
