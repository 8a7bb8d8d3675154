#pragma once
// Between two backward nodes of ops/: a convolution's data gradient taken into the kernels of
// the node that produced the convolution's input.
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
};

}  // namespace kiln::F::detail
