// Strided, converting copy and bit-pattern fill.
#include <cstdint>
#include <cstring>

#include "cuda/kernels/copy.cuh"
#include "cuda/kernels/common.cuh"

namespace kiln::cuda {
namespace {

template <typename D, typename S>
__global__ void copy_kernel(Geom<2> g, D* __restrict__ dst, const S* __restrict__ src,
                            int64_t n) {
  pdl_start();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[2];
    g.offsets(i, off);
    dst[off[0]] = cvt<D>(src[off[1]]);
  }
}

// Element-size-generic: U is an unsigned integer of the element's width.
template <typename U>
__global__ void fill_kernel(Geom<1> g, U* __restrict__ dst, U bits, int64_t n) {
  pdl_start();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[1];
    g.offsets(i, off);
    dst[off[0]] = bits;
  }
}

// dst (P, 4) = src (P, C) with channels C.. zero, C < 4: one pixel per thread, one 8-byte store.
__global__ void pad4_kernel(uint2* __restrict__ dst, const uint16_t* __restrict__ src, int C,
                            int64_t pixels) {
  pdl_start();
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < pixels;
       p += int64_t(gridDim.x) * blockDim.x) {
    uint16_t h[4] = {0, 0, 0, 0};
    for (int c = 0; c < C; ++c) h[c] = src[p * C + c];
    dst[p] = make_uint2(uint32_t(h[0]) | uint32_t(h[1]) << 16,
                        uint32_t(h[2]) | uint32_t(h[3]) << 16);
  }
}

// The RGB case, 8 pixels per thread: 48 bytes in as 3 16-byte loads, 64 bytes out as 4 stores.
__global__ void pad3to4_kernel(uint4* __restrict__ dst, const uint4* __restrict__ src,
                               int64_t groups) {
  pdl_start();
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * blockDim.x) {
    uint16_t in[24];
    const uint4 a = src[3 * g], b = src[3 * g + 1], c = src[3 * g + 2];
    memcpy(in, &a, 16);
    memcpy(in + 8, &b, 16);
    memcpy(in + 16, &c, 16);
    uint16_t out[32];
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      out[4 * p] = in[3 * p];
      out[4 * p + 1] = in[3 * p + 1];
      out[4 * p + 2] = in[3 * p + 2];
      out[4 * p + 3] = 0;
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint4 o;
      memcpy(&o, out + 8 * q, 16);
      dst[4 * g + q] = o;
    }
  }
}

// (A, C, H, W) with channels innermost and no gaps (channels-last dense; any strides for C = 1).
bool channels_inner_dense(const Tensor& t) {
  if (t.dim() != 4) return false;
  const int64_t c = t.size(1), h = t.size(2), w = t.size(3);
  return (c == 1 || t.stride(1) == 1) && (w == 1 || t.stride(3) == c) &&
         (h == 1 || t.stride(2) == w * c) && (t.size(0) == 1 || t.stride(0) == h * w * c);
}

}  // namespace

bool pad_channels4(const Tensor& dst, const Tensor& src) {
  if (src.element_size() != 2 || dst.element_size() != 2 || src.dtype() != dst.dtype() ||
      src.size(1) >= 4 || dst.size(1) != 4 || !channels_inner_dense(src) ||
      !channels_inner_dense(dst) || src.device() != dst.device())
    return false;
  for (int d : {0, 2, 3})
    if (src.size(d) != dst.size(d)) return false;
  const int64_t pixels = dst.numel() / 4;
  if (pixels == 0) return true;
  const bool aligned = reinterpret_cast<uintptr_t>(src.raw_data()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(dst.raw_data()) % 16 == 0;
  if (src.size(1) == 3 && pixels % 8 == 0 && aligned) {
    const int64_t groups = pixels / 8;
    launch(pad3to4_kernel, grid_for(groups), kBlock, 0, current_stream(),
           static_cast<uint4*>(dst.raw_data()), static_cast<const uint4*>(src.raw_data()), groups);
    KILN_CUDA_CHECK_LAUNCH();
    return true;
  }
  launch(pad4_kernel, grid_for(pixels), kBlock, 0, current_stream(),
         static_cast<uint2*>(dst.raw_data()), static_cast<const uint16_t*>(src.raw_data()),
         int(src.size(1)), pixels);
  KILN_CUDA_CHECK_LAUNCH();
  return true;
}

void launch_copy_strided(const Tensor& dst, const Tensor& src) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  Geom<2> g = make_geom<2>(dst.shape(), {&dst.strides(), &src.strides()});
  cudaStream_t stream = current_stream();
  dispatch_device_all(dst.dtype(), [&]<typename D>() {
    dispatch_device_all(src.dtype(), [&]<typename S>() {
      launch(copy_kernel<D, S>, grid_for(n), kBlock, 0, stream, g, static_cast<D*>(dst.raw_data()),
             static_cast<const S*>(src.raw_data()), n);
      KILN_CUDA_CHECK_LAUNCH();
    });
  });
}

void launch_fill(const Tensor& dst, uint64_t bits) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  Geom<1> g = make_geom<1>(dst.shape(), {&dst.strides()});
  cudaStream_t stream = current_stream();
  auto run = [&]<typename U>() {
    launch(fill_kernel<U>, grid_for(n), kBlock, 0, stream, g, static_cast<U*>(dst.raw_data()),
           U(bits), n);
    KILN_CUDA_CHECK_LAUNCH();
  };
  switch (dst.element_size()) {
    case 1: run.template operator()<uint8_t>(); break;
    case 2: run.template operator()<uint16_t>(); break;
    case 4: run.template operator()<uint32_t>(); break;
    case 8: run.template operator()<uint64_t>(); break;
    default: KILN_FAIL("fill (cuda): unexpected element size ", dst.element_size());
  }
}

}  // namespace kiln::cuda
