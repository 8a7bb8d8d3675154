// The Tensor members declared in core/tensor.h whose autograd needs kiln::F: expand (its
// backward sums over the broadcast dims) and the arithmetic operators. They live here, above
// core/, so that core/ includes nothing above it.
#include "core/autograd.h"
#include "core/tensor.h"
#include "ops/ops.h"

namespace kiln {

Tensor Tensor::expand(const Shape& target) const {
  Tensor out = broadcast_to(target);
  Shape in_shape = shape();
  autograd::record_unary("ExpandBackward", *this, out,
                         [in_shape](const Tensor& g) { return F::sum_to(g, in_shape); });
  return out;
}

// ---------------- arithmetic ----------------

Tensor Tensor::operator-() const { return F::neg(*this); }
const Tensor& Tensor::add_(const Tensor& o, double alpha) const { F::add_(*this, o, alpha); return *this; }
const Tensor& Tensor::add_(double v) const { F::add_(*this, v); return *this; }
const Tensor& Tensor::mul_(const Tensor& o) const { F::mul_(*this, o); return *this; }
const Tensor& Tensor::mul_(double v) const { F::mul_(*this, v); return *this; }

Tensor operator+(const Tensor& a, const Tensor& b) { return F::add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return F::sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return F::mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return F::div(a, b); }
Tensor operator+(const Tensor& a, double b) { return F::add(a, b); }
Tensor operator-(const Tensor& a, double b) { return F::add(a, -b); }
Tensor operator*(const Tensor& a, double b) { return F::mul(a, b); }
Tensor operator/(const Tensor& a, double b) { return F::mul(a, 1.0 / b); }
Tensor operator+(double a, const Tensor& b) { return F::add(b, a); }
Tensor operator-(double a, const Tensor& b) { return F::rsub(b, a); }
Tensor operator*(double a, const Tensor& b) { return F::mul(b, a); }
Tensor operator/(double a, const Tensor& b) { return F::rdiv(b, a); }

}  // namespace kiln
