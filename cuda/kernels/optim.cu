// Fused optimizer and loss-scaler kernels. One block per chunk (a slice of one parameter):
// every thread of a block reads the same slot, group and scalars, so a sweep over all
// parameters is one launch with no divergence between parameters of different dtypes.
#include "cuda/kernels/common.cuh"
#include "cuda/kernels.h"

namespace kiln::cuda {
namespace {

using namespace fused;

constexpr int kThreads = 256;

__device__ __forceinline__ float load_grad(const uint8_t* base, DType t, int64_t i) {
  switch (t) {
    case DType::f16: return __half2float(reinterpret_cast<const __half*>(base)[i]);
    case DType::bf16: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(base)[i]);
    default: return reinterpret_cast<const float*>(base)[i];
  }
}

__device__ __forceinline__ void store_param(void* base, DType t, int64_t i, float v) {
  switch (t) {
    case DType::f16: static_cast<__half*>(base)[i] = __float2half_rn(v); break;
    case DType::bf16: static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(base)[i] = v; break;
  }
}

// Block-wide sum in a fixed tree order (deterministic for a given block size).
__device__ float block_sum(float v) {
  __shared__ float warp_sums[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  float s = 0.0f;
  if (threadIdx.x < 32) {
    s = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  }
  return s;  // valid in thread 0
}

__global__ void check_kernel(CheckArgs a) {
  pdl_start();
  const Chunk ch = a.table.chunks[blockIdx.x];
  const Slot s = a.table.slots[ch.slot];
  const uint8_t* g = a.grads + s.grad;
  float sum = 0.0f;
  bool bad = false;
  for (int64_t i = ch.begin + threadIdx.x; i < ch.end; i += kThreads) {
    const float v = load_grad(g, s.dtype, i);
    bad |= !isfinite(v);
    sum = muladd(v, v, sum);
  }
  if (bad) *a.found_inf = 1.0f;  // benign race: every writer stores the same value
  sum = block_sum(sum);
  if (threadIdx.x == 0) a.partial_sumsq[blockIdx.x] = sum;
}

__global__ void clip_kernel(const float* partial, int64_t n, const float* scale, float max_norm,
                            float* norm, float* coef) {
  pdl_start();
  __shared__ double sums[kThreads];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) s += double(partial[i]);
  sums[threadIdx.x] = s;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (int(threadIdx.x) < w) sums[threadIdx.x] += sums[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    double nrm = sqrt(sums[0]);
    if (scale) nrm /= double(*scale);
    *norm = float(nrm);
    *coef = clip_coefficient(*norm, max_norm);
  }
}

__global__ void step_begin_kernel(int32_t* step, const float* found_inf) {
  pdl_start();
  if (!found_inf || *found_inf == 0.0f) *step += 1;
}

__global__ void scaler_update_kernel(ScalerArgs a) {
  pdl_start();
  scaler_update(a);
}

template <bool Adam>
__global__ void step_kernel(StepArgs a) {
  pdl_start();
  if (a.scaling.found_inf && *a.scaling.found_inf != 0.0f) return;
  const Chunk ch = a.table.chunks[blockIdx.x];
  const Slot s = a.table.slots[ch.slot];
  const GroupOptions go = a.table.groups[s.group];
  const double lr = a.table.lr[s.group];
  const int32_t t = *a.step;
  bool apply = false;
  const float mul = grad_multiplier(a.scaling, apply);
  const uint8_t* grads = a.grads + s.grad;
  float* master = a.master + s.master;
  if constexpr (Adam) {
    const AdamWScalars sc = adamw_scalars(go, lr, t);
    float* m = a.state0 + s.master;
    float* v = a.state1 + s.master;
    for (int64_t i = ch.begin + threadIdx.x; i < ch.end; i += kThreads) {
      float g = load_grad(grads, s.dtype, i);
      if (apply) g = mul_rn(g, mul);
      float p = master[i], mi = m[i], vi = v[i];
      adamw_update(p, mi, vi, g, sc);
      master[i] = p;
      m[i] = mi;
      v[i] = vi;
      store_param(s.param, s.dtype, i, p);
    }
  } else {
    const SGDScalars sc = sgd_scalars(go, lr, t);
    float* buf = a.state0 ? a.state0 + s.master : nullptr;
    for (int64_t i = ch.begin + threadIdx.x; i < ch.end; i += kThreads) {
      float g = load_grad(grads, s.dtype, i);
      if (apply) g = mul_rn(g, mul);
      float p = master[i], b = buf ? buf[i] : 0.0f;
      sgd_update(p, b, g, sc);
      master[i] = p;
      if (buf) buf[i] = b;
      store_param(s.param, s.dtype, i, p);
    }
  }
}

}  // namespace

void fused_check_grads(const CheckArgs& a) {
  if (a.table.num_chunks == 0) return;
  launch(check_kernel, unsigned(a.table.num_chunks), kThreads, 0, current_stream(), a);
  KILN_CUDA_CHECK_LAUNCH();
}

void fused_clip_coef(const float* partial, int64_t n, const float* scale, float max_norm,
                     float* norm, float* coef) {
  launch(clip_kernel, 1, kThreads, 0, current_stream(), partial, n, scale, max_norm, norm, coef);
  KILN_CUDA_CHECK_LAUNCH();
}

void fused_step_begin(int32_t* step, const float* found_inf) {
  launch(step_begin_kernel, 1, 1, 0, current_stream(), step, found_inf);
  KILN_CUDA_CHECK_LAUNCH();
}

void fused_sgd_step(const StepArgs& a) {
  if (a.table.num_chunks == 0) return;
  launch(step_kernel<false>, unsigned(a.table.num_chunks), kThreads, 0, current_stream(), a);
  KILN_CUDA_CHECK_LAUNCH();
}

void fused_adamw_step(const StepArgs& a) {
  if (a.table.num_chunks == 0) return;
  launch(step_kernel<true>, unsigned(a.table.num_chunks), kThreads, 0, current_stream(), a);
  KILN_CUDA_CHECK_LAUNCH();
}

void loss_scaler_update(const ScalerArgs& a) {
  launch(scaler_update_kernel, 1, 1, 0, current_stream(), a);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda
