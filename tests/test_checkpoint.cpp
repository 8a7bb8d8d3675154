// Checkpoints: weights files with torchvision's keys, load errors, dtype and layout handling,
// training checkpoints, atomic saves under simulated crashes, and bit-exact resume.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "core/autograd.h"
#include "optim/checkpoint.h"
#include "models/resnet.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "optim/sgd.h"
#include "tests/gradcheck.h"
#include "tests/test_util.h"

using namespace kiln;
namespace fs = std::filesystem;
using kiln::testing::error_of;

namespace {

// One folder per test process, removed at exit (a forked child leaves through _exit).
struct TempDir {
  fs::path dir = fs::temp_directory_path() / ("kiln_test_ckpt_" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(dir); }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

std::string temp_path(const std::string& name) {
  static TempDir tmp;
  return (tmp.dir / name).string();
}

std::shared_ptr<models::ResNet> small_net(uint64_t seed) {
  models::ResNetOptions o;
  o.num_classes = 10;
  o.in_channels = 1;
  o.width = 8;
  o.imagenet_stem = false;
  o.seed = seed;
  return std::make_shared<models::ResNet>(models::BlockKind::Basic, std::vector<int64_t>{1, 1, 1},
                                          o);
}

// Raw bytes of a CPU copy: "bitwise equal" without NaN or -0 subtleties.
std::string bytes_of(const Tensor& t) {
  Tensor c = t.detach().to(Device::cpu()).contiguous();
  return std::string(static_cast<const char*>(c.raw_data()), c.nbytes());
}

bool same_tensor(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && bytes_of(a) == bytes_of(b);
}

// Random BN statistics and counters, so swapped or skipped buffers show up.
void randomize_buffers(nn::Module& m, uint64_t seed) {
  Generator g(seed);
  NoGradGuard no_grad;
  for (auto& [name, b] : m.named_buffers()) {
    if (is_floating(b.dtype())) b.copy_(uniform(b.shape(), 0.5, 1.5, {}, &g));
    else b.fill_(double(g.below(1000)));
  }
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// A module with one channels-last conv weight, one f32 vector and one i64 counter.
class LayoutNet : public nn::Module {
 public:
  LayoutNet() {
    w_ = register_parameter(
        "w", zeros({4, 3, 2, 2}, TensorOptions().with_memory_format(MemoryFormat::ChannelsLast)));
    b_ = register_parameter("b", zeros({4}));
    n_ = register_buffer("n", zeros({}, DType::i64));
  }
  Tensor forward(const Tensor& x) override { return x; }
  std::string type_name() const override { return "LayoutNet"; }
  Tensor w_, b_, n_;
};

}  // namespace

TEST_CASE("state_dict: torchvision's keys and order, num_batches_tracked as 0-d i64") {
  auto m = models::resnet18(10);
  NamedTensors sd = state_dict(*m);
  REQUIRE(sd.size() == 122);  // len(torchvision.models.resnet18().state_dict())
  const char* head[] = {"conv1.weight",      "bn1.weight",         "bn1.bias",
                        "bn1.running_mean",  "bn1.running_var",    "bn1.num_batches_tracked",
                        "layer1.0.conv1.weight", "layer1.0.bn1.weight"};
  for (size_t i = 0; i < std::size(head); ++i) CHECK(sd[i].first == head[i]);
  CHECK(sd[121].first == "fc.bias");
  CHECK(sd[5].second.dtype() == DType::i64);
  CHECK(sd[5].second.dim() == 0);
  CHECK(state_dict(*models::resnet50()).size() == 320);
  // Same entries as Module::state(), which lists all parameters before all buffers.
  std::set<std::string> a, b;
  for (auto& [n, t] : sd) a.insert(n);
  for (auto& [n, t] : m->state()) b.insert(n);
  CHECK(a == b);
}

TEST_CASE("weights round trip into a fresh resnet18: every tensor equal") {
  auto src = models::make_model("resnet18", 10);
  randomize_buffers(*src, 7);
  std::string path = temp_path("r18.safetensors");
  save_weights(path, *src, WeightsDType::Float32, {{"arch", "resnet18"}});
  SafetensorsData file = load_safetensors(path);
  CHECK(file.metadata.at("arch") == "resnet18");
  CHECK(file.at("bn1.num_batches_tracked").dtype() == DType::i64);

  models::ResNetOptions o;
  o.num_classes = 10;
  o.seed = 12345;  // different initial weights
  auto dst = std::make_shared<models::ResNet>(models::BlockKind::Basic,
                                              std::vector<int64_t>{2, 2, 2, 2}, o);
  CHECK_FALSE(same_tensor(dst->state()[0].second, src->state()[0].second));
  LoadReport r = load_weights(path, *dst);
  CHECK(r.missing_keys.empty());
  CHECK(r.unexpected_keys.empty());
  NamedTensors a = state_dict(*src), b = state_dict(*dst);
  REQUIRE(a.size() == b.size());
  int differing = 0;
  for (size_t i = 0; i < a.size(); ++i) differing += !same_tensor(a[i].second, b[i].second);
  CHECK(differing == 0);
  // Parameters stay leaves that require grad.
  CHECK(dst->parameters()[0].requires_grad());
  CHECK(dst->parameters()[0].is_leaf());
}

TEST_CASE("save_weights dtype option: f32 by default, as stored on request") {
  auto m = small_net(1);
  m->to(DType::f16);
  std::string path = temp_path("f16.safetensors");
  save_weights(path, *m);
  SafetensorsData f = load_safetensors(path);
  CHECK(f.at("conv1.weight").dtype() == DType::f32);
  CHECK(f.at("bn1.num_batches_tracked").dtype() == DType::i64);
  CHECK(f.at("conv1.weight").to_vector<float>() ==
        m->state()[0].second.to_vector<float>());  // f16 -> f32 is exact
  save_weights(path, *m, WeightsDType::AsStored);
  f = load_safetensors(path);
  CHECK(f.at("conv1.weight").dtype() == DType::f16);
  CHECK(f.at("bn1.num_batches_tracked").dtype() == DType::i64);
  CHECK(same_tensor(f.at("conv1.weight"), m->state()[0].second));
}

TEST_CASE("load keeps the module's dtype and memory format, converting values") {
  std::string path = temp_path("layout.safetensors");
  Tensor w = randn({4, 3, 2, 2}, DType::f64);
  save_safetensors(path, {{"w", w}, {"b", tensor({1, 2, 3, 4})}, {"n", full({}, 42, DType::i32)}});
  LayoutNet net;
  Tensor w_handle = net.w_;
  load_weights(path, net);
  CHECK(net.w_.is_same(w_handle));  // loaded in place
  CHECK(net.w_.dtype() == DType::f32);
  CHECK(net.w_.is_contiguous(MemoryFormat::ChannelsLast));
  CHECK_FALSE(net.w_.is_contiguous());
  CHECK(net.w_.to_vector<float>() == w.to(DType::f32).to_vector<float>());
  CHECK(net.b_.to_vector<float>() == std::vector<float>{1, 2, 3, 4});
  CHECK(net.n_.dtype() == DType::i64);
  CHECK(net.n_.item() == 42);

  // f32 file into an f16 module: values rounded to f16.
  auto m16 = small_net(3);
  auto m32 = small_net(4);
  m16->to(DType::f16);
  std::string p2 = temp_path("to16.safetensors");
  save_weights(p2, *m32);
  load_weights(p2, *m16);
  Tensor w16 = m16->state()[0].second;
  CHECK(w16.dtype() == DType::f16);
  CHECK(same_tensor(w16, m32->state()[0].second.to(DType::f16)));
}

TEST_CASE("load errors name the file and the key") {
  std::string path = temp_path("bad.safetensors");
  LayoutNet net;
  Tensor w = randn({4, 3, 2, 2}), b = randn({4}), n = full({}, 3, DType::i64);
  std::vector<float> before = net.b_.to_vector<float>();

  SUBCASE("shape mismatch gives both shapes") {
    save_safetensors(path, {{"w", randn({4, 3, 3, 3})}, {"b", b}, {"n", n}});
    std::string e = error_of([&] { load_weights(path, net); });
    CHECK(contains(e, path));
    CHECK(contains(e, "'w'"));
    CHECK(contains(e, "[4, 3, 3, 3]"));
    CHECK(contains(e, "[4, 3, 2, 2]"));
    // Also in lenient mode: a wrong shape is never skipped silently.
    CHECK_THROWS_AS(load_weights(path, net, KeyMatch::Lenient), Error);
  }
  SUBCASE("missing key (strict)") {
    save_safetensors(path, {{"w", w}, {"n", n}});
    std::string e = error_of([&] { load_weights(path, net); });
    CHECK(contains(e, path));
    CHECK(contains(e, "missing keys 'b' (1 in all)"));
    CHECK_FALSE(contains(e, "unexpected"));
  }
  SUBCASE("unexpected key (strict)") {
    save_safetensors(path, {{"w", w}, {"b", b}, {"n", n}, {"extra.weight", b}});
    std::string e = error_of([&] { load_weights(path, net); });
    CHECK(contains(e, "unexpected keys 'extra.weight' (1 in all)"));
    CHECK_FALSE(contains(e, "missing"));
  }
  SUBCASE("floating file tensor for an integer buffer, and the reverse") {
    save_safetensors(path, {{"w", w}, {"b", b}, {"n", full({}, 3.0)}});
    std::string e = error_of([&] { load_weights(path, net); });
    CHECK(contains(e, "'n' is f32"));
    CHECK(contains(e, "i64"));
    save_safetensors(path, {{"w", w}, {"b", full({4}, 1, DType::i64)}, {"n", n}});
    e = error_of([&] { load_weights(path, net); });
    CHECK(contains(e, "'b' is i64"));
  }
  SUBCASE("lenient mode loads the common keys and reports the others") {
    save_safetensors(path, {{"b", b}, {"zz", b}, {"n", n}});
    LoadReport r = load_weights(path, net, KeyMatch::Lenient);
    CHECK(r.missing_keys == std::vector<std::string>{"w"});
    CHECK(r.unexpected_keys == std::vector<std::string>{"zz"});
    CHECK(net.b_.to_vector<float>() == b.to_vector<float>());
    CHECK(net.n_.item() == 3);
    before = net.b_.to_vector<float>();
  }
  SUBCASE("missing file") {
    std::string e = error_of([&] { load_weights(temp_path("nope.safetensors"), net); });
    CHECK(contains(e, "nope.safetensors"));
  }
  // Failed loads change nothing (validation precedes every copy).
  CHECK(net.b_.to_vector<float>() == before);
}

TEST_CASE("strict errors list at most 10 keys of each kind, with the count") {
  auto m = models::resnet18(10);
  std::string path = temp_path("trunc.safetensors");
  NamedTensors sd = state_dict(*m), kept, extra;
  for (size_t i = 0; i < sd.size(); ++i)
    if (i >= 15) kept.push_back(sd[i]);
  for (int i = 0; i < 12; ++i) kept.emplace_back("junk." + std::to_string(i), ones({1}));
  save_safetensors(path, kept);
  std::string e = error_of([&] { load_weights(path, *m); });
  CHECK(contains(e, "missing keys 'conv1.weight', 'bn1.weight'"));
  CHECK(contains(e, ", ... (15 in all)"));
  CHECK(contains(e, "unexpected keys 'junk.0'"));
  CHECK(contains(e, ", ... (12 in all)"));
  CHECK_FALSE(contains(e, "junk.10"));
  LoadReport r = load_weights(path, *m, KeyMatch::Lenient);
  CHECK(r.missing_keys.size() == 15);
  CHECK(r.unexpected_keys.size() == 12);
}

// ---- training checkpoints ----

namespace {

enum class OptKind { SGD, AdamW };

std::unique_ptr<optim::Optimizer> make_optimizer(OptKind kind, const nn::Module& m) {
  if (kind == OptKind::SGD) {
    optim::SGDOptions o;
    o.lr = 0.05;
    o.momentum = 0.9;
    o.nesterov = true;
    o.weight_decay = 1e-4;
    return std::make_unique<optim::SGD>(optim::split_weight_decay(m, o.group()));
  }
  optim::AdamWOptions o;
  o.lr = 2e-3;
  return std::make_unique<optim::AdamW>(optim::split_weight_decay(m, o.group()));
}

// A 32-image data set of (1, 8, 8) images with labels in [0, 10).
struct Data {
  std::vector<float> x;
  std::vector<int64_t> y;
  static constexpr int64_t kN = 32, kPixels = 64, kBatch = 8;
  Data() {
    Generator g(2024);
    x = randn({kN, kPixels}, {}, &g).to_vector<float>();
    y = randint(0, 10, {kN}, DType::i64, &g).to_vector<int64_t>();
  }
};

// Steps [from, to): batches drawn by `data_gen`, input noise from kiln::default_generator(), a
// step-dependent learning rate.
void train_steps(nn::Module& model, optim::Optimizer& opt, Generator& data_gen, const Data& d,
                 int from, int to) {
  model.train();
  for (int s = from; s < to; ++s) {
    std::vector<float> bx;
    std::vector<int64_t> by;
    for (int64_t i = 0; i < Data::kBatch; ++i) {
      int64_t k = int64_t(data_gen.below(Data::kN));
      bx.insert(bx.end(), d.x.begin() + k * Data::kPixels, d.x.begin() + (k + 1) * Data::kPixels);
      by.push_back(d.y[size_t(k)]);
    }
    Tensor x = from_vector(bx, {Data::kBatch, 1, 8, 8});
    x = x + 0.05 * randn(x.shape());
    Tensor loss = F::cross_entropy(model(x), from_vector(by, {Data::kBatch}, DType::i64));
    opt.zero_grad();
    loss.backward();
    for (auto& g : opt.param_groups) g.lr = g.initial_lr * (1.0 - 0.05 * s);
    opt.step();
  }
}

// "" when both models and both optimizers hold bitwise-equal state, else the first difference.
std::string compare_state(const nn::Module& a, const nn::Module& b, const optim::Optimizer& oa,
                          const optim::Optimizer& ob) {
  NamedTensors sa = state_dict(a), sb = state_dict(b);
  if (sa.size() != sb.size()) return "model tensor counts differ";
  for (size_t i = 0; i < sa.size(); ++i)
    if (!same_tensor(sa[i].second, sb[i].second)) return "model tensor " + sa[i].first;
  auto da = oa.state_dict(), db = ob.state_dict();
  if (da.size() != db.size()) return "optimizer state sizes differ";
  for (auto& [k, t] : da)
    if (!db.count(k) || !same_tensor(t, db.at(k))) return "optimizer state " + k;
  return "";
}

}  // namespace

TEST_CASE("training checkpoint round trip: model, optimizer, scaler, RNG, epoch/step, metadata") {
  Data d;
  manual_seed(11);
  auto model = small_net(0);
  auto opt = make_optimizer(OptKind::SGD, *model);
  Generator data_gen(5);
  train_steps(*model, *opt, data_gen, d, 0, 2);

  TrainingState st;
  st.model = model.get();
  st.optimizer = opt.get();
  st.scaler = {{"scale", full({}, 65536.0)}, {"growth_tracker", full({}, 17, DType::i32)}};
  st.generators = {{"data", &data_gen}};
  st.epoch = 3;
  st.step = 17;
  st.metadata = {{"arch", "resnet_small"}, {"args", "--lr 0.05 --epochs 9"}};
  std::string path = temp_path("train.ckpt");
  save_checkpoint(path, st);
  std::string default_state = default_generator().state(), data_state = data_gen.state();
  SafetensorsData raw = load_safetensors(path);
  CHECK(raw.contains("model.conv1.weight"));
  CHECK(raw.contains("optim.state.0.momentum_buffer"));
  CHECK(raw.contains("optim.group.1.lr"));
  CHECK(raw.contains("scaler.scale"));
  CHECK((raw.metadata.at("kiln.rng.data") == data_state));
  CHECK(raw.metadata.at("arch") == "resnet_small");

  default_generator().manual_seed(999);
  auto fresh = small_net(77);
  auto fresh_opt = make_optimizer(OptKind::SGD, *fresh);
  Generator fresh_gen(1);
  TrainingState in;
  in.model = fresh.get();
  in.optimizer = fresh_opt.get();
  in.generators = {{"data", &fresh_gen}};
  load_checkpoint(path, in);
  KILN_CHECK_OK(compare_state(*model, *fresh, *opt, *fresh_opt));
  CHECK((default_generator().state() == default_state));
  CHECK((fresh_gen.state() == data_state));
  CHECK(in.epoch == 3);
  CHECK(in.step == 17);
  CHECK(in.metadata == st.metadata);
  REQUIRE(in.scaler.size() == 2);
  CHECK(in.scaler.at("scale").item() == 65536.0);
  CHECK(in.scaler.at("growth_tracker").dtype() == DType::i32);
  CHECK(in.scaler.at("growth_tracker").item() == 17);
  CHECK(fresh_opt->param_groups[0].lr == opt->param_groups[0].lr);
}

TEST_CASE("training checkpoint errors") {
  Data d;
  auto model = small_net(0);
  auto opt = make_optimizer(OptKind::SGD, *model);
  Generator data_gen(5);
  train_steps(*model, *opt, data_gen, d, 0, 1);
  TrainingState st;
  st.model = model.get();
  st.optimizer = opt.get();
  st.generators = {{"data", &data_gen}};
  std::string path = temp_path("err.ckpt");
  save_checkpoint(path, st);

  auto other = small_net(3);
  auto other_opt = make_optimizer(OptKind::SGD, *other);
  train_steps(*other, *other_opt, data_gen, d, 0, 1);
  std::string other_bytes = bytes_of(other->state()[0].second);
  auto before_opt = other_opt->state_dict();
  std::string before_rng = default_generator().state();
  auto unchanged = [&] {
    CHECK(bytes_of(other->state()[0].second) == other_bytes);
    CHECK((default_generator().state() == before_rng));
    auto now = other_opt->state_dict();
    REQUIRE(now.size() == before_opt.size());
    for (auto& [k, t] : before_opt) CHECK(same_tensor(now.at(k), t));
  };
  TrainingState in;
  in.model = other.get();
  in.optimizer = other_opt.get();

  SUBCASE("reserved metadata key") {
    st.metadata = {{"kiln.step", "5"}};
    CHECK(contains(error_of([&] { save_checkpoint(path, st); }), "reserved prefix"));
  }
  SUBCASE("a weights file is not a training checkpoint") {
    std::string wpath = temp_path("w.safetensors");
    save_weights(wpath, *model);
    std::string e = error_of([&] { load_checkpoint(wpath, in); });
    CHECK(contains(e, "not a kiln training checkpoint"));
    CHECK(contains(e, wpath));
  }
  SUBCASE("a requested generator is not in the file") {
    Generator g;
    in.generators = {{"augment", &g}};
    std::string e = error_of([&] { load_checkpoint(path, in); });
    CHECK(contains(e, "kiln.rng.augment"));
  }
  SUBCASE("optimizer state in the file but no optimizer given") {
    in.optimizer = nullptr;
    CHECK(contains(error_of([&] { load_checkpoint(path, in); }), "TrainingState.optimizer is null"));
  }
  SUBCASE("model of another shape: nothing changes") {
    auto wide = models::resnet_small(10, 16);
    TrainingState bad;
    bad.model = wide.get();
    std::string e = error_of([&] { load_checkpoint(path, bad); });
    CHECK(contains(e, "model.conv1.weight"));
    CHECK(contains(e, path));
  }
  SUBCASE("bad optimizer state: model, optimizer and RNG keep their state") {
    SafetensorsData raw = load_safetensors(path);
    NamedTensors t;
    for (auto& [k, v] : raw.tensors)
      t.emplace_back(k, k == "optim.state.3.momentum_buffer" ? ones({2, 2}) : v);
    save_safetensors(path, t, raw.metadata);
    std::string e = error_of([&] { load_checkpoint(path, in); });
    CHECK(contains(e, "state.3.momentum_buffer"));
    CHECK(contains(e, path));
  }
  unchanged();
}

// ---- atomicity: a failed or crashed save leaves the previous checkpoint whole ----

TEST_CASE("a failed or crashed save leaves the previous checkpoint intact") {
  auto model = small_net(0);
  TrainingState st;
  st.model = model.get();
  st.step = 1;
  std::string path = temp_path("atomic.ckpt");
  save_checkpoint(path, st);
  const std::string old_weights = bytes_of(model->state()[0].second);
  const uintmax_t old_size = fs::file_size(path);
  auto previous_intact = [&] {
    auto fresh = small_net(9);
    TrainingState in;
    in.model = fresh.get();
    load_checkpoint(path, in);
    CHECK(in.step == 1);
    CHECK(bytes_of(fresh->state()[0].second) == old_weights);
    CHECK(fs::file_size(path) == old_size);
  };
  // The next save would write different weights and step.
  {
    NoGradGuard no_grad;
    model->state()[0].second.fill_(0.25);
  }
  st.step = 2;

  SUBCASE("the temporary file cannot be created") {
    std::string tmp = path + ".tmp." + std::to_string(::getpid());
    fs::create_directory(tmp);  // open(O_CREAT) on a directory fails, even for root
    CHECK(contains(error_of([&] { save_checkpoint(path, st); }), "cannot create"));
    fs::remove(tmp);
  }
  SUBCASE("the write fails part-way (file size limit, EFBIG)") {
    struct rlimit old_lim;
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &old_lim) == 0);
    auto old_handler = ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim = old_lim;
    lim.rlim_cur = old_size / 2;
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &lim) == 0);
    std::string e = error_of([&] { save_checkpoint(path, st); });
    ::setrlimit(RLIMIT_FSIZE, &old_lim);
    ::signal(SIGXFSZ, old_handler);
    CHECK(contains(e, "failed"));
    // The partial temporary file was removed.
    for (auto& f : fs::directory_iterator(fs::path(path).parent_path()))
      CHECK_FALSE(contains(f.path().string(), "atomic.ckpt.tmp"));
  }
  SUBCASE("the process is killed mid-write") {
    // The child dies from SIGXFSZ when its write crosses the size limit: a real crash that
    // leaves a partial temporary file behind and never reaches the rename.
    const rlim_t limit = old_size / 2;
    pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      struct rlimit lim = {limit, limit};
      ::setrlimit(RLIMIT_FSIZE, &lim);
      ::signal(SIGXFSZ, SIG_DFL);
      try {
        save_checkpoint(path, st);
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);
    }
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    CHECK(WIFSIGNALED(status));
    if (WIFSIGNALED(status)) CHECK(WTERMSIG(status) == SIGXFSZ);
    std::string tmp = path + ".tmp." + std::to_string(child);
    REQUIRE(fs::exists(tmp));
    CHECK(fs::file_size(tmp) == limit);
    fs::remove(tmp);
  }
  SUBCASE("an error while gathering the state, before any write") {
    st.scaler = {{"scale", Tensor()}};
    CHECK(contains(error_of([&] { save_checkpoint(path, st); }), "'scaler.scale' is undefined"));
  }
  previous_intact();
  // And a save that succeeds replaces it.
  st.scaler.clear();
  save_checkpoint(path, st);
  auto fresh = small_net(9);
  TrainingState in;
  in.model = fresh.get();
  load_checkpoint(path, in);
  CHECK(in.step == 2);
  CHECK(fresh->state()[0].second.to_vector<float>()[0] == 0.25f);
}

// ---- bit-exact resume ----

TEST_CASE("resume is bit-exact: k steps + save + load into fresh objects + m steps == k+m steps") {
  const int k = 3, m = 3;
  Data d;
  for (OptKind kind : {OptKind::SGD, OptKind::AdamW}) {
    CAPTURE(kind == OptKind::SGD ? "SGD" : "AdamW");
    // Uninterrupted.
    manual_seed(21);
    auto ref = small_net(0);
    auto ref_opt = make_optimizer(kind, *ref);
    Generator ref_gen(8);
    train_steps(*ref, *ref_opt, ref_gen, d, 0, k + m);

    // Interrupted after k steps.
    manual_seed(21);
    auto first = small_net(0);
    auto first_opt = make_optimizer(kind, *first);
    Generator gen(8);
    train_steps(*first, *first_opt, gen, d, 0, k);
    TrainingState st;
    st.model = first.get();
    st.optimizer = first_opt.get();
    st.generators = {{"data", &gen}};
    st.step = k;
    std::string path = temp_path("resume.ckpt");
    save_checkpoint(path, st);
    first.reset();
    first_opt.reset();

    // Everything fresh and scrambled, then restored from the file.
    manual_seed(12345);
    auto resumed = small_net(4242);
    auto resumed_opt = make_optimizer(kind, *resumed);
    Generator resumed_gen(99);
    TrainingState in;
    in.model = resumed.get();
    in.optimizer = resumed_opt.get();
    in.generators = {{"data", &resumed_gen}};
    load_checkpoint(path, in);
    REQUIRE(in.step == k);
    train_steps(*resumed, *resumed_opt, resumed_gen, d, int(in.step), k + m);

    KILN_CHECK_OK(compare_state(*ref, *resumed, *ref_opt, *resumed_opt));
    // Non-vacuous: the run moved the weights away from their initial values.
    CHECK_FALSE(same_tensor(ref->state()[0].second, small_net(0)->state()[0].second));
  }
}
