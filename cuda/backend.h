#pragma once
// The CUDA backend's face: its table of entry points (core/backend.h), filled by
// cuda/backend.cpp from cuda/kernels.h. Registered by ops/backends.cpp. The other public CUDA
// headers serve the layers above with what only a GPU has: devices and streams
// (cuda/runtime.h), the caching allocator's statistics (cuda/allocator.h), whole-step graphs
// (cuda/graph.h), collectives (cuda/nccl.h), the convolution tuner's controls (cuda/conv.h),
// the op profiler's report (cuda/profiler.h) and the input pipeline's kernels
// (cuda/normalize.h).
#include "core/backend.h"

namespace kiln::cuda {

const Backend& backend_table();

// Whether a ResNet block tail's batch-norm backward takes the next 1x1 convolution's data
// gradient into its own GEMM (FastPath::BatchNormStatsDgrad). On unless KILN_FUSED_DGRAD=0 or
// switched off here (tests compare both ways).
bool dgrad_fusion_enabled();
void set_dgrad_fusion_enabled(bool on);

// Whether an identity block tail's batch-norm backward hands conv3 its factors instead of writing
// dy3 (FastPath::TailFold; ops/dgrad_sink.h, FoldedGradTarget), and from how many elements of
// conv3's input. On from 10^7 unless KILN_TAIL_FOLD=0; KILN_TAIL_FOLD_MIN sets the size (below
// it the fold's extra kernels cost more than the pass they remove; docs/lab/norm-conv.md, v37,
// v44).
// Set here for tests and A/B runs.
bool tail_fold_enabled();
void set_tail_fold_enabled(bool on);
int64_t tail_fold_min();
void set_tail_fold_min(int64_t elements);
// Whether a downsample block's tail folds too (FastPath::TailFoldDual: conv3's side of its two
// batch norms; docs/lab/norm-conv.md, v38 and v39). On unless KILN_TAIL_FOLD_DUAL=0, and only
// where the fold itself is on.
bool tail_fold_dual_enabled();
void set_tail_fold_dual_enabled(bool on);
// Whether the shortcut's side of a downsample tail folds as well, into the shortcut's
// convolution where that is a stride-1 1x1 convolution taking the fold (FastPath::
// TailFoldShortcut; ResNet-50's layer 1): the tail's pass then writes nothing. On unless
// KILN_TAIL_FOLD_SHORTCUT=0 (on since v43), and only where the dual fold is on.
bool tail_fold_shortcut_enabled();
void set_tail_fold_shortcut_enabled(bool on);
// Whether a stride-2 unpadded 1x1 convolution hands its data gradient at its input's even pixels
// alone to the block tail's GEMM behind it (FastPath::BatchNormStatsDgradStride2; ResNet-50's
// downsample shortcuts in layers 2–4), instead of writing it whole, zeros included, for that GEMM
// to read. On unless KILN_DGRAD_STRIDE2=0 (docs/lab/norm-conv.md, v45).
bool dgrad_stride2_enabled();
void set_dgrad_stride2_enabled(bool on);

}  // namespace kiln::cuda
