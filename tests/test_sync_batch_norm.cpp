// sync_batch_norm: R data-parallel ranks simulated by R threads of one process (autograd's grad
// mode and its engine state are thread-local or per call, and every rank has its own tensors),
// whose reducer sums through a barrier. Checked against F::batch_norm on the whole batch:
// outputs, running statistics, dx, and the parameter gradients summed (sum loss) or averaged
// as GradBucketer does (per-rank mean loss, and a whole ResNet with cross-entropy). Plus
// gradcheck with one rank, the module wiring, --sync-bn parsing and error paths.
#include <doctest/doctest.h>

#include <barrier>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "models/nn.h"
#include "models/resnet.h"
#include "ops/ops.h"
#include "tools/train/trainer.h"
#include "tests/gradcheck.h"

using namespace kiln;
using kiln::testing::compare;
using kiln::testing::gradcheck;
using kiln::testing::leaf;

namespace {

constexpr double kMomentum = 0.1, kEps = 1e-5, kTol = 1e-10;

// An in-memory all-reduce over R threads. Each rank deposits a copy, all wait, each adds the
// copies in rank order (every rank gets the same bits), all wait again before slots are reused.
class ThreadSum {
 public:
  explicit ThreadSum(int ranks) : slots_(size_t(ranks)), calls_(size_t(ranks)), barrier_(ranks) {}
  F::StatsAllReduce for_rank(int r) {
    return [this, r](const Tensor& t) {
      slots_[size_t(r)] = t.clone();
      ++calls_[size_t(r)];
      barrier_.arrive_and_wait();
      Tensor s = slots_[0].clone();
      for (size_t q = 1; q < slots_.size(); ++q) F::add_(s, slots_[q]);
      barrier_.arrive_and_wait();
      t.copy_(s);
    };
  }
  int calls(int r) const { return calls_[size_t(r)]; }
  void drop() { barrier_.arrive_and_drop(); }  // a failed rank must not hang the others

 private:
  std::vector<Tensor> slots_;
  std::vector<int> calls_;
  std::barrier<> barrier_;
};

// Runs fn(r) for r < R in R threads; rethrows the first exception.
void run_ranks(ThreadSum& sum, int ranks, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  std::exception_ptr error;
  std::mutex mu;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
        sum.drop();
      }
    });
  for (std::thread& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

Tensor param_leaf(const Tensor& t) { return t.detach().clone().set_requires_grad(true); }

// Rank r's shard of a whole-batch tensor: rows [offset, offset + n), laid out in fmt.
Tensor shard(const Tensor& t, int64_t offset, int64_t n, MemoryFormat fmt) {
  return t.detach().narrow(0, offset, n).contiguous(fmt).set_requires_grad(true);
}

struct Problem {
  Tensor x, g, w, b, rm, rv;  // whole batch (N, C, H, W) f64, upstream gradient, params, stats
};

Problem make_problem(int64_t n, uint64_t seed) {
  Generator gen(seed);
  Problem p;
  const TensorOptions f64(DType::f64);
  p.x = F::add(F::mul(randn({n, 3, 3, 2}, f64, &gen), 2.0), 0.7);
  p.g = randn({n, 3, 3, 2}, f64, &gen);
  p.w = uniform({3}, 0.5, 1.5, f64, &gen);
  p.b = uniform({3}, -0.5, 0.5, f64, &gen);
  p.rm = uniform({3}, -0.2, 0.2, f64, &gen);
  p.rv = uniform({3}, 0.5, 1.5, f64, &gen);
  return p;
}

}  // namespace

TEST_CASE("sync_batch_norm over simulated ranks equals batch_norm on the whole batch (sum loss)") {
  // Unequal shards for R = 2; rank sizes need not match.
  const std::vector<std::vector<int64_t>> splits = {{4, 2}, {2, 2, 2}};
  for (const auto& sizes : splits) {
    for (MemoryFormat fmt : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
      const int R = int(sizes.size());
      CAPTURE(R);
      CAPTURE(int(fmt));
      Problem p = make_problem(6, 11 + uint64_t(R));
      // Reference: one batch_norm over the whole batch, loss = Σ y·g.
      Tensor x = shard(p.x, 0, 6, fmt), w = param_leaf(p.w), b = param_leaf(p.b);
      Tensor rm = p.rm.clone(), rv = p.rv.clone();
      Tensor y = F::batch_norm(x, w, b, rm, rv, true, kMomentum, kEps);
      F::sum(F::mul(y, p.g)).backward();

      std::vector<Tensor> xs, ws, bs, rms, rvs, ys(sizes.size());
      std::vector<int64_t> offsets;
      int64_t off = 0;
      for (int r = 0; r < R; ++r) {
        offsets.push_back(off);
        xs.push_back(shard(p.x, off, sizes[size_t(r)], fmt));
        ws.push_back(param_leaf(p.w));
        bs.push_back(param_leaf(p.b));
        rms.push_back(p.rm.clone());
        rvs.push_back(p.rv.clone());
        off += sizes[size_t(r)];
      }
      ThreadSum sum(R);
      run_ranks(sum, R, [&](int r) {
        const size_t i = size_t(r);
        ys[i] = F::sync_batch_norm(xs[i], ws[i], bs[i], rms[i], rvs[i], kMomentum, kEps,
                                   sum.for_rank(r));
        F::sum(F::mul(ys[i], p.g.narrow(0, offsets[i], sizes[i]))).backward();
      });

      Tensor dw = zeros({3}, DType::f64), db = zeros({3}, DType::f64);
      for (int r = 0; r < R; ++r) {
        const size_t i = size_t(r);
        CAPTURE(r);
        CHECK(sum.calls(r) == 2);  // one forward, one backward
        CHECK(ys[i].is_contiguous(fmt));
        KILN_CHECK_OK(compare(ys[i], y.narrow(0, offsets[i], sizes[i]), kTol, kTol));
        KILN_CHECK_OK(compare(rms[i], rm, kTol, kTol));
        KILN_CHECK_OK(compare(rvs[i], rv, kTol, kTol));
        KILN_CHECK_OK(compare(xs[i].grad(), x.grad().narrow(0, offsets[i], sizes[i]), kTol, kTol));
        F::add_(dw, ws[i].grad());
        F::add_(db, bs[i].grad());
      }
      KILN_CHECK_OK(compare(dw, w.grad(), kTol, kTol));
      KILN_CHECK_OK(compare(db, b.grad(), kTol, kTol));
    }
  }
}

TEST_CASE("sync_batch_norm: per-rank mean losses, gradients averaged over ranks = one big batch") {
  // kiln-train: each rank's loss is the mean over its shard and GradBucketer averages the
  // gradients. A per-channel scale `a` before the BN stands for the layers upstream. Then the
  // average over ranks of every parameter's gradient is the big batch's, and each rank's dx is
  // R times the big batch's slice.
  for (int R : {2, 3}) {
    CAPTURE(R);
    const int64_t N = 6, n = N / R;
    Problem p = make_problem(N, 5 + uint64_t(R));
    Tensor a0 = uniform({1, 3, 1, 1}, 0.5, 1.5, DType::f64);
    auto loss_of = [&](const Tensor& y, int64_t off) {  // mean over the rows [off, off + n)
      return F::mean(F::mul(y, p.g.narrow(0, off, y.size(0))));
    };
    Tensor x = shard(p.x, 0, N, MemoryFormat::Contiguous), a = param_leaf(a0);
    Tensor w = param_leaf(p.w), b = param_leaf(p.b);
    Tensor y = F::batch_norm(F::mul(x, a), w, b, Tensor(), Tensor(), true, kMomentum, kEps);
    loss_of(y, 0).backward();

    std::vector<Tensor> xs, as, ws, bs;
    for (int r = 0; r < R; ++r) {
      xs.push_back(shard(p.x, r * n, n, MemoryFormat::Contiguous));
      as.push_back(param_leaf(a0));
      ws.push_back(param_leaf(p.w));
      bs.push_back(param_leaf(p.b));
    }
    ThreadSum sum(R);
    run_ranks(sum, R, [&](int r) {
      const size_t i = size_t(r);
      Tensor yr = F::sync_batch_norm(F::mul(xs[i], as[i]), ws[i], bs[i], Tensor(), Tensor(),
                                     kMomentum, kEps, sum.for_rank(r));
      loss_of(yr, r * n).backward();
    });
    Tensor da = zeros({1, 3, 1, 1}, DType::f64), dw = zeros({3}, DType::f64),
           db = zeros({3}, DType::f64);
    for (int r = 0; r < R; ++r) {
      const size_t i = size_t(r);
      KILN_CHECK_OK(
          compare(xs[i].grad(), F::mul(x.grad().narrow(0, r * n, n), double(R)), kTol, kTol));
      F::add_(da, as[i].grad(), 1.0 / R);
      F::add_(dw, ws[i].grad(), 1.0 / R);
      F::add_(db, bs[i].grad(), 1.0 / R);
    }
    KILN_CHECK_OK(compare(da, a.grad(), kTol, kTol));
    KILN_CHECK_OK(compare(dw, w.grad(), kTol, kTol));
    KILN_CHECK_OK(compare(db, b.grad(), kTol, kTol));
  }
}

TEST_CASE("sync_batch_norm: a rank with no upstream gradient still reduces, and gets dx") {
  // Rank 1's node runs with an undefined dy (zero): the other rank's dy still moves its x.
  Problem p = make_problem(4, 3);
  Tensor g = p.g.clone();
  g.narrow(0, 2, 2).zero_();
  Tensor x = shard(p.x, 0, 4, MemoryFormat::Contiguous), w = param_leaf(p.w);
  F::sum(F::mul(F::batch_norm(x, w, p.b, Tensor(), Tensor(), true), g)).backward();
  std::vector<Tensor> xs = {shard(p.x, 0, 2, MemoryFormat::Contiguous),
                            shard(p.x, 2, 2, MemoryFormat::Contiguous)};
  std::vector<Tensor> ws = {param_leaf(p.w), param_leaf(p.w)}, grads(2);
  ThreadSum sum(2);
  run_ranks(sum, 2, [&](int r) {
    Tensor y = F::sync_batch_norm(xs[size_t(r)], ws[size_t(r)], p.b, Tensor(), Tensor(), kMomentum,
                                  kEps, sum.for_rank(r));
    if (r == 0) {
      F::sum(F::mul(y, g.narrow(0, 0, 2))).backward();
    } else {
      NoGradGuard no_grad;  // as the engine runs nodes
      std::vector<Tensor> in{Tensor()};
      grads = y.grad_fn()->apply(in);
    }
  });
  CHECK(sum.calls(1) == 2);
  KILN_CHECK_OK(compare(xs[0].grad(), x.grad().narrow(0, 0, 2), kTol, kTol));
  KILN_CHECK_OK(compare(grads[0], x.grad().narrow(0, 2, 2), kTol, kTol));
  CHECK(F::max(F::mul(grads[0], grads[0])).item() > 1e-6);  // not trivially zero
  KILN_CHECK_OK(compare(F::add(ws[0].grad(), grads[1]), w.grad(), kTol, kTol));
}

TEST_CASE("sync_batch_norm with one rank (identity reducer) is batch_norm; gradcheck") {
  const F::StatsAllReduce identity = [](const Tensor&) {};
  for (Shape shape : std::vector<Shape>{{4, 3}, {2, 3, 2, 2}, {3, 2, 5}}) {
    for (MemoryFormat fmt : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
      if (fmt == MemoryFormat::ChannelsLast && shape.size() != 4) continue;
      CAPTURE(shape_str(shape));
      CAPTURE(int(fmt));
      const int64_t c = shape[1];
      Tensor x = leaf(shape, -2.0, 2.0), w = leaf({c}, 0.5, 1.5), b = leaf({c});
      KILN_CHECK_OK(gradcheck(
          [&](auto& in) {
            return F::sync_batch_norm(in[0].contiguous(fmt), in[1], in[2], Tensor(), Tensor(),
                                      kMomentum, kEps, identity);
          },
          {x, w, b}));
      KILN_CHECK_OK(gradcheck(
          [&](auto& in) {  // no affine parameters
            return F::sync_batch_norm(in[0].contiguous(fmt), Tensor(), Tensor(), Tensor(), Tensor(),
                                      kMomentum, kEps, identity);
          },
          {x}));
    }
  }
  // f32 and f64 forward and running stats against batch_norm.
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    const double tol = dt == DType::f64 ? 1e-12 : 1e-5;
    Tensor x = F::add(randn({3, 4, 2, 3}, dt), 3.0);
    Tensor w = uniform({4}, 0.5, 1.5, dt), b = uniform({4}, -1.0, 1.0, dt);
    Tensor rm = zeros({4}, dt), rv = ones({4}, dt), rm2 = zeros({4}, dt), rv2 = ones({4}, dt);
    Tensor y = F::sync_batch_norm(x, w, b, rm, rv, kMomentum, kEps, identity);
    Tensor ref = F::batch_norm(x, w, b, rm2, rv2, true, kMomentum, kEps);
    CHECK(y.dtype() == dt);
    KILN_CHECK_OK(compare(y, ref, tol, tol));
    KILN_CHECK_OK(compare(rm, rm2, tol, tol));
    KILN_CHECK_OK(compare(rv, rv2, tol, tol));
  }
}

TEST_CASE("sync_batch_norm errors") {
  const F::StatsAllReduce identity = [](const Tensor&) {};
  Tensor x = randn({2, 3, 2, 2}, DType::f64), w = ones({3}, DType::f64);
  CHECK_THROWS_AS(F::sync_batch_norm(x, w, w, Tensor(), Tensor(), 0.1, kEps, {}), Error);
  CHECK_THROWS_AS(F::sync_batch_norm(randn({6}, DType::f64), Tensor(), Tensor(), Tensor(), Tensor(),
                                     0.1, kEps, identity),
                  Error);
  CHECK_THROWS_AS(F::sync_batch_norm(randn({1, 3}, DType::f64), Tensor(), Tensor(), Tensor(),
                                     Tensor(), 0.1, kEps, identity),
                  Error);  // one value per channel
  CHECK_THROWS_AS(F::sync_batch_norm(x, ones({4}, DType::f64), Tensor(), Tensor(), Tensor(), 0.1,
                                     kEps, identity),
                  Error);
  CHECK_THROWS_AS(
      F::sync_batch_norm(x, ones({3}), Tensor(), Tensor(), Tensor(), 0.1, kEps, identity),
      Error);  // f32 weight for f64 x
  CHECK_THROWS_AS(F::sync_batch_norm(x.to(DType::f16), Tensor(), Tensor(), Tensor(), Tensor(), 0.1,
                                     kEps, identity),
                  Error);  // f16 on the CPU
  CHECK_THROWS_AS(
      F::sync_batch_norm(x, w, w, zeros({3}, DType::f64), Tensor(), 0.1, kEps, identity), Error);
  // A failing reducer propagates, and the running statistics are left as they were.
  Tensor rm = zeros({3}, DType::f64), rv = ones({3}, DType::f64);
  CHECK_THROWS_AS(F::sync_batch_norm(x, w, w, rm, rv, 0.1, kEps,
                                     [](const Tensor&) { throw std::runtime_error("link down"); }),
                  std::runtime_error);
  CHECK(rm.to_vector<double>() == std::vector<double>(3, 0.0));
  CHECK(rv.to_vector<double>() == std::vector<double>(3, 1.0));
}

TEST_CASE("BatchNorm2d sync: training uses the reducer, eval is plain BN; enable walks the tree") {
  int calls = 0;
  const F::StatsAllReduce counting = [&](const Tensor&) { ++calls; };
  auto bn = std::make_shared<nn::BatchNorm2d>(3), plain = std::make_shared<nn::BatchNorm2d>(3);
  bn->to(DType::f64);
  plain->to(DType::f64);
  CHECK_FALSE(bn->sync_enabled());
  bn->set_sync(counting);
  CHECK(bn->sync_enabled());
  CHECK(bn->describe().find("sync") != std::string::npos);
  Tensor x = F::add(randn({2, 3, 3, 3}, DType::f64), 1.0), z = randn({2, 3, 3, 3}, DType::f64);
  KILN_CHECK_OK(compare(bn->forward(x), plain->forward(x), kTol, kTol));
  KILN_CHECK_OK(compare(bn->forward_relu(x, z), plain->forward_relu(x, z), kTol, kTol));
  KILN_CHECK_OK(compare(bn->forward_relu(x), plain->forward_relu(x), kTol, kTol));
  CHECK(calls == 3);
  CHECK(bn->num_batches_tracked().item() == 3);
  KILN_CHECK_OK(compare(bn->running_var(), plain->running_var(), kTol, kTol));
  bn->eval();
  plain->eval();
  KILN_CHECK_OK(compare(bn->forward_relu(x, z), plain->forward_relu(x, z), kTol, kTol));
  CHECK(calls == 3);  // eval never reduces
  bn->set_sync({});
  CHECK_FALSE(bn->sync_enabled());

  // The tree walk counts a module reachable twice once; an empty reducer is refused.
  auto shared = std::make_shared<nn::BatchNorm2d>(4);
  nn::Sequential seq{std::make_shared<nn::BatchNorm2d>(2), shared,
                     std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
                         shared, std::make_shared<nn::ReLU>()})};
  CHECK(nn::enable_sync_batch_norm(seq, counting) == 2);
  CHECK(shared->sync_enabled());
  CHECK_THROWS_AS(nn::enable_sync_batch_norm(seq, {}), Error);
}

TEST_CASE("sync BN in a ResNet over 2 ranks (cross-entropy, averaged gradients) = one big batch") {
  // models/resnet routes every BN through forward_relu, the residual blocks included.
  auto make = [] {
    auto m = models::resnet_small(/*num_classes=*/4, /*width=*/4, /*blocks=*/1);
    m->to(DType::f64);
    return m;
  };
  auto big = make();
  std::vector<std::shared_ptr<models::ResNet>> ranks = {make(), make()};
  ThreadSum sum(2);
  int64_t bns = 0;
  for (const auto& [name, m] : big->named_modules()) bns += m->type_name() == "BatchNorm2d";
  REQUIRE(bns >= 7);
  for (int r = 0; r < 2; ++r)
    CHECK(nn::enable_sync_batch_norm(*ranks[size_t(r)], sum.for_rank(r)) == bns);

  Generator gen(21);
  Tensor x = randn({6, 1, 8, 8}, TensorOptions(DType::f64), &gen);
  Tensor labels = from_vector<int64_t>({0, 3, 1, 2, 2, 0}, {6}, DType::i64);
  Tensor logits = big->forward(x);
  F::cross_entropy(logits, labels).backward();
  std::vector<Tensor> out(2);
  run_ranks(sum, 2, [&](int r) {
    Tensor lr = ranks[size_t(r)]->forward(x.narrow(0, 3 * r, 3));
    F::cross_entropy(lr, labels.narrow(0, 3 * r, 3)).backward();
    out[size_t(r)] = lr.detach();
  });
  KILN_CHECK_OK(compare(out[0], logits.narrow(0, 0, 3), 1e-9, 1e-9));
  KILN_CHECK_OK(compare(out[1], logits.narrow(0, 3, 3), 1e-9, 1e-9));
  const auto want = big->named_parameters();
  const auto p0 = ranks[0]->named_parameters(), p1 = ranks[1]->named_parameters();
  for (size_t i = 0; i < want.size(); ++i) {
    CAPTURE(want[i].first);
    Tensor avg = F::mul(F::add(p0[i].second.grad(), p1[i].second.grad()), 0.5);
    KILN_CHECK_OK(compare(avg, want[i].second.grad(), 1e-9, 1e-7));
  }
  const auto bufs = big->named_buffers(), b0 = ranks[0]->named_buffers();
  for (size_t i = 0; i < bufs.size(); ++i) {
    CAPTURE(bufs[i].first);
    KILN_CHECK_OK(compare(b0[i].second.to(DType::f64), bufs[i].second.to(DType::f64), 1e-9, 1e-9));
  }
}

TEST_CASE("kiln-train --sync-bn flag") {
  CHECK_FALSE(train::parse_args({}).sync_bn);
  CHECK(train::parse_args({"--sync-bn"}).sync_bn);
  CHECK(train::usage().find("--sync-bn") != std::string::npos);
}
