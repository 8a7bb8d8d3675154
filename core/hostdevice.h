#pragma once
// KILN_HD marks a small function that both the host compiler and nvcc compile (device code
// and host code share its arithmetic): __host__ __device__ inline under nvcc, inline elsewhere.
// Headers that use it must need nothing beyond the C++ standard library and core/.
#if defined(__CUDACC__)
#define KILN_HD __host__ __device__ __forceinline__
#else
#define KILN_HD inline
#endif
