#pragma once
// CUDA kernels of the fused optimizers and the dynamic loss scaler (cuda/kernels/optim.cu):
// the device counterparts of fused::ref (core/fused_optim.h), same contracts and
// same per-element formulas. All run on current_stream() and never synchronise the host, so a
// whole training step can be captured in a CUDA graph. Pointers are device pointers.
#include "core/fused_optim.h"

namespace kiln::cuda {

// One launch over all chunks: found_inf (|=) and partial_sumsq (=, one per chunk).
void fused_check_grads(const fused::CheckArgs& a);
// <<<1, 256>>>: total norm and clip coefficient from the partial sums (fixed summation order,
// so replays are bit-identical).
void fused_clip_coef(const float* partial, int64_t n, const float* scale, float max_norm,
                     float* norm, float* coef);
// <<<1, 1>>>: *step += 1 unless *found_inf (found_inf may be null).
void fused_step_begin(int32_t* step, const float* found_inf);
// One launch each over all chunks; nothing is written when *found_inf != 0.
void fused_sgd_step(const fused::StepArgs& a);
void fused_adamw_step(const fused::StepArgs& a);
// <<<1, 1>>>: the scaler's update (scale, growth tracker, skipped count).
void loss_scaler_update(const fused::ScalerArgs& a);

}  // namespace kiln::cuda
