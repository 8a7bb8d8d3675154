// max over all elements or one dim (values and the argmax), and argmax.
// The reduced dim is permuted last and made contiguous (plan_reduction), so one row kernel serves
// every case; backward scatters each row's gradient to its argmax and permutes back.
#include "ops/check.h"
#include "ops/ops.h"
#include "ops/reduce_util.h"

namespace kiln::F {
namespace {

struct MaxResult {
  Tensor values;   // p.out_shape
  Tensor indices;  // p.out_shape, i64: position of the first maximum within the reduced dims
  ReducePlan plan;
};

MaxResult max_impl(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim,
                   const char* op) {
  check_defined(x, op);
  check_float(x, op);
  MaxResult r;
  r.plan = plan_reduction(x, dims, keepdim, op);
  const ReducePlan& p = r.plan;
  KILN_CHECK(p.inner > 0, op, ": reduction over zero elements of ", x.desc(),
             " (max has no identity)");
  Tensor xp = x.detach().permute(p.perm).contiguous();
  TensorOptions opts = TensorOptions(x.dtype()).with_device(x.device());
  r.values = empty(p.out_shape, opts);
  r.indices = empty(p.out_shape, opts.with_dtype(DType::i64));
  backend(x).max_rows(r.values, r.indices, xp, p.rows, p.inner);
  return r;
}

class MaxBackward final : public Node {
 public:
  MaxBackward(const Tensor& indices, ReducePlan plan)
      : indices_(SavedTensor(indices)), plan_(std::move(plan)) {}
  std::string name() const override { return "MaxBackward"; }
  void release_saved() override { indices_.release(); }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    if (!grads[0].defined()) return {Tensor()};
    const Tensor indices = indices_.get(*this);
    const Shape& in_shape = input_meta_[0].shape;
    const ReducePlan& p = plan_;
    Tensor g = grads[0].contiguous();
    Shape permuted(p.perm.size());
    for (size_t i = 0; i < p.perm.size(); ++i) permuted[i] = in_shape[size_t(p.perm[i])];
    Tensor dx = empty(permuted, TensorOptions(g.dtype()).with_device(g.device()));
    backend(g).scatter_rows(dx, g, indices, p.rows, p.inner);
    std::vector<int64_t> inv(p.perm.size());
    for (size_t i = 0; i < p.perm.size(); ++i) inv[size_t(p.perm[i])] = int64_t(i);
    return {dx.permute(inv).contiguous()};
  }

 private:
  SavedTensor indices_;
  ReducePlan plan_;
};

Tensor max_with_grad(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  MaxResult r = max_impl(x, dims, keepdim, "max");
  if (autograd::any_requires_grad({x})) {
    auto node = std::make_shared<MaxBackward>(r.indices, r.plan);
    node->set_inputs({x});
    autograd::set_history(r.values, node);
  }
  return r.values;
}

}  // namespace

Tensor max(const Tensor& x) { return max_with_grad(x, {}, false); }

Tensor max(const Tensor& x, int64_t dim, bool keepdim) { return max_with_grad(x, {dim}, keepdim); }

Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) {
  return max_impl(x, {dim}, keepdim, "argmax").indices;
}

}  // namespace kiln::F
