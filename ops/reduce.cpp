// Reductions: sum and mean over all or some dims; max over all or one dim.
#include <algorithm>
#include <numeric>

#include "ops/check.h"
#include "ops/ops.h"
#include "ops/reduce_util.h"

namespace kiln::F {

ReducePlan plan_reduction(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim,
                          const char* op) {
  ReducePlan p;
  const int64_t nd = x.dim();
  std::vector<bool> reduce(size_t(nd), dims.empty());
  for (int64_t d : dims) {
    KILN_CHECK(d >= -std::max<int64_t>(nd, 1) && d < std::max<int64_t>(nd, 1), op, ": dim ", d,
               " out of range for ", x.desc());
    int64_t w = d < 0 ? d + nd : d;
    if (nd == 0) continue;
    KILN_CHECK(!reduce[size_t(w)] || dims.empty(), op, ": dim ", d, " repeated");
    reduce[size_t(w)] = true;
  }
  for (int64_t i = 0; i < nd; ++i)
    if (!reduce[size_t(i)]) p.perm.push_back(i);
  p.kept = int64_t(p.perm.size());
  for (int64_t i = 0; i < nd; ++i)
    if (reduce[size_t(i)]) p.perm.push_back(i);
  p.rows = 1;
  p.inner = 1;
  for (int64_t i = 0; i < nd; ++i) {
    if (reduce[size_t(i)]) {
      p.inner *= x.size(i);
      if (keepdim) p.out_shape.push_back(1);
    } else {
      p.rows *= x.size(i);
      p.out_shape.push_back(x.size(i));
    }
    p.keepdim_shape.push_back(reduce[size_t(i)] ? 1 : x.size(i));
  }
  return p;
}

Tensor reduce_rows_raw(ReduceOp op, const Tensor& x, const ReducePlan& p) {
  KILN_OP_SCOPE("reduce", x);
  KILN_CHECK(op == ReduceOp::Sum || op == ReduceOp::Max, "reduce: only Sum and Max reduce rows");
  Tensor out = empty(p.out_shape, TensorOptions(x.dtype()).with_device(x.device()));
  const Backend& be = backend(x);
  if (op == ReduceOp::Sum && be.reduce_cols && p.rows > 1 && p.inner > 1) {
    // When x's memory holds the reduced dims outside the kept ones (a channels-last tensor
    // summed over N, H, W), it already is (inner, rows): sum its columns where they lie.
    std::vector<int64_t> order(p.perm.begin() + std::ptrdiff_t(p.kept), p.perm.end());
    order.insert(order.end(), p.perm.begin(), p.perm.begin() + std::ptrdiff_t(p.kept));
    const Tensor xc = x.detach().permute(order);
    if (xc.is_contiguous()) {
      be.reduce_cols(out, xc, p.inner, p.rows);
      return out;
    }
  }
  // (kept dims..., reduced dims...) contiguous, viewed as (rows, inner).
  Tensor xp = x.detach().permute(p.perm).contiguous();
  be.reduce_rows(op, out, xp, p.rows, p.inner);
  return out;
}

namespace {

class SumBackward final : public Node {
 public:
  SumBackward(Shape keepdim_shape, double scale)
      : keepdim_shape_(std::move(keepdim_shape)), scale_(scale) {}
  std::string name() const override { return scale_ == 1.0 ? "SumBackward" : "MeanBackward"; }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    Tensor g = grads[0].reshape(keepdim_shape_).expand(input_meta_[0].shape);
    return {scale_ == 1.0 ? g : mul(g, scale_)};
  }

 private:
  Shape keepdim_shape_;
  double scale_;
};

Tensor sum_impl(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim, bool is_mean,
                const char* op) {
  check_defined(x, op);
  check_float(x, op);
  ReducePlan p = plan_reduction(x, dims, keepdim, op);
  Tensor out = reduce_rows_raw(ReduceOp::Sum, x, p);
  double scale = 1.0;
  if (is_mean) {
    KILN_CHECK(p.inner > 0, op, ": mean over an empty set of elements of ", x.desc());
    scale = 1.0 / double(p.inner);
    out = out.detach();
    mul_(out, scale);
  }
  if (autograd::any_requires_grad({x})) {
    auto node = std::make_shared<SumBackward>(p.keepdim_shape, scale);
    node->set_inputs({x});
    autograd::set_history(out, node);
  }
  return out;
}

}  // namespace

Tensor sum(const Tensor& x) { return sum_impl(x, {}, false, false, "sum"); }
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  KILN_CHECK(!dims.empty(), "sum: empty dim list (use sum(x) for a full reduction)");
  return sum_impl(x, dims, keepdim, false, "sum");
}
Tensor mean(const Tensor& x) { return sum_impl(x, {}, false, true, "mean"); }
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  KILN_CHECK(!dims.empty(), "mean: empty dim list (use mean(x) for a full reduction)");
  return sum_impl(x, dims, keepdim, true, "mean");
}

}  // namespace kiln::F
