// cuDNN's fused attention (cuda/cudnn_attention.h) against kiln's own attention kernels and the
// f32 composition, through the CUDA table's attention entries (what F::packed_attention and
// F::scaled_dot_product_attention call) with the path switched on and off; the layouts the ViT
// passes (q, k, v views of one (B, L, 3, H, D) projection, out and dout (B, L, H, D), dq, dk, dv
// into one (B, L, 3, H, D) gradient) and contiguous (B, H, L, D); L 197 and 128, head dim 64 and
// 128, f16 and bf16. Then: both ops end to end, a captured forward + backward replayed bit for
// bit equal to eager, a plan search refused during capture, and the cases cuDNN does not take
// (causal, Lq != Lk, an untried stride pattern, f32), which run kiln's kernels bit for bit.
//
// Tolerances, as max |diff| over max |reference| (NaN fails): out 2e-3, dq/dk/dv 2e-2, four
// times that in bf16 — the bounds kiln's kernels meet against the f32 composition
// (tests/gpu/test_transformer_ops.cpp): both paths round P (and dS) to 16 bits for their MMAs,
// in different orders, so each lies within them of the composition and the two within them of
// each other (kiln-sdpa-probe measured max |diff| 5e-4 in f16, 2e-3 in bf16 at ViT-B/16's shape,
// values of order 1). lse is f32 from the same 16-bit inputs: the two differ only by summation
// order and exp's rounding (1e-6 measured), so 1e-4 + 1e-5·|lse|; the wrong base (log2) or a
// missing scale moves it by more than 0.1.
//
// cuDNN is required to run where the probe ran it (sm_90, cuDNN 9): elsewhere a case it does not
// take is reported (MESSAGE) and still compared.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "core/generator.h"
#include "cuda/check.h"
#include "cuda/cudnn_attention.h"
#include "cuda/graph.h"
#include "cuda/runtime.h"
#include "ops/ops.h"
#include "tests/gpu/gpu_test_util.h"

using namespace kiln;
using namespace kiln::gputest;

namespace {

// Sets the cuDNN path for a scope, restoring the previous setting.
class CudnnAttention {
 public:
  explicit CudnnAttention(bool on) : prev_(cuda::cudnn_attention_enabled()) {
    cuda::set_cudnn_attention_enabled(on);
  }
  ~CudnnAttention() { cuda::set_cudnn_attention_enabled(prev_); }
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

 private:
  bool prev_;
};

// Where kiln-sdpa-probe ran cuDNN's graphs (an H200, cuDNN 9.14): there the path must run.
bool cudnn_required() { return cuda::context().props.major == 9 && cudnnGetVersion() >= 90000; }

// Checks that the calls between `before` and now ran `fwd` forwards and `bwd` backwards on
// cuDNN — required where cudnn_required(), reported elsewhere.
void check_cudnn_ran(const cuda::CudnnAttentionStats& before, uint64_t fwd, uint64_t bwd) {
  const cuda::CudnnAttentionStats now = cuda::cudnn_attention_stats();
  const bool ran = now.forward_runs - before.forward_runs == fwd &&
                   now.backward_runs - before.backward_runs == bwd;
  if (cudnn_required())
    CHECK_MESSAGE(ran, "cuDNN ran ", now.forward_runs - before.forward_runs, " forwards and ",
                  now.backward_runs - before.backward_runs, " backwards, expected ", fwd, " and ",
                  bwd, " (stderr says why a plan is unavailable)");
  else if (!ran)
    MESSAGE("cuDNN's attention did not run here (sm_", cuda::context().props.major,
            cuda::context().props.minor, ", cuDNN ", cudnnGetVersion(), "): compared anyway");
}

void check_cudnn_idle(const cuda::CudnnAttentionStats& before) {
  const cuda::CudnnAttentionStats now = cuda::cudnn_attention_stats();
  CHECK(now.forward_runs == before.forward_runs);
  CHECK(now.backward_runs == before.backward_runs);
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::cpu()).contiguous(), y = b.to(Device::cpu()).contiguous();
  return x.dtype() == y.dtype() && x.shape() == y.shape() &&
         std::memcmp(x.raw_data(), y.raw_data(), size_t(x.nbytes())) == 0;
}

// max |got - want| / max |want|; infinite when either holds a NaN (an element never written).
double rel_error(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = host_f64(got).to_vector<double>(),
                            w = host_f64(want).to_vector<double>();
  REQUIRE(g.size() == w.size());
  double err = 0, scale = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(g[i]) || std::isnan(w[i])) return std::numeric_limits<double>::infinity();
    err = std::max(err, std::fabs(g[i] - w[i]));
    scale = std::max(scale, std::fabs(w[i]));
  }
  return err / std::max(scale, 1e-30);
}

bool all_finite(const Tensor& t) {
  for (double x : host_f64(t).to_vector<double>())
    if (!std::isfinite(x)) return false;
  return true;
}

// max over elements of |got - want| - rel·|want| (≤ abs passes); infinite on NaN.
double lse_excess(const Tensor& got, const Tensor& want, double rel) {
  const std::vector<double> g = host_f64(got).to_vector<double>(),
                            w = host_f64(want).to_vector<double>();
  REQUIRE(g.size() == w.size());
  double worst = -std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(g[i]) || std::isnan(w[i])) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, std::fabs(g[i] - w[i]) - rel * std::fabs(w[i]));
  }
  return worst;
}

enum class Layout { Packed, Bhsd };

// One problem's operands: q, k, v, dout (B, H, L, D) views in the layout, drawn once.
struct Problem {
  int64_t b, h, l, d;
  DType dt;
  Layout layout;
  Tensor q, k, v, dout;
  double scale() const { return 1.0 / std::sqrt(double(d)); }

  // (B, H, L, D) NaN-filled outputs in the layout: dq, dk, dv (parts of one (B, L, 3, H, D)
  // tensor when packed) and out ((B, L, H, D) memory when packed).
  Tensor out_like() const {
    if (layout == Layout::Packed) return nan_output({b, l, h, d}, dt).transpose(1, 2);
    return nan_output({b, h, l, d}, dt);
  }
  std::array<Tensor, 3> grads_like() const {
    if (layout == Layout::Packed) {
      const Tensor g = nan_output({b, l, 3, h, d}, dt);
      return {g.select(2, 0).transpose(1, 2), g.select(2, 1).transpose(1, 2),
              g.select(2, 2).transpose(1, 2)};
    }
    return {nan_output({b, h, l, d}, dt), nan_output({b, h, l, d}, dt),
            nan_output({b, h, l, d}, dt)};
  }
};

Problem make_problem(int64_t b, int64_t h, int64_t l, int64_t d, DType dt, Layout layout,
                     uint64_t seed) {
  Generator gen(seed);
  Problem p{b, h, l, d, dt, layout, {}, {}, {}, {}};
  auto draw = [&](const Shape& s) { return randn(s, DType::f32, &gen).to(dt).to(kGpu); };
  if (layout == Layout::Packed) {
    const Tensor qkv = draw({b, l, 3, h, d});
    p.q = qkv.select(2, 0).transpose(1, 2);
    p.k = qkv.select(2, 1).transpose(1, 2);
    p.v = qkv.select(2, 2).transpose(1, 2);
    p.dout = draw({b, l, h, d}).transpose(1, 2);
  } else {
    p.q = draw({b, h, l, d});
    p.k = draw({b, h, l, d});
    p.v = draw({b, h, l, d});
    p.dout = draw({b, h, l, d});
  }
  return p;
}

struct Result {
  Tensor out, lse, dq, dk, dv;
};

// The table's forward, then its backward on that forward's out and lse (as the ops' nodes do).
Result run_table(const Problem& p, bool causal = false) {
  const AttentionPaths& a = *backend(p.q).attention;
  Result r;
  r.out = p.out_like();
  r.lse = nan_output({p.b, p.h, p.l}, DType::f32);
  a.forward(r.out, r.lse, p.q, p.k, p.v, p.scale(), causal);
  auto [dq, dk, dv] = p.grads_like();
  a.backward(dq, dk, dv, p.dout, p.q, p.k, p.v, r.out, r.lse, p.scale(), causal);
  r.dq = dq;
  r.dk = dk;
  r.dv = dv;
  return r;
}

// The f32 composition from the same 16-bit values: out and the gradients for dout.
Result run_reference(const Problem& p) {
  Tensor q = p.q.to(DType::f32).detach().set_requires_grad(true),
         k = p.k.to(DType::f32).detach().set_requires_grad(true),
         v = p.v.to(DType::f32).detach().set_requires_grad(true);
  Result r;
  r.out = F::scaled_dot_product_attention(q, k, v);
  r.out.backward(p.dout.to(DType::f32));
  r.dq = q.grad();
  r.dk = k.grad();
  r.dv = v.grad();
  return r;
}

}  // namespace

TEST_CASE("cuDNN attention equals kiln's kernels and the composition: out, lse, dq, dk, dv") {
  struct Size {
    int64_t b, h, l, d;
  };
  const Size sizes[] = {{2, 3, 197, 64}, {2, 3, 128, 64}, {2, 2, 197, 128}, {2, 2, 128, 128}};
  for (DType dt : {DType::f16, DType::bf16})
    for (Layout layout : {Layout::Packed, Layout::Bhsd})
      for (const Size& s : sizes) {
        CAPTURE(dtype_name(dt));
        CAPTURE(layout == Layout::Packed ? "packed (B, L, 3, H, D)" : "contiguous (B, H, L, D)");
        CAPTURE(s.l);
        CAPTURE(s.d);
        const Problem p = make_problem(s.b, s.h, s.l, s.d, dt, layout, uint64_t(s.l * 1000 + s.d));
        REQUIRE(supports(backend(p.q), FastPath::Attention, {&p.q, &p.k, &p.v}));
        Result kiln, cudnn, again;
        {
          CudnnAttention off(false);
          const cuda::CudnnAttentionStats before = cuda::cudnn_attention_stats();
          kiln = run_table(p);
          check_cudnn_idle(before);
        }
        {
          CudnnAttention on(true);
          const cuda::CudnnAttentionStats before = cuda::cudnn_attention_stats();
          cudnn = run_table(p);
          again = run_table(p);
          check_cudnn_ran(before, 2, 2);
        }
        const Result ref = run_reference(p);
        const double f = dt == DType::bf16 ? 4.0 : 1.0;
        CHECK(rel_error(cudnn.out, kiln.out) < 2e-3 * f);
        CHECK(lse_excess(cudnn.lse, kiln.lse, 1e-5) <= 1e-4);
        CHECK(rel_error(cudnn.dq, kiln.dq) < 2e-2 * f);
        CHECK(rel_error(cudnn.dk, kiln.dk) < 2e-2 * f);
        CHECK(rel_error(cudnn.dv, kiln.dv) < 2e-2 * f);
        CHECK(rel_error(cudnn.out, ref.out) < 2e-3 * f);
        CHECK(rel_error(cudnn.dq, ref.dq) < 2e-2 * f);
        CHECK(rel_error(cudnn.dk, ref.dk) < 2e-2 * f);
        CHECK(rel_error(cudnn.dv, ref.dv) < 2e-2 * f);
        // Deterministic: the same bits again (dQ is written directly, no atomics).
        CHECK(same_bits(again.out, cudnn.out));
        CHECK(same_bits(again.lse, cudnn.lse));
        CHECK(same_bits(again.dq, cudnn.dq));
        CHECK(same_bits(again.dk, cudnn.dk));
        CHECK(same_bits(again.dv, cudnn.dv));
      }
}

TEST_CASE("cuDNN attention's backward stays finite where every score of a row is very negative") {
  // Every scaled score is near -120, so every row's log-sum-exp is near -115 and exp(-lse)
  // overflows f32. cuDNN's Hopper backward (9.14) scores the padded tail of the last 128-wide key
  // tile as 0, not -inf, so there P = exp(-lse) = inf and dQ = dS·K got inf·0 = NaN; the tail
  // mask (sdpa::tail_mask_needed) keeps it out. In training this showed as vit_s_16 and vit_b_16
  // steps the loss scaler skipped (docs/lab/transformer.md). L 197 needs the mask, 256 does not.
  for (DType dt : {DType::f16, DType::bf16})
    for (Layout layout : {Layout::Packed, Layout::Bhsd})
      for (int64_t l : {197, 256}) {
        CAPTURE(dtype_name(dt));
        CAPTURE(layout == Layout::Packed ? "packed (B, L, 3, H, D)" : "contiguous (B, H, L, D)");
        CAPTURE(l);
        const Problem p = make_problem(2, 2, l, 64, dt, layout, uint64_t(l) + 31);
        p.q.mul_(0.1);
        p.k.mul_(0.1);
        p.q.select(3, 0).fill_(1.0);
        p.k.select(3, 0).fill_(-120.0 * std::sqrt(double(p.d)));
        Result kiln, cudnn;
        {
          CudnnAttention off(false);
          kiln = run_table(p);
        }
        {
          CudnnAttention on(true);
          const cuda::CudnnAttentionStats before = cuda::cudnn_attention_stats();
          cudnn = run_table(p);
          check_cudnn_ran(before, 1, 1);
        }
        const double lse0 = host_f64(kiln.lse).to_vector<double>()[0];
        CHECK(lse0 < -100.0);  // the premise: exp(-lse) is not a finite f32
        CHECK(all_finite(cudnn.dq));
        CHECK(all_finite(cudnn.dk));
        CHECK(all_finite(cudnn.dv));
        // dQ's head-dim column 0 is -960·Σⱼ dSᵢⱼ: zero exactly, and in 16 bits whatever
        // rounding dS leaves, on either path. The other columns compare.
        const auto rest = [](const Tensor& t) { return t.narrow(3, 1, t.shape()[3] - 1); };
        const Result ref = run_reference(p);
        const double f = dt == DType::bf16 ? 4.0 : 1.0;
        CHECK(rel_error(cudnn.out, kiln.out) < 2e-3 * f);
        CHECK(lse_excess(cudnn.lse, kiln.lse, 1e-5) <= 1e-4);
        CHECK(rel_error(rest(cudnn.dq), rest(kiln.dq)) < 2e-2 * f);
        CHECK(rel_error(cudnn.dk, kiln.dk) < 2e-2 * f);
        CHECK(rel_error(cudnn.dv, kiln.dv) < 2e-2 * f);
        CHECK(rel_error(rest(cudnn.dq), rest(ref.dq)) < 2e-2 * f);
        CHECK(rel_error(cudnn.dk, ref.dk) < 2e-2 * f);
        CHECK(rel_error(cudnn.dv, ref.dv) < 2e-2 * f);
      }
}

TEST_CASE("F::packed_attention and F::scaled_dot_product_attention run on cuDNN end to end") {
  for (DType dt : {DType::f16, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    const double f = dt == DType::bf16 ? 4.0 : 1.0;
    Generator gen(21);
    const int64_t B = 3, L = 197, H = 2, D = 64;
    const Tensor qkv0 = randn({B, L, 3, H, D}, DType::f32, &gen).to(dt).to(kGpu);
    const Tensor dout = randn({B, L, H, D}, DType::f32, &gen).to(dt).to(kGpu);
    // The ViT's op: one (B, L, 3, H, D) gradient.
    auto packed = [&](bool on, Tensor& out) {
      CudnnAttention path(on);
      Tensor qkv = qkv0.detach().set_requires_grad(true);
      out = F::packed_attention(qkv);
      F::sum(F::mul(out.to(DType::f32), dout.to(DType::f32))).backward();
      return qkv.grad();
    };
    Tensor out_on, out_off;
    cuda::CudnnAttentionStats before = cuda::cudnn_attention_stats();
    const Tensor g_on = packed(true, out_on);
    check_cudnn_ran(before, 1, 1);
    before = cuda::cudnn_attention_stats();
    const Tensor g_off = packed(false, out_off);
    check_cudnn_idle(before);
    CHECK(rel_error(out_on, out_off) < 2e-3 * f);
    CHECK(rel_error(g_on, g_off) < 2e-2 * f);
    // The four-tensor op on contiguous (B, H, L, D) q, k, v (its out is (B, L, H, D) memory).
    auto sdpa = [&](bool on, Tensor& out) {
      CudnnAttention path(on);
      auto part = [&](int64_t i) {
        return qkv0.select(2, i).transpose(1, 2).contiguous().set_requires_grad(true);
      };
      Tensor q = part(0), k = part(1), v = part(2);
      out = F::scaled_dot_product_attention(q, k, v);
      F::sum(F::mul(out.to(DType::f32), dout.transpose(1, 2).to(DType::f32))).backward();
      return std::array<Tensor, 3>{q.grad(), k.grad(), v.grad()};
    };
    before = cuda::cudnn_attention_stats();
    const auto s_on = sdpa(true, out_on);
    check_cudnn_ran(before, 1, 1);
    const auto s_off = sdpa(false, out_off);
    CHECK(rel_error(out_on, out_off) < 2e-3 * f);
    for (int i = 0; i < 3; ++i) {
      CAPTURE(i);
      CHECK(rel_error(s_on[size_t(i)], s_off[size_t(i)]) < 2e-2 * f);
    }
  }
}

TEST_CASE("cuDNN attention forward and backward in a CUDA graph replay equal to eager") {
  CudnnAttention on(true);
  for (DType dt : {DType::f16, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    Generator gen(33);
    const int64_t B = 2, L = 197, H = 3, D = 64;
    const Tensor qkv0 = randn({B, L, 3, H, D}, DType::f32, &gen).to(dt).to(kGpu);
    const Tensor dout = randn({B, L, H, D}, DType::f32, &gen).to(DType::f32).to(kGpu);
    Tensor qkv = qkv0.clone().set_requires_grad(true);
    Tensor out_s = zeros({B, L, H, D}, gpu_opts(dt)), grad_s = zeros_like(qkv0);
    auto step = [&] {
      qkv.set_grad(Tensor());
      Tensor out = F::packed_attention(qkv);
      F::sum(F::mul(out.to(DType::f32), dout)).backward();
      NoGradGuard ng;
      out_s.copy_(out);
      grad_s.copy_(qkv.grad());
    };
    std::vector<Tensor> eager_out, eager_grad, graph_out, graph_grad;
    const cuda::CudnnAttentionStats before = cuda::cudnn_attention_stats();
    for (int i = 0; i < 2; ++i) {
      step();
      eager_out.push_back(out_s.clone());
      eager_grad.push_back(grad_s.clone());
    }
    check_cudnn_ran(before, 2, 2);
    {
      cuda::GraphStep g(step, cuda::GraphOptions{.warmup_steps = 2});
      for (int i = 0; i < 5; ++i) {
        out_s.fill_(std::nan(""));
        grad_s.fill_(std::nan(""));
        g.run();
        g.synchronize();
        graph_out.push_back(out_s.clone());
        graph_grad.push_back(grad_s.clone());
      }
    }
    // Warm-ups, the capture and the replays (the last three runs) all equal the eager steps.
    for (size_t i = 0; i < graph_out.size(); ++i) {
      CAPTURE(i);
      CHECK(same_bits(graph_out[i], eager_out[0]));
      CHECK(same_bits(graph_grad[i], eager_grad[0]));
    }
    CHECK(same_bits(eager_out[1], eager_out[0]));
    CHECK(same_bits(eager_grad[1], eager_grad[0]));
  }
}

TEST_CASE("cuDNN attention: a problem with no plan yet is refused during graph capture") {
  CudnnAttention on(true);
  // A size no other case uses, so its plan is not cached.
  const Problem p = make_problem(1, 2, 77, 64, DType::f16, Layout::Bhsd, 5);
  Tensor out = p.out_like(), lse = nan_output({p.b, p.h, p.l}, DType::f32);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    cuda::StreamGuard guard(stream);
    cudaGraph_t graph = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    bool refused = false;
    try {
      cuda::cudnn_attention_forward(out, lse, p.q, p.k, p.v, p.scale(), false);
    } catch (const Error& e) {
      refused = std::string(e.what()).find("graph capture") != std::string::npos;
    }
    cudaStreamEndCapture(stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    CHECK(refused);
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
  // Outside capture the same call tunes and runs.
  const cuda::CudnnAttentionStats before = cuda::cudnn_attention_stats();
  const bool ran = cuda::cudnn_attention_forward(out, lse, p.q, p.k, p.v, p.scale(), false);
  check_cudnn_ran(before, ran ? 1 : 0, 0);
  if (cudnn_required()) CHECK(ran);
}

TEST_CASE("cases cuDNN does not take run kiln's kernels, bit for bit") {
  Generator gen(44);
  const int64_t B = 2, H = 2, D = 64;
  auto draw = [&](const Shape& s) { return randn(s, DType::f32, &gen).to(DType::f16).to(kGpu); };
  // Through the table with the path on and off: the same bits, and cuDNN idle.
  auto both_ways = [&](const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
    const int64_t lq = q.size(2);
    const Tensor dout = draw({B, H, lq, D});
    auto run = [&](bool on) {
      CudnnAttention path(on);
      const AttentionPaths& a = *backend(q).attention;
      Result r;
      r.out = nan_output({B, lq, H, D}, DType::f16).transpose(1, 2);
      r.lse = nan_output({B, H, lq}, DType::f32);
      a.forward(r.out, r.lse, q, k, v, 0.125, causal);
      r.dq = nan_output(q.shape(), DType::f16);
      r.dk = nan_output(k.shape(), DType::f16);
      r.dv = nan_output(v.shape(), DType::f16);
      a.backward(r.dq, r.dk, r.dv, dout, q, k, v, r.out, r.lse, 0.125, causal);
      return r;
    };
    const Result off = run(false);
    const cuda::CudnnAttentionStats before = cuda::cudnn_attention_stats();
    const Result on = run(true);
    check_cudnn_idle(before);
    for (const auto& [got, want] :
         {std::pair{on.out, off.out}, std::pair{on.lse, off.lse}, std::pair{on.dq, off.dq},
          std::pair{on.dk, off.dk}, std::pair{on.dv, off.dv}}) {
      CHECK(same_bits(got, want));
      CHECK(rel_error(got, want) == 0);  // and every element written (a NaN reads infinite)
    }
  };
  const Tensor q = draw({B, H, 128, D}), k = draw({B, H, 128, D}), v = draw({B, H, 128, D});
  SUBCASE("causal") { both_ways(q, k, v, true); }
  SUBCASE("Lq != Lk") {
    const Tensor k2 = draw({B, H, 96, D}), v2 = draw({B, H, 96, D});
    both_ways(q, k2, v2, false);
  }
  SUBCASE("q, k, v narrowed from a wider head dim") {
    auto narrow = [&]() { return draw({B, H, 128, 2 * D}).narrow(3, 0, D); };
    const Tensor qn = narrow(), kn = narrow(), vn = narrow();
    REQUIRE(supports(backend(qn), FastPath::Attention, {&qn, &kn, &vn}));
    both_ways(qn, kn, vn, false);
  }
  SUBCASE("f32 is declined by the cuDNN entry itself") {
    const Tensor q32 = q.to(DType::f32), k32 = k.to(DType::f32), v32 = v.to(DType::f32);
    Tensor out = empty({B, 128, H, D}, gpu_opts(DType::f32)).transpose(1, 2);
    Tensor lse = empty({B, H, 128}, gpu_opts(DType::f32));
    CudnnAttention on(true);
    const cuda::CudnnAttentionStats before = cuda::cudnn_attention_stats();
    CHECK_FALSE(cuda::cudnn_attention_forward(out, lse, q32, k32, v32, 0.125, false));
    check_cudnn_idle(before);
    // The op composes f32 (no fused path takes it) and agrees with the f16 fused result.
    Tensor ref = F::scaled_dot_product_attention(q32, k32, v32);
    Tensor fused = F::scaled_dot_product_attention(q, k, v);
    CHECK(rel_error(fused, ref) < 2e-3);
  }
}
