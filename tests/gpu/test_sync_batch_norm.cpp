// F::sync_batch_norm on the GPU.
//  * The four CUDA kernels (cuda/kernels.h), NaN-prefilled outputs, against the CPU
//    kernels in f64 on the same rounded inputs: f16/bf16/f32, NHWC, NCHW and (N, C), channel
//    counts off the 32-wide tile, and sizes that split the rows over many partial blocks.
//  * The op with an identity reducer (one rank), f16 NHWC with f32 parameters, against the CPU
//    f64 batch_norm: output, running statistics, dx, dweight, dbias.
//  * Two GPUs (NCCL): each rank normalises its half of a batch with an NCCL all-reduce; against
//    the CPU f64 batch_norm of the whole batch. Prints "SKIPPED" with fewer than 2 GPUs.
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>

#include "cuda/runtime.h"
#include "cuda/kernels.h"
#include "ops/cpu/kernels.h"
#include "ops/ops.h"
#include "tests/gpu/ref_check.h"

#ifdef KILN_WITH_NCCL
#include "tools/train/dist_env.h"
#include "tools/train/launcher.h"
#include "tools/train/rendezvous.h"
#include "tools/train/train_dist.h"
#include "cuda/nccl.h"
#endif

using namespace kiln;
using namespace kiln::ref_check;
using kiln::testing::compare;

namespace {

constexpr double kMomentum = 0.1, kEps = 1e-5;

// Relative tolerance of a GPU data dtype's outputs (rounded to the dtype) against f64.
double out_tol(DType t) { return t == DType::f16 ? 4e-3 : t == DType::bf16 ? 2e-2 : 1e-5; }

// Host f64 data, rounded to `dtype` (exactly what the GPU holds), mean `shift`.
Tensor host_data(const Shape& shape, DType dtype, double shift, uint64_t seed) {
  Generator gen(seed);
  return rounded(F::add(F::mul(randn(shape, DType::f64, &gen), 1.5), shift), dtype);
}

struct KernelCase {
  Shape shape;
  DType dtype;
  MemoryFormat fmt;
};

}  // namespace

TEST_CASE("sync_batch_norm CUDA kernels match the CPU kernels") {
  const MemoryFormat kCL = MemoryFormat::ChannelsLast, kC = MemoryFormat::Contiguous;
  const std::vector<KernelCase> cases = {
      {{8, 64, 7, 9}, DType::f16, kCL},    {{4, 40, 5, 6}, DType::f16, kCL},
      {{32, 96, 14, 14}, DType::f16, kCL}, {{4, 40, 5, 6}, DType::f32, kC},
      {{32, 24, 14, 14}, DType::bf16, kC}, {{16, 3, 9, 9}, DType::f32, kCL},
      {{300, 70}, DType::f16, kC}};
  for (const KernelCase& k : cases) {
    CAPTURE(shape_str(k.shape));
    CAPTURE(dtype_name(k.dtype));
    CAPTURE(k.fmt == kCL ? "NHWC" : "NCHW");
    const int64_t c = k.shape[1];
    Tensor hx = host_data(k.shape, k.dtype, 0.5, 1), hdy = host_data(k.shape, k.dtype, 0.0, 2);
    Tensor gx = to_gpu(hx, k.dtype, k.fmt), gdy = to_gpu(hdy, k.dtype, k.fmt);
    Generator gen(3);
    Tensor hw = uniform({c}, 0.5, 1.5, DType::f64, &gen),
           hb = uniform({c}, -0.5, 0.5, DType::f64, &gen);
    Tensor hw32 = rounded(hw, DType::f32), hb32 = rounded(hb, DType::f32);
    Tensor gw = to_gpu(hw32, DType::f32), gb = to_gpu(hb32, DType::f32);

    // Local sums: f32 accumulation of exact inputs.
    Tensor gstats = nan_gpu({2 * c + 1}, DType::f32), hstats = empty({2 * c + 1}, DType::f64);
    cuda::sync_batch_norm_stats(gstats, gx);
    cpu::sync_batch_norm_stats(hstats, hx);
    KILN_CHECK_OK(compare_scaled(gstats.narrow(0, 0, c), hstats.narrow(0, 0, c), 1e-5));
    KILN_CHECK_OK(compare_scaled(gstats.narrow(0, c, c), hstats.narrow(0, c, c), 1e-5));
    CHECK(to_cpu64(gstats).to_vector<double>().back() == double(hx.numel() / c));

    // Normalisation from the GPU's statistics (both sides start from the same numbers).
    Tensor st = to_cpu64(gstats);
    Tensor gy = nan_gpu(k.shape, k.dtype, k.fmt), hy = empty(k.shape, DType::f64);
    Tensor gm = nan_gpu({c}, DType::f32), gi = nan_gpu({c}, DType::f32);
    Tensor hm = empty({c}, DType::f64), hi = empty({c}, DType::f64);
    Tensor grm = to_gpu(zeros({c}, DType::f64), DType::f32),
           grv = to_gpu(ones({c}, DType::f64), DType::f32);
    Tensor hrm = zeros({c}, DType::f64), hrv = ones({c}, DType::f64);
    cuda::sync_batch_norm_apply(gy, gm, gi, gx, gw, gb, grm, grv, gstats, kMomentum, kEps);
    cpu::sync_batch_norm_apply(hy, hm, hi, hx, hw32, hb32, hrm, hrv, st, kMomentum, kEps);
    KILN_CHECK_OK(compare_scaled(gy, hy, out_tol(k.dtype)));
    KILN_CHECK_OK(compare_scaled(gm, hm, 1e-5));
    KILN_CHECK_OK(compare_scaled(gi, hi, 1e-5));
    KILN_CHECK_OK(compare_scaled(grm, hrm, 1e-5));
    KILN_CHECK_OK(compare_scaled(grv, hrv, 1e-5));
    CHECK(gy.is_contiguous(k.fmt));

    // Backward sums and dx, from the GPU's mean and invstd.
    Tensor mean = to_cpu64(gm), invstd = to_cpu64(gi);
    Tensor gsums = nan_gpu({2 * c}, DType::f32), hsums = empty({2 * c}, DType::f64);
    cuda::sync_batch_norm_backward_sums(gsums, gdy, gx, gm, gi);
    cpu::sync_batch_norm_backward_sums(hsums, hdy, hx, mean, invstd);
    KILN_CHECK_OK(compare_scaled(gsums.narrow(0, 0, c), hsums.narrow(0, 0, c), 1e-4));
    KILN_CHECK_OK(compare_scaled(gsums.narrow(0, c, c), hsums.narrow(0, c, c), 1e-4));
    Tensor sums = to_cpu64(gsums);
    Tensor gdx = nan_gpu(k.shape, k.dtype, k.fmt), hdx = empty(k.shape, DType::f64);
    cuda::sync_batch_norm_backward_dx(gdx, gdy, gx, gw, gm, gi, gsums, gstats.narrow(0, 2 * c, 1));
    cpu::sync_batch_norm_backward_dx(hdx, hdy, hx, hw32, mean, invstd, sums,
                                     st.narrow(0, 2 * c, 1));
    KILN_CHECK_OK(compare_scaled(gdx, hdx, out_tol(k.dtype)));
    // Without weight and bias.
    Tensor gy2 = nan_gpu(k.shape, k.dtype, k.fmt), hy2 = empty(k.shape, DType::f64);
    cuda::sync_batch_norm_apply(gy2, gm, gi, gx, Tensor(), Tensor(), Tensor(), Tensor(), gstats,
                                kMomentum, kEps);
    cpu::sync_batch_norm_apply(hy2, hm, hi, hx, Tensor(), Tensor(), Tensor(), Tensor(), st,
                               kMomentum, kEps);
    KILN_CHECK_OK(compare_scaled(gy2, hy2, out_tol(k.dtype)));
  }
  // A layout mismatch between x and dy is refused.
  Tensor x = to_gpu(zeros({2, 8, 3, 3}, DType::f64), DType::f16, MemoryFormat::ChannelsLast);
  Tensor dy = to_gpu(zeros({2, 8, 3, 3}, DType::f64), DType::f16);
  Tensor sums = nan_gpu({16}, DType::f32), m = nan_gpu({8}, DType::f32);
  CHECK_THROWS_AS(cuda::sync_batch_norm_backward_sums(sums, dy, x, m, m), Error);
}

TEST_CASE("sync_batch_norm op, one GPU (identity reducer): f16 NHWC against CPU f64 batch_norm") {
  const F::StatsAllReduce identity = [](const Tensor&) {};
  for (MemoryFormat fmt : {MemoryFormat::ChannelsLast, MemoryFormat::Contiguous}) {
    CAPTURE(fmt == MemoryFormat::ChannelsLast ? "NHWC" : "NCHW");
    const Shape shape{8, 48, 7, 9};
    const int64_t c = 48;
    Tensor hx = host_data(shape, DType::f16, 1.0, 4), hdy = host_data(shape, DType::f16, 0.0, 5);
    Generator gen(6);
    Tensor hw = rounded(uniform({c}, 0.5, 1.5, DType::f64, &gen), DType::f32);
    Tensor hb = rounded(uniform({c}, -0.5, 0.5, DType::f64, &gen), DType::f32);
    // CPU f64 reference over the same values.
    Tensor rx = hx.clone().set_requires_grad(true), rw = hw.clone().set_requires_grad(true),
           rb = hb.clone().set_requires_grad(true);
    Tensor rrm = zeros({c}, DType::f64), rrv = ones({c}, DType::f64);
    Tensor ry = F::batch_norm(rx, rw, rb, rrm, rrv, true, kMomentum, kEps);
    ry.backward(hdy);
    // GPU: f16 data, f32 parameters and statistics.
    Tensor x = to_gpu(hx, DType::f16, fmt).set_requires_grad(true);
    Tensor w = to_gpu(hw, DType::f32).set_requires_grad(true);
    Tensor b = to_gpu(hb, DType::f32).set_requires_grad(true);
    Tensor rm = to_gpu(zeros({c}, DType::f64), DType::f32),
           rv = to_gpu(ones({c}, DType::f64), DType::f32);
    Tensor y = F::sync_batch_norm(x, w, b, rm, rv, kMomentum, kEps, identity);
    CHECK(y.dtype() == DType::f16);
    CHECK(y.is_contiguous(fmt));
    y.backward(to_gpu(hdy, DType::f16, fmt));
    KILN_CHECK_OK(compare_scaled(y, ry, 1e-2));
    KILN_CHECK_OK(compare_scaled(rm, rrm, 1e-4));
    KILN_CHECK_OK(compare_scaled(rv, rrv, 1e-4));
    CHECK(x.grad().dtype() == DType::f16);
    CHECK(w.grad().dtype() == DType::f32);
    KILN_CHECK_OK(compare_scaled(x.grad(), rx.grad(), 1e-2));
    KILN_CHECK_OK(compare_scaled(w.grad(), rw.grad(), 1e-3));
    KILN_CHECK_OK(compare_scaled(b.grad(), rb.grad(), 1e-3));
  }
}

#ifdef KILN_WITH_NCCL

namespace {

constexpr int kWorld = 2;
const char* kWorkerVar = "KILN_SYNC_BN_TEST_WORKER";
bool is_worker() { return std::getenv(kWorkerVar) != nullptr; }

}  // namespace

TEST_CASE("sync_batch_norm: 2 GPUs over NCCL equal one batch_norm over the whole batch") {
  if (is_worker()) return;  // the ranks run "sync_batch_norm worker"
  if (cuda::device_count() < kWorld) {
    std::printf("SKIPPED: needs 2 GPUs (%d visible)\n", cuda::device_count());
    return;
  }
  ::setenv(kWorkerVar, "1", 1);
  LaunchResult r =
      launch_processes({"/proc/self/exe", "--test-case=sync_batch_norm worker"}, {.nproc = kWorld});
  ::unsetenv(kWorkerVar);
  INFO(r.message);
  CHECK(r.ok());
}

TEST_CASE("sync_batch_norm worker") {
  if (!is_worker()) return;  // only inside a launched rank
  const DistEnv env = DistEnv::from_env();
  REQUIRE(env.world_size == kWorld);
  cuda::set_device(env.local_rank);
  const Device dev = Device::cuda(env.local_rank);
  Rendezvous rv(env, {.timeout = std::chrono::seconds(60)});
  auto comm_ptr = train::join_communicator(rv, env.local_rank);
  cuda::Communicator& comm = *comm_ptr;
  int calls = 0;
  const F::StatsAllReduce reduce = [&](const Tensor& t) {
    ++calls;
    comm.all_reduce(t, ReduceOp::Sum);
  };
  // The whole batch (same on every rank); rank r holds rows [r·n, r·n + n), NHWC f16.
  const Shape shape{8, 40, 6, 5};
  const int64_t c = 40, n = 4, off = n * env.rank;
  Tensor hx = host_data(shape, DType::f16, 0.8, 7), hdy = host_data(shape, DType::f16, 0.0, 8);
  Generator gen(9);
  Tensor hw = rounded(uniform({c}, 0.5, 1.5, DType::f64, &gen), DType::f32);
  Tensor hb = rounded(uniform({c}, -0.5, 0.5, DType::f64, &gen), DType::f32);
  Tensor rx = hx.clone().set_requires_grad(true), rw = hw.clone().set_requires_grad(true),
         rb = hb.clone().set_requires_grad(true);
  Tensor rrm = zeros({c}, DType::f64), rrv = ones({c}, DType::f64);
  Tensor ry = F::batch_norm(rx, rw, rb, rrm, rrv, true, kMomentum, kEps);
  ry.backward(hdy);

  auto on_dev = [&](const Tensor& t, DType d, MemoryFormat f = MemoryFormat::Contiguous) {
    return t.detach().to(d).contiguous(f).to(dev);
  };
  const MemoryFormat cl = MemoryFormat::ChannelsLast;
  Tensor x = on_dev(hx.narrow(0, off, n), DType::f16, cl).set_requires_grad(true);
  Tensor w = on_dev(hw, DType::f32).set_requires_grad(true);
  Tensor b = on_dev(hb, DType::f32).set_requires_grad(true);
  Tensor rm = on_dev(zeros({c}, DType::f64), DType::f32),
         rvar = on_dev(ones({c}, DType::f64), DType::f32);
  Tensor y = F::sync_batch_norm(x, w, b, rm, rvar, kMomentum, kEps, reduce);
  y.backward(on_dev(hdy.narrow(0, off, n), DType::f16, cl));
  CHECK(calls == 2);  // one forward, one backward
  KILN_CHECK_OK(compare_scaled(y, ry.narrow(0, off, n), 1e-2));
  KILN_CHECK_OK(compare_scaled(rm, rrm, 1e-4));
  KILN_CHECK_OK(compare_scaled(rvar, rrv, 1e-4));
  KILN_CHECK_OK(compare_scaled(x.grad(), rx.grad().narrow(0, off, n), 1e-2));
  // This rank's dweight and dbias are its parts: summed over the ranks, the whole batch's.
  Tensor dw = w.grad().clone(), db = b.grad().clone();
  comm.all_reduce(dw, ReduceOp::Sum);
  comm.all_reduce(db, ReduceOp::Sum);
  KILN_CHECK_OK(compare_scaled(dw, rw.grad(), 1e-3));
  KILN_CHECK_OK(compare_scaled(db, rb.grad(), 1e-3));
  cuda::synchronize();
  rv.barrier();
}

#else  // !KILN_WITH_NCCL

TEST_CASE("sync_batch_norm: 2 GPUs") {
  std::printf("SKIPPED: needs 2 GPUs and NCCL (built without NCCL)\n");
}

#endif
