#pragma once
// Test helpers: finite-difference gradient checking and tensor comparison.
//
// gradcheck(f, inputs): f maps the inputs to one tensor. Every f64 CPU input with
// requires_grad is checked: the analytic gradient of sum(v * f(inputs)) for a random upstream v
// (autograd) against central differences with step eps, |a - n| <= atol + rtol*|n|.
// It also pre-fills each input's .grad with a sentinel and checks that backward ADDS into it.
#include <functional>
#include <string>
#include <vector>

#include "core/autograd.h"
#include "core/generator.h"
#include "core/tensor.h"

namespace kiln::testing {

struct GradcheckOptions {
  double eps = 1e-6;
  double atol = 1e-5;
  double rtol = 1e-3;
  uint64_t seed = 1234;
};

using TensorFn = std::function<Tensor(const std::vector<Tensor>&)>;

// Empty string on success, else a description of the first mismatches.
std::string gradcheck(const TensorFn& f, const std::vector<Tensor>& inputs,
                      GradcheckOptions opts = {});

// Empty string when allclose(actual, expected): |a-e| <= atol + rtol*|e| elementwise, same shape,
// no NaN in actual unless expected has NaN there. Else the first mismatches.
std::string compare(const Tensor& actual, const Tensor& expected, double atol, double rtol);

// f64 CPU leaf with values uniform in [lo, hi), requires_grad set.
Tensor leaf(const Shape& shape, double lo = -1.0, double hi = 1.0, Generator* gen = nullptr);

}  // namespace kiln::testing

// CHECK that a helper returned "" and print its message otherwise.
#define KILN_CHECK_OK(expr)           \
  do {                                \
    std::string _kiln_msg = (expr);   \
    INFO(_kiln_msg);                  \
    CHECK(_kiln_msg.empty());         \
  } while (0)
