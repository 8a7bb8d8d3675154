#pragma once
// Error checks for every CUDA, cuDNN and cuBLASLt call, through kiln's one error family
// (core/error.h). A kernel launch is followed by KILN_CUDA_CHECK_LAUNCH().
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include "core/error.h"

#define CUDA_CHECK(expr)                                                                     \
  do {                                                                                       \
    cudaError_t _e = (expr);                                                                 \
    if (_e != cudaSuccess) [[unlikely]]                                                      \
      ::kiln::detail::fail(_e == cudaErrorMemoryAllocation ? ::kiln::ErrorKind::OutOfMemory  \
                                                           : ::kiln::ErrorKind::Cuda,        \
                           __FILE__, __LINE__, #expr,                                        \
                           ::kiln::detail::str_cat("CUDA error ", cudaGetErrorName(_e), ": ", \
                                                   cudaGetErrorString(_e)));                 \
  } while (0)

#define CUDNN_CHECK(expr)                                                                    \
  do {                                                                                       \
    cudnnStatus_t _s = (expr);                                                               \
    if (_s != CUDNN_STATUS_SUCCESS) [[unlikely]] {                                           \
      char _buf[512] = {0};                                                                  \
      cudnnGetLastErrorString(_buf, sizeof(_buf));                                           \
      ::kiln::detail::fail(::kiln::ErrorKind::Cudnn, __FILE__, __LINE__, #expr,              \
                           ::kiln::detail::str_cat("cuDNN error ", cudnnGetErrorString(_s),  \
                                                   _buf[0] ? ": " : "", _buf));              \
    }                                                                                        \
  } while (0)

#define CUBLAS_CHECK(expr)                                                                   \
  do {                                                                                       \
    cublasStatus_t _s = (expr);                                                              \
    if (_s != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                            \
      ::kiln::detail::fail(::kiln::ErrorKind::Cublas, __FILE__, __LINE__, #expr,             \
                           ::kiln::detail::str_cat("cuBLAS error ", int(_s)));               \
  } while (0)

#define KILN_CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
