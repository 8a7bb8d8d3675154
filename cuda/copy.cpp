// Tensor copies between any devices, dtypes and layouts, and fill. Dense same-dtype copies are
// one cudaMemcpyAsync; everything else is staged so that conversion and striding happen where
// they are cheap: host-side conversion before an upload, a device kernel before a download.
//
// Host memory: uploads from pageable memory are staged by the driver before cudaMemcpyAsync
// returns, so the host tensor may be freed at once; an upload from pinned memory wrapped in a
// Storage is truly asynchronous and the caller keeps the memory alive until the stream reaches
// it. Downloads synchronise the stream before returning: callers read host memory right away.
#include <cstring>

#include "cuda/check.h"
#include "cuda/kernels/copy.cuh"
#include "cuda/kernels.h"
#include "cuda/runtime.h"

namespace kiln::cuda {
namespace {

bool is_dense(const Tensor& t) {
  return t.is_contiguous() || t.is_contiguous(MemoryFormat::ChannelsLast);
}
MemoryFormat dense_format(const Tensor& t) {
  return t.is_contiguous() ? MemoryFormat::Contiguous : MemoryFormat::ChannelsLast;
}
// A layout for a staging buffer that lets the final transfer into `t` be one memcpy.
MemoryFormat staging_format(const Tensor& t) {
  return is_dense(t) ? dense_format(t) : MemoryFormat::Contiguous;
}
bool same_dense_layout(const Tensor& a, const Tensor& b) {
  if (a.is_contiguous() && b.is_contiguous()) return true;
  return a.is_contiguous(MemoryFormat::ChannelsLast) && b.is_contiguous(MemoryFormat::ChannelsLast);
}
bool memcpy_compatible(const Tensor& dst, const Tensor& src) {
  return dst.dtype() == src.dtype() && same_dense_layout(dst, src);
}

Tensor staging(const Tensor& like, DType dtype, Device device, MemoryFormat fmt) {
  return empty(like.shape(), TensorOptions(dtype).with_device(device).with_memory_format(fmt));
}

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : prev_(current_device()) {
    if (prev_ != device) CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(prev_); }  // best effort in a destructor
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_;
};

// dst[i] = src[i] for host tensors of one dtype, any strides.
void host_strided_copy(const Tensor& dst, const Tensor& src) {
  dispatch_all(dst.dtype(), [&]<typename T>() {
    T* d = static_cast<T*>(dst.raw_data());
    const T* s = static_cast<const T*>(src.raw_data());
    detail::for_each_offset(dst.shape(), dst.strides(), src.strides(),
                            [&](int64_t od, int64_t os) { d[od] = s[os]; });
  });
}

void copy_device_to_device(const Tensor& dst, const Tensor& src) {
  const int dd = dst.device().index, sd = src.device().index;
  if (dd == sd) {
    DeviceGuard guard(dd);
    if (memcpy_compatible(dst, src)) {
      CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), dst.nbytes(),
                                 cudaMemcpyDeviceToDevice, current_stream()));
    } else {
      launch_copy_strided(dst, src);
    }
    return;
  }
  check_not_capturing("a copy between two cuda devices", "it synchronises both devices' streams");
  // Across devices (rare): make src dense in dst's dtype on its own device, move it with a peer
  // copy, then scatter into dst. Both streams are synchronised so the staging buffers can go.
  Tensor s = src;
  {
    DeviceGuard guard(sd);
    if (!(s.dtype() == dst.dtype() && is_dense(s))) {
      s = staging(src, dst.dtype(), src.device(), staging_format(dst));
      launch_copy_strided(s, src);
    }
    CUDA_CHECK(cudaStreamSynchronize(current_stream()));
  }
  DeviceGuard guard(dd);
  Tensor d = same_dense_layout(dst, s) ? dst : staging(s, dst.dtype(), dst.device(), dense_format(s));
  CUDA_CHECK(cudaMemcpyPeerAsync(d.raw_data(), dd, s.raw_data(), sd, d.nbytes(), current_stream()));
  if (!d.is_same(dst)) launch_copy_strided(dst, d);
  CUDA_CHECK(cudaStreamSynchronize(current_stream()));
}

void copy_host_to_device(const Tensor& dst, const Tensor& src) {
  check_not_capturing("a copy from host memory to a cuda tensor (from_vector, to(cuda), copy_)",
                      "a replay would copy from that host address again, long after it changed "
                      "or was freed");
  DeviceGuard guard(dst.device().index);
  cudaStream_t stream = current_stream();
  Tensor h = src;
  if (!memcpy_compatible(dst, src)) {
    // Convert and reorder on the host, into the layout dst has (or contiguous when dst is not
    // dense), so that what crosses the bus is already in dst's dtype.
    h = staging(src, dst.dtype(), Device::cpu(), staging_format(dst));
    h.copy_(src);
  }
  if (same_dense_layout(dst, h)) {
    CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), h.raw_data(), dst.nbytes(),
                               cudaMemcpyHostToDevice, stream));
    return;
  }
  Tensor d = staging(h, dst.dtype(), dst.device(), MemoryFormat::Contiguous);
  CUDA_CHECK(cudaMemcpyAsync(d.raw_data(), h.raw_data(), d.nbytes(), cudaMemcpyHostToDevice,
                             stream));
  launch_copy_strided(dst, d);
}

void copy_device_to_host(const Tensor& dst, const Tensor& src) {
  check_not_capturing("Tensor::item() / a copy from a cuda tensor to the host (to_vector, to(cpu))",
                      "it synchronises the host with the device");
  DeviceGuard guard(src.device().index);
  cudaStream_t stream = current_stream();
  Tensor s = src;
  if (!memcpy_compatible(dst, src)) {
    s = staging(src, dst.dtype(), src.device(), staging_format(dst));
    launch_copy_strided(s, src);
  }
  if (same_dense_layout(dst, s)) {
    CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), s.raw_data(), dst.nbytes(),
                               cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  Tensor h = staging(s, dst.dtype(), Device::cpu(), dense_format(s));
  CUDA_CHECK(cudaMemcpyAsync(h.raw_data(), s.raw_data(), h.nbytes(), cudaMemcpyDeviceToHost,
                             stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  host_strided_copy(dst, h);
}

}  // namespace

void copy_tensor(const Tensor& dst, const Tensor& src) {
  KILN_CHECK(dst.shape() == src.shape(), "copy_ (cuda): shape mismatch ", src.desc(), " -> ",
             dst.desc());
  if (dst.numel() == 0) return;
  if (dst.is_cuda() && src.is_cuda()) return copy_device_to_device(dst, src);
  if (dst.is_cuda()) return copy_host_to_device(dst, src);
  if (src.is_cuda()) return copy_device_to_host(dst, src);
  KILN_FAIL("copy_ (cuda): neither ", src.desc(), " nor ", dst.desc(), " is a cuda tensor");
}

void fill_tensor(const Tensor& dst, double value) {
  KILN_CHECK(dst.is_cuda(), "fill_ (cuda): ", dst.desc(), " is not a cuda tensor");
  if (dst.numel() == 0) return;
  DeviceGuard guard(dst.device().index);
  uint64_t bits = 0;
  dispatch_all(dst.dtype(), [&]<typename T>() {
    T v = convert<T>(value);
    std::memcpy(&bits, &v, sizeof(T));
  });
  if (bits == 0 && is_dense(dst)) {
    CUDA_CHECK(cudaMemsetAsync(dst.raw_data(), 0, dst.nbytes(), current_stream()));
    return;
  }
  launch_fill(dst, bits);
}

}  // namespace kiln::cuda
