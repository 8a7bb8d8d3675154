#pragma once
// How a reduction over some dims is laid out: permute the kept dims first and the reduced dims
// last, make that contiguous and view it as (rows, inner).
#include <vector>

#include "core/tensor.h"
#include "core/kinds.h"

namespace kiln::F {

struct ReducePlan {
  std::vector<int64_t> perm;  // kept dims, then reduced dims
  int64_t kept = 0;           // how many of perm's dims are kept
  int64_t rows = 1;           // product of kept sizes
  int64_t inner = 1;          // product of reduced sizes
  Shape out_shape;            // result shape (honours keepdim)
  Shape keepdim_shape;        // result shape with reduced dims kept as 1
};

// `dims` empty means all dims. Errors name `op`.
ReducePlan plan_reduction(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim,
                          const char* op);
// Forward only (no autograd): the reduced values, shaped p.out_shape.
Tensor reduce_rows_raw(ReduceOp op, const Tensor& x, const ReducePlan& p);

}  // namespace kiln::F
