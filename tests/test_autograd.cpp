// Autograd engine: recording rules, leaves, accumulation, graph freeing, in-place detection,
// gradient validation.
#include <doctest/doctest.h>

#include <functional>

#include "ops/ops.h"
#include "tests/gradcheck.h"
#include "tests/test_util.h"

using namespace kiln;
using kiln::testing::compare;
using kiln::testing::error_of;
using kiln::testing::gradcheck;
using kiln::testing::leaf;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

Tensor vec(std::vector<double> v) {
  int64_t n = int64_t(v.size());
  return from_vector(v, {n}, DType::f64);
}

// A node whose backward is given by the test: lets us feed the engine bad gradients.
class TestNode final : public Node {
 public:
  using Fn = std::function<std::vector<Tensor>(std::vector<Tensor>&)>;
  explicit TestNode(Fn f) : f_(std::move(f)) {}
  std::string name() const override { return "TestNodeBackward"; }
  std::vector<Tensor> apply(std::vector<Tensor>& g) override { return f_(g); }

 private:
  Fn f_;
};

// An op out = zeros(shape) recorded with TestNode over `inputs`.
Tensor custom_op(const std::vector<Tensor>& inputs, const Shape& shape, TestNode::Fn f) {
  Tensor out = zeros(shape, DType::f64);
  auto node = std::make_shared<TestNode>(std::move(f));
  node->set_inputs(inputs);
  autograd::set_history(out, node);
  return out;
}

}  // namespace

TEST_CASE("requires_grad propagation, leaves, grad_fn") {
  Tensor a = leaf({3});
  Tensor b = vec({1, 2, 3});
  CHECK(a.requires_grad());
  CHECK(a.is_leaf());
  CHECK(a.grad_fn() == nullptr);
  CHECK_FALSE(b.requires_grad());
  CHECK(b.is_leaf());
  Tensor y = F::mul(a, b);
  CHECK(y.requires_grad());
  CHECK_FALSE(y.is_leaf());
  REQUIRE(y.grad_fn() != nullptr);
  CHECK(contains(y.grad_fn()->name(), "mul"));
  CHECK(y.grad_fn()->num_inputs() == 2);
  CHECK(y.grad_fn()->needs_input_grad(0));
  CHECK_FALSE(y.grad_fn()->needs_input_grad(1));
  Tensor z = F::mul(b, b);
  CHECK_FALSE(z.requires_grad());
  CHECK(z.is_leaf());
  // through views and chains
  Tensor v = F::exp(y).unsqueeze(0).expand({2, 3}).select(0, 1);
  CHECK(v.requires_grad());
  CHECK_FALSE(v.is_leaf());
  // gradients of non-leaves are not kept
  F::sum(v).backward();
  CHECK(a.grad().defined());
  CHECK_FALSE(y.grad().defined());
  CHECK_FALSE(b.grad().defined());
  // the engine wires the leaf's AccumulateGrad
  Tensor w = leaf({2});
  Tensor s = F::add(w, 1.0);
  REQUIRE(s.grad_fn()->next_edges().size() == 1);
  CHECK(s.grad_fn()->next_edges()[0].fn->name() == "AccumulateGrad");
}

TEST_CASE("detach") {
  Tensor a = leaf({3});
  Tensor d = a.detach();
  CHECK_FALSE(d.requires_grad());
  CHECK(d.is_leaf());
  CHECK(d.shares_storage(a));
  CHECK(d.to_vector<double>() == a.to_vector<double>());
  {
    NoGradGuard ng;
    a.fill_(2.0);
  }
  CHECK(d.to_vector<double>() == std::vector<double>{2, 2, 2});  // same memory
  CHECK(d.version() == a.version());                             // same counter
  // no gradient flows through the detached operand: d(a * detach(a))/da = a
  Tensor y = F::mul(a, a.detach());
  F::sum(y).backward();
  CHECK(a.grad().to_vector<double>() == std::vector<double>{2, 2, 2});
  // detach of a non-leaf is a leaf
  Tensor e = F::exp(a).detach();
  CHECK(e.is_leaf());
  CHECK_FALSE(e.requires_grad());
}

TEST_CASE("NoGradGuard stops recording and nests") {
  Tensor a = leaf({2});
  CHECK(GradMode::is_enabled());
  {
    NoGradGuard ng;
    CHECK_FALSE(GradMode::is_enabled());
    Tensor y = F::mul(a, 2.0);
    CHECK_FALSE(y.requires_grad());
    CHECK(y.is_leaf());
    CHECK(y.grad_fn() == nullptr);
    CHECK_FALSE(a.t().requires_grad());
    CHECK_FALSE(a.clone().requires_grad());
    CHECK_FALSE(a.to(DType::f32).requires_grad());
    {
      NoGradGuard inner;
      CHECK_FALSE(GradMode::is_enabled());
    }
    CHECK_FALSE(GradMode::is_enabled());  // inner guard restores "off"
    CHECK_THROWS_AS(F::sum(y).backward(), Error);  // nothing recorded
  }
  CHECK(GradMode::is_enabled());
  CHECK(F::mul(a, 2.0).requires_grad());
}

TEST_CASE("leaf gradients accumulate across backward calls") {
  Tensor a = leaf({3});
  Tensor c = vec({1, -2, 0.5});
  F::sum(F::mul(a, c)).backward();
  CHECK(a.grad().to_vector<double>() == std::vector<double>{1, -2, 0.5});
  F::sum(F::mul(a, c)).backward();  // a fresh graph: adds
  CHECK(a.grad().to_vector<double>() == std::vector<double>{2, -4, 1});
  // zeroing and resetting
  {
    NoGradGuard ng;
    a.grad().zero_();
  }
  F::sum(F::mul(a, 3.0)).backward();
  CHECK(a.grad().to_vector<double>() == std::vector<double>{3, 3, 3});
  a.set_grad(Tensor());
  CHECK_FALSE(a.grad().defined());
  F::sum(a).backward();
  CHECK(a.grad().to_vector<double>() == std::vector<double>{1, 1, 1});
  // the first gradient is a private copy, not the caller's tensor
  Tensor b = leaf({2});
  Tensor g = vec({5, 6});
  b.backward(g);
  CHECK(b.grad().to_vector<double>() == std::vector<double>{5, 6});
  CHECK_FALSE(b.grad().shares_storage(g));
  g.fill_(0.0);
  CHECK(b.grad().to_vector<double>() == std::vector<double>{5, 6});
  b.backward(vec({1, 1}));
  CHECK(b.grad().to_vector<double>() == std::vector<double>{6, 7});
}

TEST_CASE("a tensor used twice receives the sum") {
  Tensor a = leaf({3});
  Tensor y = F::add(F::mul(a, 2.0), F::mul(a, 3.0));
  F::sum(y).backward();
  CHECK(a.grad().to_vector<double>() == std::vector<double>{5, 5, 5});
  // two views of one leaf
  Tensor b = leaf({2, 3});
  F::sum(F::add(F::mul(b.select(0, 0), 2.0), b.select(0, 1))).backward();
  CHECK(b.grad().to_vector<double>() == std::vector<double>{2, 2, 2, 1, 1, 1});
  // overlapping views: both paths land on the same elements
  Tensor c = leaf({4});
  F::sum(F::add(c.narrow(0, 0, 3), c.narrow(0, 1, 3))).backward();
  CHECK(c.grad().to_vector<double>() == std::vector<double>{1, 2, 2, 1});
  // a diamond through a non-leaf: u = exp(x); y = u*u + u
  Tensor x = leaf({3});
  KILN_CHECK_OK(gradcheck(
      [](auto& in) {
        Tensor u = F::exp(in[0]);
        return F::add(F::mul(u, u), u);
      },
      {x}));
}

TEST_CASE("same tensor feeding both inputs of an op") {
  Tensor a = leaf({4}, 0.5, 2.0);
  F::sum(F::mul(a, a)).backward();
  KILN_CHECK_OK(compare(a.grad(), F::mul(a.detach(), 2.0), 1e-12, 0));
  a.set_grad(Tensor());
  F::sum(F::add(a, a)).backward();
  CHECK(a.grad().to_vector<double>() == std::vector<double>(4, 2.0));
  a.set_grad(Tensor());
  F::sum(F::sub(a, a)).backward();
  CHECK(a.grad().to_vector<double>() == std::vector<double>(4, 0.0));
  // a and its transpose
  Tensor m = leaf({3, 3});
  KILN_CHECK_OK(gradcheck([](auto& in) { return F::mul(in[0], in[0].t()); }, {m}));
}

TEST_CASE("backward needs a gradient for non-scalars and a matching one otherwise") {
  Tensor a = leaf({2, 3});
  Tensor y = F::mul(a, 2.0);
  std::string msg = error_of([&] { y.backward(); });
  CHECK(contains(msg, "one-element"));
  CHECK_THROWS_AS(y.backward(ones({3, 2}, DType::f64)), Error);
  CHECK_THROWS_AS(y.backward(ones({6}, DType::f64)), Error);
  y.backward(ones({2, 3}, DType::f64));
  CHECK(a.grad().to_vector<double>() == std::vector<double>(6, 2.0));
  // a one-element non-0-d root needs none
  Tensor b = leaf({1, 1});
  F::mul(b, 4.0).backward();
  CHECK(b.grad().item() == 4.0);
  // a gradient of another dtype is converted to the root's dtype
  Tensor c = leaf({2});
  F::mul(c, 3.0).backward(ones({2}, DType::f32));
  CHECK(c.grad().dtype() == DType::f64);
  CHECK(c.grad().to_vector<double>() == std::vector<double>{3, 3});
  // roots that need no grad
  CHECK_THROWS_AS(vec({1.0}).backward(), Error);
  CHECK_THROWS_AS(Tensor().backward(), Error);
  // several roots at once
  Tensor d = leaf({2});
  autograd::backward({F::sum(F::mul(d, 2.0)), F::mul(d, 3.0)}, {Tensor(), vec({1, 10})});
  CHECK(d.grad().to_vector<double>() == std::vector<double>{5, 32});
  CHECK_THROWS_AS(autograd::backward({F::sum(d)}, {}), Error);
}

TEST_CASE("a freed graph refuses a second backward; retain_graph keeps it") {
  Tensor a = leaf({3}), b = leaf({3});
  Tensor y = F::sum(F::mul(a, b));
  y.backward();
  std::string msg = error_of([&] { y.backward(); });
  CHECK(contains(msg, "retain_graph"));
  CHECK(contains(msg, "mul"));

  a.set_grad(Tensor());
  b.set_grad(Tensor());
  Tensor z = F::sum(F::mul(a, b));
  z.backward(Tensor(), /*retain_graph=*/true);
  std::vector<double> ga = a.grad().to_vector<double>();
  z.backward(Tensor(), true);
  z.backward();  // the third one frees
  std::vector<double> want = b.detach().to_vector<double>();
  for (double& w : want) w *= 3;
  KILN_CHECK_OK(compare(a.grad(), vec(want), 1e-12, 0));
  CHECK(ga == b.detach().to_vector<double>());
  CHECK_THROWS_AS(z.backward(), Error);
}

TEST_CASE("in-place modification of a saved tensor is caught at backward") {
  Tensor a = leaf({3}), b = leaf({3});
  Tensor y = F::sum(F::mul(a, b));  // mul saves a and b
  {
    NoGradGuard ng;
    a.add_(1.0);
  }
  std::string msg = error_of([&] { y.backward(); });
  CHECK(contains(msg, "in-place"));
  CHECK(contains(msg, "version"));
  // through a view of the saved tensor: one version counter per storage
  Tensor c = leaf({2, 2}), d = leaf({2, 2});
  Tensor z = F::sum(F::mul(c, d));
  {
    NoGradGuard ng;
    d.select(0, 1).fill_(0.0);
  }
  CHECK(contains(error_of([&] { z.backward(); }), "in-place"));
  // a saved output (exp saves its result) modified in place
  Tensor e = leaf({2});
  Tensor u = F::exp(e);
  Tensor s = F::sum(u);
  {
    NoGradGuard ng;
    u.mul_(2.0);
  }
  CHECK(contains(error_of([&] { s.backward(); }), "version"));
  // ops that save nothing are unaffected
  Tensor f = leaf({2});
  Tensor t = F::sum(F::add(f, 1.0));
  {
    NoGradGuard ng;
    f.add_(1.0);
  }
  t.backward();
  CHECK(f.grad().to_vector<double>() == std::vector<double>{1, 1});
}

TEST_CASE("in-place ops on tensors that require grad are refused while recording") {
  Tensor a = leaf({3});
  Tensor o = vec({1, 1, 1});
  const std::vector<double> before = a.detach().to_vector<double>();
  for (auto op : std::vector<std::function<void()>>{
           [&] { a.add_(1.0); }, [&] { a.add_(o); }, [&] { a.mul_(2.0); }, [&] { a.mul_(o); },
           [&] { a.fill_(0.0); }, [&] { a.zero_(); }, [&] { a.copy_(o); },
           [&] { a.narrow(0, 0, 2).fill_(1.0); }, [&] { F::exp(a).add_(1.0); }}) {
    std::string msg = error_of(op);
    CHECK(contains(msg, "in-place"));
  }
  CHECK(a.detach().to_vector<double>() == before);  // nothing was written
  {
    NoGradGuard ng;
    a.add_(1.0);
  }
  CHECK(a.to_vector<double>()[0] == doctest::Approx(before[0] + 1.0));
  // a tensor that does not require grad is fine either way
  o.add_(1.0);
  CHECK(o.to_vector<double>() == std::vector<double>{2, 2, 2});
}

TEST_CASE("set_requires_grad rules") {
  CHECK_THROWS_AS(zeros({2}, DType::i64).set_requires_grad(true), Error);
  CHECK_THROWS_AS(zeros({2}, DType::boolean).set_requires_grad(true), Error);
  CHECK_THROWS_AS(zeros({2}, DType::u8).set_requires_grad(true), Error);
  zeros({2}, DType::i32).set_requires_grad(false);  // turning it off is always fine
  CHECK(zeros({2}, DType::f16).set_requires_grad(true).requires_grad());
  CHECK(zeros({2}, DType::bf16).set_requires_grad(true).requires_grad());
  CHECK(zeros({2}, DType::f32).set_requires_grad(true).requires_grad());
  Tensor a = leaf({2});
  Tensor y = F::mul(a, 2.0);
  std::string msg = error_of([&] { y.set_requires_grad(false); });
  CHECK(contains(msg, "leaf"));
  CHECK_THROWS_AS(y.set_requires_grad(true), Error);
  CHECK_THROWS_AS(a.t().set_requires_grad(true), Error);  // a recorded view is no leaf
  Tensor b = leaf({2});
  b.set_requires_grad(false);
  CHECK_FALSE(F::mul(b, 2.0).requires_grad());
}

TEST_CASE("gradient validation") {
  Tensor a = leaf({2, 3}), b = leaf({3});
  // set_grad checks shape, dtype
  CHECK_THROWS_AS(a.set_grad(zeros({3, 2}, DType::f64)), Error);
  CHECK_THROWS_AS(a.set_grad(zeros({2, 3}, DType::f32)), Error);
  a.set_grad(zeros({2, 3}, DType::f64));
  a.set_grad(Tensor());
  // a node returning a gradient of the wrong shape is named in the error
  Tensor y = custom_op({a, b}, {2}, [](std::vector<Tensor>&) {
    return std::vector<Tensor>{zeros({3, 2}, DType::f64), zeros({3}, DType::f64)};
  });
  std::string msg = error_of([&] { y.backward(ones({2}, DType::f64)); });
  CHECK(contains(msg, "TestNodeBackward"));
  CHECK(contains(msg, "[3, 2]"));
  // ... or the wrong number of gradients
  Tensor z = custom_op({a, b}, {2}, [](std::vector<Tensor>&) {
    return std::vector<Tensor>{zeros({2, 3}, DType::f64)};
  });
  CHECK(contains(error_of([&] { z.backward(ones({2}, DType::f64)); }), "TestNodeBackward"));
  CHECK_FALSE(a.grad().defined());
  // a gradient of another dtype is converted to the input's dtype
  Tensor w = custom_op({a}, {2}, [](std::vector<Tensor>&) {
    return std::vector<Tensor>{full({2, 3}, 0.5, DType::f32)};
  });
  w.backward(ones({2}, DType::f64));
  CHECK(a.grad().dtype() == DType::f64);
  CHECK(a.grad().to_vector<double>() == std::vector<double>(6, 0.5));
  // an undefined gradient means zero, also through views: the leaf gets nothing
  Tensor c = leaf({2, 2}), e = leaf({2});
  Tensor u = custom_op({c.t().reshape({4}), e}, {1}, [](std::vector<Tensor>&) {
    return std::vector<Tensor>{Tensor(), ones({2}, DType::f64)};
  });
  u.backward();
  CHECK_FALSE(c.grad().defined());
  CHECK(e.grad().to_vector<double>() == std::vector<double>{1, 1});
}

TEST_CASE("deep graphs run and free without recursion trouble") {
  // backward walks a long chain without recursion
  Tensor a = leaf({2});
  Tensor y = a;
  for (int i = 0; i < 100000; ++i) y = F::add(y, 1e-6);
  F::sum(y).backward();
  CHECK(a.grad().to_vector<double>() == std::vector<double>{1, 1});
  // dropping a chain of a million recorded views frees it without deep recursion
  Tensor v = a;
  for (int i = 0; i < 1000000; ++i) v = v.view({2});
  CHECK(v.requires_grad());
  v = Tensor();
  y = Tensor();
  CHECK(a.grad().defined());
}

// What ops/dgrad_sink.h relies on: a consumer may return no gradient for an input and hand the
// work to that input's producer instead. The engine still counts the edge, so the producer runs
// after the consumer — with every other contribution summed, or with an undefined gradient when
// there is none.
TEST_CASE("an input's producer runs after every consumer, also one that returned no gradient") {
  for (bool other_consumer : {true, false}) {
    CAPTURE(other_consumer);
    Tensor a = leaf({3});
    std::vector<std::string> order;
    Tensor handed;  // what the consumer passed to the producer instead of a gradient
    Tensor received;
    Tensor p = custom_op({a}, {3}, [&](std::vector<Tensor>& g) {
      order.push_back("producer");
      received = g[0];
      CHECK(handed.defined());
      return std::vector<Tensor>{g[0].defined() ? F::add(g[0], handed) : handed};
    });
    Tensor c = custom_op({p}, {1}, [&](std::vector<Tensor>&) {
      order.push_back("consumer");
      handed = full({3}, 0.25, DType::f64);
      return std::vector<Tensor>{Tensor()};
    });
    Tensor loss = other_consumer ? F::add(F::sum(c), F::sum(F::mul(p, 2.0))) : F::sum(c);
    loss.backward();
    REQUIRE(order.size() == 2);
    CHECK(order[0] == "consumer");
    CHECK(order[1] == "producer");
    if (other_consumer) {
      REQUIRE(received.defined());
      CHECK(received.to_vector<double>() == std::vector<double>{2, 2, 2});
      CHECK(a.grad().to_vector<double>() == std::vector<double>{2.25, 2.25, 2.25});
    } else {
      CHECK_FALSE(received.defined());
      CHECK(a.grad().to_vector<double>() == std::vector<double>{0.25, 0.25, 0.25});
    }
  }
}
