#pragma once
// Helpers for GPU suites that check CUDA results against CPU f64 references. Conversions and
// layout changes happen on the CPU, so a host->device transfer is a plain same-layout copy.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/tensor.h"
#include "tests/gradcheck.h"

namespace kiln::ref_check {

// The f64 CPU tensor `t` rounded to `dtype` and back (what a `dtype` GPU input really holds).
inline Tensor rounded(const Tensor& t, DType dtype) {
  return t.detach().to(dtype).to(DType::f64);
}

// `t` (CPU) as a `dtype` CUDA tensor dense in `fmt`.
inline Tensor to_gpu(const Tensor& t, DType dtype,
                     MemoryFormat fmt = MemoryFormat::Contiguous) {
  return t.detach().to(dtype).contiguous(fmt).to(Device::cuda());
}

// A `dtype` CUDA tensor dense in `fmt`, every element NaN (catches unwritten outputs).
inline Tensor nan_gpu(const Shape& shape, DType dtype,
                      MemoryFormat fmt = MemoryFormat::Contiguous) {
  return full(shape, std::numeric_limits<double>::quiet_NaN(),
              TensorOptions(dtype).with_memory_format(fmt))
      .to(Device::cuda());
}

// Back to the CPU as f64.
inline Tensor to_cpu64(const Tensor& t) { return t.detach().to(Device::cpu()).to(DType::f64); }

inline double max_abs(const Tensor& t) {
  double m = 0;
  for (double v : t.to_vector<double>()) m = std::max(m, std::abs(v));
  return m;
}

// Relative tolerance of a GPU dtype against an f64 reference computed from the same
// (rounded) inputs: f32 accumulates in f32; f16 also rounds its output to 11 bits, bf16 to 8.
inline double tol_for(DType t) {
  return t == DType::f16 ? 1e-2 : t == DType::bf16 ? 6e-2 : 1e-4;
}

// "" when |a - e| <= tol·max|e| + tol·|e| elementwise (a is a CUDA or CPU tensor).
inline std::string compare_scaled(const Tensor& actual, const Tensor& expected, double tol) {
  Tensor a = to_cpu64(actual);
  double scale = std::max(max_abs(expected), 1e-30);
  return testing::compare(a, expected, tol * scale, tol);
}

}  // namespace kiln::ref_check
