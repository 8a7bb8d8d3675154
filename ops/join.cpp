// Joining and splitting along a dim: cat and stack copy into one new tensor (each input's
// slice written by the backend's copy, any strides); split and chunk are views (narrow).
#include "ops/check.h"
#include "ops/ops.h"

namespace kiln::F {
namespace {

int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op) {
  KILN_CHECK(dim >= -ndim && dim < ndim, op, ": dim ", dim, " out of range for ", ndim,
             "-D tensors");
  return dim < 0 ? dim + ndim : dim;
}

// Gradient of cat: each input's slice of the output's gradient.
class CatBackward final : public Node {
 public:
  CatBackward(int64_t dim, std::vector<int64_t> sizes) : dim_(dim), sizes_(std::move(sizes)) {}
  std::string name() const override { return "CatBackward"; }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    const Tensor& g = grads[0];
    std::vector<Tensor> out(sizes_.size());
    if (!g.defined()) return out;
    int64_t at = 0;
    for (size_t i = 0; i < sizes_.size(); ++i) {
      if (needs_input_grad(i)) out[i] = g.narrow(dim_, at, sizes_[i]);
      at += sizes_[i];
    }
    return out;
  }

 private:
  int64_t dim_;
  std::vector<int64_t> sizes_;
};

}  // namespace

Tensor cat(const std::vector<Tensor>& ts, int64_t dim) {
  const char* op = "cat";
  KILN_CHECK(!ts.empty(), op, ": no tensors to join");
  const Tensor& first = ts[0];
  check_defined(first, op, "tensor 0");
  const int64_t d = wrap_dim(dim, first.dim(), op);
  Shape shape = first.shape();
  shape[size_t(d)] = 0;
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < ts.size(); ++i) {
    const Tensor& t = ts[i];
    check_defined(t, op, "a tensor");
    check_same(first, t, op);
    KILN_CHECK(t.dim() == first.dim(), op, ": tensor ", i, " is ", t.desc(), ", tensor 0 ",
               first.desc(), ": all must have the same number of dims");
    for (int64_t k = 0; k < t.dim(); ++k)
      KILN_CHECK(k == d || t.size(k) == first.size(k), op, ": tensor ", i, " ", t.desc(),
                 " differs from tensor 0 ", first.desc(), " outside dim ", d);
    sizes.push_back(t.size(d));
    shape[size_t(d)] += t.size(d);
  }
  KILN_OP_SCOPE("cat", first);
  Tensor out = empty(shape, TensorOptions(first.dtype()).with_device(first.device()));
  {
    NoGradGuard ng;
    int64_t at = 0;
    for (size_t i = 0; i < ts.size(); ++i) {
      if (sizes[i] > 0) out.narrow(d, at, sizes[i]).copy_(ts[i].detach());
      at += sizes[i];
    }
  }
  if (autograd::any_requires_grad(ts)) {
    auto node = std::make_shared<CatBackward>(d, sizes);
    node->set_inputs(ts);
    autograd::set_history(out, node);
  }
  return out;
}

Tensor stack(const std::vector<Tensor>& ts, int64_t dim) {
  KILN_CHECK(!ts.empty(), "stack: no tensors to join");
  const int64_t d = wrap_dim(dim, ts[0].dim() + 1, "stack");
  std::vector<Tensor> parts;
  for (size_t i = 0; i < ts.size(); ++i) {
    KILN_CHECK(ts[i].defined() && ts[i].shape() == ts[0].shape(), "stack: tensor ", i, " is ",
               ts[i].defined() ? ts[i].desc() : "undefined", ", tensor 0 ", ts[0].desc(),
               ": all must have one shape");
    parts.push_back(ts[i].unsqueeze(d));
  }
  return cat(parts, d);
}

std::vector<Tensor> split(const Tensor& x, int64_t size, int64_t dim) {
  check_defined(x, "split", "x");
  KILN_CHECK(size > 0, "split: size ", size, " must be > 0");
  const int64_t d = wrap_dim(dim, x.dim(), "split");
  std::vector<Tensor> out;
  for (int64_t at = 0; at < x.size(d); at += size)
    out.push_back(x.narrow(d, at, std::min(size, x.size(d) - at)));
  if (out.empty()) out.push_back(x);  // a zero-size dim: one empty piece, as PyTorch
  return out;
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  check_defined(x, "chunk", "x");
  KILN_CHECK(chunks > 0, "chunk: chunks ", chunks, " must be > 0");
  const int64_t d = wrap_dim(dim, x.dim(), "chunk");
  return split(x, std::max<int64_t>(1, (x.size(d) + chunks - 1) / chunks), d);
}

}  // namespace kiln::F
