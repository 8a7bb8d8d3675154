// kiln-bench --model NAME --verify-graph: is a CUDA-graph replay of the whole training step
// bit-identical to eager steps on a real model? (contract in model_bench.h)
//
// Per batch size, in the order bench_model runs its rows: setup A runs K eager steps and is
// freed, then setup B, built the same way, runs K steps through cuda::GraphStep exactly as
// bench_model's graph rows do (stage_lr() before every run()). Neither loop synchronises the
// host between steps; after each step everything the step writes is cloned on the caller's
// stream (GraphStep::run makes that stream wait for the step), and the clones go to the host
// once the loop is over. B's first kWarmup steps run eagerly on the GraphStep's stream, the
// next one captures and launches, the rest replay.
//
// Localising a divergence, at the first step whose snapshots differ (everything was equal
// before it, so the step's inputs were): BN running statistics are written by the forward pass
// alone and describe each BN's input, so the earliest BN (registration order = forward order)
// whose statistics differ bounds where the forward pass went apart; with equal statistics, the
// gradient latest in forward order that differs is where backward (which runs from the loss
// towards the input) went apart.
// A difference during B's warm-up is between two eager runs: eager itself is not reproducible.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "core/autograd.h"
#include "core/generator.h"
#include "tools/bench/model_bench.h"
#include "tools/cli/cli.h"
#ifdef KILN_WITH_CUDA
#include "cuda/conv.h"
#include "cuda/graph.h"
#include "cuda/runtime.h"
#endif

namespace kiln::bench {

// ViTs are verified with dropout on: masks drawn inside the graph must replay as eager draws.
constexpr double kVerifyDropout = 0.1;

#ifdef KILN_WITH_CUDA
namespace {

constexpr uint64_t kSeed = 0x5eed;
constexpr int kWarmup = 3;  // GraphStep warm-up steps, as in bench_model

enum class Kind { Param, Buffer, Grad, Optim, Scaler, Metric };
constexpr Kind kKinds[] = {Kind::Param, Kind::Buffer, Kind::Grad,
                           Kind::Optim, Kind::Scaler, Kind::Metric};

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Param: return "param";
    case Kind::Buffer: return "buffer";
    case Kind::Grad: return "grad";
    case Kind::Optim: return "optim";
    case Kind::Scaler: return "scaler";
    case Kind::Metric: return "metric";
  }
  return "?";
}

struct Entry {
  std::string name;
  Kind kind;
  Tensor t;  // a clone: on the device while the loop runs, then dense on the host
};
using Snapshot = std::vector<Entry>;

// Clones (on the current stream, no synchronisation) of everything a step writes: parameters,
// buffers, gradients (views of the optimizer's arena), optimizer state, scaler state and the
// step's metric accumulators. The order is fixed by the model's registration order.
Snapshot take_snapshot(const TrainSetup& s) {
  NoGradGuard no_grad;
  Snapshot snap;
  auto add = [&](std::string name, Kind k, const Tensor& t) {
    snap.push_back({std::move(name), k, t.detach().clone()});
  };
  const std::vector<nn::NamedTensor> params = s.model->named_parameters();
  for (const auto& [n, p] : params) add(n, Kind::Param, p);
  for (const auto& [n, b] : s.model->named_buffers()) add(n, Kind::Buffer, b);
  for (const auto& [n, p] : params)
    if (p.grad().defined()) add(n + ".grad", Kind::Grad, p.grad());

  // Optimizer keys "state.<i>.<key>" number the parameters across groups in group order.
  std::vector<std::string> names;
  for (const optim::ParamGroup& g : s.opt->param_groups) {
    for (const Tensor& p : g.params) {
      std::string name = "param" + std::to_string(names.size());
      for (const auto& [n, q] : params)
        if (q.is_same(p)) name = n;
      names.push_back(name);
    }
  }
  std::vector<std::tuple<size_t, std::string, Tensor>> per_param;
  for (const auto& [key, t] : s.opt->state_dict()) {
    if (key.rfind("state.", 0) == 0) {
      const size_t dot = key.find('.', 6);
      const size_t i = std::stoul(key.substr(6, dot - 6));
      KILN_CHECK(i < names.size(), "verify-graph: optimizer key ", key, " names no parameter");
      per_param.emplace_back(i, names[i] + "." + key.substr(dot + 1), t);
    } else {
      add("opt." + key, Kind::Optim, t);
    }
  }
  std::stable_sort(per_param.begin(), per_param.end(),
                   [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
  for (const auto& [i, name, t] : per_param) add(name, Kind::Optim, t);

  add("scaler.scale", Kind::Scaler, s.scaler->scale_tensor());
  add("scaler.growth_tracker", Kind::Scaler, s.scaler->growth_tracker());
  add("scaler.found_inf", Kind::Scaler, s.scaler->found_inf());
  add("scaler.skipped", Kind::Scaler, s.scaler->skipped_steps());
  add("loss_sum", Kind::Metric, s.step->loss_sum());
  add("correct_sum", Kind::Metric, s.step->correct_sum());
  return snap;
}

// Moves the clones to the host, dense row-major (synchronises the current stream).
void to_host(Snapshot& snap) {
  NoGradGuard no_grad;
  for (Entry& e : snap) e.t = e.t.to(Device::cpu()).contiguous();
}

const Entry& entry(const Snapshot& snap, const std::string& name) {
  for (const Entry& e : snap)
    if (e.name == name) return e;
  KILN_FAIL("verify-graph: no entry ", name, " in the snapshot");
}
double value(const Snapshot& snap, const std::string& name) { return entry(snap, name).t.item(); }

struct TensorDiff {
  int64_t elements = 0;   // elements whose bits differ
  int64_t nonfinite = 0;  // of those, pairs where either side is inf or NaN
  double max_abs = 0;     // over the finite pairs
};

// Bitwise comparison of two dense host tensors of one shape and dtype; element by element when
// `detailed`, else `elements` is just 0 or 1.
TensorDiff diff(const Tensor& a, const Tensor& b, bool detailed = true) {
  TensorDiff d;
  if (std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0) return d;
  if (!detailed) {
    d.elements = 1;
    return d;
  }
  const Tensor a64 = a.to(DType::f64).contiguous(), b64 = b.to(DType::f64).contiguous();
  const double* va = a64.data<double>();
  const double* vb = b64.data<double>();
  const auto* pa = static_cast<const uint8_t*>(a.raw_data());
  const auto* pb = static_cast<const uint8_t*>(b.raw_data());
  const size_t es = a.element_size();
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (std::memcmp(pa + size_t(i) * es, pb + size_t(i) * es, es) == 0) continue;
    ++d.elements;
    if (std::isfinite(va[i]) && std::isfinite(vb[i]))
      d.max_abs = std::max(d.max_abs, std::fabs(va[i] - vb[i]));
    else
      ++d.nonfinite;
  }
  return d;
}

struct EntryDiff {
  size_t index;  // into the snapshots
  TensorDiff d;
};

std::vector<EntryDiff> compare(const Snapshot& a, const Snapshot& b, bool detailed) {
  KILN_CHECK(a.size() == b.size(), "verify-graph: the snapshots hold ", a.size(), " and ",
             b.size(), " tensors");
  std::vector<EntryDiff> out;
  for (size_t i = 0; i < a.size(); ++i) {
    const Tensor &ta = a[i].t, &tb = b[i].t;
    KILN_CHECK(a[i].name == b[i].name && ta.shape() == tb.shape() && ta.dtype() == tb.dtype(),
               "verify-graph: snapshot entry ", i, " is ", a[i].name, " ", ta.desc(), " in A but ",
               b[i].name, " ", tb.desc(), " in B");
    const TensorDiff d = diff(ta, tb, detailed);
    if (d.elements > 0) out.push_back({i, d});
  }
  return out;
}

std::string describe(const Snapshot& a, const EntryDiff& e) {
  char buf[320];
  std::snprintf(buf, sizeof buf, "%s (%ld of %ld elements, max |diff| %.3g%s)",
                a[e.index].name.c_str(), long(e.d.elements), long(a[e.index].t.numel()),
                e.d.max_abs, e.d.nonfinite ? ", some inf/NaN" : "");
  return buf;
}

// Per kind: how many tensors differ, the first few in registration order and the last one.
void print_diffs(const Snapshot& a, const std::vector<EntryDiff>& diffs) {
  for (Kind k : kKinds) {
    size_t total = 0;
    for (const Entry& e : a) total += e.kind == k;
    std::vector<EntryDiff> ks;
    for (const EntryDiff& d : diffs)
      if (a[d.index].kind == k) ks.push_back(d);
    if (total == 0) continue;
    if (ks.empty()) {
      std::printf("    %-7s all %zu equal\n", kind_name(k), total);
      continue;
    }
    double max_abs = 0;
    int64_t nonfinite = 0;
    for (const EntryDiff& d : ks) {
      max_abs = std::max(max_abs, d.d.max_abs);
      nonfinite += d.d.nonfinite;
    }
    std::printf("    %-7s %zu of %zu DIFFER, max |diff| %.3g, %ld inf/NaN element mismatches\n",
                kind_name(k), ks.size(), total, max_abs, long(nonfinite));
    for (size_t i = 0; i < ks.size() && i < 4; ++i)
      std::printf("      %s\n", describe(a, ks[i]).c_str());
    if (ks.size() > 5) std::printf("      ... %zu more ...\n", ks.size() - 5);
    if (ks.size() > 4) std::printf("      last: %s\n", describe(a, ks.back()).c_str());
  }
}

// Where the first differing step went apart (see the file comment): prints the reasoning,
// returns a few words for the verdict.
std::string print_localisation(const Snapshot& a, const std::vector<EntryDiff>& diffs,
                               bool loss_differs) {
  auto module_of = [](const std::string& name) { return name.substr(0, name.rfind('.')); };
  const EntryDiff* first_buffer = nullptr;
  const EntryDiff* last_grad = nullptr;
  for (const EntryDiff& d : diffs) {
    if (a[d.index].kind == Kind::Buffer && !first_buffer) first_buffer = &d;
    if (a[d.index].kind == Kind::Grad) last_grad = &d;
  }
  if (first_buffer) {
    // Running statistics describe a BN's input: the previous BN's input still matched.
    const std::string bn = module_of(a[first_buffer->index].name);
    std::string previous;
    for (size_t i = 0; i < first_buffer->index; ++i)
      if (a[i].kind == Kind::Buffer && module_of(a[i].name) != bn) previous = module_of(a[i].name);
    std::printf("  localisation: the earliest BN whose running statistics differ is %s: the "
                "forward pass went apart between %s and %s's statistics (the layers in between, "
                "or that BN's own statistics)\n",
                bn.c_str(), previous.empty() ? "the input" : ("the input of " + previous).c_str(),
                bn.c_str());
    return "forward apart at or before the input of " + bn;
  }
  if (loss_differs) {
    std::printf("  localisation: all BN statistics equal but the loss differs: the forward pass "
                "went apart after the last BN's input (last BN, pooling, fc, loss)\n");
    return "forward apart after the last BN's input";
  }
  if (last_grad) {
    std::printf("  localisation: forward equal (BN statistics and loss); the gradient latest in "
                "forward order that differs is %s: backward went apart there\n",
                a[last_grad->index].name.c_str());
    return "backward apart at " + a[last_grad->index].name;
  }
  std::printf("  localisation: forward and gradients equal: the optimizer or loss-scaler update "
              "went apart\n");
  return "optimizer or loss-scaler update apart";
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<Snapshot> run_eager(const TrainSetup& s, const Tensor& x, const Tensor& y, int steps) {
  std::vector<Snapshot> snaps{take_snapshot(s)};
  for (int i = 0; i < steps; ++i) {
    s.step->reset_metrics();
    s.step->run(x, y);
    snaps.push_back(take_snapshot(s));
  }
  cuda::synchronize();
  for (Snapshot& sn : snaps) to_host(sn);
  return snaps;
}

// modes[i]: what GraphStep did for step i + 1 ("warm-up", "capture", "replay").
std::vector<Snapshot> run_graph(const TrainSetup& s, const Tensor& x, const Tensor& y, int steps,
                                std::vector<std::string>& modes) {
  std::vector<Snapshot> snaps{take_snapshot(s)};
  {
    cuda::GraphStep g([&] { s.step->run(x, y); }, {.warmup_steps = kWarmup});
    for (int i = 0; i < steps; ++i) {
      s.step->reset_metrics();  // on the caller's stream, which g.run() waits for
      const cuda::GraphStepStats before = g.stats();
      s.opt->stage_lr();
      g.run();
      const cuda::GraphStepStats& after = g.stats();
      modes.push_back(after.eager_steps > before.eager_steps ? "warm-up"
                      : after.captures > before.captures   ? "capture"
                                                           : "replay");
      snaps.push_back(take_snapshot(s));
    }
    g.synchronize();
  }
  cuda::synchronize();
  for (Snapshot& sn : snaps) to_host(sn);
  return snaps;
}

// Sets convolution determinism; restores the previous setting on every exit.
class DeterministicConvs {
 public:
  explicit DeterministicConvs(bool on) : previous_(cuda::conv_deterministic()) {
    cuda::set_conv_deterministic(on);
  }
  ~DeterministicConvs() { cuda::set_conv_deterministic(previous_); }
  DeterministicConvs(const DeterministicConvs&) = delete;
  DeterministicConvs& operator=(const DeterministicConvs&) = delete;

 private:
  bool previous_;
};

bool verify_batch(const ModelBenchOptions& o, int64_t batch) {
  const Device dev = Device::cuda(0);
  const int K = o.verify_steps;
  std::printf("\n== verify-graph %s batch %ld: %d eager steps (A) vs %d GraphStep steps (B: %d "
              "warm-up, 1 capture, %d replays), %s\n",
              o.model.c_str(), long(batch), K, K, kWarmup, K - kWarmup - 1,
              o.verify_deterministic ? "deterministic convolutions"
                                     : "cuDNN's fastest convolutions (not necessarily "
                                       "deterministic: bitwise equality is not expected)");
  std::fflush(stdout);

  manual_seed(kSeed);
  const Tensor x = amp::prepare_input(randn({batch, 3, o.image_size, o.image_size}), dev, o.precision);
  const Tensor y = randint(0, 1000, {batch}, TensorOptions(DType::i64).with_device(dev));

  // Both setups are built from the same global generator state; the states after the builds
  // and a bitwise comparison of the initial snapshots (below) check that they start identical.
  std::vector<Snapshot> a, b;
  std::vector<std::string> modes;
  std::string seeded, gen_a, gen_b;
  auto t0 = std::chrono::steady_clock::now();
  {
    manual_seed(kSeed);
    seeded = default_generator().state();
    TrainSetup s = make_train_setup(o.model, dev, o.precision, kVerifyDropout);
    gen_a = default_generator().state();
    a = run_eager(s, x, y, K);
  }
  std::printf("  A (eager): %d steps and snapshots in %.1f s\n", K, seconds_since(t0));
  std::fflush(stdout);
  t0 = std::chrono::steady_clock::now();
  {
    manual_seed(kSeed);
    TrainSetup s = make_train_setup(o.model, dev, o.precision, kVerifyDropout);
    gen_b = default_generator().state();
    b = run_graph(s, x, y, K, modes);
  }
  std::printf("  B (graph): %d steps and snapshots in %.1f s\n", K, seconds_since(t0));
  std::fflush(stdout);

  // Element-level detail only where it is printed: the start, the first differing step, the end.
  std::vector<std::vector<EntryDiff>> diffs;
  bool seen = false;
  for (int s = 0; s <= K; ++s) {
    std::vector<EntryDiff> d = compare(a[size_t(s)], b[size_t(s)], false);
    if (!d.empty() && (!seen || s == K)) d = compare(a[size_t(s)], b[size_t(s)], true);
    seen = seen || !d.empty();
    diffs.push_back(std::move(d));
  }
  const size_t n = a[0].size();
  const std::string start = diffs[0].empty()
                                ? "all " + std::to_string(n) + " tensors bitwise equal"
                                : std::to_string(diffs[0].size()) + " of " + std::to_string(n) +
                                      " tensors DIFFER";
  std::printf("  start: global generator state after building A %s after building B (%s by the "
              "build); initial state of A and B: %s\n",
              gen_a == gen_b ? "==" : "!=", gen_a == seeded ? "unchanged" : "advanced",
              start.c_str());
  if (!diffs[0].empty()) print_diffs(a[0], diffs[0]);

  std::printf("  %4s  %-7s  %-15s  %-15s  %-5s  %-11s  %-11s  %-10s  %-10s  %s\n", "step", "B mode",
              "eager loss", "graph loss", "loss", "eager scale", "graph scale", "eager skip",
              "graph skip", "tensors differing");
  int first_diff = diffs[0].empty() ? -1 : 0, first_loss_diff = -1;
  for (int s = 1; s <= K; ++s) {
    const Snapshot &sa = a[size_t(s)], &sb = b[size_t(s)];
    const bool loss_equal = diff(entry(sa, "loss_sum").t, entry(sb, "loss_sum").t).elements == 0;
    if (!loss_equal && first_loss_diff < 0) first_loss_diff = s;
    if (!diffs[size_t(s)].empty() && first_diff < 0) first_diff = s;
    auto skip = [&](const std::vector<Snapshot>& v) {
      const double now = value(v[size_t(s)], "scaler.skipped");
      return std::string(now > value(v[size_t(s) - 1], "scaler.skipped") ? "yes" : "no") + " (" +
             std::to_string(long(now)) + ")";
    };
    std::printf("  %4d  %-7s  %-15.9g  %-15.9g  %-5s  %-11g  %-11g  %-10s  %-10s  %zu of %zu\n", s,
                modes[size_t(s) - 1].c_str(), value(sa, "loss_sum") / double(batch),
                value(sb, "loss_sum") / double(batch), loss_equal ? "equal" : "DIFF",
                value(sa, "scaler.scale"), value(sb, "scaler.scale"), skip(a).c_str(),
                skip(b).c_str(), diffs[size_t(s)].size(), n);
  }
  std::fflush(stdout);

  std::string where;
  if (first_diff > 0) {
    std::printf("  first differing step %d (B mode %s):\n", first_diff,
                modes[size_t(first_diff) - 1].c_str());
    print_diffs(a[size_t(first_diff)], diffs[size_t(first_diff)]);
    where = print_localisation(a[size_t(first_diff)], diffs[size_t(first_diff)],
                               first_loss_diff == first_diff);
  }
  std::printf("  after step %d:\n", K);
  print_diffs(a[size_t(K)], diffs[size_t(K)]);
  std::printf("  skipped steps: eager %ld of %d, graph %ld of %d; final scale eager %g, graph %g\n",
              long(value(a[size_t(K)], "scaler.skipped")), K,
              long(value(b[size_t(K)], "scaler.skipped")), K, value(a[size_t(K)], "scaler.scale"),
              value(b[size_t(K)], "scaler.scale"));

  if (first_diff < 0) {
    std::printf("verdict: graph replay matches eager bitwise at batch %ld (%d steps, %zu tensors "
                "per step)\n", long(batch), K, n);
  } else if (first_diff == 0) {
    std::printf("verdict: DIFFERS at batch %ld: before the first step (the setups are not built "
                "identically)\n", long(batch));
  } else {
    const std::string& mode = modes[size_t(first_diff) - 1];
    const std::string loss = first_loss_diff < 0
                                 ? "losses equal at every step"
                                 : "first loss difference at step " + std::to_string(first_loss_diff);
    std::printf("verdict: DIFFERS at batch %ld: first step %d (B %s), %zu of %zu tensors differ, "
                "%s; %s%s\n",
                long(batch), first_diff, mode.c_str(), diffs[size_t(first_diff)].size(), n,
                where.c_str(), loss.c_str(),
                mode == "warm-up" ? "; B was still eager: eager steps are not reproducible" : "");
  }
  std::fflush(stdout);
  return first_diff < 0;
}

}  // namespace

bool verify_graph(const ModelBenchOptions& o) {
  if (cuda::device_count() == 0)
    cli::usage_error("--verify-graph runs on the GPU, and no CUDA device is visible");
  if (o.verify_steps < kWarmup + 2)
    cli::usage_error("--verify-steps ", o.verify_steps, ": expected an integer >= ", kWarmup + 2,
                     " (", kWarmup, " warm-up steps, a capture, a replay)");
  DeterministicConvs deterministic(o.verify_deterministic);
  bool all = true;
  std::vector<int64_t> differs;
  for (int64_t batch : o.batches)
    if (!verify_batch(o, batch)) {
      all = false;
      differs.push_back(batch);
    }
  std::printf("\nverify-graph %s: %s", o.model.c_str(),
              all ? "graph replay matches eager bitwise at every batch\n" : "DIFFERS at batch");
  for (int64_t b : differs) std::printf(" %ld", long(b));
  if (!all) std::printf("\n");
  std::fflush(stdout);
  return all;
}
#else
bool verify_graph(const ModelBenchOptions&) {
  cli::usage_error(
      "--verify-graph compares CUDA graph replay with eager steps on the GPU, and "
      "this kiln was built without CUDA");
}
#endif

}  // namespace kiln::bench
