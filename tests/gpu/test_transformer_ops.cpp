// The transformer ops' CUDA kernels against the CPU reference (ops/cpu/), on the same values:
// layer norm forward and backward in every float dtype, dropout's mask bit for bit, embedding
// and where; linear_gelu's bias-GELU kernels against the composition; kiln's fused attention kernels against the composition (f16 and bf16, head_dim 64
// and 128, lengths that are not a multiple of the tile, causal or not, Lq != Lk),
// bit-reproducible, with cuDNN's attention path switched off (tests/gpu/test_cudnn_attention.cpp
// tests that one); and a step with dropout and attention (on whichever path the default picks)
// captured in a CUDA graph, replayed bit for bit equal to eager.
// Tolerances: layer norm within the dtype's (tol_for); attention's f16 forward 2e-3 relative to
// the largest output, its gradients 2e-2 (P and dS are rounded to 16 bits for the MMAs, as in
// FlashAttention-2), bf16 four times that.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>

#include "core/generator.h"
#include "cuda/cudnn_attention.h"
#include "cuda/graph.h"
#include "cuda/kernels.h"
#include "ops/cpu/kernels.h"
#include "ops/ops.h"
#include "tests/gpu/gpu_test_util.h"

using namespace kiln;
using namespace kiln::gputest;

namespace {

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::cpu()).contiguous(), y = b.to(Device::cpu()).contiguous();
  return x.dtype() == y.dtype() && x.shape() == y.shape() &&
         std::memcmp(x.raw_data(), y.raw_data(), size_t(x.nbytes())) == 0;
}

// max |got - want| / max |want| over the tensor (both widened to f64 on the host).
double rel_error(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = host_f64(got).to_vector<double>(), w = host_f64(want).to_vector<double>();
  double err = 0, scale = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    err = std::max(err, std::fabs(g[i] - w[i]));
    scale = std::max(scale, std::fabs(w[i]));
  }
  return err / std::max(scale, 1e-30);
}

}  // namespace

// Shapes for both paths of cuda/kernels/layer_norm.cu: rows in registers (f32/f16/bf16, cols a
// multiple of 8 up to 1024: one to four 16-byte vectors per lane, lanes holding fewer vectors
// than others at 384 and 520, one vector in all at 8 cols; 5000 and 9000 rows are more than one
// wave of warps on an H200, so warps sum several rows) and the generic kernels (33, 1032, 100
// in f16/bf16 — a register row in f32 —, and every f64 shape).
TEST_CASE("layer_norm: CUDA equals the CPU reference, forward and all three gradients") {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {7, 33},    {300, 768}, {3, 1024},  {1000, 768}, {257, 384}, {64, 1024},
      {5, 8},     {130, 520}, {5000, 768}, {9000, 64}, {40, 1032}, {50, 100}};
  for (DType dt : {DType::f32, DType::f16, DType::bf16, DType::f64})
    for (auto [rows, cols] : shapes) {
      const std::string dtype = dtype_name(dt);
      CAPTURE(dtype);
      CAPTURE(rows);
      CAPTURE(cols);
      const DType pt = dt == DType::f64 ? DType::f64 : DType::f32;
      const Tensor x = gpu_tensor(uniform_values(rows * cols, -2.0, 3.0, 1), {rows, cols}, dt);
      const Tensor w = gpu_tensor(uniform_values(cols, 0.5, 1.5, 2), {cols}, pt);
      const Tensor b = gpu_tensor(uniform_values(cols, -0.5, 0.5, 3), {cols}, pt);
      const Tensor dy = gpu_tensor(uniform_values(rows * cols, -1.0, 1.0, 4), {rows, cols}, dt);
      Tensor y = nan_output({rows, cols}, dt), mean = nan_output({rows}, pt), rstd = nan_output({rows}, pt);
      cuda::layer_norm_forward(y, mean, rstd, x, w, b, rows, cols, 1e-5);
      // The reference on the values the device holds, in f64.
      const Tensor xh = host_f64(x), wh = host_f64(w), bh = host_f64(b), gh = host_f64(dy);
      Tensor yr = empty({rows, cols}, TensorOptions(DType::f64)), mr = empty({rows}, TensorOptions(DType::f64)),
             rr = empty({rows}, TensorOptions(DType::f64));
      cpu::layer_norm_forward(yr, mr, rr, xh, wh, bh, rows, cols, 1e-5);
      check_close(host_f64(y), yr, tol_for(dt), "y");
      check_close(host_f64(mean), mr, tol_for(pt), "mean");
      check_close(host_f64(rstd), rr, {1e-5, 1e-5}, "rstd");
      Tensor dx = nan_output({rows, cols}, dt), dw = nan_output({cols}, pt), db = nan_output({cols}, pt);
      cuda::layer_norm_backward(dx, dw, db, dy, x, w, mean, rstd, rows, cols, GradientMode::Set,
                                GradientMode::Set);
      Tensor dxr = empty({rows, cols}, TensorOptions(DType::f64)), dwr = empty({cols}, TensorOptions(DType::f64)),
             dbr = empty({cols}, TensorOptions(DType::f64));
      cpu::layer_norm_backward(dxr, dwr, dbr, gh, xh, wh, host_f64(mean), host_f64(rstd), rows, cols,
                               GradientMode::Set, GradientMode::Set);
      const Tol big = dt == DType::f64 ? Tol{1e-10, 1e-10} : Tol{2e-3 * std::sqrt(double(rows)), 2e-3};
      check_close(host_f64(dx), dxr, dt == DType::bf16 ? Tol{3e-2, 3e-2} : tol_for(dt), "dx");
      check_close(host_f64(dw), dwr, big, "dweight");
      check_close(host_f64(db), dbr, big, "dbias");
      // `+=` adds onto what is there; a second run gives the same bits (fixed summation order).
      Tensor dw2 = dw.clone();
      cuda::layer_norm_backward(Tensor(), dw2, Tensor(), dy, x, w, mean, rstd, rows, cols,
                                GradientMode::Accumulate, GradientMode::Set);
      check_close(host_f64(dw2), F::mul(host_f64(dw), 2.0), tol_for(pt), "dweight +=");
      Tensor dw3 = nan_output({cols}, pt);
      cuda::layer_norm_backward(Tensor(), dw3, Tensor(), dy, x, w, mean, rstd, rows, cols,
                                GradientMode::Set, GradientMode::Set);
      CHECK(same_bits(dw3, dw));
      // dx added onto a partial sum (autograd's accumulate-into): the same bits as writing dx and
      // adding it with F::add; the parameter gradients unchanged by dx's mode.
      const Tensor prev = gpu_tensor(uniform_values(rows * cols, -1.0, 1.0, 5), {rows, cols}, dt);
      Tensor dx_acc = prev.clone(), dw4 = nan_output({cols}, pt), db4 = nan_output({cols}, pt);
      cuda::layer_norm_backward(dx_acc, dw4, db4, dy, x, w, mean, rstd, rows, cols,
                                GradientMode::Set, GradientMode::Accumulate);
      CHECK(same_bits(dx_acc, F::add(prev, dx)));
      CHECK(same_bits(dw4, dw));
      CHECK(same_bits(db4, db));
    }
}

// F::linear_gelu's CUDA path (the GEMM without its bias, cuda/kernels/bias_gelu.cu adding it in
// the GELU's pass and giving the bias gradient from the backward's) against the composition
// gelu(linear(x, w, b)) on the CPU in f64, on the values the device holds: 16-byte columns (256,
// 1024, and 40 in f16/bf16), one element at a time (45, and 40 in f32), rows that are not a
// multiple of the backward's row unroll; the bias gradient bit for bit the same when run again.
TEST_CASE("linear_gelu: the fused bias-GELU path against the composition on the CPU") {
  struct Case {
    int64_t rows, in, out;
  };
  for (DType dt : {DType::f32, DType::f16, DType::bf16})
    for (Case c : {Case{394, 64, 256}, Case{33, 24, 40}, Case{130, 16, 45}, Case{1001, 128, 1024}}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(c.rows);
      CAPTURE(c.in);
      CAPTURE(c.out);
      const Tensor x = gpu_tensor(uniform_values(c.rows * c.in, -1.0, 1.0, 11), {c.rows, c.in}, dt);
      const Tensor w = gpu_tensor(uniform_values(c.out * c.in, -0.3, 0.3, 12), {c.out, c.in}, dt);
      const Tensor b = gpu_tensor(uniform_values(c.out, -0.5, 0.5, 13), {c.out}, dt);
      const Tensor dout = gpu_tensor(uniform_values(c.rows * c.out, -1.0, 1.0, 14), {c.rows, c.out}, dt);
      REQUIRE(supports(backend(x), FastPath::BiasGelu, {&x, &w, &b}));
      auto run = [&] {
        Tensor xl = x.detach(), wl = w.detach(), bl = b.detach();
        for (const Tensor& t : {xl, wl, bl}) t.set_requires_grad(true);
        Tensor out = F::linear_gelu(xl, wl, bl);
        REQUIRE(out.grad_fn());
        CHECK(out.grad_fn()->name() == "LinearGeluBackward");
        out.backward(dout);
        return std::vector<Tensor>{out.detach(), xl.grad(), wl.grad(), bl.grad()};
      };
      const std::vector<Tensor> got = run();
      Tensor xr = host_f64(x), wr = host_f64(w), br = host_f64(b);
      for (const Tensor& t : {xr, wr, br}) t.set_requires_grad(true);
      Tensor ref = F::gelu(F::linear(xr, wr, br));
      ref.backward(host_f64(dout));
      const double fwd = dt == DType::f32 ? 1e-5 : dt == DType::f16 ? 3e-3 : 2e-2;
      const double bwd = dt == DType::f32 ? 1e-5 : dt == DType::f16 ? 1e-2 : 5e-2;
      CHECK(rel_error(got[0], ref.detach()) <= fwd);
      CHECK(rel_error(got[1], xr.grad()) <= bwd);
      CHECK(rel_error(got[2], wr.grad()) <= bwd);
      CHECK(rel_error(got[3], br.grad()) <= bwd);
      const std::vector<Tensor> again = run();
      for (size_t i = 0; i < got.size(); ++i) CHECK(same_bits(again[i], got[i]));
    }
  // f64 (no cuBLASLt GEMM either), and no bias: the backend declines, and the op composes
  // linear and gelu.
  const Tensor x = gpu_tensor(uniform_values(8 * 4, -1.0, 1.0, 15), {8, 4}, DType::f64);
  const Tensor w = gpu_tensor(uniform_values(6 * 4, -1.0, 1.0, 16), {6, 4}, DType::f64);
  const Tensor b = gpu_tensor(uniform_values(6, -1.0, 1.0, 17), {6}, DType::f64);
  CHECK_FALSE(supports(backend(x), FastPath::BiasGelu, {&x, &w, &b}));
  const Tensor x16 = x.to(DType::f16), none;
  Tensor w16 = w.to(DType::f16);
  CHECK_FALSE(supports(backend(x16), FastPath::BiasGelu, {&x16, &w16, &none}));
  w16.set_requires_grad(true);
  const Tensor out = F::linear_gelu(x16, w16, none);
  REQUIRE(out.grad_fn());
  CHECK(out.grad_fn()->name() != "LinearGeluBackward");
}

TEST_CASE("dropout: the CUDA mask is the CPU mask, element for element") {
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    const int64_t n = 100003;  // not a multiple of the Philox block
    const Tensor x = gpu_tensor(uniform_values(n, 0.5, 1.5, 5), {n}, dt);
    Tensor base = zeros({1}, gpu_opts(DType::i64)), offset = full({1}, 4096.0, gpu_opts(DType::i64));
    cuda::philox_advance(base, offset, n);
    CHECK(base.to(Device::cpu()).data<int64_t>()[0] == 4096);
    CHECK(offset.to(Device::cpu()).data<int64_t>()[0] == 4096 + (n + 3) / 4 * 4);
    Tensor y = nan_output({n}, dt);
    cuda::dropout(y, x, 0.3, 1234567, base);
    const Tensor xh = x.to(Device::cpu()).to(DType::f32), bh = base.to(Device::cpu());
    Tensor yr = empty({n}, TensorOptions(DType::f32));
    cpu::dropout(yr, xh, 0.3, 1234567, bh);
    // Same mask; kept values equal up to the dtype's rounding of x/(1-p).
    const auto g = host_f64(y).to_vector<double>(), w = yr.to_vector<double>();
    int64_t mask_diff = 0;
    for (int64_t i = 0; i < n; ++i) mask_diff += (g[size_t(i)] == 0) != (w[size_t(i)] == 0);
    CHECK(mask_diff == 0);
    check_close(host_f64(y), yr.to(DType::f64), tol_for(dt), "dropout values");
  }
}

TEST_CASE("embedding and where: CUDA equals the CPU") {
  const Tensor w = gpu_tensor(uniform_values(50 * 16, -1, 1, 6), {50, 16}, DType::f32);
  const Tensor idx = from_vector<int64_t>({3, 49, 0, 3, 7, 3}, {6}, DType::i64).to(kGpu);
  Tensor out = nan_output({6, 16}, DType::f32);
  cuda::embedding_forward(out, w, idx);
  Tensor outr = empty({6, 16}, TensorOptions(DType::f32));
  cpu::embedding_forward(outr, w.to(Device::cpu()), idx.to(Device::cpu()));
  CHECK(same_bits(out, outr));
  const Tensor g = gpu_tensor(uniform_values(6 * 16, -1, 1, 7), {6, 16}, DType::f32);
  Tensor dw = nan_output({50, 16}, DType::f32);
  cuda::embedding_backward(dw, g, idx, GradientMode::Set);
  Tensor dwr = empty({50, 16}, TensorOptions(DType::f32));
  cpu::embedding_backward(dwr, g.to(Device::cpu()), idx.to(Device::cpu()), GradientMode::Set);
  CHECK(same_bits(dw, dwr));  // the same adds in the same (index) order
  // An index outside the table reads a zero row on the device (no host check there).
  Tensor bad = nan_output({1, 16}, DType::f32);
  cuda::embedding_forward(bad, w, from_vector<int64_t>({50}, {1}, DType::i64).to(kGpu));
  CHECK(F::sum(F::mul(bad, bad)).item() == 0.0);

  const Tensor cond = from_vector<bool>({true, false, false, true, true}, {5}, DType::boolean).to(kGpu);
  const Tensor a = gpu_tensor({1, 2, 3, 4, 5}, {5}, DType::f16), b = gpu_tensor({-1, -2, -3, -4, -5}, {5}, DType::f16);
  CHECK(F::where(cond, a, b).to(DType::f64).to(Device::cpu()).to_vector<double>() ==
        std::vector<double>{1, -2, -3, 4, 5});
}

namespace {

struct AttnCase {
  int64_t b, h, lq, lk, d;
  bool causal;
};

// kiln's own attention kernels for a scope: the cuDNN path (on by default) would otherwise take
// the cases it supports.
class KilnAttentionKernels {
 public:
  KilnAttentionKernels() : prev_(cuda::cudnn_attention_enabled()) {
    cuda::set_cudnn_attention_enabled(false);
  }
  ~KilnAttentionKernels() { cuda::set_cudnn_attention_enabled(prev_); }
  KilnAttentionKernels(const KilnAttentionKernels&) = delete;
  KilnAttentionKernels& operator=(const KilnAttentionKernels&) = delete;

 private:
  bool prev_;
};

}  // namespace

TEST_CASE("scaled_dot_product_attention: the fused kernels against the composition") {
  KilnAttentionKernels kiln_kernels;
  const AttnCase cases[] = {{2, 3, 197, 197, 64, false}, {1, 2, 256, 256, 128, true},
                            {2, 2, 100, 300, 64, true},  {1, 4, 65, 33, 128, false},
                            {2, 1, 1, 70, 64, true},     {3, 2, 130, 130, 64, true}};
  for (DType dt : {DType::f16, DType::bf16})
    for (const AttnCase& c : cases) {
      CAPTURE(dtype_name(dt));
      CAPTURE(c.lq);
      CAPTURE(c.lk);
      CAPTURE(c.d);
      CAPTURE(c.causal);
      Generator gen(uint64_t(c.lq * 1000 + c.lk));
      auto make = [&](int64_t l) {
        return (randn({c.b, c.h, l, c.d}, DType::f32, &gen)).to(dt).to(kGpu).set_requires_grad(true);
      };
      Tensor q = make(c.lq), k = make(c.lk), v = make(c.lk);
      REQUIRE(supports(backend(q), FastPath::Attention, {&q, &k, &v}));
      Tensor out = F::scaled_dot_product_attention(q, k, v, c.causal);
      // The oracle: the composition in f32 on the GPU, from the same 16-bit values.
      Tensor q32 = q.detach().to(DType::f32).set_requires_grad(true),
             k32 = k.detach().to(DType::f32).set_requires_grad(true),
             v32 = v.detach().to(DType::f32).set_requires_grad(true);
      Tensor ref = F::scaled_dot_product_attention(q32, k32, v32, c.causal);
      const double f = dt == DType::bf16 ? 4.0 : 1.0;
      CHECK(rel_error(out, ref) < 2e-3 * f);
      const Tensor dout = randn(out.shape(), DType::f32, &gen).to(dt).to(kGpu);
      F::sum(F::mul(out, dout)).backward();
      F::sum(F::mul(ref, dout.to(DType::f32))).backward();
      CHECK(rel_error(q.grad(), q32.grad()) < 2e-2 * f);
      CHECK(rel_error(k.grad(), k32.grad()) < 2e-2 * f);
      CHECK(rel_error(v.grad(), v32.grad()) < 2e-2 * f);
      // Bit-reproducible, forward and backward.
      Tensor q2 = q.detach().set_requires_grad(true), k2 = k.detach().set_requires_grad(true),
             v2 = v.detach().set_requires_grad(true);
      Tensor out2 = F::scaled_dot_product_attention(q2, k2, v2, c.causal);
      F::sum(F::mul(out2, dout)).backward();
      CHECK(same_bits(out2, out));
      CHECK(same_bits(q2.grad(), q.grad()));
      CHECK(same_bits(k2.grad(), k.grad()));
      CHECK(same_bits(v2.grad(), v.grad()));
    }
}

TEST_CASE("packed_attention: fused forward and the one-tensor backward equal the composition") {
  KilnAttentionKernels kiln_kernels;
  Generator gen(8);
  for (DType dt : {DType::f16, DType::bf16})
    for (bool causal : {false, true}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(causal);
      const int64_t B = 2, L = 197, H = 3, D = 64;
      Tensor qkv = randn({B, L, 3, H, D}, DType::f32, &gen).to(dt).to(kGpu).set_requires_grad(true);
      Tensor out = F::packed_attention(qkv, causal);
      CHECK(out.shape() == Shape{B, L, H, D});
      Tensor q32 = qkv.detach().to(DType::f32).set_requires_grad(true);
      Tensor ref = F::packed_attention(q32, causal);  // f32: the composition
      const double f = dt == DType::bf16 ? 4.0 : 1.0;
      CHECK(rel_error(out, ref) < 2e-3 * f);
      const Tensor dout = randn(out.shape(), DType::f32, &gen).to(dt).to(kGpu);
      F::sum(F::mul(out, dout)).backward();
      F::sum(F::mul(ref, dout.to(DType::f32))).backward();
      CHECK(rel_error(qkv.grad(), q32.grad()) < 2e-2 * f);
    }
}

TEST_CASE("attention reading strided q, k, v from one projection; unsupported shapes compose") {
  KilnAttentionKernels kiln_kernels;
  // (B, L, 3, H, D) as the in-projection writes it: q, k, v are strided views, no copies.
  Generator gen(5);
  const int64_t B = 2, L = 50, H = 4, D = 64;
  Tensor qkv = randn({B, L, 3, H, D}, DType::f32, &gen).to(DType::f16).to(kGpu);
  auto part = [&](int64_t i) { return qkv.select(2, i).transpose(1, 2); };  // (B, H, L, D)
  Tensor q = part(0), k = part(1), v = part(2);
  REQUIRE(supports(backend(q), FastPath::Attention, {&q, &k, &v}));
  Tensor out = F::scaled_dot_product_attention(q, k, v);
  Tensor ref = F::scaled_dot_product_attention(q.to(DType::f32), k.to(DType::f32), v.to(DType::f32));
  CHECK(rel_error(out, ref) < 2e-3);
  // head_dim 32 and f32 take the composition.
  Tensor q32 = randn({1, 1, 8, 32}, DType::f32, &gen).to(DType::f16).to(kGpu);
  CHECK_FALSE(supports(backend(q32), FastPath::Attention, {&q32, &q32, &q32}));
  CHECK(F::scaled_dot_product_attention(q32, q32, q32).shape() == Shape{1, 1, 8, 32});
}

TEST_CASE("a step with dropout and attention in a CUDA graph replays equal to eager") {
  // One layer's worth: x -> layer_norm -> attention(x, x, x) -> dropout -> loss; the gradient of
  // x. Eager steps and graph replays from the same starting stream must agree bit for bit, and
  // every step must draw a new mask.
  Generator gen(9);
  const int64_t B = 2, H = 2, L = 70, D = 64;
  const Tensor x0 = randn({B, H, L, D}, DType::f32, &gen).to(DType::f16).to(kGpu);
  const Tensor w = ones({D}, gpu_opts(DType::f32)), b = zeros({D}, gpu_opts(DType::f32));
  Tensor x = x0.clone().set_requires_grad(true);
  Tensor loss_out = zeros({}, gpu_opts(DType::f32)), grad_out = zeros_like(x0);
  auto step = [&] {
    x.set_grad(Tensor());
    Tensor h = F::layer_norm(x, {D}, w, b);
    Tensor a = F::scaled_dot_product_attention(h, h, h);
    Tensor y = F::dropout(a, 0.2, true);
    Tensor loss = F::sum(F::mul(y.to(DType::f32), y.to(DType::f32)));
    loss.backward();
    NoGradGuard ng;
    loss_out.copy_(loss);
    grad_out.copy_(x.grad());
  };
  auto run = [&](bool graph, std::vector<Tensor>& losses, std::vector<Tensor>& grads) {
    manual_seed(3);
    std::unique_ptr<cuda::GraphStep> g;
    if (graph) g = std::make_unique<cuda::GraphStep>(step, cuda::GraphOptions{.warmup_steps = 2});
    for (int i = 0; i < 6; ++i) {
      if (g) g->run(); else step();
      if (g) g->synchronize();
      losses.push_back(loss_out.clone());
      grads.push_back(grad_out.clone());
    }
  };
  std::vector<Tensor> le, ge, lg, gg;
  run(false, le, ge);
  run(true, lg, gg);
  for (int i = 0; i < 6; ++i) {
    CAPTURE(i);
    CHECK(same_bits(lg[size_t(i)], le[size_t(i)]));
    CHECK(same_bits(gg[size_t(i)], ge[size_t(i)]));
  }
  CHECK_FALSE(same_bits(le[4], le[5]));  // a fresh mask every step
}
