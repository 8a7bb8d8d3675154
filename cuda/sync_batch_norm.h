#pragma once
// The CUDA halves of F::sync_batch_norm (ops/sync_batch_norm.cpp), kernels in
// cuda/kernels/sync_batch_norm.cu; the CPU counterparts are in ops/cpu/kernels.h with the same
// contracts. The op all-reduces `stats` and `sums` between the calls.
//
// x, y, dy, dx: (N, C, ...) f32, f16 or bf16, all dense in ONE layout (contiguous, or
// channels-last for 4-D). Per-channel tensors (weight, bias, running stats, mean, invstd, stats,
// sums, count): contiguous f32 on x's device; weight and bias may be undefined (1 and 0).
// Sums accumulate in f32, deterministically (fixed per-block partials, no atomics). Every
// function runs on kiln::cuda::current_stream() and never synchronises the host.
#include "core/tensor.h"

namespace kiln::cuda {

// Each function's contract is its namesake's in ops/cpu/kernels.h (stats, apply, backward sums,
// backward dx), with the differences above: f32 per-channel tensors and f32 sums.
void sync_batch_norm_stats(const Tensor& stats, const Tensor& x);
void sync_batch_norm_apply(const Tensor& y, const Tensor& save_mean, const Tensor& save_invstd,
                           const Tensor& x, const Tensor& weight, const Tensor& bias,
                           const Tensor& running_mean, const Tensor& running_var,
                           const Tensor& stats, double momentum, double eps);
void sync_batch_norm_backward_sums(const Tensor& sums, const Tensor& dy, const Tensor& x,
                                   const Tensor& mean, const Tensor& invstd);
// count: a one-element f32 device tensor holding n, read on the device.
void sync_batch_norm_backward_dx(const Tensor& dx, const Tensor& dy, const Tensor& x,
                                 const Tensor& weight, const Tensor& mean, const Tensor& invstd,
                                 const Tensor& sums, const Tensor& count);

}  // namespace kiln::cuda
