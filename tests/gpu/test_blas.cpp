// cuBLASLt matmul and linear (cuda/blas.cpp) against the CPU backend in f64: all transpose
// combinations, batched, odd and ResNet-sized shapes, non-contiguous inputs and outputs; linear
// forward with and without bias (BIAS epilogue) and backward (BGRADB epilogue), f32 and f16.
// Outputs are pre-filled with NaN so an unwritten element fails.
#include <doctest/doctest.h>

#include <tuple>
#include <vector>

#include "core/generator.h"
#include "cuda/kernels.h"
#include "ops/ops.h"
#include "tests/gpu/ref_check.h"

using namespace kiln;
using namespace kiln::ref_check;

namespace {

// f32 GEMMs run with CUBLAS_COMPUTE_32F (no TF32), so f32 is held to f32 accuracy; f16 and bf16
// to their output's rounding.
double blas_tol(DType t) { return t == DType::f16 ? 1e-2 : t == DType::bf16 ? 6e-2 : 1e-5; }

// op(a) for a 2-D or 3-D CPU tensor.
Tensor op(const Tensor& a, bool trans) { return trans ? a.transpose(-2, -1) : a; }

void check_matmul(int64_t batch, int64_t m, int64_t k, int64_t n, bool ta, bool tb, DType dtype,
                  Generator& gen) {
  CAPTURE(batch);
  CAPTURE(m);
  CAPTURE(k);
  CAPTURE(n);
  CAPTURE(ta);
  CAPTURE(tb);
  CAPTURE(dtype_name(dtype));
  Shape sa = ta ? Shape{k, m} : Shape{m, k}, sb = tb ? Shape{n, k} : Shape{k, n}, so{m, n};
  if (batch > 0) {
    sa.insert(sa.begin(), batch);
    sb.insert(sb.begin(), batch);
    so.insert(so.begin(), batch);
  }
  Tensor a = rounded(randn(sa, DType::f64, &gen), dtype), b = rounded(randn(sb, DType::f64, &gen), dtype);
  Tensor ref = F::matmul(op(a, ta).contiguous(), op(b, tb).contiguous());
  Tensor out = nan_gpu(so, dtype);
  cuda::matmul(out, to_gpu(a, dtype), ta, to_gpu(b, dtype), tb);
  KILN_CHECK_OK(compare_scaled(out, ref, blas_tol(dtype)));
}

}  // namespace

TEST_CASE("matmul: every transpose combination, odd sizes, f32 and f16") {
  Generator gen(31);
  for (DType t : {DType::f32, DType::f16})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (auto [m, k, n] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
                 {1, 1, 1}, {5, 7, 3}, {33, 65, 17}, {64, 128, 96}, {256, 2048, 100}})
          check_matmul(0, m, k, n, ta, tb, t, gen);
}

TEST_CASE("matmul: batched") {
  Generator gen(32);
  for (DType t : {DType::f32, DType::f16})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        check_matmul(3, 4, 5, 6, ta, tb, t, gen);
        check_matmul(7, 32, 16, 48, ta, tb, t, gen);
      }
}

TEST_CASE("matmul: non-contiguous inputs and output") {
  Generator gen(33);
  Tensor a = randn({12, 10}, DType::f64, &gen), b = randn({10, 9}, DType::f64, &gen);
  Tensor ref = F::matmul(rounded(a, DType::f32), rounded(b, DType::f32));
  // a as a strided column slice of a wider matrix; the output buffer a transposed view.
  Tensor a_big = randn({12, 20}, DType::f64, &gen);
  a_big.narrow(1, 5, 10).copy_(a);
  Tensor a_view = to_gpu(a_big, DType::f32).narrow(1, 5, 10);  // (12, 10), row stride 20
  Tensor out_t = nan_gpu({9, 12}, DType::f32);
  Tensor out = out_t.t();  // (12, 9), column-major in memory
  cuda::matmul(out, a_view, false, to_gpu(b, DType::f32), false);
  KILN_CHECK_OK(compare_scaled(out, ref, 1e-5));
}

namespace {

void check_linear(int64_t n, int64_t in, int64_t out, bool with_bias, DType t, Generator& gen) {
  CAPTURE(dtype_name(t));
  CAPTURE(n);
  CAPTURE(in);
  CAPTURE(out);
  CAPTURE(with_bias);
  const double tol = blas_tol(t);
  Tensor x = rounded(randn({n, in}, DType::f64, &gen), t);
  Tensor w = rounded(randn({out, in}, DType::f64, &gen) * (1.0 / std::sqrt(double(in))), t);
  Tensor b = with_bias ? rounded(randn({out}, DType::f64, &gen), t) : Tensor();
  Tensor dy = rounded(randn({n, out}, DType::f64, &gen), t);
  // CPU reference with autograd.
  Tensor xl = x.detach(), wl = w.detach(), bl = with_bias ? b.detach() : Tensor();
  xl.set_requires_grad(true);
  wl.set_requires_grad(true);
  if (with_bias) bl.set_requires_grad(true);
  Tensor y_ref = F::linear(xl, wl, bl);
  y_ref.backward(dy);

  Tensor xg = to_gpu(x, t), wg = to_gpu(w, t), dyg = to_gpu(dy, t);
  Tensor bg = with_bias ? to_gpu(b, t) : Tensor();
  Tensor y = nan_gpu({n, out}, t);
  cuda::linear_forward(y, xg, wg, bg);
  KILN_CHECK_OK(compare_scaled(y, y_ref.detach(), tol));

  Tensor dx = nan_gpu({n, in}, t), dw = nan_gpu({out, in}, t);
  Tensor db = with_bias ? nan_gpu({out}, t) : Tensor();
  cuda::linear_backward(dx, dw, db, dyg, xg, wg);
  KILN_CHECK_OK(compare_scaled(dx, xl.grad(), tol));
  KILN_CHECK_OK(compare_scaled(dw, wl.grad(), tol));
  if (with_bias) {
    KILN_CHECK_OK(compare_scaled(db, bl.grad(), tol));
    // bias gradient alone (no dw: the GEMM-with-ones path) and dw alone
    Tensor db2 = nan_gpu({out}, t), dw2 = nan_gpu({out, in}, t);
    cuda::linear_backward(Tensor(), Tensor(), db2, dyg, xg, wg);
    KILN_CHECK_OK(compare_scaled(db2, bl.grad(), tol));
    cuda::linear_backward(Tensor(), dw2, Tensor(), dyg, xg, wg);
    KILN_CHECK_OK(compare_scaled(dw2, wl.grad(), tol));
  }
}

}  // namespace

TEST_CASE("linear: forward with and without bias, backward incl. bias gradient") {
  Generator gen(34);
  for (DType t : {DType::f32, DType::f16})
    for (auto [n, in, out] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {1, 1, 1}, {6, 10, 7}, {33, 17, 65}, {64, 2048, 1000}})
      for (bool with_bias : {false, true}) check_linear(n, in, out, with_bias, t, gen);
}

// A problem met for the first time is tuned (several algorithms timed, the fastest kept) or,
// with tuning off, takes the heuristic's first answer; either way every output is right. The
// shapes are a ViT block's (8 images of 197 tokens) and met nowhere else in this suite, so each
// mode chooses its own algorithms; f16 as in training, bf16 for its own kernels.
TEST_CASE("linear: tuned and untuned algorithms on transformer shapes") {
  Generator gen(35);
  for (bool tune : {true, false}) {
    CAPTURE(tune);
    cuda::set_gemm_tuning_enabled(tune);
    const int64_t n = tune ? 8 * 197 : 4 * 197;
    check_linear(n, 384, 1152, true, DType::f16, gen);
    check_linear(n, 1536, 384, true, DType::f16, gen);
    check_linear(n, 384, 1536, false, DType::bf16, gen);
  }
  cuda::set_gemm_tuning_enabled(true);
}
