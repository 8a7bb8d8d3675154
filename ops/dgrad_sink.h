#pragma once
// Between two backward nodes of ops/: a convolution's data gradient taken into the kernels of
// the node that produced the convolution's input (DgradSink), and a batch norm's backward
// handed to the convolution that produced its input as factors (FoldedGradTarget).
//
// In a ResNet the identity block's conv1 reads the previous block's output relu(bn3(y3) + x).
// Its data gradient is a GEMM, and the previous block's batch-norm backward starts by reading
// that gradient (summed with the shortcut's) for its per-channel sums. Conv2dBackward offers the
// GEMM's operands to the node behind its input edge; a node that accepts computes
// dgrad(dy, w) itself in its apply(), added to whatever gradient the engine hands it (on CUDA
// one GEMM with the sums in its epilogue: cuda/kernels/gemm_bn.cu), and the convolution leaves
// that input's gradient undefined. The engine still counts the edge, so the accepting node runs
// after the convolution, with every other contribution summed. A bottleneck's conv2 (3x3) reads
// relu(bn1(y1)) the same way (on CUDA kiln's 3x3 implicit GEMM with the same epilogue).
#include <cstdint>

#include "core/tensor.h"

namespace kiln::F::detail {

class DgradSink {
 public:
  virtual ~DgradSink() = default;
  // Whether this node takes dgrad(dy, w) of a stride-1 convolution — w (K, C, 1, 1) unpadded,
  // or w (K, C, 3, 3) with padding 1 — into the gradient of its output `output_nr`. At most
  // once per backward.
  virtual bool accept_dgrad(uint32_t output_nr, const Tensor& dy, const Tensor& w) = 0;
  // The same with a linear map of x2 added: dgrad(dy, w) + x2 · w2ᵀ + b2 on the rows of the
  // convolution's input, x2 (N, C2, H, W) at its positions, w2 (C, C2), b2 (C) — the tail fold's
  // data gradient of a2 (FoldedGradTarget below), whose second term is then never written. No
  // node takes it unless it says so here.
  virtual bool accept_dgrad_linear(uint32_t /*output_nr*/, const Tensor& /*dy*/,
                                   const Tensor& /*w*/, const Tensor& /*x2*/,
                                   const Tensor& /*w2*/, const Tensor& /*b2*/) {
    return false;
  }
  // A stride-2 unpadded 1x1 convolution's data gradient is zero but at its input's even pixels
  // (h and w even). A node that says yes here takes those alone, compact — dx_sub (N, C, ⌈H/2⌉,
  // ⌈W/2⌉) — as a contribution to the gradient of its output `output_nr`, and the convolution
  // neither writes nor leaves behind the other three quarters (a downsample block's shortcut,
  // read by the block tail's GEMM before it: docs/lab/norm-conv.md, v45). Asked before the
  // convolution forms dx_sub; at most once per backward.
  virtual bool wants_dgrad_stride2(uint32_t /*output_nr*/) const { return false; }
  virtual void take_dgrad_stride2(uint32_t /*output_nr*/, const Tensor& /*dx_sub*/) {}
};

// The other direction: a block tail's batch-norm backward hands the convolution that produced
// its input the gradient as per-channel factors instead of writing it. A bottleneck's bn3
// backward is dy3 = a·g + b·y3 + c per channel (g: the gradient through the ReLU, y3 = conv3's
// output, a, b, c from the batch norm's sums), and the pass that writes dy3 reads g and y3 and
// writes dy3, all 4·C channels wide. conv3 (a 1x1 convolution of a2, C channels) can take
// (g, a, b, c) instead: with y3 = a2 · w3ᵀ, its data gradient dy3 · w3 is
// g · (a ⊙ w3) + a2 · (w3ᵀ · diag(b) · w3) + cᵀ · w3, and its weight gradient dy3ᵀ · a2 is
// a ⊙ (gᵀ · a2) + b ⊙ (w3 · a2ᵀ · a2) + c ⊗ Σa2: GEMMs on g and a2 and small matrices, with
// nothing 4·C wide written but g (ops/conv2d.cpp has the whole of it; docs/lab/norm-conv.md,
// "The tail fold").
class FoldedGradTarget {
 public:
  virtual ~FoldedGradTarget() = default;
  // Whether this node would take its output `output_nr`'s gradient in the factored form, g
  // being that output's shape, dtype and device. Asked before the factors are computed.
  virtual bool can_take_folded(uint32_t output_nr, const Tensor& g) const = 0;
  // The gradient of output `output_nr` is coef[k]·g + coef[K + k]·y + coef[2K + k] per channel
  // k (coef: f32, 3·K), y this node's own output. The caller returns that gradient undefined.
  virtual void take_folded(uint32_t output_nr, const Tensor& g, const Tensor& coef) = 0;
};

}  // namespace kiln::F::detail
