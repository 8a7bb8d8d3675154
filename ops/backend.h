#pragma once
// Shared helpers of ops/*.cpp: input validation with messages that name the op, and the CUDA
// dispatch macro. Included only by ops implementation files.
#include "core/tensor.h"
#include "cuda/profiler.h"

#ifdef KILN_WITH_CUDA
#include "cuda/ops.h"
// Runs `expr` (a call into cuda/ops.h) on builds with CUDA.
#define KILN_CUDA_CALL(expr) (expr)
#else
#define KILN_CUDA_CALL(expr) \
  KILN_FAIL("this op was given a cuda tensor, but kiln was built without CUDA")
#endif

// Profiles the rest of the enclosing scope as op `name` (a string literal) when `t` is a cuda
// tensor and the profiler is on: an NVTX range with the shape and CUDA-event timing.
#define KILN_OP_SCOPE(name, t) KILN_PROFILE_OP((t).defined() && (t).is_cuda() ? (name) : nullptr, (t).desc())

namespace kiln {

inline void check_defined(const Tensor& t, const char* op, const char* what = "input") {
  KILN_CHECK(t.defined(), op, ": ", what, " is undefined");
}

// Both defined, same dtype, same device.
inline void check_same(const Tensor& a, const Tensor& b, const char* op) {
  check_defined(a, op, "first input");
  check_defined(b, op, "second input");
  KILN_CHECK(a.dtype() == b.dtype(), op, ": dtype mismatch: ", a.desc(), " vs ", b.desc());
  KILN_CHECK(a.device() == b.device(), op, ": device mismatch: ", a.desc(), " vs ", b.desc());
}

inline void check_float(const Tensor& t, const char* op) {
  KILN_CHECK(is_floating(t.dtype()), op, ": expected a floating tensor, got ", t.desc());
}

inline void check_dim(const Tensor& t, int64_t d, const char* op, const char* what = "input") {
  KILN_CHECK(t.dim() == d, op, ": ", what, " must be ", d, "-D, got ", t.desc());
}

}  // namespace kiln
