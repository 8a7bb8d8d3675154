#pragma once
// The block tail GEMM's epilogue for one row and 8 channels, shared by the mma.sync kernel
// (gemm_bn.cu, whose header says what it computes) and the wgmma kernel (gemm_bn_wgmma.cu).
#include <cuda_fp16.h>

#include <cstdint>

namespace kiln::cuda {

__device__ inline float4 h4(const uint2 u) {
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  return {a.x, a.y, b.x, b.y};
}

// pv: the 8 halves of acc + r, already rounded to f16 as cuDNN stores G; xv: x's 8 halves; bits:
// the ReLU mask's byte. Returns g's 8 halves: pv masked — exactly what the unfused sums kernel
// would read; adds g into s1 and g·(x − mean) into s2.
__device__ inline uint4 tail_epilogue8_rounded(uint4 pv, uint4 xv, unsigned bits,
                                               const float (&mu)[8], float (&s1)[8],
                                               float (&s2)[8]) {
  const float4 x0 = h4(uint2{xv.x, xv.y}), x1 = h4(uint2{xv.z, xv.w});
  const float xf[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
  const __half2* ph = reinterpret_cast<const __half2*>(&pv);
  uint4 out;
  __half2* oh = reinterpret_cast<__half2*>(&out);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float2 gv = __half22float2(ph[q]);
    if (!((bits >> (2 * q)) & 1u)) gv.x = 0.f;
    if (!((bits >> (2 * q + 1)) & 1u)) gv.y = 0.f;
    oh[q] = __floats2half2_rn(gv.x, gv.y);
    s1[2 * q] += gv.x;
    s1[2 * q + 1] += gv.y;
    s2[2 * q] = fmaf(gv.x, xf[2 * q] - mu[2 * q], s2[2 * q]);
    s2[2 * q + 1] = fmaf(gv.y, xf[2 * q + 1] - mu[2 * q + 1], s2[2 * q + 1]);
  }
  return out;
}

// The dual form's third sum (two batch norms meeting at the residual add, the second's input u):
// s3 += g·(u − mean_u) for g's 8 halves as stored (the masked values dual_sums_kernel reads, in
// its order) and u's.
__device__ inline void dual_sum8(uint4 gv, uint4 uv, const float (&mu)[8], float (&s3)[8]) {
  const float4 g0 = h4(uint2{gv.x, gv.y}), g1 = h4(uint2{gv.z, gv.w});
  const float4 u0 = h4(uint2{uv.x, uv.y}), u1 = h4(uint2{uv.z, uv.w});
  const float gf[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
  const float uf[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
  for (int q = 0; q < 8; ++q) s3[q] = fmaf(gf[q], uf[q] - mu[q], s3[q]);
}

// A batch norm's scale, shift and ReLU applied to 8 halves in place: relu(x·scale + shift)
// rounded to f16, bit for bit what bn_nhwc_apply.cu's apply_kernel<Relu, false> stores (NaN
// kept). The prologue of kiln's wgmma kernels, applied to an operand in shared memory.
__device__ inline uint4 bn_relu8(uint4 xv, const float (&sc)[8], const float (&sh)[8]) {
  const __half2* xh = reinterpret_cast<const __half2*>(&xv);
  uint4 out;
  __half2* oh = reinterpret_cast<__half2*>(&out);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 v = __half22float2(xh[q]);
    float a = fmaf(v.x, sc[2 * q], sh[2 * q]), b = fmaf(v.y, sc[2 * q + 1], sh[2 * q + 1]);
    a = a < 0.f ? 0.f : a;
    b = b < 0.f ? 0.f : b;
    oh[q] = __floats2half2_rn(a, b);
  }
  return out;
}

// The ReLU mask's byte of x's 8 halves, recomputed as the forward's relu(x·scale + shift) kept
// them: bit q set where x_q·scale_q + shift_q > 0 (the unfused sums kernel's kMaskFromX test).
__device__ inline unsigned relu_bits8(uint4 xv, const float (&sc)[8], const float (&sh)[8]) {
  const float4 x0 = h4(uint2{xv.x, xv.y}), x1 = h4(uint2{xv.z, xv.w});
  const float xf[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
  unsigned bits = 0;
#pragma unroll
  for (int q = 0; q < 8; ++q) bits |= unsigned(fmaf(xf[q], sc[q], sh[q]) > 0.f) << q;
  return bits;
}

// acc: the GEMM's 8 f32 results (16-byte aligned, shared memory); rv, xv: r's and x's 8 halves;
// bits: the ReLU mask's byte. acc + r rounded to f16, then tail_epilogue8_rounded.
__device__ inline uint4 tail_epilogue8(const float* acc, uint4 rv, uint4 xv, unsigned bits,
                                       const float (&mu)[8], float (&s1)[8], float (&s2)[8]) {
  const float4 a0 = *reinterpret_cast<const float4*>(acc);
  const float4 a1 = *reinterpret_cast<const float4*>(acc + 4);
  const float4 r0 = h4(uint2{rv.x, rv.y}), r1 = h4(uint2{rv.z, rv.w});
  uint4 pv;
  __half2* ph = reinterpret_cast<__half2*>(&pv);
  ph[0] = __floats2half2_rn(a0.x + r0.x, a0.y + r0.y);
  ph[1] = __floats2half2_rn(a0.z + r0.z, a0.w + r0.w);
  ph[2] = __floats2half2_rn(a1.x + r1.x, a1.y + r1.y);
  ph[3] = __floats2half2_rn(a1.z + r1.z, a1.w + r1.w);
  return tail_epilogue8_rounded(pv, xv, bits, mu, s1, s2);
}

// Rows m0 + rr + kStride·i (i < kRows, those below M) of a tile, channels c0..c0 + 7 of C: all
// loads first (r's and x's 16 bytes and the mask's byte per row), then tail_epilogue8 per row,
// written to g. acc: the staged accumulators of row rr, channel c0; pitch: floats per staged row.
template <int kRows, int kStride>
__device__ inline void tail_epilogue_rows(__half* __restrict__ g, const __half* __restrict__ r,
                                          const uint8_t* __restrict__ mask,
                                          const __half* __restrict__ x, int64_t M, int64_t C,
                                          int64_t m0, int rr, int c0, const float* acc, int pitch,
                                          const float (&mu)[8], float (&s1)[8], float (&s2)[8]) {
  uint4 rv[kRows], xv[kRows];
  unsigned bits[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int64_t m = m0 + rr + kStride * i;
    const int64_t v = (m < M ? m : 0) * (C / 8) + c0 / 8;  // the 16-byte vector's index
    rv[i] = reinterpret_cast<const uint4*>(r)[v];
    xv[i] = reinterpret_cast<const uint4*>(x)[v];
    bits[i] = mask[v];
  }
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int64_t m = m0 + rr + kStride * i;
    if (m >= M) continue;
    reinterpret_cast<uint4*>(g)[m * (C / 8) + c0 / 8] =
        tail_epilogue8(acc + kStride * i * pitch, rv[i], xv[i], bits[i], mu, s1, s2);
  }
}

}  // namespace kiln::cuda
