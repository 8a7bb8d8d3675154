#include "tests/gradcheck.h"

#include <cmath>
#include <sstream>

#include "ops/ops.h"

namespace kiln::testing {

Tensor leaf(const Shape& shape, double lo, double hi, Generator* gen) {
  Tensor t = uniform(shape, lo, hi, DType::f64, gen);
  t.set_requires_grad(true);
  return t;
}

std::string compare(const Tensor& actual, const Tensor& expected, double atol, double rtol) {
  std::ostringstream os;
  if (actual.shape() != expected.shape()) {
    os << "shape mismatch: actual " << actual.desc() << " vs expected " << expected.desc();
    return os.str();
  }
  std::vector<double> a = actual.to_vector<double>(), e = expected.to_vector<double>();
  int bad = 0;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    bool ok;
    if (std::isnan(e[i])) ok = std::isnan(a[i]);
    else ok = !std::isnan(a[i]) && std::abs(a[i] - e[i]) <= atol + rtol * std::abs(e[i]);
    if (!ok) {
      if (bad < 5) os << "  [" << i << "] actual " << a[i] << " expected " << e[i] << "\n";
      ++bad;
      if (!std::isnan(a[i])) worst = std::max(worst, std::abs(a[i] - e[i]));
    }
  }
  if (bad) {
    std::ostringstream head;
    head << bad << " of " << a.size() << " elements differ (atol " << atol << ", rtol " << rtol
         << ", worst abs diff " << worst << ")\n";
    return head.str() + os.str();
  }
  return "";
}

namespace {

double weighted_sum(const Tensor& out, const std::vector<double>& v) {
  std::vector<double> o = out.to_vector<double>();
  double s = 0;
  for (size_t i = 0; i < o.size(); ++i) s += o[i] * v[i];
  return s;
}

}  // namespace

std::string gradcheck(const TensorFn& f, const std::vector<Tensor>& inputs, GradcheckOptions opts) {
  std::ostringstream report;
  for (const Tensor& x : inputs) {
    if (x.defined() && x.requires_grad()) {
      if (x.dtype() != DType::f64 || !x.is_cpu() || !x.is_leaf())
        return "gradcheck: inputs that require grad must be f64 CPU leaves, got " + x.desc();
      x.set_grad(Tensor());
    }
  }
  Generator gen(opts.seed);

  // Analytic gradients.
  Tensor out = f(inputs);
  if (!out.requires_grad()) return "gradcheck: output does not require grad";
  Tensor v = randn(out.shape(), DType::f64, &gen);
  std::vector<double> vv = v.to_vector<double>();
  out.backward(v);
  std::vector<Tensor> analytic;
  for (const Tensor& x : inputs)
    analytic.push_back(x.defined() && x.requires_grad() ? x.grad() : Tensor());

  // Numeric gradients, one element at a time.
  for (size_t k = 0; k < inputs.size(); ++k) {
    const Tensor& x = inputs[k];
    if (!x.defined() || !x.requires_grad()) continue;
    if (!analytic[k].defined()) {
      report << "input " << k << ": no gradient reached it\n";
      continue;
    }
    std::vector<double> a = analytic[k].to_vector<double>();
    Tensor xc = x.contiguous();
    if (!xc.is_same(x)) return "gradcheck: inputs must be contiguous";
    double* p = x.data<double>();
    int bad = 0;
    for (int64_t i = 0; i < x.numel(); ++i) {
      double orig = p[i];
      double plus, minus;
      {
        NoGradGuard ng;
        p[i] = orig + opts.eps;
        plus = weighted_sum(f(inputs), vv);
        p[i] = orig - opts.eps;
        minus = weighted_sum(f(inputs), vv);
        p[i] = orig;
      }
      double n = (plus - minus) / (2 * opts.eps);
      if (!(std::abs(a[size_t(i)] - n) <= opts.atol + opts.rtol * std::abs(n))) {
        if (bad < 5)
          report << "input " << k << " " << x.desc() << " element " << i << ": analytic "
                 << a[size_t(i)] << " numeric " << n << "\n";
        ++bad;
      }
    }
    if (bad) report << "input " << k << ": " << bad << " of " << x.numel() << " elements wrong\n";
  }
  if (!report.str().empty()) return report.str();

  // Accumulation: backward must add into an existing .grad, never overwrite it.
  std::vector<Tensor> sentinels;
  for (const Tensor& x : inputs) {
    if (x.defined() && x.requires_grad()) {
      Tensor s = uniform(x.shape(), 10.0, 20.0, DType::f64, &gen);
      x.set_grad(s.clone());
      sentinels.push_back(s);
    } else {
      sentinels.push_back(Tensor());
    }
  }
  f(inputs).backward(v);
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (!sentinels[k].defined()) continue;
    NoGradGuard ng;
    Tensor expected = F::add(sentinels[k], analytic[k]);
    std::string msg = compare(inputs[k].grad(), expected, 1e-9, 1e-9);
    if (!msg.empty()) report << "input " << k << ": backward did not accumulate into .grad:\n" << msg;
    inputs[k].set_grad(Tensor());
  }
  return report.str();
}

}  // namespace kiln::testing
