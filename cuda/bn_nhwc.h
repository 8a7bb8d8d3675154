#pragma once
// Training-mode batch norm on f16 NHWC activations whose per-channel statistics are already
// known — the convolution that produced x summed x and x² in its epilogue
// (cuda::conv2d_forward_stats) — so the forward is one elementwise pass instead of cuDNN's
// statistics pass plus its elementwise pass. Kernels in cuda/kernels/bn_nhwc.cu; used by
// F::batch_norm_from_stats (ops/batch_norm_act.cpp), whose unfused composition defines them.
//
// x, z, y, dy, dx, dz: (N, C, H, W) f16 channels-last, C a multiple of 8 (16-byte vectors), all
// on one device. Per-channel tensors are contiguous f32 there. M = N·H·W. Every function runs
// on kiln::cuda::current_stream(), never synchronises the host, and is deterministic (fixed
// per-block partial sums, no atomics).
#include "core/tensor.h"

namespace kiln::cuda {

// Whether the kernels take x: f16, 4-D, channels-last dense, C % 8 == 0, on a CUDA device.
bool bn_nhwc_supported(const Tensor& x);

// From sum and sqsum (C) of x over M values: save_mean (=), save_invstd (=) = 1/sqrt(var + eps)
// with var = sqsum/M - mean² (biased, clamped at 0), scale_shift (2C) (=) = [weight·invstd,
// bias - mean·weight·invstd], and the running stats (when defined) r = (1-momentum)·r +
// momentum·stat (variance unbiased: M/(M-1)).
void bn_nhwc_finalize(const Tensor& save_mean, const Tensor& save_invstd,
                      const Tensor& scale_shift, const Tensor& sum, const Tensor& sqsum,
                      const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                      const Tensor& running_var, int64_t count, double momentum, double eps);

// y (=) = act(x·scale + shift [+ z]) per channel; act = ReLU when relu, else identity.
// z may be undefined. With relu and z, `mask` (u8, numel/8, contiguous) (=) gets the ReLU's
// mask, bit j of byte i set when y's element 8i + j is positive: the backward reads it instead
// of y (1/16 of the bytes).
void bn_nhwc_apply(const Tensor& y, const Tensor& x, const Tensor& z, const Tensor& scale_shift,
                   bool relu, const Tensor& mask = Tensor());

// Backward of bn_nhwc_apply. g = dy masked by the ReLU (when relu): the forward's `mask` when z
// was given, else recomputed as x·scale + shift > 0. Writes dx (=), dz (=) = g when defined,
// dweight (=) = Σ g·x̂ and dbias (=) = Σ g when defined, x̂ = (x - mean)·invstd — or `+=`
// with accumulate_params (autograd's accumulate-into: they are the parameters' .grad).
void bn_nhwc_backward(const Tensor& dx, const Tensor& dz, const Tensor& dweight,
                      const Tensor& dbias, const Tensor& dy, const Tensor& x, const Tensor& mask,
                      const Tensor& weight, const Tensor& save_mean, const Tensor& save_invstd,
                      const Tensor& scale_shift, bool relu, bool accumulate_params = false);

// Two batch norms meeting at a residual add, as at the end of a ResNet block whose shortcut is
// a convolution + batch norm: y (=) = relu(x·scale_shift_x + r·scale_shift_r), with `mask` (=)
// as in bn_nhwc_apply. One pass instead of two, and the shortcut's normalised tensor is never
// written.
void bn_nhwc_dual_apply(const Tensor& y, const Tensor& x, const Tensor& scale_shift_x,
                        const Tensor& r, const Tensor& scale_shift_r, const Tensor& mask);

// Its backward: g = dy masked by `mask`; dx (=) and dr (=) as bn_nhwc_backward's dx for each
// side; dweight_x/dbias_x and dweight_r/dbias_r (=, or += with accumulate_params) when
// defined (Σ g·x̂ and Σ g per side).
void bn_nhwc_dual_backward(const Tensor& dx, const Tensor& dr, const Tensor& dweight_x,
                           const Tensor& dbias_x, const Tensor& dweight_r, const Tensor& dbias_r,
                           const Tensor& dy, const Tensor& mask, const Tensor& x,
                           const Tensor& weight_x, const Tensor& mean_x, const Tensor& invstd_x,
                           const Tensor& r, const Tensor& weight_r, const Tensor& mean_r,
                           const Tensor& invstd_r, bool accumulate_params = false);

}  // namespace kiln::cuda
