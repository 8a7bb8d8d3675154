// The tail fold's pieces on CUDA (contract in cuda/kernels.h: conv1x1_fold_prep,
// conv1x1_fold_weight_grad; the algebra in ops/conv2d.cpp). A 1x1 convolution's weight w (K × C,
// f16) and its output gradient's factors dy = a·g + b·y + c per output channel k. Each output
// element is a dot product over K or C of values in L2, in a fixed order, in f32: one thread
// per element, one launch per entry, instead of the dozen elementwise ops and small GEMMs of the
// composition.
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/kernels.h"
#include "cuda/kernels/common.cuh"

namespace kiln::cuda {
namespace {

// Threads [0, K·C): w1[k][i] = a_k·w[k][i]. Then [K·C, K·C + C·C): m2t[j][i] = Σ_k w[k][j]·b_k·
// w[k][i] (wᵀ·diag(b)·w, which is symmetric; written as the weight of a linear layer, the
// transpose). Then [K·C + C·C, K·C + C·C + C): bias[j] = Σ_k c_k·w[k][j].
__global__ void fold_prep_kernel(__half* __restrict__ w1, __half* __restrict__ m2t,
                                 __half* __restrict__ bias, const __half* __restrict__ w,
                                 const float* __restrict__ coef, int K, int C) {
  pdl_start();
  const int64_t kc = int64_t(K) * C, cc = int64_t(C) * C, n = kc + cc + C;
  const float* a = coef;
  const float* b = coef + K;
  const float* c = coef + 2 * K;
  // A grid-stride loop: grid_for caps the grid (layer 4's K·C + C·C is past one pass of it).
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < n;
       t += int64_t(gridDim.x) * blockDim.x) {
    if (t < kc) {
      const int k = int(t / C);
      w1[t] = __float2half_rn(a[k] * __half2float(w[t]));
    } else if (t < kc + cc) {
      const int j = int((t - kc) / C), i = int((t - kc) % C);
      float s = 0.f;
      for (int k = 0; k < K; ++k)
        s = fmaf(__half2float(w[int64_t(k) * C + j]) * b[k], __half2float(w[int64_t(k) * C + i]),
                 s);
      m2t[t - kc] = __float2half_rn(s);
    } else {
      const int j = int(t - kc - cc);
      float s = 0.f;
      for (int k = 0; k < K; ++k) s = fmaf(c[k], __half2float(w[int64_t(k) * C + j]), s);
      bias[j] = __float2half_rn(s);
    }
  }
}

// dw[k][i] (strides so, si) = a_k·gx[k][i] + b_k·Σ_j w[k][j]·G[j][i] + c_k·s_i, G = gram (C × C),
// or gram (2C × 2C)'s blocks [0, C)² + [C, 2C)² when paired.
template <typename T>
__global__ void fold_weight_grad_kernel(T* __restrict__ dw, int64_t so, int64_t si,
                                        const float* __restrict__ gx,
                                        const float* __restrict__ gram,
                                        const float* __restrict__ sums,
                                        const __half* __restrict__ w,
                                        const float* __restrict__ coef, int K, int C,
                                        bool paired) {
  pdl_start();
  const int P = paired ? 2 * C : C;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < int64_t(K) * C;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int k = int(t / C), i = int(t % C);
    float wg = 0.f;
    for (int j = 0; j < C; ++j) {
      float g = gram[int64_t(j) * P + i];
      if (paired) g += gram[int64_t(C + j) * P + C + i];
      wg = fmaf(__half2float(w[int64_t(k) * C + j]), g, wg);
    }
    const float v = coef[k] * gx[t] + coef[K + k] * wg + coef[2 * K + k] * sums[i];
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
  const int64_t n = K * C + C * C + C;
  launch(fold_prep_kernel, grid_for(n), kBlock, 0, current_stream(),
         static_cast<__half*>(w1.raw_data()), static_cast<__half*>(m2t.raw_data()),
         static_cast<__half*>(bias.raw_data()), static_cast<const __half*>(w.raw_data()),
         static_cast<const float*>(coef.raw_data()), int(K), int(C));
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
  // gᵀx and xᵀx summed in f32 (the three terms below cancel in part), Σx per channel.
  Tensor gx = empty({K, C, 1, 1}, f32);
  conv1x1_backward_weight(gx, g, x, ConvParams{}, false);
  const Tensor xg = gram_operand(x);
  const int64_t P = xg.size(1);
  Tensor gram = empty({P, P, 1, 1}, f32);
  conv1x1_backward_weight(gram, xg, xg, ConvParams{}, false);
  Tensor sums = empty({C}, f32), sqsums = empty({C}, f32);
  bn_nhwc_stats(sums, sqsums, x);
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
  const auto* wp = static_cast<const __half*>(w.raw_data());
  cudaStream_t s = current_stream();
  if (dw.dtype() == DType::f16)
    launch(fold_weight_grad_kernel<__half>, grid_for(K * C), kBlock, 0, s,
           static_cast<__half*>(dw.raw_data()), dw.stride(0), dw.stride(1), gxp, gp, sp, wp, cp,
           int(K), int(C), paired);
  else
    launch(fold_weight_grad_kernel<float>, grid_for(K * C), kBlock, 0, s,
           static_cast<float*>(dw.raw_data()), dw.stride(0), dw.stride(1), gxp, gp, sp, wp, cp,
           int(K), int(C), paired);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda
