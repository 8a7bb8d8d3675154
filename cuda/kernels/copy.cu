// Strided, converting copy and bit-pattern fill.
#include "cuda/kernels/copy.cuh"
#include "cuda/kernels/common.cuh"

namespace kiln::cuda {
namespace {

template <typename D, typename S>
__global__ void copy_kernel(Geom<2> g, D* __restrict__ dst, const S* __restrict__ src,
                            int64_t n) {
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
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[1];
    g.offsets(i, off);
    dst[off[0]] = bits;
  }
}

}  // namespace

void launch_copy_strided(const Tensor& dst, const Tensor& src) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  Geom<2> g = make_geom<2>(dst.shape(), {&dst.strides(), &src.strides()});
  cudaStream_t stream = current_stream();
  dispatch_device_all(dst.dtype(), [&]<typename D>() {
    dispatch_device_all(src.dtype(), [&]<typename S>() {
      copy_kernel<D, S><<<grid_for(n), kBlock, 0, stream>>>(
          g, static_cast<D*>(dst.raw_data()), static_cast<const S*>(src.raw_data()), n);
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
    fill_kernel<U><<<grid_for(n), kBlock, 0, stream>>>(g, static_cast<U*>(dst.raw_data()),
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
