// F::batch_norm_relu on the GPU: the fused cuDNN path (f16 NHWC, training) against the unfused
// composition batch_norm -> add -> relu computed in f32 on the GPU, forward, running statistics
// and every gradient, with and without the residual.
#include <doctest/doctest.h>

#include "ops/ops.h"
#include "tests/gradcheck.h"

using namespace kiln;

namespace {

const Device kGpu = Device::cuda(0);

Tensor gpu_leaf(const Tensor& host, DType t, bool nhwc) {
  Tensor g = host.to(t).to(kGpu);
  if (nhwc) g = g.contiguous(MemoryFormat::ChannelsLast);
  g = g.detach();
  g.set_requires_grad(true);
  return g;
}

}  // namespace

TEST_CASE("fused batch_norm_relu (and + residual) equals the unfused ops") {
  for (bool with_residual : {false, true}) {
    CAPTURE(with_residual);
    const Shape shape{8, 64, 7, 9};
    Tensor hx = randn(shape), hz = randn(shape), hdy = randn(shape);
    Tensor hw = uniform({64}, 0.5, 1.5), hb = uniform({64}, -0.5, 0.5);
    // Fused: f16 NHWC activations, f32 parameters.
    Tensor x = gpu_leaf(hx, DType::f16, true), z = gpu_leaf(hz, DType::f16, true);
    Tensor w = gpu_leaf(hw, DType::f32, false), b = gpu_leaf(hb, DType::f32, false);
    Tensor rm = zeros({64}, TensorOptions().with_device(kGpu)), rv = ones({64}, TensorOptions().with_device(kGpu));
    Tensor y = F::batch_norm_relu(x, with_residual ? z : Tensor(), w, b, rm, rv, true);
    CHECK(y.dtype() == DType::f16);
    CHECK(y.is_contiguous(MemoryFormat::ChannelsLast));
    if (y.grad_fn()) CHECK(y.grad_fn()->name().find("BatchNorm") != std::string::npos);
    y.backward(hdy.to(DType::f16).to(kGpu).contiguous(MemoryFormat::ChannelsLast));
    // Reference: the same f16-rounded inputs in f32, unfused.
    Tensor rx = gpu_leaf(hx.to(DType::f16), DType::f32, false);
    Tensor rz = gpu_leaf(hz.to(DType::f16), DType::f32, false);
    Tensor rw = gpu_leaf(hw, DType::f32, false), rb = gpu_leaf(hb, DType::f32, false);
    Tensor rrm = zeros({64}, TensorOptions().with_device(kGpu)), rrv = ones({64}, TensorOptions().with_device(kGpu));
    Tensor ry = F::batch_norm(rx, rw, rb, rrm, rrv, true);
    if (with_residual) ry = F::add(ry, rz);
    ry = F::relu(ry);
    ry.backward(hdy.to(DType::f16).to(DType::f32).to(kGpu));
    KILN_CHECK_OK(testing::compare(y.to(DType::f32), ry, 2e-2, 1e-2));
    KILN_CHECK_OK(testing::compare(rm, rrm, 1e-4, 1e-3));
    KILN_CHECK_OK(testing::compare(rv, rrv, 1e-4, 1e-3));
    KILN_CHECK_OK(testing::compare(x.grad().to(DType::f32), rx.grad(), 3e-2, 2e-2));
    KILN_CHECK_OK(testing::compare(w.grad(), rw.grad(), 5e-2, 1e-2));
    KILN_CHECK_OK(testing::compare(b.grad(), rb.grad(), 5e-2, 1e-2));
    if (with_residual) KILN_CHECK_OK(testing::compare(z.grad().to(DType::f32), rz.grad(), 3e-2, 2e-2));
  }
}

TEST_CASE("batch_norm_relu falls back to the composition for f32 and NCHW inputs") {
  Tensor x = randn({4, 8, 5, 5}, TensorOptions().with_device(kGpu));
  Tensor w = ones({8}, TensorOptions().with_device(kGpu)), b = zeros({8}, TensorOptions().with_device(kGpu));
  Tensor rm = zeros({8}, TensorOptions().with_device(kGpu)), rv = ones({8}, TensorOptions().with_device(kGpu));
  Tensor y = F::batch_norm_relu(x, x, w, b, rm, rv, true);
  Tensor want = F::relu(F::add(F::batch_norm(x, w, b, zeros_like(rm), ones_like(rv), true), x));
  KILN_CHECK_OK(testing::compare(y, want, 1e-5, 1e-5));
}
