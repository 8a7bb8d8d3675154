// The tail fold's pieces on CUDA (contract in cuda/kernels.h: conv1x1_fold_prep,
// conv1x1_fold_weight_grad; the algebra in ops/conv2d.cpp). A 1x1 convolution's weight w (K × C,
// f16) and its output gradient's factors dy = a·g + b·y + c per output channel k. The two K·C²
// products, wᵀ·diag(b)·w and w·G, are f32 GEMMs on cuBLASLt (cuda::matmul, exact f32: no TF32);
// the rest is elementwise over K·C or C·C, in small grid-stride kernels. (v37 had one thread per
// output computing each product's dot product: 437 µs for layer 4's wᵀ·diag(b)·w, against tens
// of µs as a GEMM; docs/lab/norm-conv.md, v38.)
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/conv.h"
#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"

namespace kiln::cuda {
namespace {

// Over K·C: w1 = a ⊙ w (f16), wf = w and wb = b ⊙ w (f32).
__global__ void fold_scale_kernel(__half* __restrict__ w1, float* __restrict__ wf,
                                  float* __restrict__ wb, const __half* __restrict__ w,
                                  const float* __restrict__ coef, int K, int C) {
  pdl_start();
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < int64_t(K) * C;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int k = int(t / C);
    const float v = __half2float(w[t]);
    w1[t] = __float2half_rn(coef[k] * v);
    wf[t] = v;
    wb[t] = coef[K + k] * v;
  }
}

// Over C·C + C: m2t[j][i] = m2[i][j], bias_h = bias, both to f16.
__global__ void fold_prep_finish_kernel(__half* __restrict__ m2t, __half* __restrict__ bias_h,
                                        const float* __restrict__ m2,
                                        const float* __restrict__ bias, int C) {
  pdl_start();
  const int64_t cc = int64_t(C) * C;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < cc + C;
       t += int64_t(gridDim.x) * blockDim.x) {
    if (t < cc) {
      const int j = int(t / C), i = int(t % C);
      m2t[t] = __float2half_rn(m2[int64_t(i) * C + j]);
    } else {
      bias_h[t - cc] = __float2half_rn(bias[t - cc]);
    }
  }
}

// Over C·C: g2 = the paired gram's two diagonal blocks added (gram: 2C × 2C).
__global__ void fold_gram_pairs_kernel(float* __restrict__ g2, const float* __restrict__ gram,
                                       int C) {
  pdl_start();
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < int64_t(C) * C;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int j = int(t / C), i = int(t % C);
    g2[t] = gram[int64_t(j) * 2 * C + i] + gram[int64_t(C + j) * 2 * C + C + i];
  }
}

// Over K·C: dw[k][i] = a_k·gx[k][i] + b_k·q[k][i] + c_k·s_i (q = w·G).
template <typename T>
__global__ void fold_combine_kernel(T* __restrict__ dw, int64_t so, int64_t si,
                                    const float* __restrict__ gx, const float* __restrict__ q,
                                    const float* __restrict__ sums,
                                    const float* __restrict__ coef, int K, int C) {
  pdl_start();
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < int64_t(K) * C;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int k = int(t / C), i = int(t % C);
    const float v = coef[k] * gx[t] + coef[K + k] * q[t] + coef[2 * K + k] * sums[i];
    dw[int64_t(k) * so + int64_t(i) * si] = T(v);
  }
}

}  // namespace

void conv1x1_fold_prep(const Tensor& w1, const Tensor& m2t, const Tensor& bias, const Tensor& w,
                       const Tensor& coef) {
  const char* op = "conv1x1_fold_prep";
  KILN_CHECK(w.dtype() == DType::f16 && w.is_cuda() && w.dim() == 4 && w.size(2) == 1 &&
                 w.size(3) == 1 && w.is_contiguous(),
             op, " (cuda): w must be a contiguous f16 (K, C, 1, 1) weight, got ", w.desc());
  const int64_t K = w.size(0), C = w.size(1);
  KILN_CHECK(w1.dtype() == DType::f16 && w1.is_contiguous() && w1.numel() == K * C &&
                 m2t.dtype() == DType::f16 && m2t.is_contiguous() && m2t.numel() == C * C &&
                 bias.dtype() == DType::f16 && bias.is_contiguous() && bias.numel() == C,
             op, " (cuda): w1 (K·C), m2t (C·C) and bias (C) must be contiguous f16, got ",
             w1.desc(), ", ", m2t.desc(), ", ", bias.desc());
  KILN_CHECK(coef.dtype() == DType::f32 && coef.is_contiguous() && coef.numel() == 3 * K, op,
             " (cuda): coef must be 3·K = ", 3 * K, " contiguous f32 values, got ", coef.desc());
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(w.device());
  Tensor wf = empty({K, C}, f32), wb = empty({K, C}, f32), m2 = empty({C, C}, f32);
  Tensor bias_f = empty({1, C}, f32);
  cudaStream_t s = current_stream();
  launch(fold_scale_kernel, grid_for(K * C), kBlock, 0, s,
         static_cast<__half*>(w1.raw_data()), static_cast<float*>(wf.raw_data()),
         static_cast<float*>(wb.raw_data()), static_cast<const __half*>(w.raw_data()),
         static_cast<const float*>(coef.raw_data()), int(K), int(C));
  KILN_CUDA_CHECK_LAUNCH();
  matmul(m2, wf, /*trans_a=*/true, wb, /*trans_b=*/false);             // wᵀ · diag(b) · w
  matmul(bias_f, coef.narrow(0, 2 * K, K).view({1, K}), false, wf, false);  // cᵀ · w
  launch(fold_prep_finish_kernel, grid_for(C * C + C), kBlock, 0, s,
         static_cast<__half*>(m2t.raw_data()), static_cast<__half*>(bias.raw_data()),
         static_cast<const float*>(m2.raw_data()), static_cast<const float*>(bias_f.raw_data()),
         int(C));
  KILN_CUDA_CHECK_LAUNCH();
}

namespace {
// x (N, C, H, W) channels-last as the operand of its own Gram matrix xᵀx on the 1x1 weight
// gradient's kernel: itself, or, with C = 64, its rows paired into (N·H·W / 2, 128, 1, 1) (the
// kernel wants 128 channels on one side), whose Gram's two diagonal 64 × 64 blocks add up to x's.
Tensor gram_operand(const Tensor& x) {
  const int64_t C = x.size(1), M = x.numel() / std::max<int64_t>(C, 1);
  if (C != 64 || M % 2 != 0 || !x.is_contiguous(MemoryFormat::ChannelsLast)) return x;
  return x.permute({0, 2, 3, 1}).view({M / 2, 1, 1, 2 * C}).permute({0, 3, 1, 2});
}
}  // namespace

bool conv1x1_fold_supported(const Tensor& g, const Tensor& x, const Tensor& w) {
  if (!(x.defined() && w.defined() && w.dtype() == DType::f16 && w.dim() == 4 &&
        conv1x1_wgrad_f32_supported(g, x) && bn_nhwc_supported(x)))
    return false;
  const Tensor xg = gram_operand(x);
  return conv1x1_wgrad_f32_supported(xg, xg);
}

void conv1x1_fold_weight_grad(const Tensor& dw, const Tensor& g, const Tensor& x, const Tensor& w,
                              const Tensor& coef) {
  const char* op = "conv1x1_fold_weight_grad";
  KILN_CHECK(conv1x1_fold_supported(g, x, w), op,
             " (cuda): needs what conv1x1_backward_weight takes with an f32 dw for (g, x) and for "
             "x's Gram, and an f16 w; got g ",
             g.desc(), ", x ", x.desc(), ", w ", w.desc());
  const Tensor wc = w.contiguous();
  const int64_t K = wc.size(0), C = wc.size(1);
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(x.device());
  // gᵀx and xᵀx summed in f32 (the three terms below cancel in part), Σx per channel: from gᵀx's
  // pass where the kernel's idle warps can add x's tiles, else from a pass of its own.
  // x's Gram from that pass too where it fits (C 64 or 128), else a GEMM of its own.
  // In deterministic mode, neither: on two H100 boards of four, Σx from the kernel's summing
  // warps (with the Gram) gave other bits in about 2% of runs, a row of x read out of turn, while
  // gᵀx and the Gram never did (docs/lab/norm-conv.md, "The determinism finding run"); the
  // separate passes below repeat.
  Tensor gx = empty({K, C, 1, 1}, f32);
  Tensor sums = empty({C}, f32);
  Tensor gram;
  const bool in_kernel_sums = !conv_deterministic();
  if (in_kernel_sums && conv1x1_wgrad_x_gram_supported(gx, g, x)) {
    gram = empty({C, C, 1, 1}, f32);
    conv1x1_backward_weight_x_sum(gx, sums, g, x, gram);
  } else if (in_kernel_sums && conv1x1_wgrad_x_sum_supported(gx, g, x)) {
    conv1x1_backward_weight_x_sum(gx, sums, g, x);
  } else {
    conv1x1_backward_weight(gx, g, x, ConvParams{}, false);
    Tensor sqsums = empty({C}, f32);
    bn_nhwc_stats(sums, sqsums, x);
  }
  if (!gram.defined()) {
    const Tensor xg = gram_operand(x);
    const int64_t P = xg.size(1);
    gram = empty({P, P, 1, 1}, f32);
    conv1x1_backward_weight(gram, xg, xg, ConvParams{}, false);
  }
  conv1x1_fold_weight_grad_sum(dw, gx, gram, sums, wc, coef);
}

void conv1x1_fold_weight_grad_sum(const Tensor& dw, const Tensor& gx, const Tensor& gram,
                                  const Tensor& sums, const Tensor& w, const Tensor& coef) {
  const char* op = "conv1x1_fold_weight_grad_sum";
  KILN_CHECK(w.dtype() == DType::f16 && w.is_cuda() && w.dim() == 4 && w.is_contiguous(), op,
             " (cuda): w must be a contiguous f16 (K, C, 1, 1) weight, got ", w.desc());
  const int64_t K = w.size(0), C = w.size(1);
  const bool paired = gram.numel() == 4 * C * C;
  auto f32_of = [&](const Tensor& t, int64_t n, const char* what) {
    KILN_CHECK(t.dtype() == DType::f32 && t.is_contiguous() && t.numel() == n &&
                   t.device() == w.device(),
               op, " (cuda): ", what, " must be ", n, " contiguous f32 values, got ", t.desc());
    return static_cast<const float*>(t.raw_data());
  };
  const float* gxp = f32_of(gx, K * C, "gx");
  const float* gp = f32_of(gram, paired ? 4 * C * C : C * C, "gram");
  const float* sp = f32_of(sums, C, "sums");
  const float* cp = f32_of(coef, 3 * K, "coef");
  KILN_CHECK(dw.dim() == 4 && dw.size(0) == K && dw.size(1) == C && dw.size(2) == 1 &&
                 dw.size(3) == 1 && (dw.dtype() == DType::f16 || dw.dtype() == DType::f32),
             op, " (cuda): dw must be (K, C, 1, 1) f16 or f32, got ", dw.desc());
  cudaStream_t s = current_stream();
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(w.device());
  // x's Gram (C × C): the gram itself, or the sum of the paired (2C × 2C) one's diagonal blocks.
  Tensor g2 = gram.view({paired ? 2 * C : C, paired ? 2 * C : C});
  if (paired) {
    g2 = empty({C, C}, f32);
    launch(fold_gram_pairs_kernel, grid_for(C * C), kBlock, 0, s,
           static_cast<float*>(g2.raw_data()), gp, int(C));
    KILN_CUDA_CHECK_LAUNCH();
  }
  Tensor q = empty({K, C}, f32);
  matmul(q, w.to(DType::f32).view({K, C}), false, g2, false);  // w · G
  const float* qp = static_cast<const float*>(q.raw_data());
  if (dw.dtype() == DType::f16)
    launch(fold_combine_kernel<__half>, grid_for(K * C), kBlock, 0, s,
           static_cast<__half*>(dw.raw_data()), dw.stride(0), dw.stride(1), gxp, qp, sp, cp,
           int(K), int(C));
  else
    launch(fold_combine_kernel<float>, grid_for(K * C), kBlock, 0, s,
           static_cast<float*>(dw.raw_data()), dw.stride(0), dw.stride(1), gxp, qp, sp, cp,
           int(K), int(C));
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda
