// Tensor basics: devices, factories, random generation, memory formats, copies, printing.
#include <doctest/doctest.h>

#include <cmath>
#include <numeric>
#include <set>
#include <sstream>

#include "core/autograd.h"
#include "core/generator.h"
#include "core/tensor.h"

using namespace kiln;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string printed(const Tensor& t) {
  std::ostringstream os;
  os << t;
  return os.str();
}

}  // namespace

TEST_CASE("Device::parse and printing") {
  CHECK(Device::parse("cpu") == Device::cpu());
  CHECK(Device::parse("cpu").is_cpu());
  CHECK(Device::parse("cuda") == Device::cuda(0));
  CHECK(Device::parse("cuda:0") == Device::cuda(0));
  Device d = Device::parse("cuda:3");
  CHECK(d.is_cuda());
  CHECK(d.index == 3);
  CHECK(Device::parse("cuda:12").index == 12);
  CHECK_FALSE(Device::parse("cuda:1") == Device::cuda(0));
  for (const char* bad : {"", "gpu", "CPU", "cuda:", "cuda:-1", "cuda:1x", "cuda:x", "cuda1",
                          "cuda:1:2", "cuda: 1", "cuda:+1", "cpu:0 ", " cpu", "cuda:99999999999"}) {
    CAPTURE(std::string(bad));
    CHECK_THROWS_AS(Device::parse(bad), Error);
  }
  try {
    Device::parse("tpu:0");
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(contains(e.what(), "tpu:0"));
  }
  CHECK(Device::cpu().str() == "cpu");
  CHECK(Device::cuda(2).str() == "cuda:2");
  std::ostringstream os;
  os << Device::cuda(1);
  CHECK(os.str() == "cuda:1");
}

TEST_CASE("empty/zeros/ones/full: shapes, dtypes, values") {
  Tensor e = empty({2, 3, 4});
  CHECK(e.shape() == Shape{2, 3, 4});
  CHECK(e.strides() == Shape{12, 4, 1});
  CHECK(e.dtype() == DType::f32);
  CHECK(e.is_cpu());
  CHECK(e.numel() == 24);
  CHECK(e.dim() == 3);
  CHECK(e.size(-1) == 4);
  CHECK(e.stride(0) == 12);
  CHECK(e.nbytes() == 96);
  CHECK(e.is_contiguous());
  CHECK_FALSE(e.requires_grad());
  CHECK(e.is_leaf());

  Tensor z = zeros({3, 2}, DType::f64);
  CHECK(z.dtype() == DType::f64);
  CHECK(z.to_vector<double>() == std::vector<double>(6, 0.0));
  CHECK(ones({4}, DType::i32).to_vector<int>() == std::vector<int>{1, 1, 1, 1});
  CHECK(full({2, 2}, 2.5, DType::f16).to_vector<float>() == std::vector<float>(4, 2.5f));
  CHECK(full({3}, -7, DType::i64).to_vector<int64_t>() == std::vector<int64_t>{-7, -7, -7});
  CHECK(full({2}, 3, DType::boolean).to_vector<int>() == std::vector<int>{1, 1});
  Tensor r = ones({2}, TensorOptions(DType::f64).with_requires_grad());
  CHECK(r.requires_grad());
  CHECK(r.is_leaf());
  CHECK_THROWS_AS(ones({2}, TensorOptions(DType::i64).with_requires_grad()), Error);

  // 0-d and zero-size tensors
  Tensor s = full({}, 4.0);
  CHECK(s.dim() == 0);
  CHECK(s.numel() == 1);
  CHECK(s.item() == 4.0);
  Tensor z0 = zeros({0, 3});
  CHECK(z0.numel() == 0);
  CHECK(z0.to_vector<float>().empty());

  // negative dims
  CHECK_THROWS_AS(empty({2, -1}), Error);
  CHECK_THROWS_AS(zeros({-3}), Error);
  CHECK_THROWS_AS(ones({1, -2, 3}), Error);
  CHECK_THROWS_AS(full({-1}, 1.0), Error);
  CHECK_THROWS_AS(rand({-1}), Error);

  // *_like keep shape, dtype and layout
  Tensor cl = empty({2, 3, 4, 5}, TensorOptions(DType::f64).with_memory_format(MemoryFormat::ChannelsLast));
  Tensor ol = ones_like(cl);
  CHECK(ol.dtype() == DType::f64);
  CHECK(ol.shape() == cl.shape());
  CHECK(ol.strides() == cl.strides());
  CHECK(zeros_like(cl).strides() == cl.strides());
  CHECK(empty_like(cl).strides() == cl.strides());
  CHECK(full_like(z, 9).to_vector<double>() == std::vector<double>(6, 9.0));
}

TEST_CASE("arange, from_vector, tensor") {
  CHECK(arange(5).to_vector<float>() == std::vector<float>{0, 1, 2, 3, 4});
  CHECK(arange(5).dtype() == DType::f32);
  CHECK(arange(5, DType::i64).to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 3, 4});
  CHECK(arange(1.0, 2.0, 0.25, DType::f64).to_vector<double>() ==
        std::vector<double>{1.0, 1.25, 1.5, 1.75});
  CHECK(arange(5.0, 0.0, -2.0, DType::f64).to_vector<double>() == std::vector<double>{5, 3, 1});
  CHECK(arange(0.0, 1.0, 0.3, DType::f64).numel() == 4);  // 0, .3, .6, .9
  CHECK(arange(3.0, 3.0).numel() == 0);
  CHECK(arange(3.0, 1.0).numel() == 0);  // wrong direction: empty
  CHECK_THROWS_AS(arange(0.0, 1.0, 0.0), Error);
  CHECK_THROWS_AS(arange(0.0, INFINITY, 1.0), Error);
  CHECK_THROWS_AS(arange(0.0, NAN, 1.0), Error);

  Tensor v = from_vector<int>({1, 2, 3, 4, 5, 6}, {3, 2}, DType::f64);
  CHECK(v.shape() == Shape{3, 2});
  CHECK(v.dtype() == DType::f64);
  CHECK(v.to_vector<double>() == std::vector<double>{1, 2, 3, 4, 5, 6});
  CHECK_THROWS_AS(from_vector<int>({1, 2, 3}, {2, 2}), Error);
  // channels-last from_vector: logical order preserved, physical NHWC
  Tensor cl = from_vector<int>({0, 1, 2, 3, 4, 5, 6, 7}, {1, 2, 2, 2},
                               TensorOptions(DType::i32).with_memory_format(MemoryFormat::ChannelsLast));
  CHECK(cl.is_contiguous(MemoryFormat::ChannelsLast));
  CHECK(cl.to_vector<int>() == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7});
  const int* raw = cl.data<int>();
  CHECK(std::vector<int>(raw, raw + 8) == std::vector<int>{0, 4, 1, 5, 2, 6, 3, 7});
  Tensor rg = from_vector<double>({1, 2}, {2}, TensorOptions(DType::f64).with_requires_grad());
  CHECK(rg.requires_grad());
  CHECK(rg.is_leaf());

  Tensor t = tensor({1.5, -2.0, 3.0});
  CHECK(t.shape() == Shape{3});
  CHECK(t.dtype() == DType::f32);
  CHECK(t.to_vector<float>() == std::vector<float>{1.5f, -2.0f, 3.0f});
  CHECK(tensor({7, 8}, DType::i64).to_vector<int64_t>() == std::vector<int64_t>{7, 8});
  CHECK_THROWS_AS(t.data<double>(), Error);
  CHECK(t.data<float>()[1] == -2.0f);
}

TEST_CASE("rand/uniform/randint ranges and generator reproducibility") {
  Generator g1(42), g2(42), g3(43);
  Tensor a = rand({1000}, DType::f64, &g1);
  Tensor b = rand({1000}, DType::f64, &g2);
  Tensor c = rand({1000}, DType::f64, &g3);
  CHECK(a.to_vector<double>() == b.to_vector<double>());
  CHECK(a.to_vector<double>() != c.to_vector<double>());
  for (double x : a.to_vector<double>()) {
    REQUIRE(x >= 0.0);
    REQUIRE(x < 1.0);
  }
  double mean = 0;
  for (double x : a.to_vector<double>()) mean += x / 1000;
  CHECK(mean == doctest::Approx(0.5).epsilon(0.05));

  // U[0,1) holds after rounding to a narrow dtype, too
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    CAPTURE(std::string(dtype_name(t)));
    Generator g(7);
    std::vector<double> v = rand({100000}, t, &g).to_vector<double>();
    double lo = 1, hi = 0;
    for (double x : v) lo = std::min(lo, x), hi = std::max(hi, x);
    CHECK(lo >= 0.0);
    CHECK(hi < 1.0);
    CHECK(hi > 0.99);
  }

  // manual_seed resets the default generator
  manual_seed(123);
  std::vector<float> r1 = randn({50}).to_vector<float>();
  std::vector<float> r1b = rand({5}).to_vector<float>();
  manual_seed(123);
  CHECK(randn({50}).to_vector<float>() == r1);
  CHECK(rand({5}).to_vector<float>() == r1b);
  manual_seed(124);
  CHECK(randn({50}).to_vector<float>() != r1);

  // a generator's state round-trips through its text form
  Generator gs(5);
  (void)rand({10}, DType::f64, &gs);
  std::string st = gs.state();
  std::vector<double> next = randn({20}, DType::f64, &gs).to_vector<double>();
  Generator gr;
  gr.set_state(st);
  CHECK(randn({20}, DType::f64, &gr).to_vector<double>() == next);
  Generator copy = gs;
  CHECK(copy.next_u64() == gs.next_u64());
  CHECK_THROWS_AS(gr.set_state("not a state"), Error);

  Generator gu(9);
  std::vector<double> u = uniform({2000}, -3.0, 5.0, DType::f64, &gu).to_vector<double>();
  double ulo = 1e9, uhi = -1e9;
  for (double x : u) ulo = std::min(ulo, x), uhi = std::max(uhi, x);
  CHECK(ulo >= -3.0);
  CHECK(uhi < 5.0);
  CHECK(ulo < -2.9);
  CHECK(uhi > 4.9);
  CHECK_THROWS_AS(uniform({2}, 1.0, 0.0), Error);

  Generator gi(11);
  Tensor ri = randint(-2, 3, {4000}, DType::i64, &gi);
  CHECK(ri.dtype() == DType::i64);
  CHECK(ri.shape() == Shape{4000});
  std::vector<int64_t> counts(5, 0);
  for (int64_t x : ri.to_vector<int64_t>()) {
    REQUIRE(x >= -2);
    REQUIRE(x < 3);
    ++counts[size_t(x + 2)];
  }
  for (int64_t n : counts) CHECK(n > 650);  // ~800 each
  CHECK(randint(0, 10, {3, 4}, DType::i32).dtype() == DType::i32);
  CHECK_THROWS_AS(randint(3, 3, {2}), Error);
  Generator gi2(11);
  CHECK(randint(-2, 3, {4000}, DType::i64, &gi2).to_vector<int64_t>() == ri.to_vector<int64_t>());
}

TEST_CASE("randn moments on 100k samples") {
  Generator g(2024);
  std::vector<double> v = randn({100000}, DType::f64, &g).to_vector<double>();
  double m = 0, m2 = 0, m3 = 0, m4 = 0;
  for (double x : v) m += x;
  m /= double(v.size());
  for (double x : v) {
    double d = x - m;
    m2 += d * d;
    m3 += d * d * d;
    m4 += d * d * d * d;
  }
  m2 /= double(v.size());
  m3 /= double(v.size());
  m4 /= double(v.size());
  CHECK(std::abs(m) < 0.015);  // std error ~0.003
  CHECK(std::sqrt(m2) == doctest::Approx(1.0).epsilon(0.01));
  CHECK(std::abs(m3) < 0.05);                          // skewness of a normal: 0
  CHECK(m4 / (m2 * m2) == doctest::Approx(3.0).epsilon(0.05));  // kurtosis: 3
  int beyond2 = 0;
  for (double x : v) beyond2 += std::abs(x) > 2.0;
  CHECK(double(beyond2) / double(v.size()) == doctest::Approx(0.0455).epsilon(0.1));
  // f32 randn follows the same stream
  Generator g2(2024);
  std::vector<float> f = randn({10}, DType::f32, &g2).to_vector<float>();
  for (int i = 0; i < 10; ++i) CHECK(f[size_t(i)] == float(v[size_t(i)]));
}

TEST_CASE("channels-last memory format") {
  const Shape s{2, 3, 4, 5};
  Tensor cl = empty(s, TensorOptions(DType::f64).with_memory_format(MemoryFormat::ChannelsLast));
  CHECK(cl.shape() == s);
  CHECK(cl.strides() == Shape{60, 1, 15, 3});  // N: H*W*C, C: 1, H: W*C, W: C
  CHECK(channels_last_strides(s) == Shape{60, 1, 15, 3});
  CHECK(cl.is_contiguous(MemoryFormat::ChannelsLast));
  CHECK_FALSE(cl.is_contiguous());
  CHECK(cl.suggest_memory_format() == MemoryFormat::ChannelsLast);
  CHECK(contains(cl.desc(), "NHWC"));
  Tensor nchw = empty(s, DType::f64);
  CHECK(nchw.is_contiguous());
  CHECK_FALSE(nchw.is_contiguous(MemoryFormat::ChannelsLast));
  CHECK(nchw.suggest_memory_format() == MemoryFormat::Contiguous);
  CHECK_FALSE(contains(nchw.desc(), "NHWC"));
  // a 3-D tensor is never channels-last; channels-last needs 4-D
  CHECK_FALSE(empty({2, 3, 4}).is_contiguous(MemoryFormat::ChannelsLast));
  CHECK_THROWS_AS(empty({2, 3, 4}, TensorOptions().with_memory_format(MemoryFormat::ChannelsLast)), Error);
  // C == 1 or H == W == 1: both layouts address every element alike; the exact strides the
  // tensor was made with decide what it suggests (what ops then allocate their outputs in)
  for (const Shape& amb : {Shape{2, 1, 3, 3}, Shape{2, 5, 1, 1}, Shape{1, 1, 4, 2}}) {
    CAPTURE(shape_str(amb));
    Tensor made_cl = empty(amb, TensorOptions().with_memory_format(MemoryFormat::ChannelsLast));
    CHECK(made_cl.is_contiguous());
    CHECK(made_cl.is_contiguous(MemoryFormat::ChannelsLast));
    CHECK(made_cl.strides() == channels_last_strides(amb));
    CHECK(made_cl.suggest_memory_format() == MemoryFormat::ChannelsLast);
    CHECK(made_cl.clone().suggest_memory_format() == MemoryFormat::ChannelsLast);
    Tensor plain = empty(amb);
    CHECK(plain.is_contiguous(MemoryFormat::ChannelsLast));
    CHECK(plain.suggest_memory_format() == MemoryFormat::Contiguous);
    // contiguous(fmt) only promises density in fmt: plain strides stay (no copy)
    CHECK(plain.contiguous(MemoryFormat::ChannelsLast).strides() == plain.strides());
    CHECK(plain.clone(MemoryFormat::ChannelsLast).suggest_memory_format() ==
          MemoryFormat::ChannelsLast);
  }
  // (N, 1, 1, 1): the two layouts' strides are the same numbers; plain
  CHECK(empty({3, 1, 1, 1}, TensorOptions().with_memory_format(MemoryFormat::ChannelsLast))
            .suggest_memory_format() == MemoryFormat::Contiguous);
  // permuting an NHWC-contiguous (N,H,W,C) tensor to (N,C,H,W) gives channels-last strides
  Tensor nhwc = empty({2, 4, 5, 3}).permute({0, 3, 1, 2});
  CHECK(nhwc.is_contiguous(MemoryFormat::ChannelsLast));
  CHECK(nhwc.suggest_memory_format() == MemoryFormat::ChannelsLast);

  // contiguous(ChannelsLast) copies values; check element (n,c,h,w) at its NHWC address
  Tensor x = arange(0.0, 120.0, 1.0, DType::f64).reshape(s);
  Tensor y = x.contiguous(MemoryFormat::ChannelsLast);
  CHECK(y.strides() == Shape{60, 1, 15, 3});
  CHECK_FALSE(y.shares_storage(x));
  const double* p = y.data<double>();
  int bad = 0;
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t c = 0; c < 3; ++c)
      for (int64_t h = 0; h < 4; ++h)
        for (int64_t w = 0; w < 5; ++w) {
          double want = double(((n * 3 + c) * 4 + h) * 5 + w);
          bad += p[((n * 4 + h) * 5 + w) * 3 + c] != want;
        }
  CHECK(bad == 0);
  CHECK(y.to_vector<double>() == x.to_vector<double>());  // same logical values
  CHECK(y.contiguous(MemoryFormat::ChannelsLast).is_same(y));
  Tensor back = y.contiguous();
  CHECK(back.is_contiguous());
  CHECK(back.to_vector<double>() == x.to_vector<double>());
  CHECK(x.contiguous().is_same(x));
  // clone keeps the layout unless told otherwise
  CHECK(y.clone().is_contiguous(MemoryFormat::ChannelsLast));
  CHECK(y.clone(MemoryFormat::Contiguous).is_contiguous());
  CHECK_THROWS_AS(empty({2, 3}).contiguous(MemoryFormat::ChannelsLast), Error);
}

TEST_CASE("copy_ with broadcasting and dtype conversion; fill_; item; to_vector") {
  Tensor dst = zeros({2, 3}, DType::f64);
  dst.copy_(from_vector<float>({1.5f, 2.5f, 3.5f}, {3}));  // broadcast rows, f32 -> f64
  CHECK(dst.to_vector<double>() == std::vector<double>{1.5, 2.5, 3.5, 1.5, 2.5, 3.5});
  dst.copy_(from_vector<int>({7, 8}, {2, 1}, DType::i32));  // broadcast columns, i32 -> f64
  CHECK(dst.to_vector<double>() == std::vector<double>{7, 7, 7, 8, 8, 8});
  dst.copy_(full({}, 4.0, DType::f16));  // 0-d source
  CHECK(dst.to_vector<double>() == std::vector<double>(6, 4.0));
  CHECK_THROWS_AS(dst.copy_(zeros({4})), Error);
  CHECK_THROWS_AS(dst.copy_(Tensor()), Error);
  // into a non-contiguous view, from a non-contiguous source
  Tensor base = zeros({3, 4}, DType::i64);
  Tensor src = arange(0.0, 6.0, 1.0, DType::f32).reshape({2, 3}).t();  // (3, 2)
  {
    NoGradGuard ng;
    base.slice(1, 0, 4, 2).copy_(src);
  }
  CHECK(base.to_vector<int64_t>() == std::vector<int64_t>{0, 0, 3, 0, 1, 0, 4, 0, 2, 0, 5, 0});
  // copy_ bumps the version; copying a tensor onto itself is a no-op
  uint64_t v0 = base.version();
  base.copy_(base);
  base.copy_(ones({4}, DType::i64));
  CHECK(base.version() > v0);
  CHECK(base.to_vector<int64_t>() == std::vector<int64_t>(12, 1));
  // source and destination overlapping in one buffer: the result is as if src were copied first
  Tensor sq = arange(4, DType::f64).reshape({2, 2});
  sq.copy_(sq.t());
  CHECK(sq.to_vector<double>() == std::vector<double>{0, 2, 1, 3});
  Tensor line = arange(5, DType::f64);
  line.narrow(0, 1, 4).copy_(line.narrow(0, 0, 4));
  CHECK(line.to_vector<double>() == std::vector<double>{0, 0, 1, 2, 3});
  Tensor col = arange(3, DType::f64);
  col.copy_(col.narrow(0, 2, 1));  // broadcast from an element of itself
  CHECK(col.to_vector<double>() == std::vector<double>{2, 2, 2});
  // float -> f16 with rounding, f16 -> u8
  Tensor h = empty({2}, DType::f16);
  h.copy_(tensor({1.0 + 0x1p-11, 3.0}, DType::f64));
  CHECK(h.to_vector<double>() == std::vector<double>{1.0, 3.0});
  Tensor u = empty({2}, DType::u8);
  u.copy_(h);
  CHECK(u.to_vector<int>() == std::vector<int>{1, 3});

  // fill_ on a strided view writes only the view
  Tensor f = zeros({3, 3}, DType::f32);
  f.select(1, 1).fill_(2.0);
  CHECK(f.to_vector<float>() == std::vector<float>{0, 2, 0, 0, 2, 0, 0, 2, 0});
  uint64_t v1 = f.version();
  f.zero_();
  CHECK(f.version() > v1);
  CHECK(f.to_vector<float>() == std::vector<float>(9, 0.0f));
  Tensor b = empty({3}, DType::boolean);
  b.fill_(0.5);
  CHECK(b.to_vector<int>() == std::vector<int>{1, 1, 1});
  // fill_/copy_ on a tensor that requires grad: refused while recording
  Tensor w = ones({2}, TensorOptions(DType::f64).with_requires_grad());
  CHECK_THROWS_AS(w.fill_(3.0), Error);
  CHECK_THROWS_AS(w.copy_(zeros({2}, DType::f64)), Error);
  {
    NoGradGuard ng;
    w.fill_(3.0);
  }
  CHECK(w.to_vector<double>() == std::vector<double>{3, 3});

  CHECK(full({}, 2.5).item() == 2.5);
  CHECK(full({1, 1}, -3.0, DType::i32).item<int>() == -3);
  CHECK(tensor({1, 2, 3}).select(0, 2).item() == 3.0);
  CHECK_THROWS_AS(zeros({2}).item(), Error);
  CHECK_THROWS_AS(zeros({0}).item(), Error);
  // to_vector reads logical order through any strides
  Tensor m = arange(0.0, 6.0, 1.0, DType::i64).reshape({2, 3});
  CHECK(m.t().to_vector<int64_t>() == std::vector<int64_t>{0, 3, 1, 4, 2, 5});
  CHECK(m.to_vector<float>() == std::vector<float>{0, 1, 2, 3, 4, 5});
  CHECK(m.to(Device::cpu()).is_same(m));
}

TEST_CASE("printing shows values, dtype and shape") {
  std::string s = printed(from_vector<double>({1, 2, 3, 4.5, 5, 6}, {2, 3}, DType::f64));
  CHECK(contains(s, "[[1, 2, 3], [4.5, 5, 6]]"));
  CHECK(contains(s, "f64"));
  CHECK(contains(s, "[2, 3]"));
  CHECK(contains(s, "cpu"));
  std::string r = printed(tensor({-1.25}).reshape({1, 1, 1}));
  CHECK(contains(r, "[[[-1.25]]]"));
  CHECK(contains(r, "f32"));
  CHECK(contains(printed(full({}, 7.0, DType::i64)), "7"));
  CHECK(contains(printed(full({}, 7.0, DType::i64)), "i64"));
  CHECK(contains(printed(ones({2}, TensorOptions(DType::f32).with_requires_grad())), "requires_grad"));
  CHECK(contains(printed(Tensor()), "undefined"));
  CHECK(contains(printed(zeros({0, 2})), "[]"));
  CHECK(contains(printed(zeros({1000})), "f32[1000]"));  // large: elided, but described
  // a transposed tensor prints in logical order
  CHECK(contains(printed(arange(4, DType::i32).reshape({2, 2}).t()), "[[0, 2], [1, 3]]"));
  CHECK(contains(printed(from_vector<int>({1, 0}, {2}, DType::boolean)), "[1, 0]"));
}

TEST_CASE("metadata helpers") {
  CHECK(shape_str({2, 3}) == "[2, 3]");
  CHECK(shape_str({}) == "[]");
  CHECK(shape_numel({}) == 1);
  CHECK(shape_numel({2, 0, 3}) == 0);
  CHECK(contiguous_strides({2, 3, 4}) == Shape{12, 4, 1});
  CHECK(contiguous_strides({}) == Shape{});
  Tensor t = zeros({2, 3});
  CHECK(t.desc() == "f32[2, 3] cpu");
  CHECK_THROWS_AS(t.size(2), Error);
  CHECK_THROWS_AS(t.size(-3), Error);
  CHECK_THROWS_AS(t.stride(5), Error);
  CHECK_THROWS_AS(full({}, 1.0).size(0), Error);  // a 0-d tensor has no dims
  CHECK_THROWS_AS(Tensor().shape(), Error);
  CHECK_FALSE(Tensor().defined());
  CHECK(Tensor().desc() == "undefined");
  // zero-size tensors are contiguous whatever their strides
  CHECK(zeros({0, 3}).t().is_contiguous());
  CHECK(zeros({0, 3}).t().view({-1}).numel() == 0);
  // external storage is wrapped, never freed
  std::vector<float> host = {1, 2, 3, 4};
  auto st = std::make_shared<Storage>(host.data(), host.size() * 4, Device::cpu());
  Tensor ext = make_tensor(st, 1, {3}, {1}, DType::f32);
  CHECK(ext.to_vector<float>() == std::vector<float>{2, 3, 4});
  ext.fill_(0.0);
  CHECK(host == std::vector<float>{1, 0, 0, 0});
  CHECK(cpu_allocator() == allocator_for(Device::cpu()));
}
