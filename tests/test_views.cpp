// Views: values, storage sharing and write-through, errors, and gradients of every view op;
// contiguous(), clone() and to(dtype) gradients.
#include <doctest/doctest.h>

#include <functional>
#include <set>

#include "ops/ops.h"
#include "tests/gradcheck.h"

using namespace kiln;
using kiln::testing::gradcheck;
using kiln::testing::leaf;

namespace {

using ViewFn = std::function<Tensor(const Tensor&)>;

// f64 tensor whose value at each position is its flat index: a view's values then name the
// base elements it covers.
Tensor iota(const Shape& shape) {
  return arange(0.0, double(shape_numel(shape)), 1.0, DType::f64).reshape(shape);
}

std::vector<double> iota_vec(int64_t n, double start = 0) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = start + double(i);
  return v;
}

// The view shares the base's storage, and writes through it land exactly on the base elements
// it covers. The base requires grad, so the view is recorded and writing needs NoGradGuard.
void check_write_through(const Shape& shape, const ViewFn& view, bool overlapping = false) {
  Tensor x = iota(shape);
  x.set_requires_grad(true);
  Tensor y = view(x);
  CHECK(y.shares_storage(x));
  CHECK(y.requires_grad());
  CHECK_FALSE(y.is_leaf());
  std::vector<double> covered = y.to_vector<double>();
  CHECK_THROWS_AS(y.fill_(-1.0), Error);  // recording: refused
  uint64_t v0 = x.version();
  std::vector<double> want = iota_vec(x.numel());
  {
    NoGradGuard ng;
    if (overlapping) {
      y.fill_(-1.0);
      for (double i : covered) want[size_t(i)] = -1.0;
    } else {
      y.copy_(from_vector(iota_vec(y.numel(), 1000.0), y.shape(), DType::f64));
      for (size_t k = 0; k < covered.size(); ++k) want[size_t(covered[k])] = 1000.0 + double(k);
    }
  }
  CHECK(x.version() > v0);  // one counter for base and view
  CHECK(x.to_vector<double>() == want);
}

// Gradient of view(x) * w for a fixed random w of the view's shape.
std::string check_view_grad(const Shape& shape, const ViewFn& view) {
  Tensor x = leaf(shape);
  Shape out_shape;
  {
    NoGradGuard ng;
    out_shape = view(x).shape();
  }
  Generator g(99);
  Tensor w = uniform(out_shape, 0.5, 2.0, DType::f64, &g);
  return gradcheck([&](const std::vector<Tensor>& in) { return F::mul(view(in[0]), w); }, {x});
}

}  // namespace

TEST_CASE("view and reshape") {
  Tensor x = iota({2, 3, 4});
  Tensor v = x.view({6, 4});
  CHECK(v.shape() == Shape{6, 4});
  CHECK(v.strides() == Shape{4, 1});
  CHECK(v.to_vector<double>() == iota_vec(24));
  CHECK(x.view({-1}).shape() == Shape{24});
  CHECK(x.view({4, -1, 2}).shape() == Shape{4, 3, 2});
  CHECK(x.reshape({3, -1}).shape() == Shape{3, 8});
  CHECK(x.view({2, 3, 4}).shares_storage(x));
  CHECK(x.view({1, 24, 1}).shape() == Shape{1, 24, 1});
  CHECK(full({}, 3.0).view({1}).item() == 3.0);
  CHECK(tensor({5.0}).view({}).dim() == 0);
  // a view keeps the storage offset of a contiguous slice
  Tensor row = x.select(0, 1);
  CHECK(row.is_contiguous());
  CHECK(row.view({-1}).to_vector<double>() == iota_vec(12, 12));
  // errors: two -1, wrong count, negative size, -1 with a zero-size known part
  CHECK_THROWS_AS(x.view({-1, -1}), Error);
  CHECK_THROWS_AS(x.view({5, 5}), Error);
  CHECK_THROWS_AS(x.view({-1, 5}), Error);
  CHECK_THROWS_AS(x.view({-2, -12}), Error);
  CHECK_THROWS_AS(x.reshape({25}), Error);
  CHECK_THROWS_AS(zeros({0, 4}).view({0, -1}), Error);
  CHECK(zeros({0, 4}).view({-1}).numel() == 0);
  // a view of a non-contiguous tensor is refused; reshape copies instead
  Tensor t = x.transpose(1, 2);
  CHECK_THROWS_AS(t.view({24}), Error);
  Tensor r = t.reshape({24});
  CHECK_FALSE(r.shares_storage(x));
  std::vector<double> want;
  for (int a = 0; a < 2; ++a)
    for (int c = 0; c < 4; ++c)
      for (int b = 0; b < 3; ++b) want.push_back(a * 12 + b * 4 + c);
  CHECK(r.to_vector<double>() == want);
  CHECK(x.reshape({4, 6}).shares_storage(x));
  check_write_through({2, 3, 4}, [](const Tensor& a) { return a.view({4, 6}); });
  check_write_through({2, 3, 4}, [](const Tensor& a) { return a.reshape({-1}); });
}

TEST_CASE("flatten") {
  Tensor x = iota({2, 3, 4, 5});
  CHECK(x.flatten().shape() == Shape{120});
  CHECK(x.flatten(1).shape() == Shape{2, 60});
  CHECK(x.flatten(1, 2).shape() == Shape{2, 12, 5});
  CHECK(x.flatten(-2, -1).shape() == Shape{2, 3, 20});
  CHECK(x.flatten(2, 2).shape() == Shape{2, 3, 4, 5});
  CHECK(x.flatten(0, 1).to_vector<double>() == iota_vec(120));
  CHECK(full({}, 1.0).flatten().shape() == Shape{1});
  CHECK_THROWS_AS(x.flatten(2, 1), Error);
  CHECK_THROWS_AS(x.flatten(0, 4), Error);
  // flattening a transposed tensor copies, in logical order
  Tensor t = iota({2, 3}).t().flatten();
  CHECK(t.to_vector<double>() == std::vector<double>{0, 3, 1, 4, 2, 5});
  check_write_through({2, 3, 4}, [](const Tensor& a) { return a.flatten(1); });
}

TEST_CASE("permute and transpose") {
  Tensor x = iota({2, 3, 4});
  Tensor p = x.permute({2, 0, 1});
  CHECK(p.shape() == Shape{4, 2, 3});
  CHECK(p.strides() == Shape{1, 12, 4});
  CHECK_FALSE(p.is_contiguous());
  int bad = 0;
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j)
      for (int k = 0; k < 3; ++k)
        bad += p.to_vector<double>()[size_t((i * 2 + j) * 3 + k)] != double(j * 12 + k * 4 + i);
  CHECK(bad == 0);
  CHECK(x.permute({-1, 0, 1}).shape() == Shape{4, 2, 3});
  CHECK(x.permute({0, 1, 2}).strides() == x.strides());
  CHECK_THROWS_AS(x.permute({0, 1}), Error);
  CHECK_THROWS_AS(x.permute({0, 1, 1}), Error);
  CHECK_THROWS_AS(x.permute({0, 1, 3}), Error);
  Tensor t = x.transpose(0, -1);
  CHECK(t.shape() == Shape{4, 3, 2});
  CHECK(t.strides() == Shape{1, 4, 12});
  CHECK(iota({2, 3}).t().to_vector<double>() == std::vector<double>{0, 3, 1, 4, 2, 5});
  CHECK_THROWS_AS(x.transpose(0, 3), Error);
  CHECK(full({}, 2.0).transpose(0, -1).item() == 2.0);  // 0-d: nothing to swap
  check_write_through({2, 3, 4}, [](const Tensor& a) { return a.permute({2, 0, 1}); });
  check_write_through({3, 4}, [](const Tensor& a) { return a.t(); });
}

TEST_CASE("narrow, slice, select") {
  Tensor x = iota({4, 5});
  Tensor n = x.narrow(1, 1, 3);
  CHECK(n.shape() == Shape{4, 3});
  CHECK(n.offset() == 1);
  CHECK(n.to_vector<double>() == std::vector<double>{1, 2, 3, 6, 7, 8, 11, 12, 13, 16, 17, 18});
  CHECK(x.narrow(0, 3, 1).to_vector<double>() == std::vector<double>{15, 16, 17, 18, 19});
  CHECK(x.narrow(0, 4, 0).numel() == 0);
  CHECK_THROWS_AS(x.narrow(1, 3, 3), Error);
  CHECK_THROWS_AS(x.narrow(1, -1, 2), Error);
  CHECK_THROWS_AS(x.narrow(1, 0, -1), Error);
  CHECK_THROWS_AS(x.narrow(2, 0, 1), Error);

  Tensor s = x.slice(1, 0, 5, 2);
  CHECK(s.shape() == Shape{4, 3});
  CHECK(s.strides() == Shape{5, 2});
  CHECK(s.to_vector<double>() == std::vector<double>{0, 2, 4, 5, 7, 9, 10, 12, 14, 15, 17, 19});
  CHECK(x.slice(1, 1, 5, 3).to_vector<double>() == std::vector<double>{1, 4, 6, 9, 11, 14, 16, 19});
  CHECK(x.slice(0, -2, 4).to_vector<double>() == iota_vec(10, 10));       // negative start
  CHECK(x.slice(0, 0, -3).to_vector<double>() == iota_vec(5, 0));         // negative end
  CHECK(x.slice(0, 1, 100).shape() == Shape{3, 5});                       // end clamped
  CHECK(x.slice(0, 3, 1).numel() == 0);                                   // empty
  CHECK(x.slice(-1, 4, 5).to_vector<double>() == std::vector<double>{4, 9, 14, 19});
  CHECK(x.slice(0, 1, 4, 2).slice(1, 1, 5, 2).to_vector<double>() ==
        std::vector<double>{6, 8, 16, 18});
  CHECK_THROWS_AS(x.slice(1, 0, 5, 0), Error);
  CHECK_THROWS_AS(x.slice(1, 0, 5, -1), Error);
  CHECK_THROWS_AS(x.slice(2, 0, 1), Error);

  Tensor r = x.select(0, 2);
  CHECK(r.shape() == Shape{5});
  CHECK(r.to_vector<double>() == iota_vec(5, 10));
  CHECK(x.select(1, -1).to_vector<double>() == std::vector<double>{4, 9, 14, 19});
  CHECK(x.select(1, 0).select(0, 3).item() == 15.0);
  CHECK(x.select(1, 0).select(0, 3).dim() == 0);
  CHECK_THROWS_AS(x.select(0, 4), Error);
  CHECK_THROWS_AS(x.select(0, -5), Error);
  // a 0-d tensor has no dim to index
  Tensor z = full({}, 1.0);
  CHECK_THROWS_AS(z.select(0, 0), Error);
  CHECK_THROWS_AS(z.slice(0, 0, 1), Error);
  CHECK_THROWS_AS(z.narrow(0, 0, 1), Error);

  check_write_through({4, 5}, [](const Tensor& a) { return a.narrow(1, 1, 3); });
  check_write_through({4, 5}, [](const Tensor& a) { return a.slice(1, 1, 5, 2); });
  check_write_through({4, 5}, [](const Tensor& a) { return a.slice(0, 1, 4, 2).t(); });
  check_write_through({4, 5}, [](const Tensor& a) { return a.select(1, 3); });
  check_write_through({2, 3, 4}, [](const Tensor& a) { return a.select(0, 1).select(1, 2); });
}

TEST_CASE("expand, squeeze, unsqueeze") {
  Tensor c = iota({3, 1});
  Tensor e = c.expand({2, 3, 4});
  CHECK(e.shape() == Shape{2, 3, 4});
  CHECK(e.strides() == Shape{0, 1, 0});
  std::vector<double> want;
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 3; ++b)
      for (int k = 0; k < 4; ++k) want.push_back(b);
  CHECK(e.to_vector<double>() == want);
  CHECK(c.expand({-1, 5}).shape() == Shape{3, 5});
  CHECK(c.expand({3, 1}).strides() == c.strides());
  CHECK(c.expand({0, 3, 2}).numel() == 0);
  CHECK_THROWS_AS(c.expand({2, 4}), Error);      // 3 cannot become 2
  CHECK_THROWS_AS(c.expand({1}), Error);         // fewer dims
  CHECK_THROWS_AS(c.expand({-1, 3, 4}), Error);  // -1 in a new leading dim
  CHECK_THROWS_AS(c.expand({3, -2}), Error);     // negative size
  check_write_through({3, 1}, [](const Tensor& a) { return a.expand({2, 3, 4}); }, true);

  Tensor s = iota({1, 3, 1, 2});
  CHECK(s.squeeze().shape() == Shape{3, 2});
  CHECK(s.squeeze().to_vector<double>() == iota_vec(6));
  CHECK(s.squeeze(0).shape() == Shape{3, 1, 2});
  CHECK(s.squeeze(-2).shape() == Shape{1, 3, 2});
  CHECK(s.squeeze(1).shape() == Shape{1, 3, 1, 2});  // size 3: unchanged
  CHECK(full({}, 1.0).squeeze().dim() == 0);
  CHECK_THROWS_AS(s.squeeze(4), Error);
  check_write_through({1, 3, 1, 2}, [](const Tensor& a) { return a.squeeze(); });

  Tensor u = iota({2, 3});
  CHECK(u.unsqueeze(0).shape() == Shape{1, 2, 3});
  CHECK(u.unsqueeze(1).shape() == Shape{2, 1, 3});
  CHECK(u.unsqueeze(2).shape() == Shape{2, 3, 1});
  CHECK(u.unsqueeze(-1).shape() == Shape{2, 3, 1});
  CHECK(u.unsqueeze(-3).shape() == Shape{1, 2, 3});
  CHECK(u.unsqueeze(1).is_contiguous());
  CHECK(u.unsqueeze(2).is_contiguous());
  CHECK(u.t().unsqueeze(0).to_vector<double>() == std::vector<double>{0, 3, 1, 4, 2, 5});
  CHECK(full({}, 4.0).unsqueeze(0).shape() == Shape{1});
  CHECK_THROWS_AS(u.unsqueeze(3), Error);
  CHECK_THROWS_AS(u.unsqueeze(-4), Error);
  check_write_through({2, 3}, [](const Tensor& a) { return a.unsqueeze(1); });
}

TEST_CASE("gradients of every view op") {
  struct Case {
    const char* name;
    Shape shape;
    ViewFn fn;
  };
  const std::vector<Case> cases = {
      {"view", {2, 3, 4}, [](const Tensor& a) { return a.view({4, -1}); }},
      {"reshape (copy)", {3, 4}, [](const Tensor& a) { return a.t().reshape({2, 6}); }},
      {"flatten", {2, 3, 4}, [](const Tensor& a) { return a.flatten(1); }},
      {"permute", {2, 3, 4}, [](const Tensor& a) { return a.permute({2, 0, 1}); }},
      {"transpose", {2, 3, 4}, [](const Tensor& a) { return a.transpose(0, 2); }},
      {"narrow", {4, 5}, [](const Tensor& a) { return a.narrow(1, 1, 3); }},
      {"slice step 2", {5, 4}, [](const Tensor& a) { return a.slice(0, 0, 5, 2); }},
      {"slice step 3", {4, 7}, [](const Tensor& a) { return a.slice(1, 1, 7, 3); }},
      {"slice negative", {4, 5}, [](const Tensor& a) { return a.slice(1, -3, -1); }},
      {"select", {3, 4}, [](const Tensor& a) { return a.select(1, 2); }},
      {"select negative", {3, 4, 2}, [](const Tensor& a) { return a.select(0, -1); }},
      {"expand", {3, 1}, [](const Tensor& a) { return a.expand({2, 3, 4}); }},
      {"expand 0-d", {}, [](const Tensor& a) { return a.expand({3, 2}); }},
      {"squeeze", {1, 3, 1, 2}, [](const Tensor& a) { return a.squeeze(); }},
      {"squeeze dim", {3, 1, 2}, [](const Tensor& a) { return a.squeeze(1); }},
      {"unsqueeze", {3, 2}, [](const Tensor& a) { return a.unsqueeze(1); }},
      {"contiguous", {3, 4}, [](const Tensor& a) { return a.t().contiguous(); }},
      {"clone", {3, 4}, [](const Tensor& a) { return a.clone(); }},
      {"channels-last", {2, 3, 2, 2},
       [](const Tensor& a) { return a.contiguous(MemoryFormat::ChannelsLast); }},
      {"chain", {3, 4},
       [](const Tensor& a) { return a.t().slice(0, 1, 4, 2).unsqueeze(0).expand({2, 2, 3}); }},
      {"view of a view", {2, 6},
       [](const Tensor& a) { return a.narrow(1, 2, 3).select(0, 1).unsqueeze(-1).squeeze(); }},
  };
  for (const Case& c : cases) {
    CAPTURE(std::string(c.name));
    KILN_CHECK_OK(check_view_grad(c.shape, c.fn));
  }
}

TEST_CASE("view gradients land on the covered elements (hand-checked)") {
  Tensor x = leaf({3, 4});
  Tensor w = from_vector<double>({1, 2, 3, 4, 5, 6}, {3, 2}, DType::f64);
  F::sum(F::mul(x.slice(1, 1, 4, 2), w)).backward();
  CHECK(x.grad().to_vector<double>() ==
        std::vector<double>{0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6});
  // expand sums the gradient over the broadcast dims
  Tensor y = leaf({2, 1});
  F::sum(F::mul(y.expand({3, 2, 4}), 1.5)).backward();
  CHECK(y.grad().to_vector<double>() == std::vector<double>{18, 18});
  // select gives a one-hot row
  Tensor z = leaf({2, 3});
  F::sum(z.select(0, 1)).backward();
  CHECK(z.grad().to_vector<double>() == std::vector<double>{0, 0, 0, 1, 1, 1});
}

TEST_CASE("contiguous and clone") {
  Tensor x = iota({2, 3});
  CHECK(x.contiguous().is_same(x));
  Tensor t = x.t();
  Tensor c = t.contiguous();
  CHECK(c.is_contiguous());
  CHECK_FALSE(c.shares_storage(x));
  CHECK(c.to_vector<double>() == std::vector<double>{0, 3, 1, 4, 2, 5});
  CHECK(c.strides() == Shape{2, 1});
  Tensor k = x.clone();
  CHECK_FALSE(k.shares_storage(x));
  CHECK(k.to_vector<double>() == x.to_vector<double>());
  k.fill_(7.0);
  CHECK(x.to_vector<double>() == iota_vec(6));  // the clone is independent
  CHECK(t.clone().strides() == Shape{2, 1});    // non-dense input: contiguous clone
  // recorded: clone/contiguous of a requires-grad tensor are not leaves
  Tensor l = leaf({2, 3});
  CHECK(l.clone().grad_fn() != nullptr);
  CHECK(l.t().contiguous().grad_fn() != nullptr);
  CHECK(l.contiguous().is_same(l));
  {
    NoGradGuard ng;
    CHECK(l.clone().grad_fn() == nullptr);
    CHECK_FALSE(l.t().requires_grad());
  }
}

TEST_CASE("to(dtype) gradients") {
  // f64 -> f16 / bf16 / f32 -> f32: the gradient comes back through each cast, in the
  // input's dtype (the weights are exact in every dtype, so the result is exact).
  for (DType mid : {DType::f32, DType::f16, DType::bf16}) {
    CAPTURE(std::string(dtype_name(mid)));
    Tensor x = leaf({2, 3});
    Tensor w = from_vector<double>({1, 2, 3, 0.5, -1, 4}, {2, 3}, DType::f32);
    Tensor m = x.to(mid);
    CHECK(m.dtype() == mid);
    CHECK(m.requires_grad());
    CHECK(m.grad_fn() != nullptr);
    Tensor y = F::mul(m.to(DType::f32), w);
    F::sum(y).backward();
    REQUIRE(x.grad().defined());
    CHECK(x.grad().dtype() == DType::f64);
    CHECK(x.grad().to_vector<double>() == std::vector<double>{1, 2, 3, 0.5, -1, 4});
  }
  // f32 leaf -> f64 compute: gradient converted back to f32
  Tensor xf = ones({3}, TensorOptions(DType::f32).with_requires_grad());
  F::sum(F::mul(xf.to(DType::f64), from_vector<double>({0.25, 2, -3}, {3}, DType::f64))).backward();
  CHECK(xf.grad().dtype() == DType::f32);
  CHECK(xf.grad().to_vector<float>() == std::vector<float>{0.25f, 2.0f, -3.0f});
  // to an integer or bool dtype: not differentiable, no history
  Tensor l = leaf({3});
  CHECK_FALSE(l.to(DType::i64).requires_grad());
  CHECK_FALSE(l.to(DType::boolean).requires_grad());
  CHECK(l.to(DType::f64).is_same(l));
}
