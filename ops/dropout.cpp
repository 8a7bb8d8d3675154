// Dropout on the device's counter-based stream (core/generator.h's philox_stream): no mask is
// stored. The forward claims numel elements of the stream (Backend::philox_advance, on the
// device) and keeps the base it got; the backward draws the same elements from the same base,
// so it rebuilds the mask. A captured CUDA graph claims fresh elements on every replay, and a
// replay is bit for bit the eager step it recorded.
#include "core/generator.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace kiln::F {
namespace {

class DropoutBackward final : public Node {
 public:
  DropoutBackward(double p, uint64_t seed, const Tensor& base) : p_(p), seed_(seed), base_(base) {}
  std::string name() const override { return "DropoutBackward"; }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    Tensor g = grads[0];
    if (!g.defined()) return {Tensor()};
    g = g.contiguous();
    Tensor dx = empty(g.shape(), TensorOptions(g.dtype()).with_device(g.device()));
    backend(g).dropout(dx, g, p_, seed_, base_);
    return {dx};
  }

 private:
  double p_;
  uint64_t seed_;
  Tensor base_;  // i64 (1): where the forward's elements start in the stream
};

}  // namespace

Tensor dropout(const Tensor& x, double p, bool training) {
  const char* op = "dropout";
  check_defined(x, op, "x");
  check_float(x, op);
  KILN_CHECK(p >= 0.0 && p <= 1.0, op, ": p ", p, " must be in [0, 1]");
  if (!training || p == 0.0) return x;
  if (p == 1.0) return mul(x, 0.0);  // everything dropped (and the gradient with it)
  KILN_OP_SCOPE("dropout", x);
  const Tensor xc = x.detach().contiguous();
  PhiloxStream& stream = philox_stream(x.device());
  Tensor base = empty({1}, TensorOptions(DType::i64).with_device(x.device()));
  const Backend& be = backend(x);
  be.philox_advance(base, stream.offset, xc.numel());
  Tensor y = empty(x.shape(), TensorOptions(x.dtype()).with_device(x.device()));
  be.dropout(y, xc, p, stream.seed, base);
  if (autograd::any_requires_grad({x})) {
    auto node = std::make_shared<DropoutBackward>(p, stream.seed, base);
    node->set_inputs({x});
    autograd::set_history(y, node);
  }
  return y;
}

}  // namespace kiln::F
