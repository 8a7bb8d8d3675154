// CUDA elementwise and row-reduction kernels against the CPU backend (f64 on the very values
// the device holds), in every float dtype and layout path: vectorised dense, channels-last,
// strided views, misaligned offsets, broadcasting, in place. Outputs are pre-filled with NaN.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "cuda/kernels.h"
#include "ops/cpu/kernels.h"
#include "ops/ops.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gradcheck.h"

using namespace kiln;
using namespace kiln::gputest;

namespace {

const DType kFloat[] = {DType::f32, DType::f16, DType::f64, DType::bf16};

const UnaryOp kUnary[] = {UnaryOp::Neg, UnaryOp::Exp, UnaryOp::Log, UnaryOp::Sqrt,
                          UnaryOp::Relu, UnaryOp::Sigmoid, UnaryOp::Tanh, UnaryOp::PowScalar,
                          UnaryOp::AddScalar, UnaryOp::MulScalar, UnaryOp::RsubScalar,
                          UnaryOp::RdivScalar, UnaryOp::GtScalar, UnaryOp::Gelu,
                          UnaryOp::GeluTanh, UnaryOp::Silu};
const BinaryOp kBinary[] = {BinaryOp::AddScaled, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Pow,
                            BinaryOp::ReluBackward, BinaryOp::Eq, BinaryOp::GeluBackward,
                            BinaryOp::GeluTanhBackward, BinaryOp::SiluBackward};

bool positive_domain(UnaryOp op) {
  return op == UnaryOp::Log || op == UnaryOp::Sqrt || op == UnaryOp::PowScalar ||
         op == UnaryOp::RdivScalar;
}
double scalar_for(UnaryOp op) {
  switch (op) {
    case UnaryOp::PowScalar: return 2.5;
    case UnaryOp::AddScalar: return 0.75;
    case UnaryOp::MulScalar: return -1.5;
    case UnaryOp::RsubScalar: return 2.0;
    case UnaryOp::RdivScalar: return 3.0;
    case UnaryOp::GtScalar: return 0.25;
    default: return 0.0;
  }
}

// Runs cuda::unary on `a` (any layout) into a NaN-filled output of layout `fmt` and compares
// with cpu::unary in f64 on the same input values.
void check_unary(UnaryOp op, const Tensor& a, MemoryFormat fmt, const std::string& what) {
  const double s = scalar_for(op);
  Tensor out = nan_output(a.shape(), a.dtype(), fmt);
  cuda::unary(op, out, a, s);
  Tensor a64 = host_f64(a);
  Tensor want = empty(a.shape(), TensorOptions(DType::f64));
  cpu::unary(op, want, a64, s);
  check_close(out, want, tol_for(a.dtype()), what);
}

}  // namespace

TEST_CASE("unary: every op, dtype and layout path") {
  for (DType t : kFloat) {
    for (UnaryOp op : kUnary) {
      const std::string name = std::string(unary_name(op)) + " " + dtype_name(t);
      CAPTURE(name);
      const double lo = positive_domain(op) ? 0.5 : -3.0, hi = positive_domain(op) ? 2.0 : 3.0;
      // dense, with a vector tail (1027 is not a multiple of any vector width)
      Tensor a = gpu_tensor(uniform_values(1027, lo, hi, 1), {1027}, t);
      check_unary(op, a, MemoryFormat::Contiguous, name + " dense");
      // NHWC in and out: the flat path over channels-last memory
      Tensor c = gpu_tensor(uniform_values(2 * 3 * 4 * 5, lo, hi, 2), {2, 3, 4, 5}, t,
                            MemoryFormat::ChannelsLast);
      check_unary(op, c, MemoryFormat::ChannelsLast, name + " nhwc");
      // NHWC in, NCHW out: the strided path
      check_unary(op, c, MemoryFormat::Contiguous, name + " nhwc->nchw");
      // transposed view and a misaligned offset (one element in)
      Tensor m = gpu_tensor(uniform_values(33 * 17, lo, hi, 3), {33, 17}, t);
      check_unary(op, m.t(), MemoryFormat::Contiguous, name + " transposed");
      check_unary(op, m.flatten().narrow(0, 1, 500), MemoryFormat::Contiguous,
                  name + " misaligned");
    }
  }
}

TEST_CASE("unary in place (out aliases a)") {
  for (DType t : kFloat) {
    CAPTURE(dtype_name(t));
    std::vector<double> v = uniform_values(1000, -2, 2, 4);
    Tensor a = gpu_tensor(v, {1000}, t);
    Tensor want = empty({1000}, TensorOptions(DType::f64));
    cpu::unary(UnaryOp::MulScalar, want, host_f64(a), 3.0);
    cuda::unary(UnaryOp::MulScalar, a, a, 3.0);
    check_close(a, want, tol_for(t), "mul_ in place");
  }
}

TEST_CASE("binary: every op, dtype, broadcasting and layout") {
  struct Case {
    Shape a, b;
    MemoryFormat fa = MemoryFormat::Contiguous, fb = MemoryFormat::Contiguous;
  };
  const std::vector<Case> cases = {
      {{4099}, {4099}},
      {{3, 4}, {3, 4}},
      {{3, 4}, {4}},
      {{3, 1}, {1, 4}},
      {{2, 3, 4}, {3, 1}},
      {{4}, {2, 3, 4}},
      {{2, 3, 4, 5}, {2, 3, 4, 5}, MemoryFormat::ChannelsLast, MemoryFormat::ChannelsLast},
      {{2, 3, 4, 5}, {3, 1, 1}, MemoryFormat::ChannelsLast},
      {{2, 3, 4, 5}, {2, 3, 4, 5}, MemoryFormat::ChannelsLast, MemoryFormat::Contiguous},
  };
  for (DType t : kFloat) {
    for (BinaryOp op : kBinary) {
      for (size_t ci = 0; ci < cases.size(); ++ci) {
        const Case& c = cases[ci];
        const std::string name = std::string(binary_name(op)) + " " + dtype_name(t) + " " +
                                 shape_str(c.a) + " " + shape_str(c.b);
        CAPTURE(name);
        std::vector<double> va, vb;
        if (op == BinaryOp::Eq) {  // small integers so that equal pairs occur
          va = uniform_values(shape_numel(c.a), 0, 3, 10 + ci);
          vb = uniform_values(shape_numel(c.b), 0, 3, 20 + ci);
          for (auto& x : va) x = std::floor(x);
          for (auto& x : vb) x = std::floor(x);
        } else {
          const bool pos_a = op == BinaryOp::Pow, pos_b = op == BinaryOp::Div;
          va = uniform_values(shape_numel(c.a), pos_a ? 0.5 : -2, 2, 10 + ci);
          vb = uniform_values(shape_numel(c.b), pos_b ? 0.5 : -2, 2, 20 + ci);
        }
        Tensor a = gpu_tensor(va, c.a, t, c.fa), b = gpu_tensor(vb, c.b, t, c.fb);
        const Shape shape = F::broadcast_shapes(c.a, c.b, "test");
        const double alpha = op == BinaryOp::AddScaled ? -0.7 : 1.0;
        Tensor out = nan_output(shape, t, c.fa);
        cuda::binary(op, out, a.expand(shape), b.expand(shape), alpha);
        Tensor want = empty(shape, TensorOptions(DType::f64));
        cpu::binary(op, want, host_f64(a).expand(shape), host_f64(b).expand(shape), alpha);
        check_close(out, want, tol_for(t), name);
      }
    }
  }
}

TEST_CASE("binary in place with a broadcast operand (add_)") {
  Tensor self = gpu_tensor(uniform_values(24, -1, 1, 5), {2, 3, 4}, DType::f32);
  Tensor other = gpu_tensor(uniform_values(4, -1, 1, 6), {4}, DType::f32);
  Tensor want = empty({2, 3, 4}, TensorOptions(DType::f64));
  cpu::binary(BinaryOp::AddScaled, want, host_f64(self), host_f64(other).expand({2, 3, 4}), 2.0);
  cuda::binary(BinaryOp::AddScaled, self, self, other.expand({2, 3, 4}), 2.0);
  check_close(self, want, tol_for(DType::f32), "add_ in place");
}

TEST_CASE("reduce_rows: sum and max, warp and block paths, NaN propagation") {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 1}, {7, 1000}, {3, 5000}, {1000, 3}, {4, 0}, {2, 2048}};
  for (DType t : kFloat) {
    for (auto [rows, inner] : shapes) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max}) {
        const std::string name = std::string(op == ReduceOp::Sum ? "sum " : "max ") +
                                 dtype_name(t) + " " + std::to_string(rows) + "x" +
                                 std::to_string(inner);
        CAPTURE(name);
        std::vector<double> v = uniform_values(rows * inner, op == ReduceOp::Sum ? 0 : -1, 1, 7);
        if (op == ReduceOp::Max && rows > 1 && inner > 2)
          v[size_t(inner + inner / 2)] = std::numeric_limits<double>::quiet_NaN();  // row 1
        Tensor x = gpu_tensor(v, {rows, inner}, t);
        Tensor out = nan_output({rows}, t);
        cuda::reduce_rows(op, out, x, rows, inner);
        Tensor want = empty({rows}, TensorOptions(DType::f64));
        cpu::reduce_rows(op, want, host_f64(x), rows, inner);
        Tol tol = tol_for(t);
        if (t == DType::f32) tol.rtol = 1e-5 + 1e-7 * double(inner);  // f32 accumulation
        check_close(out, want, tol, name);
      }
    }
  }
}

TEST_CASE("reduce_cols: column sums of (outer, cols), against the CPU; the same bits every call") {
  // Few wide rows, many narrow ones (a channels-last bias gradient: N·H·W x 24), more columns
  // than a block (several tiles), a single row, a single column.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {3, 5}, {200003, 24}, {1000, 300}, {1, 7}, {4097, 1}, {64, 1000}};
  for (DType t : kFloat) {
    for (auto [outer, cols] : shapes) {
      const std::string name =
          std::string(dtype_name(t)) + " " + std::to_string(outer) + "x" + std::to_string(cols);
      CAPTURE(name);
      const Tensor x = gpu_tensor(uniform_values(outer * cols, -1, 1, 11), {outer, cols}, t);
      Tensor out = nan_output({cols}, t);
      cuda::reduce_cols(out, x, outer, cols);
      Tensor want = empty({cols}, TensorOptions(DType::f64));
      cpu::reduce_cols(want, host_f64(x), outer, cols);
      Tol tol = tol_for(t);
      tol.atol += 1e-6 * double(outer);  // f32 partial sums of values in [-1, 1]
      check_close(out, want, tol, name);
      Tensor again = nan_output({cols}, t);
      cuda::reduce_cols(again, x, outer, cols);
      CHECK(out.to(Device::cpu()).to_vector<double>() == again.to(Device::cpu()).to_vector<double>());
    }
  }
  // Through F::sum: a channels-last tensor summed over N, H, W takes this path and agrees with
  // the same values laid out NCHW (the transposing path).
  const Tensor cl = gpu_tensor(uniform_values(8 * 24 * 31 * 31, -1, 1, 5), {8, 24, 31, 31},
                               DType::f16)
                        .contiguous(MemoryFormat::ChannelsLast);
  const Tensor nchw = cl.contiguous();
  check_close(F::sum(cl, {0, 2, 3}), F::sum(nchw, {0, 2, 3}), tol_for(DType::f16),
              "channels-last sum over N, H, W");
}

TEST_CASE("max_rows: values and first maximal index; scatter_rows routes gradients") {
  for (DType t : kFloat) {
    for (auto [rows, inner] : std::vector<std::pair<int64_t, int64_t>>{
             {5, 7}, {64, 1000}, {3, 3000}, {1, 1}}) {
      const std::string name = std::string(dtype_name(t)) + " " + std::to_string(rows) + "x" +
                               std::to_string(inner);
      CAPTURE(name);
      // Integers 0..4: many ties, so "first maximal index" is really exercised.
      std::vector<double> v = uniform_values(rows * inner, 0, 5, 8);
      for (auto& x : v) x = std::floor(x);
      Tensor x = gpu_tensor(v, {rows, inner}, t);
      Tensor values = nan_output({rows}, t);
      Tensor indices = full({rows}, -7.0, gpu_opts(DType::i64));
      cuda::max_rows(values, indices, x, rows, inner);
      std::vector<double> wv, wi;
      for (int64_t r = 0; r < rows; ++r) {
        int64_t best = 0;
        for (int64_t i = 1; i < inner; ++i)
          if (v[size_t(r * inner + i)] > v[size_t(r * inner + best)]) best = i;
        wv.push_back(v[size_t(r * inner + best)]);
        wi.push_back(double(best));
      }
      CHECK(values.to_vector<double>() == wv);
      CHECK(indices.to_vector<double>() == wi);

      std::vector<double> g = uniform_values(rows, -1, 1, 9);
      Tensor gt = gpu_tensor(g, {rows}, t);
      Tensor dx = nan_output({rows, inner}, t);
      cuda::scatter_rows(dx, gt, indices, rows, inner);
      std::vector<double> gexact = gt.to_vector<double>();
      std::vector<double> want(size_t(rows * inner), 0.0);
      for (int64_t r = 0; r < rows; ++r) want[size_t(r * inner + int64_t(wi[size_t(r)]))] = gexact[size_t(r)];
      CHECK(dx.to_vector<double>() == want);
    }
  }
}

TEST_CASE("max_rows propagates NaN with its index") {
  std::vector<double> v = {1, 5, std::nan(""), 7, 2, 3};
  Tensor x = gpu_tensor(v, {2, 3}, DType::f32);
  Tensor values = nan_output({2}, DType::f32);
  Tensor indices = full({2}, -1.0, gpu_opts(DType::i64));
  cuda::max_rows(values, indices, x, 2, 3);
  auto vv = values.to_vector<double>();
  CHECK(std::isnan(vv[0]));
  CHECK(vv[1] == 7.0);
  CHECK(indices.to_vector<double>() == std::vector<double>{2, 0});
}

TEST_CASE("F:: elementwise and reductions dispatch to the device") {
  Tensor a = gpu_tensor(uniform_values(12, -1, 1, 12), {3, 4}, DType::f32);
  Tensor b = gpu_tensor(uniform_values(4, -1, 1, 13), {4}, DType::f32);
  Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  check_close(F::add(a, b, 0.5), F::add(ha, hb, 0.5), tol_for(DType::f32), "F::add");
  check_close(F::tanh(a), F::tanh(ha), tol_for(DType::f32), "F::tanh");
  check_close(F::sum(a, {0}), F::sum(ha, {0}), tol_for(DType::f32), "F::sum dim 0");
  check_close(F::mean(a), F::mean(ha), tol_for(DType::f32), "F::mean");
  CHECK(F::sum(a).is_cuda());
}

TEST_CASE("add_ on an i64 counter is exact (batch norm's num_batches_tracked)") {
  // 2^60 + 1 has no f64 representation: a round trip through f64 would lose the 1.
  Tensor h = empty({3}, TensorOptions(DType::i64));
  const int64_t big = (int64_t(1) << 60) + 1;
  h.data<int64_t>()[0] = big;
  h.data<int64_t>()[1] = -7;
  h.data<int64_t>()[2] = 0;
  Tensor g = h.to(Device::cuda(0));
  F::add_(g, 1.0);
  F::add_(g, 3.0);
  Tensor back = g.to(Device::cpu());
  CHECK(back.data<int64_t>()[0] == big + 4);
  CHECK(back.data<int64_t>()[1] == -3);
  CHECK(back.data<int64_t>()[2] == 4);
  CHECK_THROWS_AS(F::add_(g, 0.5), Error);
}

TEST_CASE("pad_channels4: the stem's 1-3 channels to 4, channels C.. zero") {
  struct Case {
    int64_t n, c, h, w;
  };
  // 3 channels with a pixel count divisible by 8 take the 8-pixel path; the rest one per thread.
  for (Case cs : {Case{2, 3, 8, 4}, Case{1, 3, 5, 3}, Case{2, 2, 6, 6}, Case{3, 1, 7, 5}}) {
    CAPTURE(cs.c);
    CAPTURE(cs.n * cs.h * cs.w);
    for (DType t : {DType::f16, DType::bf16}) {
      CAPTURE(dtype_name(t));
      Tensor src = randn({cs.n, cs.c, cs.h, cs.w}).to(t).to(Device::cuda(0))
                       .contiguous(MemoryFormat::ChannelsLast);
      Tensor dst = empty({cs.n, 4, cs.h, cs.w}, gpu_opts(t, MemoryFormat::ChannelsLast));
      dst.fill_(7.0);  // every element must be written
      REQUIRE(cuda::pad_channels4(dst, src));
      Tensor got = dst.to(Device::cpu()).to(DType::f32);
      Tensor want = zeros({cs.n, 4, cs.h, cs.w});
      want.narrow(1, 0, cs.c).copy_(src.to(Device::cpu()).to(DType::f32));
      KILN_CHECK_OK(testing::compare(got, want, 0, 0));
    }
  }
  // Pairs it does not take: it declines, and leaves dst alone.
  Tensor four = empty({1, 4, 2, 2}, gpu_opts(DType::f16, MemoryFormat::ChannelsLast));
  CHECK_FALSE(cuda::pad_channels4(four, randn({1, 4, 2, 2}).to(DType::f16).to(Device::cuda(0))));
  CHECK_FALSE(cuda::pad_channels4(four, randn({1, 3, 2, 2}).to(Device::cuda(0))));  // f32
  CHECK_FALSE(cuda::pad_channels4(four, randn({1, 3, 2, 2}).to(DType::f16).to(Device::cuda(0))));
}
