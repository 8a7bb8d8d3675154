#pragma once
// Small helpers shared by the cuDNN wrappers (cuda/conv.cpp, cuda/batchnorm.cpp,
// cuda/cudnn_attention.cpp): RAII descriptors, dtype mapping, layout canonicalisation, the plan
// caches' key hash. Internal to cuda/.
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/autograd.h"
#include "core/tensor.h"
#include "cuda/check.h"

namespace kiln::cuda {

// The hash of a plan cache's key (cuda/conv.cpp, cuda/cudnn_attention.cpp): a struct of int64_t
// fields without padding, compared with memcmp and hashed as its words (FNV-1a).
template <typename Key>
struct WordsHash {
  static_assert(std::has_unique_object_representations_v<Key>, "Key must have no padding");
  static_assert(sizeof(Key) % sizeof(int64_t) == 0, "Key must be whole 64-bit words");
  size_t operator()(const Key& k) const {
    int64_t words[sizeof(Key) / sizeof(int64_t)];
    std::memcpy(words, &k, sizeof(Key));
    uint64_t h = 1469598103934665603ull;
    for (int64_t w : words) h = (h ^ uint64_t(w)) * 1099511628211ull;
    return size_t(h ^ (h >> 29));
  }
};

inline cudnnDataType_t cudnn_dtype(DType t) {
  switch (t) {
    case DType::f32: return CUDNN_DATA_FLOAT;
    case DType::f64: return CUDNN_DATA_DOUBLE;
    case DType::f16: return CUDNN_DATA_HALF;
    case DType::bf16: return CUDNN_DATA_BFLOAT16;
    default: KILN_FAIL("cuDNN: unsupported dtype ", dtype_name(t));
  }
}

struct TensorDesc {
  cudnnTensorDescriptor_t d = nullptr;
  TensorDesc() { CUDNN_CHECK(cudnnCreateTensorDescriptor(&d)); }
  // dims and strides in elements, outermost first (N, C, H, W order for 4-D).
  TensorDesc(DType t, const Shape& dims, const Shape& strides) : TensorDesc() {
    std::vector<int> di(dims.begin(), dims.end()), st(strides.begin(), strides.end());
    CUDNN_CHECK(cudnnSetTensorNdDescriptor(d, cudnn_dtype(t), int(di.size()), di.data(), st.data()));
  }
  ~TensorDesc() { cudnnDestroyTensorDescriptor(d); }
  TensorDesc(const TensorDesc&) = delete;
  TensorDesc& operator=(const TensorDesc&) = delete;
};

struct FilterDesc {
  cudnnFilterDescriptor_t d = nullptr;
  // dims (O, C/groups, kH, kW); NHWC format means the buffer is (O, kH, kW, C/groups).
  FilterDesc(DType t, const Shape& dims, cudnnTensorFormat_t format) {
    CUDNN_CHECK(cudnnCreateFilterDescriptor(&d));
    std::vector<int> di(dims.begin(), dims.end());
    CUDNN_CHECK(cudnnSetFilterNdDescriptor(d, cudnn_dtype(t), format, int(di.size()), di.data()));
  }
  ~FilterDesc() { cudnnDestroyFilterDescriptor(d); }
  FilterDesc(const FilterDesc&) = delete;
  FilterDesc& operator=(const FilterDesc&) = delete;
};

struct ConvDesc {
  cudnnConvolutionDescriptor_t d = nullptr;
  ConvDesc() { CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&d)); }
  ~ConvDesc() { cudnnDestroyConvolutionDescriptor(d); }
  ConvDesc(const ConvDesc&) = delete;
  ConvDesc& operator=(const ConvDesc&) = delete;
};

struct ActivationDesc {
  cudnnActivationDescriptor_t d = nullptr;
  explicit ActivationDesc(cudnnActivationMode_t mode) {
    CUDNN_CHECK(cudnnCreateActivationDescriptor(&d));
    CUDNN_CHECK(cudnnSetActivationDescriptor(d, mode, CUDNN_NOT_PROPAGATE_NAN, 0.0));
  }
  ~ActivationDesc() { cudnnDestroyActivationDescriptor(d); }
  ActivationDesc(const ActivationDesc&) = delete;
  ActivationDesc& operator=(const ActivationDesc&) = delete;
};

// Dense strides of `shape` in `fmt` (ChannelsLast only for 4-D).
inline Shape format_strides(const Shape& shape, MemoryFormat fmt) {
  return fmt == MemoryFormat::ChannelsLast ? channels_last_strides(shape) : contiguous_strides(shape);
}

// t itself when dense in fmt, else a dense copy (never recorded by autograd).
inline Tensor dense_in(const Tensor& t, MemoryFormat fmt) {
  if (t.is_contiguous(fmt)) return t;
  NoGradGuard no_grad;
  return t.detach().contiguous(fmt);
}

// A buffer dense in fmt that ends up in `out`: out itself when already dense in fmt, else a
// temporary that finish_out copies into out.
inline Tensor out_buffer(const Tensor& out, MemoryFormat fmt) {
  if (out.is_contiguous(fmt)) return out;
  return empty(out.shape(),
               TensorOptions(out.dtype()).with_device(out.device()).with_memory_format(fmt));
}
inline void finish_out(const Tensor& out, const Tensor& buf) {
  if (!buf.is_same(out)) out.copy_(buf);
}

}  // namespace kiln::cuda
