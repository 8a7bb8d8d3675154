// NCCL data parallelism on 2 GPUs: the parent test launches 2 ranks of this binary through the
// launcher (tools/train/launcher.h); each rank runs the "nccl worker" case on GPU LOCAL_RANK over a
// loopback rendezvous. With fewer than 2 GPUs (or without NCCL) the cases print
// "SKIPPED: needs 2 GPUs" and pass.
//
// Run on a 2-GPU machine:  ./build-cuda/gpu_test_nccl
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>

#include "cuda/runtime.h"
#include "tests/gpu/gpu_test_util.h"

#ifdef KILN_WITH_NCCL
#include "core/autograd.h"
#include "tools/train/launcher.h"
#include "tools/train/rendezvous.h"
#include "tools/train/train_dist.h"
#include "cuda/graph.h"
#include "cuda/nccl.h"
#include "ops/ops.h"

using namespace kiln;
using namespace kiln::gputest;

namespace {

constexpr int kWorld = 2;
const char* kWorkerVar = "KILN_NCCL_TEST_WORKER";

bool is_worker() { return std::getenv(kWorkerVar) != nullptr; }

// Host values of rank r's input k: multiples of 1/8 in [-4, 4), exact in f16, so sums and
// averages of two are exact in every dtype.
std::vector<double> rank_values(int64_t n, int rank, int k) {
  Generator g(uint64_t(1000 + 17 * k + rank));
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = double(int64_t(g.below(64)) - 32) / 8.0;
  return v;
}

struct Worker {
  DistEnv env = DistEnv::from_env();
  Device dev = Device::cuda(env.local_rank);
  TensorOptions opts(DType t, MemoryFormat f = MemoryFormat::Contiguous) const {
    return TensorOptions(t).with_device(dev).with_memory_format(f);
  }
};

void check_all_reduce(Worker& w, cuda::Communicator& comm) {
  const int r = w.env.rank;
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    for (MemoryFormat f : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(int(f));
      const Shape shape = {2, 3, 4, 5};
      const int64_t n = 120;
      // Logical values; the channels-last tensor holds them in NHWC order.
      Tensor t = from_vector(rank_values(n, r, 0), shape, w.opts(dt, f));
      Tensor a = from_vector(rank_values(n, r, 0), shape, w.opts(dt, f));
      comm.all_reduce(t, ReduceOp::Sum);
      comm.all_reduce(a, ReduceOp::Avg);
      std::vector<double> sum(static_cast<size_t>(n), 0.0);
      for (int q = 0; q < kWorld; ++q) {
        const auto v = rank_values(n, q, 0);
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += v[i];
      }
      std::vector<double> avg = sum;
      for (double& x : avg) x /= kWorld;
      check_close(t.to_vector<double>(), sum, tol_for(dt), "all_reduce sum");
      check_close(a.to_vector<double>(), avg, tol_for(dt), "all_reduce avg");
    }
  }
  // Max and broadcast.
  Tensor m = from_vector(std::vector<double>{double(r), double(-r), 3.0}, {3}, w.opts(DType::f32));
  comm.all_reduce(m, ReduceOp::Max);
  CHECK(m.to_vector<double>() == std::vector<double>{1.0, 0.0, 3.0});
  Tensor b = full({7}, double(r + 3), w.opts(DType::f16));
  comm.broadcast(b, /*root=*/1);
  CHECK(b.to_vector<double>() == std::vector<double>(7, 4.0));
  // Errors: a tensor on the host, a non-dense view, Avg of integers.
  CHECK_THROWS_AS(comm.all_reduce(zeros({2})), Error);
  CHECK_THROWS_AS(comm.all_reduce(zeros({4, 4}, w.opts(DType::f32)).t()), Error);
  CHECK_THROWS_AS(comm.all_reduce(zeros({4}, w.opts(DType::i32)), ReduceOp::Avg), Error);
}

void check_found_inf(Worker& w, cuda::Communicator& comm) {
  for (int who_overflows : {-1, 0, 1}) {
    CAPTURE(who_overflows);
    Tensor f32 = full({1}, w.env.rank == who_overflows ? 1.0 : 0.0, w.opts(DType::f32));
    Tensor i32 = full({1}, w.env.rank == who_overflows ? 1.0 : 0.0, w.opts(DType::i32));
    comm.agree_found_inf(f32);
    comm.agree_found_inf(i32);
    const double want = who_overflows >= 0 ? 1.0 : 0.0;
    CHECK(f32.item() == want);
    CHECK(i32.item() == want);
  }
}

// Parameters of mixed dtypes and layouts; loss_k = sum(p_k * x_k) so grad p_k = x_k (exact).
// Rank 1 leaves the last parameter out of its loss (no gradient there: zeros in the average).
struct Toy {
  std::vector<Tensor> params;
  std::vector<Tensor> inputs;             // this rank's x_k
  std::vector<std::vector<double>> want;  // average over ranks of x_k, logical order
  std::vector<DType> dtypes;
};

Toy make_toy(Worker& w) {
  struct Spec {
    Shape shape;
    DType dt;
    MemoryFormat f;
  };
  const std::vector<Spec> specs = {{{16, 8}, DType::f16, MemoryFormat::Contiguous},
                                   {{16}, DType::f32, MemoryFormat::Contiguous},
                                   {{4, 3, 5, 6}, DType::f16, MemoryFormat::ChannelsLast},
                                   {{4}, DType::f32, MemoryFormat::Contiguous},
                                   {{10, 4}, DType::f16, MemoryFormat::Contiguous},
                                   {{6}, DType::f16, MemoryFormat::Contiguous}};
  Toy toy;
  for (size_t k = 0; k < specs.size(); ++k) {
    const Spec& s = specs[k];
    const int64_t n = shape_numel(s.shape);
    Tensor p = from_vector(rank_values(n, 0, 50 + int(k)), s.shape, w.opts(s.dt, s.f));
    p.set_requires_grad(true);
    toy.params.push_back(p);
    toy.inputs.push_back(
        from_vector(rank_values(n, w.env.rank, int(k)), s.shape, w.opts(s.dt, s.f)));
    std::vector<double> avg(static_cast<size_t>(n), 0.0);
    for (int q = 0; q < kWorld; ++q) {
      if (q == 1 && k + 1 == specs.size()) continue;  // rank 1 leaves it out
      const auto v = rank_values(n, q, int(k));
      for (size_t i = 0; i < avg.size(); ++i) avg[i] += v[i] / kWorld;
    }
    toy.want.push_back(avg);
    toy.dtypes.push_back(s.dt);
  }
  return toy;
}

void toy_backward(Toy& toy, int rank) {
  std::vector<Tensor> losses;
  for (size_t k = 0; k < toy.params.size(); ++k) {
    if (rank == 1 && k + 1 == toy.params.size()) continue;
    losses.push_back(F::sum(F::mul(toy.params[k], toy.inputs[k])));
  }
  autograd::backward(losses, std::vector<Tensor>(losses.size()));
}

void check_toy_grads(const Toy& toy, const std::string& what) {
  for (size_t k = 0; k < toy.params.size(); ++k) {
    const Tensor g = toy.params[k].grad();
    REQUIRE_MESSAGE(g.defined(), what, ": parameter ", k, " has no gradient");
    check_close(g.to_vector<double>(), toy.want[k], tol_for(toy.dtypes[k]),
                what + ": grad of parameter " + std::to_string(k));
  }
}

void check_bucketer(Worker& w, cuda::Communicator& comm) {
  Toy toy = make_toy(w);
  // 200-byte buckets, filled in reverse order with one open bucket per dtype: f16 {5, 4, 2}
  // (12 + 80 + 720 bytes), f16 {0} (256), and the f32 one {3, 1} (16 + 64) closed at the end.
  cuda::GradBucketer ddp(comm, toy.params, {.bucket_bytes = 200});
  CHECK(ddp.num_buckets() == 3);
  CHECK(ddp.bucket_layout() == std::vector<std::vector<size_t>>{{5, 4, 2}, {3, 1}, {0}});
  const auto layout = ddp.bucket_layout();
  CHECK(layout.front().front() == toy.params.size() - 1);  // reverse registration order
  for (const auto& b : layout)
    for (size_t i : b) CHECK(toy.params[i].dtype() == toy.params[b.front()].dtype());

  for (int step = 0; step < 3; ++step) {
    for (Tensor& p : toy.params) p.set_grad(Tensor());
    toy_backward(toy, w.env.rank);
    ddp.finish();
    check_toy_grads(toy, "eager step " + std::to_string(step));
  }

  // Accumulation micro-step with sync off, then a synced one: the average of the sums.
  for (Tensor& p : toy.params) p.set_grad(Tensor());
  ddp.set_sync(false);
  toy_backward(toy, w.env.rank);
  ddp.set_sync(true);
  toy_backward(toy, w.env.rank);
  ddp.finish();
  for (auto& v : toy.want)
    for (double& x : v) x *= 2;
  check_toy_grads(toy, "accumulated");
  for (auto& v : toy.want)
    for (double& x : v) x /= 2;

  // The same step captured into a CUDA graph and replayed.
  cuda::GraphStep graph(
      [&] {
        for (Tensor& p : toy.params) p.set_grad(Tensor());
        toy_backward(toy, w.env.rank);
        ddp.finish();
      },
      {.warmup_steps = 2});
  for (int step = 0; step < 4; ++step) {
    graph.run();
    graph.synchronize();
    check_toy_grads(toy, "graph step " + std::to_string(step));
  }
  CHECK(graph.has_graph());
  CHECK(graph.stats().replays == 2);
}

}  // namespace

TEST_CASE("nccl: 2 ranks (all_reduce, broadcast, found_inf, GradBucketer, graph capture)") {
  if (is_worker()) return;  // the ranks run "nccl worker"
  if (cuda::device_count() < kWorld) {
    std::printf("SKIPPED: needs 2 GPUs (%d visible)\n", cuda::device_count());
    return;
  }
  ::setenv(kWorkerVar, "1", 1);
  LaunchResult r =
      launch_processes({"/proc/self/exe", "--test-case=nccl worker"}, {.nproc = kWorld});
  ::unsetenv(kWorkerVar);
  INFO(r.message);
  CHECK(r.ok());
}

TEST_CASE("nccl worker") {
  if (!is_worker()) return;  // only inside a launched rank
  Worker w;
  REQUIRE(w.env.world_size == kWorld);
  cuda::set_device(w.env.local_rank);
  Rendezvous rv(w.env, {.timeout = std::chrono::seconds(60)});
  auto comm_ptr = train::join_communicator(rv, w.env.local_rank);
  cuda::Communicator& comm = *comm_ptr;
  CHECK(comm.rank() == w.env.rank);
  CHECK(comm.world_size() == kWorld);
  check_all_reduce(w, comm);
  check_found_inf(w, comm);
  check_bucketer(w, comm);
  cuda::synchronize();
  rv.barrier();
}

#else  // !KILN_WITH_NCCL

TEST_CASE("nccl: 2 ranks") { std::printf("SKIPPED: needs 2 GPUs and NCCL (built without NCCL)\n"); }

#endif
