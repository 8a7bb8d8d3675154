// wgmma_desc_probe: does wgmma read an A operand whose core matrices overlap in shared memory?
// The question behind the stem forward's A from shared memory (docs/lab/stem.md, "After v30"):
// at one k-step, output pixel m's 16 values of A are 16 contiguous halves of the patch starting
// 8·m halves in (stride 2, 4 channels), so with no swizzle the 8-row core matrices of A are
// contiguous 128-byte blocks, the K-neighbouring one 16 bytes on (overlapping) and the
// M-neighbouring one 128 bytes on. If the tensor cores take a leading byte offset of 16, the
// stem's A needs no ldmatrix and no registers: one descriptor per k-step.
//
//   nvcc -O2 -std=c++20 -I. -gencode arch=compute_90a,code=sm_90a \
//     tools/bench/wgmma_desc_probe.cu -o wgmma_desc_probe
//   ./wgmma_desc_probe
//
// One warpgroup runs one m64n64k16 wgmma with A and B from shared memory (no swizzle, K-major)
// for each case and compares D with a double-precision product on the host:
//   canonical  A as 8 × 2 disjoint core matrices (K-neighbour 128 bytes on, M-neighbour 256):
//              the control, which checks this probe's own layouts;
//   overlap    A read from the patch-like vector P: A[m][k] = P[8m + k] (K-neighbour 16 bytes
//              on, M-neighbour 128), at the start of P and 32 bytes into it (a k-step whose
//              first kernel column is 4 pixels in).
// Each case runs with the descriptor's two offsets as PTX documents them (leading = between
// core matrices adjacent in K, stride = adjacent in M or N) and swapped, so a mistaken reading
// of the convention shows up as the control failing, not as a false answer. Exit status 0 when
// the control matches under one convention; the overlap cases print their verdict.
// Not built by CMake: a question for one device call, answered in docs/lab/stem.md.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda/kernels/wgmma.cuh"  // kiln's PTX wrappers (device code only is used)

#define CHECK(x)                                                                               \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                            \
    }                                                                                          \
  } while (0)

namespace {

using namespace kiln::cuda::sm90;

constexpr int kM = 64, kN = 64, kK = 16;
constexpr int kABytes = 4096;                    // room for every A layout below
[[maybe_unused]] constexpr int kBOffset = 4096;  // B's place in shared memory

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A no-swizzle shared-memory descriptor: start >> 4 (bits 0-13), leading byte offset >> 4
// (16-29), stride byte offset >> 4 (32-45), layout 0 (62-63: no swizzle).
__device__ uint64_t desc(uint32_t addr, uint32_t lead, uint32_t stride) {
  return uint64_t((addr >> 4) & 0x3FFF) | uint64_t((lead >> 4) & 0x3FFF) << 16 |
         uint64_t((stride >> 4) & 0x3FFF) << 32;
}
#endif

__global__ void probe_kernel(const unsigned char* a_src, int a_bytes, const unsigned char* b_src,
                             int b_bytes, uint32_t a_start, uint32_t a_lead, uint32_t a_stride,
                             uint32_t b_lead, uint32_t b_stride, float* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ __align__(1024) unsigned char smem[kABytes + 2048];
  for (int i = threadIdx.x; i < a_bytes; i += blockDim.x) smem[i] = a_src[i];
  for (int i = threadIdx.x; i < b_bytes; i += blockDim.x) smem[kBOffset + i] = b_src[i];
  fence_proxy_async();  // the generic proxy's writes, before the tensor cores read them
  __syncthreads();
  const uint32_t base = uint32_t(__cvta_generic_to_shared(smem));
  const uint64_t da = desc(base + a_start, a_lead, a_stride);
  const uint64_t db = desc(base + kBOffset, b_lead, b_stride);
  float d[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  wgmma_fence_operands(d);
  wgmma_fence();
  wgmma_m64n64k16<0, 0>(d, da, db);
  wgmma_commit();
  wgmma_wait0();
  // D's fragments: register 4j + {0, 1} is row 16·warp + lane / 4, columns 8j + 2·(lane % 4)
  // + {0, 1}; 4j + {2, 3} the row 8 below.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r0 = 16 * warp + (lane >> 2);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = 8 * j + 2 * (lane & 3);
    out[r0 * kN + c] = d[4 * j];
    out[r0 * kN + c + 1] = d[4 * j + 1];
    out[(r0 + 8) * kN + c] = d[4 * j + 2];
    out[(r0 + 8) * kN + c + 1] = d[4 * j + 3];
  }
#endif
}

// Byte offset of element (row, k) of a K-major operand of 8 × 2 (or 8 × 8) disjoint core
// matrices: core (row / 8, k / 8) at `stride`·(row / 8) + `lead`·(k / 8), its row row % 8 at
// 16·(row % 8), element k % 8 at 2·(k % 8).
size_t canonical_offset(int row, int k, int lead, int stride) {
  return size_t(stride) * (row / 8) + size_t(lead) * (k / 8) + 16 * (row % 8) + 2 * (k % 8);
}

struct Case {
  const char* name;
  bool overlap;
  int start_halves;  // overlap: A starts this many halves into P
};

}  // namespace

int main() {
  int dev = 0, major = 0, minor = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major != 9 || minor != 0) {
    std::printf("wgmma_desc_probe: needs an sm_90 GPU (this one is sm_%d%d)\n", major, minor);
    return 2;
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> small(-8, 8);  // exact in f16, and their sums in f32

  // B (k × n = 16 × 64) and A (64 × 16) for the canonical case; P for the overlap cases.
  std::vector<float> b(kK * kN), a(kM * kK), p(8 * kM + 32);
  for (auto& v : b) v = float(small(rng)) / 4.f;
  for (auto& v : a) v = float(small(rng)) / 4.f;
  for (auto& v : p) v = float(small(rng)) / 4.f;

  unsigned char *d_a, *d_b;
  float* d_out;
  CHECK(cudaMalloc(&d_a, kABytes));
  CHECK(cudaMalloc(&d_b, 2048));
  CHECK(cudaMalloc(&d_out, kM * kN * sizeof(float)));

  const Case cases[] = {
      {"canonical", false, 0}, {"overlap, at P", true, 0}, {"overlap, 32 bytes into P", true, 16}};
  bool control_ok[2] = {false, false};
  for (int conv = 0; conv < 2; ++conv) {
    // conv 0: lead = between core matrices adjacent in K, stride = adjacent in M / N (PTX's
    // reading); conv 1: the two swapped in the descriptor.
    for (const Case& cs : cases) {
      // B, K-major: Bt[n][k] as canonical core matrices, K-neighbour 128 bytes on, N 256.
      std::vector<__half> bh(1024, __float2half(0.f));
      for (int n = 0; n < kN; ++n)
        for (int k = 0; k < kK; ++k)
          bh[canonical_offset(n, k, 128, 256) / 2] = __float2half(b[k * kN + n]);
      std::vector<__half> ah(kABytes / 2, __float2half(0.f));
      std::vector<float> amat(kM * kK);  // the A the case means
      int a_lead, a_stride, a_bytes;
      uint32_t a_start;
      if (!cs.overlap) {
        for (int m = 0; m < kM; ++m)
          for (int k = 0; k < kK; ++k) {
            ah[canonical_offset(m, k, 128, 256) / 2] = __float2half(a[m * kK + k]);
            amat[m * kK + k] = a[m * kK + k];
          }
        a_lead = 128, a_stride = 256, a_bytes = 2048, a_start = 0;
      } else {
        for (size_t i = 0; i < p.size(); ++i) ah[i] = __float2half(p[i]);
        for (int m = 0; m < kM; ++m)
          for (int k = 0; k < kK; ++k) amat[m * kK + k] = p[cs.start_halves + 8 * m + k];
        a_lead = 16, a_stride = 128, a_bytes = int(p.size() * 2), a_start = 2 * cs.start_halves;
      }
      CHECK(cudaMemcpy(d_a, ah.data(), kABytes, cudaMemcpyHostToDevice));
      CHECK(cudaMemcpy(d_b, bh.data(), 2048, cudaMemcpyHostToDevice));
      CHECK(cudaMemset(d_out, 0xff, kM * kN * sizeof(float)));
      const uint32_t al = conv ? a_stride : a_lead, as = conv ? a_lead : a_stride;
      const uint32_t bl = conv ? 256 : 128, bs = conv ? 128 : 256;
      probe_kernel<<<1, 128>>>(d_a, a_bytes, d_b, 2048, a_start, al, as, bl, bs, d_out);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      std::vector<float> out(kM * kN);
      CHECK(cudaMemcpy(out.data(), d_out, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
      double worst = 0, scale = 0;
      int wrong = 0;
      for (int m = 0; m < kM; ++m)
        for (int n = 0; n < kN; ++n) {
          double ref = 0;
          for (int k = 0; k < kK; ++k) ref += double(amat[m * kK + k]) * b[k * kN + n];
          const double err = std::fabs(double(out[m * kN + n]) - ref);
          worst = std::fmax(worst, std::isnan(err) ? INFINITY : err);
          scale = std::fmax(scale, std::fabs(ref));
          wrong += err > 0 || std::isnan(err);  // the values and their sums are exact
        }
      const bool ok = wrong == 0;
      if (!cs.overlap) control_ok[conv] = ok;
      std::printf(
          "%-26s offsets %s: %s (%d of %d elements differ; max |error| %.3g, max |D| %.3g)\n",
          cs.name, conv ? "swapped " : "as PTX's", ok ? "MATCH" : "differs", wrong, kM * kN, worst,
          scale);
    }
  }
  CHECK(cudaFree(d_a));
  CHECK(cudaFree(d_b));
  CHECK(cudaFree(d_out));
  if (!control_ok[0] && !control_ok[1]) {
    std::printf("the control matched under neither reading: this probe's layouts are wrong\n");
    return 1;
  }
  return 0;
}
