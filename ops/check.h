#pragma once
// Shared helpers of ops/*.cpp: input validation with messages that name the op, and the
// profiling scope. Included only by ops implementation files, which reach device code through
// kiln::backend() (core/backend.h).
#include "core/backend.h"
#include "core/tensor.h"

#define KILN_OPS_CAT2(a, b) a##b
#define KILN_OPS_CAT(a, b) KILN_OPS_CAT2(a, b)
// Profiles the rest of the enclosing scope as op `name` (a string literal) on t's device when
// its backend profiles (Backend::profile_begin).
#define KILN_OP_SCOPE(name, t) \
  ::kiln::OpProfileScope KILN_OPS_CAT(kiln_op_scope_, __LINE__)((name), (t))

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
