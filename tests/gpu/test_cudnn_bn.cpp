// cuDNN batch norm (cuda/batchnorm.cpp) against the CPU backend in f64: training forward with
// saved statistics and running-stat updates, eval, backward; f32/f16, NCHW/NHWC, 2-D and 3-D
// inputs; fused BN+ReLU and BN+add+ReLU against the CPU reference and the unfused CUDA path.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "core/autograd.h"
#include "core/generator.h"
#include "cuda/kernels.h"
#include "ops/ops.h"
#include "tests/gpu/ref_check.h"

using namespace kiln;
using namespace kiln::ref_check;

namespace {

constexpr double kEps = 1e-5, kMomentum = 0.1;
constexpr auto kNHWC = MemoryFormat::ChannelsLast;
constexpr auto kNCHW = MemoryFormat::Contiguous;

// Per-channel mean and 1/sqrt(biased var + eps) of a CPU (N, C, ...) tensor, by plain loops.
void channel_stats(const Tensor& x, Tensor& mean, Tensor& invstd) {
  Tensor xc = x.contiguous();
  const int64_t n = x.size(0), c = x.size(1), inner = x.numel() / (n * c);
  std::vector<double> v = xc.to_vector<double>(), m(size_t(c), 0.0), s(size_t(c), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < c; ++j)
      for (int64_t k = 0; k < inner; ++k) m[size_t(j)] += v[size_t((i * c + j) * inner + k)];
  for (auto& e : m) e /= double(n * inner);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < c; ++j)
      for (int64_t k = 0; k < inner; ++k) {
        double d = v[size_t((i * c + j) * inner + k)] - m[size_t(j)];
        s[size_t(j)] += d * d;
      }
  for (auto& e : s) e = 1.0 / std::sqrt(e / double(n * inner) + kEps);
  mean = from_vector(m, {c}, DType::f64);
  invstd = from_vector(s, {c}, DType::f64);
}

struct Inputs {
  Tensor x, w, b, dy;  // f64 CPU, x and dy rounded to the data dtype, w and b to f32
};
Inputs make_inputs(const Shape& shape, DType dtype, Generator& gen) {
  const int64_t c = shape[1];
  Inputs in;
  in.x = rounded(randn(shape, DType::f64, &gen) * 2.0 + 0.5, dtype);
  in.w = rounded(uniform({c}, 0.5, 1.5, DType::f64, &gen), DType::f32);
  in.b = rounded(randn({c}, DType::f64, &gen), DType::f32);
  in.dy = rounded(randn(shape, DType::f64, &gen), dtype);
  return in;
}

// Gradients of sum(upstream * batch_norm(x)) on the CPU (training mode, batch statistics).
struct Grads {
  Tensor dx, dw, db;
};
Grads cpu_grads(const Inputs& in, const Tensor& upstream) {
  Tensor x = in.x.detach(), w = in.w.detach(), b = in.b.detach();
  for (const Tensor* t : {&x, &w, &b}) t->set_requires_grad(true);
  F::batch_norm(x, w, b, Tensor(), Tensor(), true, kMomentum, kEps).backward(upstream);
  return {x.grad(), w.grad(), b.grad()};
}

MemoryFormat fmt_for(const Shape& s, MemoryFormat want) { return s.size() == 4 ? want : kNCHW; }

void check_training_and_backward(const Shape& shape, DType dtype, MemoryFormat fmt, Generator& gen) {
  CAPTURE(shape_str(shape));
  CAPTURE(dtype_name(dtype));
  CAPTURE(fmt == kNHWC ? "NHWC" : "NCHW");
  const int64_t c = shape[1];
  const double tol = tol_for(dtype), stat_tol = dtype == DType::f16 ? 1e-3 : 1e-4;
  Inputs in = make_inputs(shape, dtype, gen);
  Tensor rm = rounded(uniform({c}, -1.0, 1.0, DType::f64, &gen), DType::f32);
  Tensor rv = rounded(uniform({c}, 0.5, 1.5, DType::f64, &gen), DType::f32);

  // CPU reference: output, running stats updated in place, batch statistics by loops.
  Tensor rm_ref = rm.clone(), rv_ref = rv.clone();
  Tensor y_ref = F::batch_norm(in.x, in.w, in.b, rm_ref, rv_ref, true, kMomentum, kEps);
  Tensor mean_ref, invstd_ref;
  channel_stats(in.x, mean_ref, invstd_ref);

  Tensor x = to_gpu(in.x, dtype, fmt), w = to_gpu(in.w, DType::f32), b = to_gpu(in.b, DType::f32);
  Tensor rm_g = to_gpu(rm, DType::f32), rv_g = to_gpu(rv, DType::f32);
  Tensor y = nan_gpu(shape, dtype, fmt);
  Tensor sm = nan_gpu({c}, DType::f32), si = nan_gpu({c}, DType::f32);
  cuda::batch_norm_forward_training(y, sm, si, x, w, b, rm_g, rv_g, kMomentum, kEps);
  KILN_CHECK_OK(compare_scaled(y, y_ref, tol));
  KILN_CHECK_OK(compare_scaled(sm, mean_ref, stat_tol));
  KILN_CHECK_OK(compare_scaled(si, invstd_ref, stat_tol));
  KILN_CHECK_OK(compare_scaled(rm_g, rm_ref, stat_tol));
  KILN_CHECK_OK(compare_scaled(rv_g, rv_ref, stat_tol));  // unbiased variance in the update

  // Backward with all outputs, then with dx only.
  Grads g = cpu_grads(in, in.dy);
  Tensor dy = to_gpu(in.dy, dtype, fmt);
  Tensor dx = nan_gpu(shape, dtype, fmt), dw = nan_gpu({c}, DType::f32), db = nan_gpu({c}, DType::f32);
  cuda::batch_norm_backward(dx, dw, db, dy, x, w, sm, si);
  KILN_CHECK_OK(compare_scaled(dx, g.dx, tol));
  KILN_CHECK_OK(compare_scaled(dw, g.dw, tol));
  KILN_CHECK_OK(compare_scaled(db, g.db, tol));
  Tensor dx2 = nan_gpu(shape, dtype, fmt);
  cuda::batch_norm_backward(dx2, Tensor(), Tensor(), dy, x, w, sm, si);
  KILN_CHECK_OK(compare_scaled(dx2, g.dx, tol));

  // Eval with the updated running statistics.
  Tensor ye_ref = F::batch_norm(in.x, in.w, in.b, rm_ref, rv_ref, false, kMomentum, kEps);
  Tensor ye = nan_gpu(shape, dtype, fmt);
  cuda::batch_norm_forward_eval(ye, x, w, b, rm_g, rv_g, kEps);
  KILN_CHECK_OK(compare_scaled(ye, ye_ref, tol));
}

}  // namespace

TEST_CASE("batch_norm: training, running stats, backward, eval vs CPU (4-D)") {
  Generator gen(21);
  for (Shape s : {Shape{4, 64, 8, 8}, Shape{3, 32, 5, 7}, Shape{2, 256, 4, 4}})
    for (DType t : {DType::f32, DType::f16})
      for (MemoryFormat f : {kNCHW, kNHWC}) check_training_and_backward(s, t, f, gen);
}

TEST_CASE("batch_norm: (N, C) and (N, C, L) inputs") {
  Generator gen(22);
  for (Shape s : {Shape{16, 24}, Shape{4, 6, 10}})
    for (DType t : {DType::f32, DType::f16}) check_training_and_backward(s, t, fmt_for(s, kNCHW), gen);
}

TEST_CASE("batch_norm: without running stats, weight or bias") {
  Generator gen(23);
  Inputs in = make_inputs({4, 8, 3, 3}, DType::f32, gen);
  Tensor y_ref = F::batch_norm(in.x, Tensor(), Tensor(), Tensor(), Tensor(), true, kMomentum, kEps);
  Tensor y = nan_gpu({4, 8, 3, 3}, DType::f32);
  Tensor sm = nan_gpu({8}, DType::f32), si = nan_gpu({8}, DType::f32);
  cuda::batch_norm_forward_training(y, sm, si, to_gpu(in.x, DType::f32), Tensor(), Tensor(),
                                    Tensor(), Tensor(), kMomentum, kEps);
  KILN_CHECK_OK(compare_scaled(y, y_ref, 1e-4));
}

TEST_CASE("batch_norm: fused ReLU and add+ReLU vs CPU and vs unfused (NHWC f16)") {
  Generator gen(24);
  const Shape shape{4, 64, 8, 8};
  const int64_t c = 64;
  const DType h = DType::f16;
  for (bool add : {false, true}) {
    CAPTURE(add);
    Inputs in = make_inputs(shape, h, gen);
    Tensor z = rounded(randn(shape, DType::f64, &gen), h);
    Tensor x = to_gpu(in.x, h, kNHWC), zg = to_gpu(z, h, kNHWC), dy = to_gpu(in.dy, h, kNHWC);
    Tensor w = to_gpu(in.w, DType::f32), b = to_gpu(in.b, DType::f32);
    Tensor rm = zeros({c}, DType::f32).to(Device::cuda()), rv = ones({c}, DType::f32).to(Device::cuda());

    Tensor y = nan_gpu(shape, h, kNHWC), sm = nan_gpu({c}, DType::f32), si = nan_gpu({c}, DType::f32);
    Tensor reserve = add ? cuda::batch_norm_add_relu_forward_training(y, sm, si, x, zg, w, b, rm, rv,
                                                                      kMomentum, kEps)
                         : cuda::batch_norm_relu_forward_training(y, sm, si, x, w, b, rm, rv,
                                                                  kMomentum, kEps);
    REQUIRE(reserve.defined());
    // CPU f64 reference.
    Tensor pre = F::batch_norm(in.x, in.w, in.b, Tensor(), Tensor(), true, kMomentum, kEps);
    if (add) pre = F::add(pre, z);
    KILN_CHECK_OK(compare_scaled(y, F::relu(pre), 1e-2));
    // Unfused CUDA: plain BN, then add and ReLU on the host.
    Tensor yu = nan_gpu(shape, h, kNHWC), smu = nan_gpu({c}, DType::f32), siu = nan_gpu({c}, DType::f32);
    cuda::batch_norm_forward_training(yu, smu, siu, x, w, b, Tensor(), Tensor(), kMomentum, kEps);
    Tensor yu_host = to_cpu64(yu);
    if (add) yu_host = F::add(yu_host, z);
    KILN_CHECK_OK(compare_scaled(y, F::relu(yu_host), 1e-2));
    KILN_CHECK_OK(compare_scaled(sm, to_cpu64(smu), 1e-5));
    KILN_CHECK_OK(compare_scaled(si, to_cpu64(siu), 1e-5));

    // Backward. The ReLU mask is taken from the fused output, so elements at the kink cannot
    // make the references disagree.
    Tensor mask = F::gt(to_cpu64(y), 0.0).to(DType::f64);
    Tensor dy_masked = F::mul(in.dy, mask);
    Grads g = cpu_grads(in, dy_masked);
    Tensor dx = nan_gpu(shape, h, kNHWC), dz = nan_gpu(shape, h, kNHWC);
    Tensor dw = nan_gpu({c}, DType::f32), db = nan_gpu({c}, DType::f32);
    Tensor yf = y;
    if (add) {
      cuda::batch_norm_add_relu_backward(dx, dz, dw, db, dy, x, yf, w, b, sm, si, reserve, kEps);
      KILN_CHECK_OK(compare_scaled(dz, dy_masked, 1e-3));
    } else {
      cuda::batch_norm_relu_backward(dx, dw, db, dy, x, yf, w, b, sm, si, reserve, kEps);
    }
    KILN_CHECK_OK(compare_scaled(dx, g.dx, 1e-2));
    KILN_CHECK_OK(compare_scaled(dw, g.dw, 1e-2));
    KILN_CHECK_OK(compare_scaled(db, g.db, 1e-2));
    // Unfused CUDA backward of the masked gradient.
    Tensor dxu = nan_gpu(shape, h, kNHWC), dwu = nan_gpu({c}, DType::f32), dbu = nan_gpu({c}, DType::f32);
    cuda::batch_norm_backward(dxu, dwu, dbu, to_gpu(dy_masked, h, kNHWC), x, w, sm, si);
    KILN_CHECK_OK(compare_scaled(dx, to_cpu64(dxu), 1e-2));
    KILN_CHECK_OK(compare_scaled(dw, to_cpu64(dwu), 1e-3));
    KILN_CHECK_OK(compare_scaled(db, to_cpu64(dbu), 1e-3));
    // accumulate_params (autograd's accumulate-into): dweight and dbias added onto what is
    // there (cuDNN's betaParamDiff = 1), dx and dz still overwritten; and with dbias undefined.
    Tensor base_w = to_gpu(randn({c}, DType::f64, &gen), DType::f32);
    Tensor base_b = to_gpu(randn({c}, DType::f64, &gen), DType::f32);
    Tensor dwa = base_w.clone(), dba = base_b.clone(), dxa = nan_gpu(shape, h, kNHWC);
    Tensor dza = nan_gpu(shape, h, kNHWC), dwo = base_w.clone();
    if (add) {
      cuda::batch_norm_add_relu_backward(dxa, dza, dwa, dba, dy, x, yf, w, b, sm, si, reserve,
                                         kEps, /*accumulate_params=*/true);
      KILN_CHECK_OK(compare_scaled(dza, to_cpu64(dz), 0));
      cuda::batch_norm_add_relu_backward(dxa, dza, dwo, Tensor(), dy, x, yf, w, b, sm, si,
                                         reserve, kEps, true);
    } else {
      cuda::batch_norm_relu_backward(dxa, dwa, dba, dy, x, yf, w, b, sm, si, reserve, kEps, true);
      cuda::batch_norm_relu_backward(dxa, dwo, Tensor(), dy, x, yf, w, b, sm, si, reserve, kEps,
                                     true);
    }
    KILN_CHECK_OK(compare_scaled(dxa, to_cpu64(dx), 1e-3));  // cuDNN may add in another order
    KILN_CHECK_OK(compare_scaled(dwa, F::add(to_cpu64(base_w), to_cpu64(dw)), 1e-5));
    KILN_CHECK_OK(compare_scaled(dba, F::add(to_cpu64(base_b), to_cpu64(db)), 1e-5));
    KILN_CHECK_OK(compare_scaled(dwo, to_cpu64(dwa), 1e-5));
  }
}

TEST_CASE("batch_norm: fused variants refuse anything but NHWC f16") {
  const Shape shape{2, 8, 4, 4};
  Tensor w = ones({8}, DType::f32).to(Device::cuda()), b = zeros({8}, DType::f32).to(Device::cuda());
  Tensor sm = nan_gpu({8}, DType::f32), si = nan_gpu({8}, DType::f32);
  Tensor x32 = nan_gpu(shape, DType::f32, kNHWC), y32 = nan_gpu(shape, DType::f32, kNHWC);
  CHECK_THROWS_AS(cuda::batch_norm_relu_forward_training(y32, sm, si, x32, w, b, Tensor(), Tensor(),
                                                         kMomentum, kEps),
                  Error);
  Tensor xn = nan_gpu(shape, DType::f16, kNCHW), yn = nan_gpu(shape, DType::f16, kNCHW);
  CHECK_THROWS_AS(cuda::batch_norm_add_relu_forward_training(yn, sm, si, xn, xn, w, b, Tensor(),
                                                             Tensor(), kMomentum, kEps),
                  Error);
}

TEST_CASE("batch_norm_relu: autograd adds dweight and dbias into a pre-filled .grad, same as without") {
  // The fused cuDNN path's node takes the parameters' .grad as its accumulate-into target (as
  // the fused optimizer's arena offers it): cuDNN adds onto it (betaParamDiff = 1), and every
  // gradient matches the run that returns fresh ones and adds them after.
  Generator gen(31);
  const Shape shape{4, 64, 8, 8};
  Tensor x0 = randn(shape, DType::f64, &gen), z0 = randn(shape, DType::f64, &gen);
  Tensor dy0 = randn(shape, DType::f64, &gen);
  Tensor w0 = F::add(F::mul(randn({64}, DType::f64, &gen), 0.25), 1.0);
  Tensor b0 = randn({64}, DType::f64, &gen), gw0 = randn({64}, DType::f64, &gen);
  Tensor gb0 = randn({64}, DType::f64, &gen);
  for (bool add : {false, true}) {
    CAPTURE(add);
    std::vector<Tensor> results[2];
    for (bool on : {false, true}) {
      const bool prev = autograd::accumulate_into_enabled();
      autograd::set_accumulate_into_enabled(on);
      autograd::reset_accumulate_stats();
      Tensor x = to_gpu(x0, DType::f16, kNHWC).set_requires_grad(true);
      Tensor z = to_gpu(z0, DType::f16, kNHWC).set_requires_grad(true);
      Tensor w = to_gpu(w0, DType::f32).set_requires_grad(true);
      Tensor b = to_gpu(b0, DType::f32).set_requires_grad(true);
      w.set_grad(to_gpu(gw0, DType::f32));
      b.set_grad(to_gpu(gb0, DType::f32));
      Tensor rm = zeros({64}, DType::f32).to(Device::cuda());
      Tensor rv = ones({64}, DType::f32).to(Device::cuda());
      Tensor y = F::batch_norm_relu(x, add ? z : Tensor(), w, b, rm, rv, true);
      autograd::backward({y}, {to_gpu(dy0, DType::f16, kNHWC)}, false);
      const auto st = autograd::accumulate_stats();
      autograd::set_accumulate_into_enabled(prev);
      if (on) {
        CHECK(st.offered_leaf == 2);  // w.grad and b.grad
        CHECK(st.used == 2);
      }
      for (const Tensor& t : {x, w, b}) results[on].push_back(to_cpu64(t.grad()));
      if (add) results[on].push_back(to_cpu64(z.grad()));
    }
    for (size_t i = 0; i < results[0].size(); ++i) {
      CAPTURE(i);
      KILN_CHECK_OK(compare_scaled(results[1][i], results[0][i], 1e-3));
    }
  }
}
