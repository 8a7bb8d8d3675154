// Accumulate-into (core/autograd.h): a convolution's backward adds its gradient straight into
// the engine's buffered partial sum or a leaf's .grad. Every graph is run with the feature on
// and off and the gradients must agree bit for bit (f64 CPU: the fused `+=` sums in the same
// order as the engine's add); counters show what was offered and used; aliased partial sums
// are never offered.
#include <doctest/doctest.h>

#include <functional>
#include <map>
#include <vector>

#include "core/autograd.h"
#include "core/generator.h"
#include "ops/ops.h"
#include "tests/gradcheck.h"

using namespace kiln;
using testing::leaf;

namespace {

// Restores the switch at scope exit so one test cannot leak its setting into another.
struct AccumulateSwitch {
  explicit AccumulateSwitch(bool on) : prev(autograd::accumulate_into_enabled()) {
    autograd::set_accumulate_into_enabled(on);
    autograd::reset_accumulate_stats();
  }
  ~AccumulateSwitch() { autograd::set_accumulate_into_enabled(prev); }
  bool prev;
};

std::vector<double> values(const Tensor& t) { return t.contiguous().to_vector<double>(); }

// Copies of `inputs` as fresh leaves (same values, .grad copied when defined).
std::vector<Tensor> fresh_leaves(const std::vector<Tensor>& inputs) {
  std::vector<Tensor> out;
  for (const Tensor& t : inputs) {
    Tensor c = t.detach().clone();
    c.set_requires_grad(true);
    if (t.grad().defined()) c.set_grad(t.grad().detach().clone());
    out.push_back(c);
  }
  return out;
}

using Loss = std::function<Tensor(const std::vector<Tensor>&)>;

// Runs `backwards` backward passes of loss(leaves) with accumulate-into on/off; returns .grads.
std::vector<std::vector<double>> grads_of(const Loss& loss, const std::vector<Tensor>& inputs,
                                          bool on, int backwards = 1,
                                          autograd::AccumulateStats* stats = nullptr) {
  AccumulateSwitch sw(on);
  std::vector<Tensor> leaves = fresh_leaves(inputs);
  for (int i = 0; i < backwards; ++i) loss(leaves).backward();
  if (stats) *stats = autograd::accumulate_stats();
  std::vector<std::vector<double>> out;
  for (const Tensor& l : leaves) out.push_back(values(l.grad()));
  return out;
}

void check_same_grads(const Loss& loss, const std::vector<Tensor>& inputs, int backwards,
                      autograd::AccumulateStats* stats) {
  const auto off = grads_of(loss, inputs, false, backwards);
  const auto on = grads_of(loss, inputs, true, backwards, stats);
  REQUIRE(off.size() == on.size());
  for (size_t i = 0; i < on.size(); ++i) {
    CAPTURE(i);
    CHECK(on[i] == off[i]);
  }
}

// Weighted sum so every output element gets a different upstream gradient.
Tensor wsum(const Tensor& y, uint64_t seed) {
  Generator gen(seed);
  Tensor v = randn(y.shape(), DType::f64, &gen);
  return F::sum(F::mul(y, v));
}

// out = a + b, whose backward returns ONE tensor as the gradient of both inputs (aliased).
class SharedGradNode final : public Node {
 public:
  std::string name() const override { return "SharedGradNode"; }
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    Tensor t = g[0].clone();
    return {t, t};
  }
};
Tensor shared_grad_add(const Tensor& a, const Tensor& b) {
  Tensor out;
  {
    NoGradGuard no_grad;
    out = F::add(a, b);
  }
  auto node = std::make_shared<SharedGradNode>();
  node->set_inputs({a, b});
  autograd::set_history(out, node);
  return out;
}

// Identity whose backward returns a fresh-handle alias (detach) of a tensor it keeps: the impl
// is referenced once, the memory twice. Returns g·1 by copying into the kept buffer first.
Tensor kept_alias_identity(const Tensor& x, const Tensor& kept) {
  Tensor out;
  {
    NoGradGuard no_grad;
    out = x.detach().clone();
  }
  autograd::record_unary("KeptAlias", x, out, [kept](const Tensor& g) {
    kept.copy_(g);
    return kept.detach();
  });
  return out;
}

// A node that opts in but ignores its targets: the engine must restore and add.
class IgnoresTargetNode final : public Node {
 public:
  explicit IgnoresTargetNode(bool zero) : zero_(zero) {}
  std::string name() const override { return "IgnoresTargetNode"; }
  bool can_accumulate_into(size_t) const override { return true; }
  std::vector<Tensor> apply(std::vector<Tensor>& g) override {
    seen_target = accumulate_target(0).defined();
    if (zero_) return {Tensor()};
    return {F::mul(g[0], 3.0)};
  }
  bool seen_target = false;

 private:
  bool zero_;
};

}  // namespace

TEST_CASE("x feeding two convolutions: dgrad accumulated, identical gradients") {
  Generator gen(1);
  Tensor x0 = leaf({2, 3, 5, 5}, -1, 1, &gen), w1 = leaf({4, 3, 3, 3}, -1, 1, &gen);
  Tensor w2 = leaf({4, 3, 1, 1}, -1, 1, &gen);
  for (bool leaf_x : {true, false}) {
    CAPTURE(leaf_x);
    Loss loss = [leaf_x](const std::vector<Tensor>& in) {
      Tensor x = leaf_x ? in[0] : F::mul(in[0], 1.5);  // leaf: AccumulateGrad's slot
      Tensor a = F::conv2d(x, in[1], Tensor(), 1, 1);
      Tensor b = F::conv2d(x, in[2]);
      return F::add(wsum(a, 7), wsum(b, 8));
    };
    autograd::AccumulateStats st;
    check_same_grads(loss, {x0, w1, w2}, 1, &st);
    // The second conv to run finds the first one's dx buffered and adds into it.
    CHECK(st.offered == 1);
    CHECK(st.used == 1);
    CHECK(st.offered_leaf == 0);  // no .grad defined on the first backward
    // Two backward calls: the second offers the weights' .grad (one contribution each).
    check_same_grads(loss, {x0, w1, w2}, 2, &st);
    CHECK(st.offered_leaf == 2);
    CHECK(st.used == st.offered);
  }
}

TEST_CASE("x feeding a convolution and an elementwise op, in both orders") {
  Generator gen(2);
  Tensor x0 = leaf({1, 2, 4, 4}, -1, 1, &gen), w = leaf({3, 2, 3, 3}, -1, 1, &gen);
  for (bool conv_first : {true, false}) {
    CAPTURE(conv_first);
    Loss loss = [conv_first](const std::vector<Tensor>& in) {
      Tensor x = F::mul(in[0], 0.5);
      Tensor c, e;
      // Nodes run newest first: the op created last runs first.
      if (conv_first) {
        c = F::conv2d(x, in[1], Tensor(), 1, 1);
        e = F::mul(x, x);
      } else {
        e = F::mul(x, x);
        c = F::conv2d(x, in[1], Tensor(), 1, 1);
      }
      return F::add(wsum(c, 3), wsum(e, 4));
    };
    autograd::AccumulateStats st;
    check_same_grads(loss, {x0, w}, 1, &st);
    // Conv created first runs last and accumulates into the mul's gradient; created last it
    // runs first and the mul's gradient is added to its result as before.
    CHECK(st.offered == (conv_first ? 1 : 0));
    CHECK(st.used == st.offered);
  }
}

TEST_CASE("a weight used by two convolutions, with and without a pre-filled .grad") {
  Generator gen(3);
  Tensor x0 = leaf({2, 3, 5, 5}, -1, 1, &gen), w = leaf({3, 3, 3, 3}, -1, 1, &gen);
  Loss loss = [](const std::vector<Tensor>& in) {
    Tensor h = F::conv2d(in[0], in[1], Tensor(), 1, 1);
    return wsum(F::conv2d(F::relu(h), in[1], Tensor(), 1, 1), 5);
  };
  autograd::AccumulateStats st;
  check_same_grads(loss, {x0, w}, 1, &st);
  CHECK(st.offered == 1);  // the second dw into the first (w's slot), not w.grad (undefined)
  CHECK(st.used == 1);
  // A user-filled .grad, then two backward passes: .grad + (dw1 + dw2) each time, bitwise as
  // without accumulation (w has two pending contributions, so .grad itself is not offered).
  Tensor wg = w.detach().clone();
  wg.set_requires_grad(true);
  wg.set_grad(full(w.shape(), 0.25, DType::f64));
  Tensor xg = x0.detach().clone();
  xg.set_requires_grad(true);
  xg.set_grad(full(x0.shape(), -2.0, DType::f64));
  check_same_grads(loss, {xg, wg}, 2, &st);
  CHECK(st.offered_leaf == 2);  // x.grad, once per backward (x: a single contribution)
  CHECK(st.used == st.offered);
}

TEST_CASE("a pre-filled .grad receives conv's wgrad in place, hooks fire once") {
  Generator gen(4);
  Tensor x = leaf({2, 3, 4, 4}, -1, 1, &gen), w = leaf({2, 3, 3, 3}, -1, 1, &gen);
  Tensor b = leaf({2}, -1, 1, &gen);
  const Tensor w_grad0 = full(w.shape(), 0.5, DType::f64);
  for (bool on : {false, true}) {
    CAPTURE(on);
    AccumulateSwitch sw(on);
    Tensor wl = w.detach().clone(), xl = x.detach().clone(), bl = b.detach().clone();
    for (Tensor* t : {&wl, &xl, &bl}) t->set_requires_grad(true);
    Tensor buf = w_grad0.clone();
    wl.set_grad(buf);
    std::map<std::string, int> fired;
    std::vector<double> seen_in_hook;
    autograd::add_post_accumulate_grad_hook(wl, [&](const Tensor& t) {
      ++fired["w"];
      seen_in_hook = values(t.grad());
    });
    autograd::add_post_accumulate_grad_hook(xl, [&](const Tensor&) { ++fired["x"]; });
    autograd::add_post_accumulate_grad_hook(bl, [&](const Tensor&) { ++fired["b"]; });
    for (int step = 1; step <= 2; ++step) {
      wsum(F::conv2d(xl, wl, bl, 1, 1), 9).backward();
      CHECK(fired["w"] == step);
      CHECK(fired["x"] == step);
      CHECK(fired["b"] == step);
      CHECK(seen_in_hook == values(wl.grad()));  // the hook saw the complete gradient
    }
    CHECK(wl.grad().is_same(buf));  // still the user's tensor, updated in place
    const autograd::AccumulateStats st = autograd::accumulate_stats();
    // Reference: w.grad0 + 2 * dw, computed without accumulation from a fresh graph.
    Tensor wr = w.detach().clone();
    wr.set_requires_grad(true);
    {
      AccumulateSwitch off(false);
      wsum(F::conv2d(x.detach(), wr, b.detach(), 1, 1), 9).backward();
    }
    Tensor expect = F::add(F::add(w_grad0, wr.grad()), wr.grad());
    KILN_CHECK_OK(testing::compare(wl.grad(), expect, 1e-12, 1e-12));
    if (on) {
      // w.grad on each backward, x.grad on the second (undefined on the first); never b.grad.
      CHECK(st.offered_leaf == 3);
      CHECK(st.offered == 3);
      CHECK(st.used == 3);
    }
  }
}

TEST_CASE("aliased partial sums are not offered") {
  Generator gen(5);
  Tensor x0 = leaf({1, 2, 4, 4}, -1, 1, &gen), y0 = leaf({1, 2, 4, 4}, -1, 1, &gen);
  Tensor w = leaf({2, 2, 3, 3}, -1, 1, &gen);

  SUBCASE("one tensor returned as the gradient of two inputs") {
    Loss loss = [](const std::vector<Tensor>& in) {
      Tensor a = F::mul(in[0], 2.0), b = F::mul(in[1], 3.0);
      Tensor c = F::conv2d(a, in[2], Tensor(), 1, 1);  // runs after shared_grad_add
      return F::add(wsum(c, 1), wsum(shared_grad_add(a, b), 2));
    };
    autograd::AccumulateStats st;
    check_same_grads(loss, {x0, y0, w}, 1, &st);
    CHECK(st.offered == 0);
  }
  SUBCASE("a fresh handle on memory a node keeps") {
    Tensor kept = zeros(x0.shape(), DType::f64);
    Loss loss = [&kept](const std::vector<Tensor>& in) {
      Tensor a = F::mul(in[0], 2.0);
      Tensor c = F::conv2d(a, in[1], Tensor(), 1, 1);
      return F::add(wsum(c, 1), wsum(kept_alias_identity(a, kept), 2));
    };
    autograd::AccumulateStats st;
    check_same_grads(loss, {x0, w}, 1, &st);
    CHECK(st.offered == 0);
    // kept still holds what the alias node copied into it (conv did not add into it).
    Generator g2(2);
    Tensor v = randn(x0.shape(), DType::f64, &g2);
    CHECK(values(kept) == values(v));
  }
  SUBCASE("a root gradient the caller holds") {
    AccumulateSwitch sw(true);
    Tensor xl = x0.detach().clone();
    xl.set_requires_grad(true);
    Tensor a = F::mul(xl, 2.0);
    Tensor c = F::conv2d(a, w, Tensor(), 1, 1);
    Tensor ga = full(a.shape(), 1.0, DType::f64);
    autograd::backward({wsum(c, 1), a}, {Tensor(), ga});
    CHECK(autograd::accumulate_stats().offered == 0);
    CHECK(values(ga) == values(full(a.shape(), 1.0, DType::f64)));
  }
}

TEST_CASE("a node that opts in but returns a fresh or no gradient: the partial sum survives") {
  Generator gen(6);
  Tensor x0 = leaf({3, 4}, -1, 1, &gen);
  for (bool zero : {false, true}) {
    CAPTURE(zero);
    for (bool on : {false, true}) {
      AccumulateSwitch sw(on);
      Tensor xl = x0.detach().clone();
      xl.set_requires_grad(true);
      Tensor a = F::mul(xl, 2.0);
      auto node = std::make_shared<IgnoresTargetNode>(zero);
      Tensor out;
      {
        NoGradGuard no_grad;
        out = a.detach().clone();
      }
      node->set_inputs({a});
      autograd::set_history(out, node);
      Tensor e = F::mul(a, a);  // created last: its gradient is buffered first
      F::add(F::sum(out), F::sum(e)).backward();
      // d/dx = 2 * (3 [or 0] + 2a)
      Tensor expect = F::mul(F::add(F::mul(a.detach(), 2.0), zero ? 0.0 : 3.0), 2.0);
      KILN_CHECK_OK(testing::compare(xl.grad(), expect, 1e-12, 1e-12));
      CHECK(node->seen_target == on);
      if (on) CHECK(autograd::accumulate_stats().used == 0);
    }
  }
}

TEST_CASE("gradcheck with accumulation on: shared input, shared weight, pre-filled .grad") {
  AccumulateSwitch sw(true);
  Generator gen(7);
  Tensor x = leaf({1, 2, 4, 4}, -1, 1, &gen), w1 = leaf({2, 2, 3, 3}, -1, 1, &gen);
  Tensor w2 = leaf({2, 2, 1, 1}, -1, 1, &gen);
  auto f = [](const std::vector<Tensor>& in) {
    Tensor h = F::add(F::conv2d(in[0], in[1], Tensor(), 1, 1), F::conv2d(in[0], in[2]));
    Tensor g = F::conv2d(F::tanh(h), in[1], Tensor(), 1, 1);  // w1 used twice
    return F::add(g, F::mul(in[0], in[0]));
  };
  KILN_CHECK_OK(testing::gradcheck(f, {x, w1, w2}));
  CHECK(autograd::accumulate_stats().used > 0);
}

TEST_CASE("the switch turns offering off") {
  Generator gen(8);
  Tensor x0 = leaf({1, 2, 4, 4}, -1, 1, &gen), w = leaf({2, 2, 1, 1}, -1, 1, &gen);
  AccumulateSwitch sw(false);
  Tensor xl = x0.detach().clone();
  xl.set_requires_grad(true);
  F::add(wsum(F::conv2d(xl, w), 1), wsum(F::conv2d(xl, w), 2)).backward();
  CHECK(autograd::accumulate_stats().offered == 0);
  CHECK_FALSE(autograd::accumulate_into_enabled());
}

TEST_CASE("backward's zeroed memory: a .grad in it is written, not added to; same gradients") {
  // A convolution's weight and a weight used twice, their .grads views of one zeroed arena, as
  // ClassifierStep passes FusedOptimizer's after zero_grad. w.grad (a single contribution) comes
  // flagged zero and the convolution writes it; v.grad (two contributions) is never offered as
  // .grad; u.grad (a single contribution, but outside the arena) is offered, not flagged. Every
  // gradient equals the plain run.
  Generator gen(7);
  Tensor x = leaf({2, 3, 5, 5}, -1, 1, &gen), w = leaf({4, 3, 3, 3}, -1, 1, &gen);
  Tensor v = leaf({4, 4, 1, 1}, -1, 1, &gen), u = leaf({2, 4, 1, 1}, -1, 1, &gen);
  const int64_t nw = w.numel(), nv = v.numel();
  auto run = [&](bool pass_arena, double fill) {
    AccumulateSwitch sw(true);
    Tensor wl = w.detach().clone(), vl = v.detach().clone(), xl = x.detach().clone();
    Tensor ul = u.detach().clone();
    for (Tensor* t : {&wl, &vl, &xl, &ul}) t->set_requires_grad(true);
    Tensor arena = full({nw + nv}, fill, DType::f64);  // w.grad and v.grad view it
    Tensor wbuf = arena.narrow(0, 0, nw).view(w.shape());
    Tensor vbuf = arena.narrow(0, nw, nv).view(v.shape());
    wl.set_grad(wbuf);
    vl.set_grad(vbuf);
    ul.set_grad(full(u.shape(), fill, DType::f64));
    Tensor h = F::conv2d(xl, wl, Tensor(), 1, 1);
    Tensor loss = wsum(F::conv2d(F::conv2d(F::relu(F::conv2d(h, vl)), vl), ul), 11);
    autograd::backward({loss}, {Tensor()}, false, pass_arena ? arena : Tensor());
    CHECK(wl.grad().is_same(wbuf));  // written in place either way
    return std::pair{std::vector<Tensor>{wl.grad(), vl.grad(), xl.grad(), ul.grad()},
                     autograd::accumulate_stats()};
  };
  const auto [plain, st_plain] = run(false, 0.0);
  const auto [zero, st_zero] = run(true, 0.0);
  CHECK(st_plain.offered_zero == 0);
  CHECK(st_zero.offered_zero == 1);  // w.grad only (x.grad undefined, v: two contributions)
  CHECK(st_zero.offered_leaf == 2);  // w.grad and u.grad
  CHECK(st_zero.used == st_plain.used);
  for (size_t i = 0; i < plain.size(); ++i) {
    CAPTURE(i);
    KILN_CHECK_OK(testing::compare(zero[i], plain[i], 0, 0));
  }
  // The promise broken on purpose: the arena and u.grad hold 3. w.grad is overwritten (the
  // value is lost, as documented) — this is what shows the write happened; v.grad and u.grad
  // are added to as usual.
  const auto [broken, st_broken] = run(true, 3.0);
  KILN_CHECK_OK(testing::compare(broken[0], plain[0], 0, 0));
  KILN_CHECK_OK(testing::compare(broken[1], F::add(plain[1], 3.0), 1e-12, 1e-12));
  KILN_CHECK_OK(testing::compare(broken[3], F::add(plain[3], 3.0), 1e-12, 1e-12));
}

TEST_CASE("linear, linear_gelu and layer_norm write a zeroed .grad and add into a filled one") {
  // A transformer MLP's parameters as ClassifierStep leaves them: .grads viewing one zeroed
  // arena. The Linear weights and biases come flagged zero and are written (the backends' linear
  // entries only write); the layer norm's are written too (AddToZeros). u.grad, outside the
  // arena and pre-filled, is offered unflagged: Linear declines it (the engine adds), the layer
  // norm adds into it (Accumulate). Every gradient equals the plain run, bit for bit.
  Generator gen(21);
  Tensor x = leaf({6, 8}, -1, 1, &gen);
  Tensor w1 = leaf({12, 8}, -0.5, 0.5, &gen), b1 = leaf({12}, -0.5, 0.5, &gen);
  Tensor g1 = leaf({12}, 0.5, 1.5, &gen), c1 = leaf({12}, -0.5, 0.5, &gen);
  Tensor w2 = leaf({5, 12}, -0.5, 0.5, &gen), b2 = leaf({5}, -0.5, 0.5, &gen);
  Tensor u = leaf({5}, 0.5, 1.5, &gen);  // a second layer norm's weight, outside the arena
  const std::vector<Tensor> params{w1, b1, g1, c1, w2, b2};
  auto run = [&](bool pass_arena, double fill, bool on = true) {
    AccumulateSwitch sw(on);
    int64_t n = 0;
    for (const Tensor& p : params) n += p.numel();
    Tensor arena = full({n}, fill, DType::f64);
    std::vector<Tensor> ps, bufs;
    int64_t at = 0;
    for (const Tensor& p : params) {
      Tensor l = p.detach().clone();
      l.set_requires_grad(true);
      Tensor buf = arena.narrow(0, at, p.numel()).view(p.shape());
      at += p.numel();
      l.set_grad(buf);
      ps.push_back(l);
      bufs.push_back(buf);
    }
    Tensor ul = u.detach().clone(), xl = x.detach().clone();
    ul.set_requires_grad(true);
    xl.set_requires_grad(true);
    ul.set_grad(full(u.shape(), fill, DType::f64));
    Tensor h = F::linear_gelu(xl, ps[0], ps[1]);
    h = F::layer_norm(h, {12}, ps[2], ps[3], 1e-5);
    h = F::layer_norm(F::linear(h, ps[4], ps[5]), {5}, ul, Tensor(), 1e-5);
    autograd::backward({wsum(h, 22)}, {Tensor()}, false, pass_arena ? arena : Tensor());
    for (size_t i = 0; i < ps.size(); ++i) CHECK(ps[i].grad().is_same(bufs[i]));
    std::vector<Tensor> grads;
    for (const Tensor& p : ps) grads.push_back(p.grad());
    grads.push_back(ul.grad());
    grads.push_back(xl.grad());
    return std::pair{grads, autograd::accumulate_stats()};
  };
  const auto [off, st_off] = run(false, 0.0, false);
  const auto [plain, st_plain] = run(false, 0.0);
  const auto [zero, st_zero] = run(true, 0.0);
  CHECK(st_off.offered == 0);
  CHECK(st_plain.offered_zero == 0);
  CHECK(st_zero.offered_zero == 6);  // every parameter in the arena
  CHECK(st_zero.used == 7);          // those six, and u.grad added into by the layer norm
  CHECK(st_plain.used == 3);  // unflagged: Linear declines, the layer norms add into theirs
  for (size_t i = 0; i < plain.size(); ++i) {
    CAPTURE(i);
    KILN_CHECK_OK(testing::compare(plain[i], off[i], 0, 0));
    KILN_CHECK_OK(testing::compare(zero[i], off[i], 0, 0));
  }
  // The promise broken on purpose (the arena and u.grad hold 3): the flagged .grads were
  // written — the 3 is gone — and u.grad was added to.
  const auto [broken, st_broken] = run(true, 3.0);
  for (size_t i = 0; i < params.size(); ++i) {
    CAPTURE(i);
    KILN_CHECK_OK(testing::compare(broken[i], off[i], 0, 0));
  }
  KILN_CHECK_OK(testing::compare(broken[6], F::add(off[6], 3.0), 1e-12, 1e-12));
  // Without the arena the same filled .grads are all added to.
  const auto [filled, st_filled] = run(false, 3.0);
  for (size_t i = 0; i < params.size() + 1; ++i) {
    CAPTURE(i);
    KILN_CHECK_OK(testing::compare(filled[i], F::add(off[i], 3.0), 1e-12, 1e-12));
  }
}

TEST_CASE("layer_norm adds its dx into the residual stream's partial sum") {
  // A pre-norm block, h = x + linear(layer_norm(x)), twice: x's gradient is the add's
  // pass-through plus the layer norm's dx. With accumulate-into the layer norm adds its dx into
  // the buffered pass-through (rounded as the engine's add rounds it): the same bits, f64 and
  // f32, and one more target used per block.
  for (DType dt : {DType::f64, DType::f32}) {
    const std::string name = dtype_name(dt);
    CAPTURE(name);
    Generator gen(31);
    auto make = [&](const Shape& s, double lo, double hi) {
      Tensor t = leaf(s, lo, hi, &gen).detach().to(dt);
      t.set_requires_grad(true);
      return t;
    };
    const Tensor x = make({5, 3, 8}, -1, 1);
    const Tensor g = make({8}, 0.5, 1.5), b = make({8}, -0.5, 0.5);
    const Tensor w = make({8, 8}, -0.5, 0.5), c = make({8}, -0.5, 0.5);
    const Loss loss = [](const std::vector<Tensor>& in) {
      Tensor h = in[0];
      for (int block = 0; block < 2; ++block) {
        const Tensor n = F::layer_norm(h, {8}, in[1], in[2], 1e-5);
        h = F::add(h, F::linear(n.reshape({-1, 8}), in[3], in[4]).view(h.shape()));
      }
      return wsum(h.to(DType::f64), 32);
    };
    autograd::AccumulateStats st;
    check_same_grads(loss, {x, g, b, w, c}, 1, &st);
    // Per block: the layer norm's dx (the residual's partial sum) and its weight and bias
    // (their partial sums from the other block, or .grad); Linear declines unflagged targets.
    CHECK(st.used >= 4);
  }
}
