#pragma once
// Shared pieces of kiln's CUDA kernels: kiln dtype -> device type mapping and dispatch, value
// conversion on the device, strided geometry passed to kernels by value, launch sizing.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "core/tensor.h"
#include "cuda/check.h"
#include "cuda/runtime.h"

namespace kiln::cuda {

// ---- dtypes ----
template <typename T> struct DeviceTypeOf { using type = T; };
template <> struct DeviceTypeOf<Half> { using type = __half; };
template <> struct DeviceTypeOf<BFloat16> { using type = __nv_bfloat16; };
template <typename T> using dev_t = typename DeviceTypeOf<T>::type;

// Accumulation / compute type: f64 computes in double, everything else in float.
template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };
template <typename T> using acc_t = typename AccOf<T>::type;

// Calls f.template operator()<T>() with T the device type of `t`, for all eight dtypes.
template <typename F>
decltype(auto) dispatch_device_all(DType t, F&& f) {
  return dispatch_all(t, [&]<typename K>() { return f.template operator()<dev_t<K>>(); });
}

// The floating dtypes the CUDA kernels compute in: f32, f16, bf16, f64.
template <typename F>
decltype(auto) dispatch_device_float(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32: return f.template operator()<float>();
    case DType::f16: return f.template operator()<__half>();
    case DType::bf16: return f.template operator()<__nv_bfloat16>();
    case DType::f64: return f.template operator()<double>();
    default:
      KILN_FAIL(op, " (cuda): dtype ", dtype_name(t), " is not supported (f32, f16, bf16, f64)");
  }
}

// ---- conversion ----
template <typename T>
inline constexpr bool is_half_like_v =
    std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

template <typename To, typename From>
__host__ __device__ inline To cvt(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (is_half_like_v<From>) {
    return cvt<To>(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, bool>) {
    return v != From(0);
  } else if constexpr (std::is_same_v<To, __half>) {
    return __float2half_rn(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, __nv_bfloat16>) {
    return __float2bfloat16_rn(static_cast<float>(v));
  } else {
    return static_cast<To>(v);
  }
}

// ---- strided geometry ----
inline constexpr int kMaxDims = 8;

// N tensors that share one logical shape, each with its own element strides. Passed by value.
template <int N>
struct Geom {
  int nd = 1;
  int64_t size[kMaxDims] = {1};
  int64_t stride[N][kMaxDims] = {};

  // Element offsets of logical (row-major) index `lin` in each of the N tensors.
  __device__ inline void offsets(int64_t lin, int64_t (&off)[N]) const {
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] = 0;
    for (int d = nd - 1; d >= 0; --d) {
      const int64_t i = lin % size[d];
      lin /= size[d];
#pragma unroll
      for (int k = 0; k < N; ++k) off[k] += i * stride[k][d];
    }
  }
};

// Drops size-1 dims and merges adjacent dims that are contiguous with each other in every
// tensor, so most calls reach the kernel with one to three dims.
template <int N>
Geom<N> make_geom(const Shape& shape, const std::array<const Shape*, N>& strides) {
  Geom<N> g;
  g.nd = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    bool merge = g.nd > 0;
    for (int k = 0; k < N && merge; ++k)
      merge = g.stride[k][g.nd - 1] == (*strides[size_t(k)])[d] * shape[d];
    if (merge) {
      g.size[g.nd - 1] *= shape[d];
      for (int k = 0; k < N; ++k) g.stride[k][g.nd - 1] = (*strides[size_t(k)])[d];
      continue;
    }
    KILN_CHECK(g.nd < kMaxDims, "cuda: more than ", kMaxDims,
               " non-mergeable dims in shape ", shape_str(shape));
    g.size[g.nd] = shape[d];
    for (int k = 0; k < N; ++k) g.stride[k][g.nd] = (*strides[size_t(k)])[d];
    ++g.nd;
  }
  if (g.nd == 0) {  // a scalar or all-ones shape: one element at offset 0
    g.nd = 1;
    g.size[0] = 1;
    for (int k = 0; k < N; ++k) g.stride[k][0] = 0;
  }
  return g;
}

// Same shape and strides, and dense (plain or channels-last): walkable as one flat array.
inline bool dense_same_layout(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return false;
  if (a.is_contiguous() && b.is_contiguous()) return true;
  return a.is_contiguous(MemoryFormat::ChannelsLast) &&
         b.is_contiguous(MemoryFormat::ChannelsLast);
}

// ---- per-channel operands ----
// Device pointer of a contiguous f32 tensor of `n` elements on x's device (batch-norm weights,
// statistics, ...); null when t is undefined; a kiln::Error naming `op` and `what` otherwise.
inline float* f32_ptr(const Tensor& t, int64_t n, const Tensor& x, const char* op,
                      const char* what) {
  if (!t.defined()) return nullptr;
  KILN_CHECK(
      t.dtype() == DType::f32 && t.is_contiguous() && t.numel() == n && t.device() == x.device(),
      op, " (cuda): ", what, " must be a contiguous f32 tensor of ", n, " elements on ", x.device(),
      ", got ", t.desc());
  return static_cast<float*>(t.raw_data());
}

// ---- launch sizing ----
inline constexpr int kBlock = 256;
// Blocks for a grid-stride loop over n items: enough to fill the device, never more than needed.
inline unsigned grid_for(int64_t n, int block = kBlock) {
  int64_t blocks = (n + block - 1) / block;
  const int64_t cap = int64_t(context().props.multiProcessorCount) * 32;
  if (blocks > cap) blocks = cap;
  return unsigned(blocks < 1 ? 1 : blocks);
}

// ---- programmatic dependent launch ----
// A kernel launched with cuda::launch may start while the kernel before it on the stream is
// still running (sm_90+, when pdl_enabled()). Such a kernel must begin with pdl_start(): it lets
// the kernel after it be placed as soon as all of its own blocks have started, then waits until
// the kernel before it has finished and its writes are visible. Nothing of a block runs before
// that wait, so the stream order of every read and write is unchanged; what overlaps is the
// launch and the placement of blocks. On older GPUs, and when launched with <<<>>>, both
// instructions return at once.
__device__ __forceinline__ void pdl_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets `Kernel` use `bytes` of dynamic shared memory (above 48 KB must be asked for), once per
// device. Kernel is the function itself, not its type, so that each instantiation of a kernel
// template gets its own flags. `op` names the caller in the error for an unexpected device.
template <auto Kernel>
void allow_smem_once(int bytes, const char* op) {
  static std::array<std::once_flag, kMaxDevices> once;
  const int dev = current_device();  // where the attribute is set and the kernel runs
  KILN_CHECK(dev >= 0 && dev < kMaxDevices, op, " (cuda): device ", dev, " out of range");
  std::call_once(once[size_t(dev)], [&] {
    CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  });
}

// Blocks of `kernel` (`threads` each, `smem_bytes` of dynamic shared memory, above 48 KB allowed
// first with allow_smem_once) resident on one SM of the current device; cached per kernel,
// block shape and device, so that grids sized by it — and the order of the partial sums they
// write — depend on the shape and the device only.
inline int resident_blocks_per_sm(const void* kernel, int threads, int smem_bytes) {
  static std::mutex m;
  static std::map<std::tuple<const void*, int, int, int>, int> cache;
  const std::tuple<const void*, int, int, int> key{kernel, threads, smem_bytes, current_device()};
  std::lock_guard<std::mutex> lock(m);
  auto [it, fresh] = cache.try_emplace(key, 1);
  if (fresh) {
    int n = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem_bytes));
    it->second = std::max(n, 1);
  }
  return it->second;
}

// kernel<<<grid, block, smem, stream>>>(args...) for kernels that begin with pdl_start().
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
            Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// As launch(), but never early: for kernels whose block takes a whole SM's shared memory (kiln's
// wgmma GEMMs). Launched early, such a kernel's blocks wait on SMs that the kernel before it
// still needs; kiln's 1x1 weight gradient launched that way made the ResNet-50 step 0.43 ms
// slower (docs/lab/norm-conv.md, v22). The kernel may still begin with pdl_start(), which lets
// the kernel after it be placed early.
template <typename... Params, typename... Args>
void launch_whole_sm(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                     cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace kiln::cuda
