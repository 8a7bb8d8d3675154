#pragma once
// The block tail's fused data-gradient GEMM on Hopper (cuda/kernels/gemm_bn_wgmma.cu), used by
// cuda/kernels/gemm_bn.cu's dgrad1x1_bn_sums where it fits. Same contract as that function.
#include <cstdint>

#include "core/tensor.h"

namespace kiln::cuda {

// An sm_90 device, and this build compiled the kernel for sm_90a.
bool dgrad1x1_bn_wgmma_available();
// The shapes it takes: M rows within TMA's 32-bit coordinates, K a multiple of 64 up to 2,048,
// C a multiple of 128.
bool dgrad1x1_bn_wgmma_shape(int64_t M, int64_t K, int64_t C);
// Whether it takes r compact at x's even pixels (below): with the mask bits, the TMA epilogue on.
bool dgrad1x1_bn_wgmma_takes_stride2(bool mask_bits);
// Its partial rows for M rows: the SMs divided among C / 128 column tiles.
int dgrad1x1_bn_wgmma_parts(int64_t M, int64_t C);
// g and partial (parts, 2, C) as dgrad1x1_bn_sums; the operands already checked there (r may
// be undefined: no residual; mask undefined: the ReLU mask recomputed from x and scale_shift).
// u defined (the dual form, with r and the mask; bn_nhwc_dual_backward_dgrad): partial is
// (parts, 3, C), the third row Σg·(u − mean_u), u (x's shape and layout) the second batch norm's
// input; g and the first two rows are the same bits as without u.
// r of shape (N, C, ⌈H/2⌉, ⌈W/2⌉) where x is (N, C, H, W) and the two differ: r is compact, a
// stride-2 unpadded 1x1 convolution's data gradient at x's even pixels, zero at the others
// (dgrad1x1_bn_wgmma_takes_stride2 says when; the kernel's kSub2). The same bits as r scattered.
// x2 defined (with r, the mask and u undefined): the GEMM is dy · w + x2 · w2ᵀ + b2, x2 (N, C2,
// H, W) channels-last f16 at x's positions, w2 (C, C2) and b2 (C) f16 contiguous, K + C2 a
// multiple of 64 up to 2,048 (dgrad1x1_bn_sums checks them): one accumulator, rounded once.
void dgrad1x1_bn_sums_wgmma(const Tensor& g, const Tensor& partial, const Tensor& dy,
                            const Tensor& w, const Tensor& r, const Tensor& mask, const Tensor& x,
                            const Tensor& mean, const Tensor& scale_shift, int parts,
                            const Tensor& u = Tensor(), const Tensor& mean_u = Tensor(),
                            const Tensor& x2 = Tensor(), const Tensor& w2 = Tensor(),
                            const Tensor& b2 = Tensor());
// dgrad1x1_bn_sums_wgmma on x's rows in pairs (x of 64 channels, the mask from x;
// dgrad1x1_bn_pair64): the GEMM on (M/2) × 128 views of g, x, r and x2, B = w (and w2)
// block-diagonal, mean and scale_shift repeated; partial (parts, 2, 64) (=) gets the view's
// column pairs added, its rows past the view's parts zero (parts: dgrad1x1_bn_parts's, at least
// the view's).
void dgrad1x1_bn_sums_wgmma_pair64(const Tensor& g, const Tensor& partial, int parts,
                                   const Tensor& dy, const Tensor& w, const Tensor& r,
                                   const Tensor& x, const Tensor& mean, const Tensor& scale_shift,
                                   const Tensor& x2, const Tensor& w2, const Tensor& b2);
// The same for a 3x3 convolution (stride 1, padding 1): dy (N, K, H, W) through TMA's im2col
// loads, w (K, C, 3, 3) channels-last; operands checked by the caller (dgrad3x3_bn_supported,
// cuda/kernels.h); parts = dgrad1x1_bn_wgmma_parts(N·H·W, C).
void dgrad3x3_bn_sums_wgmma(const Tensor& g, const Tensor& partial, const Tensor& dy,
                            const Tensor& w, const Tensor& r, const Tensor& mask, const Tensor& x,
                            const Tensor& mean, const Tensor& scale_shift, int parts);
// A stride-1 1x1 convolution's forward on the same kernel, y (N, C, H, W) = x (N, K, H, W) ·
// w (C, K, 1, 1)ᵀ, with partial (parts, 2, C) (=) holding per part Σy and Σy² of y as stored
// (f16); parts = dgrad1x1_bn_wgmma_parts(N·H·W, C). Shapes as dgrad1x1_bn_wgmma_shape(N·H·W,
// K, C); the operands are checked by the caller (conv1x1_forward_stats, cuda/kernels.h).
// scale_shift defined (f32, 2·K): x is read as relu(x·scale + shift) (the kernel's prologue).
void conv1x1_stats_wgmma(const Tensor& y, const Tensor& partial, const Tensor& x, const Tensor& w,
                         int parts, const Tensor& scale_shift);
// Whether the 1x1 forward with statistics runs on this kernel (KILN_CONV1X1_STATS).
bool conv1x1_stats_enabled();
// Whether its epilogue's operands come into shared memory by TMA during the MMAs (on by default;
// KILN_TAIL_TMA_EPI=0 or set_tail_tma_epilogue_enabled(false): read from global memory after
// them, as before v17). Bit-identical results either way.
bool tail_tma_epilogue_enabled();
void set_tail_tma_epilogue_enabled(bool on);
// Whether its B operand is read from w as it lies (N-major, wgmma transposing it; the default)
// or from wᵀ written by a transpose kernel first (KILN_TAIL_W_DIRECT=0 or
// set_tail_w_direct_enabled(false)). Bit-identical results either way.
bool tail_w_direct_enabled();
void set_tail_w_direct_enabled(bool on);
// Whether each consumer warpgroup keeps one wgmma group in flight while it waits for the next
// stage and issues it (the default), or waits for every k-step's MMAs before the next
// (KILN_WGMMA_PIPELINE=0 or set_wgmma_pipeline_enabled(false)). Bit-identical results either way.
bool wgmma_pipeline_enabled();
void set_wgmma_pipeline_enabled(bool on);
// Whether a CTA loads its column tile's B once and keeps it in shared memory where K ≤ 256 (the
// default), with the freed slots holding more of A, or loads B with every row tile's A
// (KILN_GEMM_B_RESIDENT=0 or set_gemm_b_resident_enabled(false)). Bit-identical results either
// way.
bool gemm_b_resident_enabled();
void set_gemm_b_resident_enabled(bool on);

}  // namespace kiln::cuda
