// kiln-train's job (tools/train/trainer.h) run in-process on the CPU: a small ImageFolder of real
// Fashion-MNIST PNGs trains end to end, writes its log, checkpoint and weights, resumes bit for
// bit; bad flags fail. And the fused optimizers' checkpoint state (optim/fused.h).
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "optim/checkpoint.h"
#include "core/json.h"
#include "data/export_images.h"
#include "data/fashion_mnist.h"
#include "models/resnet.h"
#include "ops/ops.h"
#include "optim/amp.h"
#include "optim/fused.h"
#include "tools/train/train_dist.h"
#include "optim/train_step.h"
#include "tools/train/trainer.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path dir = fs::temp_directory_path() / ("kiln_test_train_" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(dir); }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

TempDir& tmp() {
  static TempDir t;
  return t;
}

// root/train: the first 300 Fashion-MNIST training images; root/val: the first 100 test images.
const std::string& image_folder() {
  static const std::string root = [] {
    const fs::path r = tmp().dir / "fmnist";
    std::vector<std::string> names(data::kFashionMnistClasses.begin(),
                                   data::kFashionMnistClasses.end());
    data::ExportOptions o;
    o.limit = 300;
    auto train = data::load_fashion_mnist(data::Split::Train);
    data::export_image_folder(train.images, train.labels, names, (r / "train").string(), o);
    o.limit = 100;
    auto test = data::load_fashion_mnist(data::Split::Test);
    data::export_image_folder(test.images, test.labels, names, (r / "val").string(), o);
    return r.string();
  }();
  return root;
}

// A fast job: resnet_small of width 8 on 16x16 crops, batch 32 (9 steps per epoch).
std::vector<std::string> job(const std::string& out, int64_t epochs) {
  return {"--data",       image_folder(),
          "--arch",       "resnet_small",
          "--width",      "8",
          "--image-size", "16",
          "-b",           "32",
          "--epochs",     std::to_string(epochs),
          "--workers",    "1",
          "--device",     "cpu",
          "--lr",         "0.05",
          "--output",     out,
          "--quiet"};
}

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& more) {
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

std::vector<json::Value> read_log(const fs::path& p) {
  std::ifstream f(p);
  std::vector<json::Value> lines;
  for (std::string line; std::getline(f, line);) lines.push_back(json::parse(line));
  return lines;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor ca = a.contiguous(), cb = b.contiguous();
  return ca.dtype() == cb.dtype() && ca.shape() == cb.shape() &&
         std::memcmp(ca.raw_data(), cb.raw_data(), ca.nbytes()) == 0;
}

void check_same_bits(const SafetensorsData& a, const SafetensorsData& b) {
  REQUIRE(a.tensors.size() == b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& [name, ta] = a.tensors[i];
    const Tensor tb = b.tensors[i].second.contiguous();
    INFO(name);
    CHECK(name == b.tensors[i].first);
    REQUIRE(ta.nbytes() == tb.nbytes());
    CHECK(std::memcmp(ta.contiguous().raw_data(), tb.raw_data(), ta.nbytes()) == 0);
  }
}

}  // namespace

TEST_CASE("kiln-train: ImageFolder of PNGs trains, logs, checkpoints and resumes") {
  const fs::path out = tmp().dir / "run1";
  train::Summary s = train::run(train::parse_args(job(out.string(), 1)));
  CHECK(s.epochs_done == 1);
  CHECK(s.test_top1 >= 0.0);
  CHECK(s.test_top5 >= s.test_top1);
  CHECK(s.test_top5 <= 1.0);
  CHECK(std::isfinite(s.test_loss));

  std::vector<json::Value> log = read_log(out / "log.jsonl");
  REQUIRE(log.size() == 1);
  for (const char* key : {"epoch", "train_loss", "train_top1", "test_loss", "test_top1",
                          "test_top5", "images_per_s", "seconds", "lr"})
    CHECK_MESSAGE(log[0].contains(key), key);
  CHECK(log[0].at("epoch").number() == 1);
  CHECK(log[0].at("test_top1").number() == doctest::Approx(s.test_top1).epsilon(1e-4));
  CHECK(log[0].at("images_per_s").number() > 0);

  // The weights load strictly into the same model; the checkpoint into model + optimizer.
  models::ResNetOptions o;
  o.num_classes = 10;
  o.in_channels = 3;
  o.width = 8;
  o.imagenet_stem = false;
  models::ResNet model(models::BlockKind::Basic, {1, 1, 1}, o);
  CHECK(load_weights((out / "model.safetensors").string(), model).missing_keys.empty());
  optim::ParamGroup proto;
  proto.momentum = 0.9;  // the job's optimizer has a momentum arena
  optim::FusedSGD opt(optim::split_weight_decay(model, proto));
  TrainingState st;
  st.model = &model;
  st.optimizer = &opt;
  load_checkpoint((out / "checkpoint.safetensors").string(), st);
  CHECK(st.epoch == 1);
  CHECK(st.step == 9);
  CHECK(st.metadata.at("arch") == "resnet_small");
  CHECK(opt.step_count().item() == 9);
  CHECK(st.scaler.count("scale") == 1);

  // --evaluate with the final weights reproduces the last evaluation.
  train::Summary e = train::run(train::parse_args(with(
      job(out.string(), 1), {"--evaluate", "--weights", (out / "model.safetensors").string()})));
  CHECK(e.test_top1 == doctest::Approx(s.test_top1));
  CHECK(e.test_loss == doctest::Approx(s.test_loss).epsilon(1e-4));

  // Resume: the epoch counter continues and the log grows.
  train::Summary r = train::run(train::parse_args(
      with(job(out.string(), 2), {"--resume", (out / "checkpoint.safetensors").string()})));
  CHECK(r.epochs_done == 2);
  log = read_log(out / "log.jsonl");
  REQUIRE(log.size() == 2);
  CHECK(log[1].at("epoch").number() == 2);
}

TEST_CASE("kiln-train: 1 epoch + resume + 1 epoch equals 2 epochs bit for bit") {
  const fs::path a = tmp().dir / "straight", b = tmp().dir / "resumed";
  for (const char* optimizer : {"sgd", "adamw"}) {
    INFO(optimizer);
    auto args = [&](const fs::path& out, int64_t epochs) {
      return with(job(out.string(), epochs),
                  {"--schedule", "constant", "--optimizer", optimizer, "--label-smoothing", "0.1"});
    };
    train::run(train::parse_args(args(a, 2)));
    train::run(train::parse_args(args(b, 1)));
    train::run(
        train::parse_args(with(args(b, 2), {"--resume", (b / "checkpoint.safetensors").string()})));
    check_same_bits(load_safetensors((a / "model.safetensors").string()),
                    load_safetensors((b / "model.safetensors").string()));
    check_same_bits(load_safetensors((a / "checkpoint.safetensors").string()),
                    load_safetensors((b / "checkpoint.safetensors").string()));
  }
}

TEST_CASE("kiln-train: bad flags and data fail with kiln::Error / exit code 1") {
  CHECK_THROWS_AS(train::parse_args({"--bogus"}), Error);
  CHECK_THROWS_AS(train::parse_args({"--epochs", "0"}), Error);
  CHECK_THROWS_AS(train::parse_args({"--lr", "abc"}), Error);
  CHECK_THROWS_AS(train::parse_args({"--epochs"}), Error);
  CHECK_THROWS_AS(train::parse_args({"--optimizer", "lamb"}), Error);
  CHECK_THROWS_AS(train::parse_args({"--amp", "maybe"}), Error);
  CHECK_THROWS_AS(train::parse_args({"--label-smoothing", "1.5"}), Error);
  bool help = false;
  train::Config c = train::parse_args({"--epochs=3", "-b", "7", "--help"}, &help);
  CHECK(help);
  CHECK(c.epochs == 3);
  CHECK(c.batch_size == 7);

  CHECK(train::main({"--bogus"}) == 1);
  if (!train::data_parallel_available()) CHECK(train::main({"--nproc", "2"}) == 1);
  const std::string out = (tmp().dir / "bad").string();
  CHECK(train::main({"--data", (tmp().dir / "missing").string(), "--output", out}) == 1);
  fs::create_directories(tmp().dir / "empty");
  CHECK_THROWS_WITH_AS(train::run(train::parse_args({"--data", (tmp().dir / "empty").string()})),
                       doctest::Contains("ImageFolder root"), Error);
  CHECK_THROWS_AS(train::run(train::parse_args(with(job(out, 1), {"--amp", "on"}))), Error);
  CHECK_THROWS_AS(train::run(train::parse_args(with(job(out, 1), {"--arch", "resnet9"}))), Error);
  CHECK_THROWS_AS(train::run(train::parse_args(
                      with(job(out, 1), {"--resume", (tmp().dir / "none.safetensors").string()}))),
                  Error);
  CHECK_THROWS_AS(
      train::run(train::parse_args(with(job(out, 1), {"--width", "8", "--arch", "resnet18"}))),
      Error);
}

namespace {

// A tiny model, a fixed batch and one optimizer; `steps` training steps through ClassifierStep
// with an enabled loss scaler that grows every 2 clean steps (so its state changes).
struct Rig {
  std::shared_ptr<models::ResNet> model;
  std::unique_ptr<optim::FusedOptimizer> opt;
  std::unique_ptr<optim::DynamicLossScaler> scaler;
  std::unique_ptr<optim::ClassifierStep> step;
  Tensor x, y;

  Rig(bool adamw, uint64_t seed) {
    model = models::resnet_small(4, 4, 1, 1);
    for (auto& [name, t] : model->state())  // perturb so the rigs start apart
      if (is_floating(t.dtype()) && seed != 0) {
        NoGradGuard ng;
        t.copy_(F::add(t, 0.5));
      }
    optim::ParamGroup proto;
    proto.lr = 0.05;
    proto.momentum = 0.9;
    proto.weight_decay = 1e-3;
    auto groups = optim::split_weight_decay(*model, proto);
    if (adamw)
      opt = std::make_unique<optim::FusedAdamW>(groups);
    else
      opt = std::make_unique<optim::FusedSGD>(groups);
    optim::LossScalerOptions so;
    so.init_scale = 4.0;
    so.growth_interval = 2;
    scaler = std::make_unique<optim::DynamicLossScaler>(Device::cpu(), so);
    step = std::make_unique<optim::ClassifierStep>(*model, *opt, *scaler, 0.0);
    Generator g(7);
    x = randn({6, 1, 8, 8}, DType::f32, &g);
    y = tensor({0, 1, 2, 3, 1, 2}, DType::i64);
  }
  void train(int steps) {
    for (int i = 0; i < steps; ++i) step->run(x, y);
  }
};

}  // namespace

TEST_CASE("fused optimizers: k steps + checkpoint + m steps equals k + m steps bitwise") {
  for (bool adamw : {false, true}) {
    INFO((adamw ? "FusedAdamW" : "FusedSGD"));
    Rig straight(adamw, 0);
    straight.train(5);

    Rig first(adamw, 0);
    first.train(3);
    const std::string path = (tmp().dir / "fused.safetensors").string();
    TrainingState st;
    st.model = first.model.get();
    st.optimizer = first.opt.get();
    st.scaler = first.scaler->state_dict();
    st.epoch = 0;
    st.step = 3;
    save_checkpoint(path, st);

    Rig second(adamw, 1);  // different weights until the load
    TrainingState in;
    in.model = second.model.get();
    in.optimizer = second.opt.get();
    load_checkpoint(path, in);
    second.scaler->load_state_dict(in.scaler);
    CHECK(in.step == 3);
    second.train(2);

    CHECK(second.opt->step_count().item() == 5);
    CHECK(second.scaler->scale_value() == straight.scaler->scale_value());
    CHECK(straight.scaler->scale_value() != 4.0);
    auto a = straight.opt->state_dict(), b = second.opt->state_dict();
    REQUIRE(a.size() == b.size());
    CHECK(a.count("state.0.master") == 1);
    CHECK(a.count(adamw ? "state.0.exp_avg_sq" : "state.0.momentum_buffer") == 1);
    for (const auto& [key, t] : a) {
      INFO(key);
      CHECK(same_bits(t, b.at(key)));
    }
    for (size_t i = 0; i < straight.model->state().size(); ++i)
      CHECK(same_bits(straight.model->state()[i].second, second.model->state()[i].second));
  }
}

TEST_CASE("FusedOptimizer::load_state_dict checks everything before changing anything") {
  Rig r(false, 0);
  r.train(1);
  auto saved = r.opt->state_dict();
  std::map<std::string, Tensor> copy;
  for (auto& [k, t] : saved) copy[k] = t.clone();
  const Tensor before = r.opt->master_arena().clone();

  auto bad = copy;
  bad.erase("state.1.momentum_buffer");
  bad["state.0.master"] = zeros_like(copy["state.0.master"]);  // would be copied first
  CHECK_THROWS_WITH_AS(r.opt->load_state_dict(bad), doctest::Contains("missing key"), Error);
  CHECK(same_bits(r.opt->master_arena(), before));

  bad = copy;
  bad["state.0.bogus"] = zeros({1});
  CHECK_THROWS_WITH_AS(r.opt->load_state_dict(bad), doctest::Contains("unexpected key"), Error);
  bad = copy;
  bad["state.0.master"] = zeros({3});
  CHECK_THROWS_AS(r.opt->load_state_dict(bad), Error);
  CHECK(same_bits(r.opt->master_arena(), before));

  // A good load restores values written since.
  r.train(1);
  CHECK_FALSE(same_bits(r.opt->master_arena(), before));
  r.opt->load_state_dict(copy);
  CHECK(same_bits(r.opt->master_arena(), before));
  CHECK(r.opt->step_count().item() == 1);
}
