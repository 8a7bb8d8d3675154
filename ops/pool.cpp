// Pooling (max, average, adaptive average) and flatten: validation, forward, backward, dispatch.
// Outputs and input gradients keep x's memory format, like conv2d's.
#include "ops/check.h"
#include "ops/ops.h"

namespace kiln::F {
namespace {

// Dense in its own layout, for the CUDA entry points (which take NCHW or NHWC tensors).
Tensor dense(const Tensor& t) { return t.contiguous(t.suggest_memory_format()); }

Tensor empty_in_format(const Shape& shape, const Tensor& like, MemoryFormat fmt) {
  return empty(shape,
               TensorOptions(like.dtype()).with_device(like.device()).with_memory_format(fmt));
}

void check_input(const Tensor& x, const char* op) {
  check_defined(x, op);
  check_dim(x, 4, op);
  check_float(x, op);
}

PoolParams validate_window(const Tensor& x, Pair kernel, std::optional<Pair> stride, Pair padding,
                           Pair dilation, const char* op) {
  check_input(x, op);
  const Pair s = stride.value_or(kernel);
  KILN_CHECK(kernel.h > 0 && kernel.w > 0, op, ": kernel size must be positive, got (", kernel.h,
             ", ", kernel.w, ")");
  KILN_CHECK(s.h > 0 && s.w > 0, op, ": stride must be positive, got (", s.h, ", ", s.w, ")");
  KILN_CHECK(dilation.h > 0 && dilation.w > 0, op, ": dilation must be positive, got (", dilation.h,
             ", ", dilation.w, ")");
  KILN_CHECK(padding.h >= 0 && padding.w >= 0, op, ": padding must be non-negative, got (",
             padding.h, ", ", padding.w, ")");
  KILN_CHECK(padding.h <= kernel.h / 2 && padding.w <= kernel.w / 2, op, ": padding (", padding.h,
             ", ", padding.w, ") must be at most half of the kernel size (", kernel.h, ", ",
             kernel.w, ")");
  const int64_t ekh = dilation.h * (kernel.h - 1) + 1, ekw = dilation.w * (kernel.w - 1) + 1;
  KILN_CHECK(ekh <= x.size(2) + 2 * padding.h && ekw <= x.size(3) + 2 * padding.w, op, ": kernel (",
             kernel.h, ", ", kernel.w, ") with dilation (", dilation.h, ", ", dilation.w,
             ") is larger than the padded input ", x.desc(), " (padding ", padding.h, ", ",
             padding.w, "): the output size would be <= 0");
  PoolParams p;
  p.kernel_h = kernel.h;
  p.kernel_w = kernel.w;
  p.stride_h = s.h;
  p.stride_w = s.w;
  p.pad_h = padding.h;
  p.pad_w = padding.w;
  p.dil_h = dilation.h;
  p.dil_w = dilation.w;
  return p;
}

Shape pooled_shape(const Tensor& x, const PoolParams& p) {
  const int64_t oh = (x.size(2) + 2 * p.pad_h - p.dil_h * (p.kernel_h - 1) - 1) / p.stride_h + 1;
  const int64_t ow = (x.size(3) + 2 * p.pad_w - p.dil_w * (p.kernel_w - 1) - 1) / p.stride_w + 1;
  return {x.size(0), x.size(1), oh, ow};
}

// The backward reads the window positions the forward saved (smaller than x and needing no
// recomputation).
class MaxPool2dBackward final : public Node {
 public:
  MaxPool2dBackward(const Tensor& x, const Tensor& indices, const PoolParams& p)
      : indices_(indices),
        shape_(x.shape()),
        format_(x.suggest_memory_format()),
        p_(p) {}
  std::string name() const override { return "MaxPool2dBackward"; }
  void release_saved() override { indices_.release(); }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    const Tensor& g = grads[0];
    Tensor dx = empty_in_format(shape_, g, format_);
    backend(g).max_pool2d_backward(dx, dense(g), indices_.get(*this), p_);
    return {dx};
  }

 private:
  SavedTensor indices_;
  Shape shape_;
  MemoryFormat format_;
  PoolParams p_;
};

class AvgPool2dBackward final : public Node {
 public:
  AvgPool2dBackward(MemoryFormat fmt, const PoolParams& p) : format_(fmt), p_(p) {}
  std::string name() const override { return "AvgPool2dBackward"; }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    const Tensor& g = grads[0];
    Tensor dx = empty_in_format(input_meta_[0].shape, g, format_);
    backend(g).avg_pool2d_backward(dx, dense(g), p_);
    return {dx};
  }

 private:
  MemoryFormat format_;
  PoolParams p_;
};

class AdaptiveAvgPool2dBackward final : public Node {
 public:
  explicit AdaptiveAvgPool2dBackward(MemoryFormat fmt) : format_(fmt) {}
  std::string name() const override { return "AdaptiveAvgPool2dBackward"; }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    const Tensor& g = grads[0];
    Tensor dx = empty_in_format(input_meta_[0].shape, g, format_);
    backend(g).adaptive_avg_pool2d_backward(dx, dense(g));
    return {dx};
  }

 private:
  MemoryFormat format_;
};

}  // namespace

Tensor max_pool2d(const Tensor& x, Pair kernel, std::optional<Pair> stride, Pair padding,
                  Pair dilation) {
  KILN_OP_SCOPE("max_pool2d", x);
  const PoolParams p = validate_window(x, kernel, stride, padding, dilation, "max_pool2d");
  const MemoryFormat fmt = x.suggest_memory_format();
  Tensor y = empty_in_format(pooled_shape(x, p), x, fmt);
  const Tensor xd = dense(x.detach());
  const Tensor indices = empty(y.shape(), TensorOptions(max_pool2d_indices_dtype(p))
                                              .with_device(x.device())
                                              .with_memory_format(fmt));
  backend(x).max_pool2d_forward(y, indices, xd, p);
  if (autograd::any_requires_grad({x})) {
    auto node = std::make_shared<MaxPool2dBackward>(xd, indices, p);
    node->set_inputs({x});
    autograd::set_history(y, node);
  }
  return y;
}

Tensor avg_pool2d(const Tensor& x, Pair kernel, std::optional<Pair> stride, Pair padding,
                  bool count_include_pad) {
  KILN_OP_SCOPE("avg_pool2d", x);
  PoolParams p = validate_window(x, kernel, stride, padding, 1, "avg_pool2d");
  p.count_include_pad = count_include_pad;
  const MemoryFormat fmt = x.suggest_memory_format();
  Tensor y = empty_in_format(pooled_shape(x, p), x, fmt);
  const Tensor xd = dense(x.detach());
  backend(x).avg_pool2d_forward(y, xd, p);
  if (autograd::any_requires_grad({x})) {
    auto node = std::make_shared<AvgPool2dBackward>(fmt, p);
    node->set_inputs({x});
    autograd::set_history(y, node);
  }
  return y;
}

Tensor adaptive_avg_pool2d(const Tensor& x, Pair output_size) {
  KILN_OP_SCOPE("adaptive_avg_pool2d", x);
  check_input(x, "adaptive_avg_pool2d");
  KILN_CHECK(output_size.h > 0 && output_size.w > 0,
             "adaptive_avg_pool2d: output size must be positive, got (", output_size.h, ", ",
             output_size.w, ") for input ", x.desc());
  KILN_CHECK(x.size(2) > 0 && x.size(3) > 0, "adaptive_avg_pool2d: empty spatial dims in input ",
             x.desc());
  const MemoryFormat fmt = x.suggest_memory_format();
  Tensor y = empty_in_format({x.size(0), x.size(1), output_size.h, output_size.w}, x, fmt);
  const Tensor xd = dense(x.detach());
  backend(x).adaptive_avg_pool2d_forward(y, xd);
  if (autograd::any_requires_grad({x})) {
    auto node = std::make_shared<AdaptiveAvgPool2dBackward>(fmt);
    node->set_inputs({x});
    autograd::set_history(y, node);
  }
  return y;
}

// A view when x's layout allows (Tensor::reshape); differentiable through the view.
Tensor flatten(const Tensor& x, int64_t start_dim, int64_t end_dim) {
  check_defined(x, "flatten");
  return x.flatten(start_dim, end_dim);
}

}  // namespace kiln::F
