// The graph executor (cuda/graph.h): a small ResNet trained with SGD + momentum, replayed as a
// CUDA graph, must match eager training bit for bit (loss, parameters, BN statistics, momentum);
// re-capture on a new batch size, eager fallback, a host sync refused during capture, and
// reserved memory across repeated graph creation.
//
// The capture case alone (e.g. under compute-sanitizer):
//   gpu_test_graph -tc="graph: replay is bit-identical to eager*"
#include <doctest/doctest.h>

#include <cstring>
#include <map>
#include <memory>

#include "core/generator.h"
#include "cuda/allocator.h"
#include "cuda/check.h"
#include "cuda/conv.h"
#include "cuda/graph.h"
#include "cuda/runtime.h"
#include "models/resnet.h"
#include "ops/ops.h"
#include "optim/sgd.h"
#include "tests/gpu/gpu_test_util.h"

using namespace kiln;
using namespace kiln::gputest;

namespace {

constexpr int64_t kClasses = 10;
constexpr int64_t kSide = 12;  // images (N, 3, 12, 12)

// A model, its optimizer and one training step that reads the handles x and y. Two Trainers
// start from identical weights (the init is seeded).
struct Trainer {
  std::shared_ptr<models::ResNet> model;
  std::unique_ptr<optim::SGD> opt;
  Tensor x, y;      // the step's inputs
  Tensor loss_out;  // static output: the step's loss
  bool sync_in_step = false;

  Trainer() {
    cuda::set_conv_deterministic(true);
    model = models::resnet_small(kClasses, /*width=*/8, /*blocks_per_stage=*/1, /*in_channels=*/3);
    model->to(kGpu);
    optim::SGDOptions o;
    o.lr = 0.05;
    o.momentum = 0.9;
    o.weight_decay = 1e-3;
    opt = std::make_unique<optim::SGD>(model->parameters(), o);
    loss_out = zeros({}, gpu_opts(DType::f32));
  }

  void step() {
    opt->zero_grad();
    Tensor loss = F::cross_entropy(model->forward(x), y);
    if (sync_in_step) (void)loss.item();
    loss.backward();
    opt->step();
    loss_out.copy_(loss.detach());
  }
};

// Batches on the device, from a fixed seed.
struct Data {
  std::vector<Tensor> x, y;
  Data(const std::vector<int64_t>& batch_sizes, MemoryFormat fmt, uint64_t seed) {
    Generator gen(seed);
    for (int64_t n : batch_sizes) {
      Tensor hx = randn({n, 3, kSide, kSide}, DType::f32, &gen);
      Tensor dx = empty(hx.shape(), gpu_opts(DType::f32, fmt));
      dx.copy_(hx);
      x.push_back(dx);
      y.push_back(randint(0, kClasses, {n}, DType::i64, &gen).to(kGpu));
    }
  }
};

// Static inputs of one batch size, reused whenever that size comes back.
struct StaticInputs {
  MemoryFormat fmt;
  std::map<int64_t, std::pair<Tensor, Tensor>> by_size;
  // Points t.x, t.y at the static tensors for batch i of d (filled on the current stream).
  std::string fill(Trainer& t, const Data& d, size_t i) {
    const int64_t n = d.x[i].size(0);
    auto [it, fresh] = by_size.try_emplace(n);
    if (fresh)
      it->second = {empty(d.x[i].shape(), gpu_opts(DType::f32, fmt)),
                    empty({n}, gpu_opts(DType::i64))};
    it->second.first.copy_(d.x[i]);
    it->second.second.copy_(d.y[i]);
    t.x = it->second.first;
    t.y = it->second.second;
    return cuda::shape_fingerprint({t.x, t.y});
  }
};

// Eager reference: losses of every step (on the device until the end).
std::vector<Tensor> train_eager(Trainer& t, const Data& d) {
  std::vector<Tensor> losses;
  for (size_t i = 0; i < d.x.size(); ++i) {
    t.x = d.x[i];
    t.y = d.y[i];
    t.step();
    losses.push_back(t.loss_out.clone());
  }
  return losses;
}

void check_identical(const Tensor& got, const Tensor& want, const std::string& what) {
  REQUIRE_MESSAGE(got.shape() == want.shape(), what, ": shape ", got.shape_str(), " vs ",
                  want.shape_str());
  const std::vector<double> g = got.to_vector<double>(), w = want.to_vector<double>();
  int bad = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::memcmp(&g[i], &w[i], sizeof(double)) != 0 && bad++ < 3)
      FAIL_CHECK(what << ": element " << i << " replay " << g[i] << " eager " << w[i]);
  }
  CHECK_MESSAGE(bad == 0, what, ": ", bad, " of ", g.size(), " elements differ");
}

// Loss history, parameters, buffers (BN running stats, num_batches_tracked) and optimizer
// state of `got` equal those of `want`, bit for bit.
void check_same_training(Trainer& got, const std::vector<Tensor>& got_losses, Trainer& want,
                         const std::vector<Tensor>& want_losses) {
  REQUIRE(got_losses.size() == want_losses.size());
  for (size_t i = 0; i < got_losses.size(); ++i)
    check_identical(got_losses[i], want_losses[i], "loss of step " + std::to_string(i));
  const auto gs = got.model->state(), ws = want.model->state();
  REQUIRE(gs.size() == ws.size());
  for (size_t i = 0; i < gs.size(); ++i) check_identical(gs[i].second, ws[i].second, gs[i].first);
  const auto go = got.opt->state_dict(), wo = want.opt->state_dict();
  REQUIRE(go.size() == wo.size());
  int momentum_buffers = 0;
  for (const auto& [name, t] : wo) {
    REQUIRE_MESSAGE(go.count(name), "optimizer state ", name, " missing");
    check_identical(go.at(name), t, "optimizer " + name);
    momentum_buffers += name.find("momentum_buffer") != std::string::npos;
  }
  CHECK(momentum_buffers == int(got.model->parameters().size()));
  // The training moved the weights (so that equality says something).
  CHECK(got_losses.front().item() != got_losses.back().item());
}

// A host tensor in pinned memory.
struct Pinned {
  void* mem = nullptr;
  Tensor t;
  Pinned(const Shape& shape, DType dtype, MemoryFormat fmt = MemoryFormat::Contiguous) {
    const Tensor like = empty(shape, TensorOptions(dtype).with_memory_format(fmt));
    mem = cuda::alloc_pinned(like.nbytes());
    auto storage = std::make_shared<Storage>(mem, like.nbytes(), Device::cpu());
    t = make_tensor(storage, 0, like.shape(), like.strides(), like.dtype());
  }
  ~Pinned() { cuda::free_pinned(mem); }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
};

}  // namespace

namespace {

// 20 steps: 3 eager warm-up steps, the capture (launched once), 16 replays.
void check_replay_matches_eager(MemoryFormat fmt) {
  const int64_t n = 8;
  const Data data(std::vector<int64_t>(20, n), fmt, 7);
  Trainer eager;
  const std::vector<Tensor> want = train_eager(eager, data);

  Trainer graph;
  graph.x = empty(data.x[0].shape(), gpu_opts(DType::f32, fmt));
  graph.y = empty({n}, gpu_opts(DType::i64));
  // Batches travel through pinned memory and the overlapped upload (two buffers in turn).
  Pinned px0(graph.x.shape(), DType::f32, fmt), px1(graph.x.shape(), DType::f32, fmt);
  Pinned py0({n}, DType::i64), py1({n}, DType::i64);
  std::vector<Tensor> got;
  {
    cuda::GraphStep step([&] { graph.step(); }, {.warmup_steps = 3});
    step.keep(graph.x);
    step.keep(graph.y);
    const std::string fp = cuda::shape_fingerprint({graph.x, graph.y});
    for (size_t i = 0; i < data.x.size(); ++i) {
      step.wait_input_copies();  // the pinned buffer of step i-2 may be rewritten
      Pinned& px = i % 2 ? px1 : px0;
      Pinned& py = i % 2 ? py1 : py0;
      px.t.copy_(data.x[i]);
      py.t.copy_(data.y[i]);
      step.stage_input(graph.x, px.t);
      step.stage_input(graph.y, py.t);
      step.run(fp);
      got.push_back(graph.loss_out.clone());
      if (i == 3) CHECK(cuda::allocator_stats().graph_pool_bytes > 0);
    }
    const cuda::GraphStepStats& s = step.stats();
    CHECK(s.eager_steps == 3);
    CHECK(s.captures == 1);
    CHECK(s.instantiations == 1);
    CHECK(s.replays == 17);
    CHECK(step.has_graph());
    CHECK(step.captured_fingerprint() == fp);
  }
  check_same_training(graph, got, eager, want);
}

}  // namespace

TEST_CASE("graph: replay is bit-identical to eager (small ResNet, SGD momentum, 20 steps)") {
  check_replay_matches_eager(MemoryFormat::Contiguous);
}

TEST_CASE("graph: replay is bit-identical to eager with channels-last activations") {
  check_replay_matches_eager(MemoryFormat::ChannelsLast);
}

TEST_CASE("graph: a new batch size re-captures, and the results still equal eager") {
  // 6 steps at batch 8, 6 at batch 6, 4 at batch 8 again.
  std::vector<int64_t> sizes(6, 8);
  sizes.insert(sizes.end(), 6, 6);
  sizes.insert(sizes.end(), 4, 8);
  const Data data(sizes, MemoryFormat::Contiguous, 11);
  Trainer eager;
  const std::vector<Tensor> want = train_eager(eager, data);

  Trainer graph;
  StaticInputs inputs{MemoryFormat::Contiguous, {}};
  std::vector<Tensor> got;
  cuda::GraphStep step([&] { graph.step(); }, {.warmup_steps = 2, .rewarmup_steps = 1});
  for (size_t i = 0; i < data.x.size(); ++i) {
    step.run(inputs.fill(graph, data, i));
    got.push_back(graph.loss_out.clone());
  }
  const cuda::GraphStepStats& s = step.stats();
  CHECK(s.captures == 3);             // batch 8, batch 6, batch 8
  CHECK(s.eager_steps == 2 + 1 + 1);  // warm-up, then one per new shape
  CHECK(s.replays == int64_t(sizes.size()) - 4);
  CHECK(s.instantiations + s.exec_updates == 3);
  MESSAGE("re-captures: ", s.exec_updates, " by cudaGraphExecUpdate, ", s.instantiations - 1,
          " by re-instantiation");
  check_same_training(graph, got, eager, want);
}

TEST_CASE("graph: OnNewShape::Eager runs other shapes eagerly and keeps the graph") {
  // 6 steps at batch 8, 3 at batch 5 (eager), 3 at batch 8 (replayed by the first graph).
  std::vector<int64_t> sizes(6, 8);
  sizes.insert(sizes.end(), 3, 5);
  sizes.insert(sizes.end(), 3, 8);
  const Data data(sizes, MemoryFormat::Contiguous, 13);
  Trainer eager;
  const std::vector<Tensor> want = train_eager(eager, data);

  Trainer graph;
  StaticInputs inputs{MemoryFormat::Contiguous, {}};
  std::vector<Tensor> got;
  cuda::GraphStep step([&] { graph.step(); },
                       {.warmup_steps = 2, .on_new_shape = cuda::OnNewShape::Eager});
  for (size_t i = 0; i < data.x.size(); ++i) {
    step.run(inputs.fill(graph, data, i));
    got.push_back(graph.loss_out.clone());
  }
  const cuda::GraphStepStats& s = step.stats();
  CHECK(s.captures == 1);
  CHECK(s.eager_steps == 2 + 3);
  CHECK(s.replays == 4 + 3);
  check_same_training(graph, got, eager, want);
}

TEST_CASE("graph: a host sync in the step is a kiln::Error naming it; the GraphStep stays usable") {
  const Data data(std::vector<int64_t>(6, 4), MemoryFormat::Contiguous, 17);
  Trainer eager;
  const std::vector<Tensor> want = train_eager(eager, data);

  Trainer graph;
  graph.sync_in_step = true;  // fine eagerly, refused in capture
  StaticInputs inputs{MemoryFormat::Contiguous, {}};
  std::vector<Tensor> got;
  cuda::GraphStep step([&] { graph.step(); }, {.warmup_steps = 2});
  for (size_t i = 0; i < 2; ++i) {
    step.run(inputs.fill(graph, data, i));
    got.push_back(graph.loss_out.clone());
  }
  // Step 3's first attempt is the capture: refused, and nothing of it runs on the device.
  std::string fp = inputs.fill(graph, data, 2);
  std::string msg;
  try {
    step.run(fp);
    FAIL("capturing a step that calls Tensor::item() did not throw");
  } catch (const Error& e) {
    msg = e.what();
  }
  MESSAGE(msg);
  CHECK(msg.find("Tensor::item()") != std::string::npos);
  CHECK(msg.find("captur") != std::string::npos);
  CHECK(msg.find("GraphStep") != std::string::npos);
  CHECK_FALSE(step.has_graph());
  CHECK(step.stats().captures == 0);
  // Without the sync the same GraphStep captures and trains on.
  graph.sync_in_step = false;
  for (size_t i = 2; i < data.x.size(); ++i) {
    if (i > 2) fp = inputs.fill(graph, data, i);
    step.run(fp);
    got.push_back(graph.loss_out.clone());
  }
  CHECK(step.stats().captures == 1);
  check_same_training(graph, got, eager, want);

  // Other host syncs are refused the same way, and a GraphStep whose capture failed is
  // destroyed cleanly.
  for (int which = 0; which < 2; ++which) {
    Trainer t;
    inputs.fill(t, data, 0);
    cuda::GraphStep s(
        [&] {
          t.step();
          if (which == 0)
            cuda::synchronize();
          else
            (void)t.loss_out.to(Device::cpu());
        },
        {.warmup_steps = 1});
    s.run();
    try {
      s.run();
      FAIL("capture with a host sync did not throw");
    } catch (const Error& e) {
      CHECK(std::string(e.what()).find(which == 0 ? "cuda::synchronize()" : "to(cpu)") !=
            std::string::npos);
    }
  }
}

TEST_CASE("graph: creating and destroying graphs does not grow reserved memory") {
  const Data data(std::vector<int64_t>(1, 8), MemoryFormat::Contiguous, 19);
  Trainer t;
  StaticInputs inputs{MemoryFormat::Contiguous, {}};
  const std::string fp = inputs.fill(t, data, 0);
  const size_t pool_before = cuda::allocator_stats().graph_pool_bytes;
  std::vector<size_t> reserved;
  std::vector<uint64_t> mallocs;
  for (int cycle = 0; cycle < 10; ++cycle) {
    {
      cuda::GraphStep step([&] { t.step(); }, {.warmup_steps = 2});
      for (int i = 0; i < 5; ++i) step.run(fp);
      CHECK(step.stats().replays == 3);
      CHECK(cuda::allocator_stats().graph_pool_bytes > pool_before);  // the graph holds a pool
    }
    t.model->zero_grad();  // the captured step's gradients were the pool's last live blocks
    const cuda::AllocatorStats s = cuda::allocator_stats();
    CHECK(s.graph_pool_bytes == pool_before);
    reserved.push_back(s.reserved_bytes);
    mallocs.push_back(s.num_cuda_mallocs);
  }
  MESSAGE("reserved bytes per cycle: ", reserved[0], " ", reserved[1], " ", reserved[2], " ... ",
          reserved[9]);
  // The first cycles fill the caches; after that a cycle is served from them.
  CHECK(reserved[9] == reserved[2]);
  CHECK(mallocs[9] == mallocs[2]);
}

TEST_CASE("allocator: a private pool keeps its blocks until released") {
  Allocator* a = cuda::caching_allocator(0);
  const size_t bytes = size_t(4) << 20;
  cudaStream_t s = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  {
    cuda::StreamGuard guard(s);
    void* before = a->allocate(bytes);  // a general block of stream s, still live
    const cuda::AllocatorStats s0 = cuda::allocator_stats(0);
    const uint64_t pool = cuda::create_pool(0);
    cuda::open_pool(0, pool, s);
    CHECK_THROWS_AS(cuda::open_pool(0, pool, s), Error);  // one open pool per stream
    void* p = a->allocate(bytes);  // from the pool (its block, and the rest of it, join it)
    const size_t pool_p = cuda::allocator_stats(0).graph_pool_bytes;
    CHECK(pool_p >= s0.graph_pool_bytes + bytes);
    a->deallocate(before, bytes);  // freed while the pool is open: the pool adopts it
    CHECK(cuda::allocator_stats(0).graph_pool_bytes == pool_p + bytes);
    a->deallocate(p, bytes);
    void* q = a->allocate(bytes);  // served by the pool
    CHECK((q == p || q == before));
    a->deallocate(q, bytes);
    cuda::close_pool(0, pool);
    const cuda::AllocatorStats s1 = cuda::allocator_stats(0);
    void* r = a->allocate(bytes);  // pool closed: its cached blocks are not handed out
    CHECK(r != p);
    CHECK(r != before);
    a->deallocate(r, bytes);
    CHECK(cuda::allocator_stats(0).graph_pool_bytes == s1.graph_pool_bytes);
    const size_t reserved = cuda::allocator_stats(0).reserved_bytes;
    cuda::release_pool(0, pool);  // its blocks join the general cache of stream s
    CHECK(cuda::allocator_stats(0).graph_pool_bytes == s0.graph_pool_bytes);
    CHECK(cuda::allocator_stats(0).reserved_bytes == reserved);
    void* t1 = a->allocate(bytes);
    void* t2 = a->allocate(bytes);
    void* t3 = a->allocate(bytes);
    CHECK(cuda::allocator_stats(0).reserved_bytes == reserved);  // all three from the cache
    for (void* t : {t1, t2, t3}) a->deallocate(t, bytes);
    CHECK_THROWS_AS(cuda::open_pool(0, pool, s), Error);  // released
  }
  CUDA_CHECK(cudaStreamSynchronize(s));
  CUDA_CHECK(cudaStreamDestroy(s));
}

TEST_CASE("graph: option and input validation") {
  CHECK_THROWS_AS(cuda::GraphStep([] {}, {.warmup_steps = 0}), Error);
  CHECK_THROWS_AS(cuda::GraphStep(cuda::GraphStep::StepFn{}), Error);
  cuda::GraphStep step([] {});
  Tensor dev = empty({4}, gpu_opts(DType::f32));
  Tensor pageable = zeros({4}, DType::f32);
  CHECK_THROWS_AS(step.stage_input(dev, pageable), Error);  // not pinned
  CHECK_THROWS_AS(step.stage_input(dev, zeros({5}, DType::f32)), Error);
  CHECK_THROWS_AS(step.stage_input(pageable, pageable), Error);  // static input on the host
  CHECK(cuda::shape_fingerprint({dev, Tensor(), zeros({2, 3}, DType::i64)}) ==
        "f32[4]|undefined|i64[2, 3]");
  CHECK_FALSE(cuda::is_capturing());
}
