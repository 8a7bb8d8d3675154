// kiln-train's job (tools/train/trainer.h) run in-process on the CPU: a small ImageFolder of real
// Fashion-MNIST PNGs trains end to end, writes its log, checkpoint and weights, resumes bit for
// bit; bad flags fail. And the fused optimizers' checkpoint state (optim/fused.h).
#include <doctest/doctest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "core/json.h"
#include "data/export_images.h"
#include "data/fashion_mnist.h"
#include "models/resnet.h"
#include "ops/ops.h"
#include "optim/amp.h"
#include "optim/checkpoint.h"
#include "optim/fused.h"
#include "optim/train_step.h"
#include "tests/test_util.h"
#include "tests/train_test_util.h"
#include "tools/train/output_dir.h"
#include "tools/train/train_dist.h"
#include "tools/train/train_parts.h"
#include "tools/train/trainer.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

using testutil::image_folder;
using testutil::tmp;

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

using kiln::testing::same_bits;

void check_same_bits(const SafetensorsData& a, const SafetensorsData& b) {
  REQUIRE(a.tensors.size() == b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& [name, ta] = a.tensors[i];
    INFO(name);
    CHECK(name == b.tensors[i].first);
    CHECK(same_bits(ta, b.tensors[i].second));
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
    train::run(train::parse_args(with(args(a, 2), {"--overwrite"})));
    train::run(train::parse_args(with(args(b, 1), {"--overwrite"})));
    train::run(
        train::parse_args(with(args(b, 2), {"--resume", (b / "checkpoint.safetensors").string()})));
    check_same_bits(load_safetensors((a / "model.safetensors").string()),
                    load_safetensors((b / "model.safetensors").string()));
    check_same_bits(load_safetensors((a / "checkpoint.safetensors").string()),
                    load_safetensors((b / "checkpoint.safetensors").string()));
  }
}

// On the CPU every run is deterministic already: --deterministic (whose work is on the GPU,
// tools/device/stop_check.sh) must change no bit there, and is parsed.
TEST_CASE("kiln-train: --deterministic changes no bit of a CPU run") {
  const fs::path a = tmp().dir / "plain", b = tmp().dir / "deterministic";
  CHECK_FALSE(train::parse_args(job(a.string(), 1)).deterministic);
  const train::Config c = train::parse_args(with(job(b.string(), 1), {"--deterministic"}));
  CHECK(c.deterministic);
  CHECK(c.decoder == "auto");  // --decoder auto is read as cpu when the data is opened
  train::run(train::parse_args(with(job(a.string(), 1), {"--overwrite"})));
  train::run(train::parse_args(with(job(b.string(), 1), {"--overwrite", "--deterministic"})));
  check_same_bits(load_safetensors((a / "model.safetensors").string()),
                  load_safetensors((b / "model.safetensors").string()));
  CHECK(train::usage().find("--deterministic") != std::string::npos);
}

// A CPU run's bits do not depend on the thread count: the convolutions' weight gradients add
// their images in order, the loss its rows, and large products are split into fixed tiles with
// Eigen's own threads off (ops/cpu/matmul.cpp). One epoch on 1, 2 and 3 threads: the same model,
// checkpoint and logged losses.
TEST_CASE("kiln-train: a CPU run gives the same bits on 1, 2 and 3 threads") {
  std::vector<fs::path> outs;
  for (int t : {1, 2, 3}) {
    outs.push_back(tmp().dir / ("threads" + std::to_string(t)));
    kiln::testing::on_threads(t, [&] {
      train::run(train::parse_args(with(job(outs.back().string(), 1), {"--overwrite"})));
      return 0;
    });
  }
  const std::vector<json::Value> log1 = read_log(outs[0] / "log.jsonl");
  REQUIRE(log1.size() == 1);
  for (size_t i = 1; i < outs.size(); ++i) {
    CAPTURE(i + 1);
    check_same_bits(load_safetensors((outs[0] / "model.safetensors").string()),
                    load_safetensors((outs[i] / "model.safetensors").string()));
    check_same_bits(load_safetensors((outs[0] / "checkpoint.safetensors").string()),
                    load_safetensors((outs[i] / "checkpoint.safetensors").string()));
    const std::vector<json::Value> log = read_log(outs[i] / "log.jsonl");
    REQUIRE(log.size() == 1);
    for (const char* key : {"train_loss", "train_top1", "test_loss", "test_top1"}) {
      CAPTURE(key);
      CHECK(log[0].at(key).number() == log1[0].at(key).number());
    }
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

// ---------------- hardening (issue 16) ----------------

namespace {

std::string run_error(const std::vector<std::string>& args) {
  try {
    train::run(train::parse_args(args));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string file_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// resnet_small of width 8 for 3-channel ImageFolder data, as job() trains it.
std::shared_ptr<models::ResNet> job_model() {
  models::ResNetOptions o;
  o.num_classes = 10;
  o.in_channels = 3;
  o.width = 8;
  o.imagenet_stem = false;
  return std::make_shared<models::ResNet>(models::BlockKind::Basic, std::vector<int64_t>{1, 1, 1},
                                          o);
}

// MNIST-style IDX files: n images of 28x28 (zeros) and the given labels.
void write_idx_split(const fs::path& dir, const std::string& prefix,
                     const std::vector<uint8_t>& labels) {
  auto u32 = [](std::string& b, uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(char(v >> s));
  };
  std::string im, lb;
  u32(im, 0x803);
  u32(im, uint32_t(labels.size()));
  u32(im, 28);
  u32(im, 28);
  im.append(labels.size() * 28 * 28, '\0');
  u32(lb, 0x801);
  u32(lb, uint32_t(labels.size()));
  for (uint8_t l : labels) lb.push_back(char(l));
  fs::create_directories(dir);
  std::ofstream(dir / (prefix + "-images-idx3-ubyte"), std::ios::binary) << im;
  std::ofstream(dir / (prefix + "-labels-idx1-ubyte"), std::ios::binary) << lb;
}

}  // namespace

TEST_CASE("kiln-train: --output is claimed before training: reuse, --overwrite, lock, probe") {
  const fs::path out = tmp().dir / "claim";
  fs::remove_all(out);
  train::run(train::parse_args(job(out.string(), 1)));
  const std::string log_before = file_bytes(out / "log.jsonl");
  // A second run into the same folder is refused, naming the way out; nothing is touched.
  std::string m = run_error(job(out.string(), 1));
  CHECK(m.find("already holds a run") != std::string::npos);
  CHECK(m.find("--overwrite") != std::string::npos);
  CHECK(file_bytes(out / "log.jsonl") == log_before);
  // --overwrite replaces the run (one log line, not two).
  train::run(train::parse_args(with(job(out.string(), 1), {"--overwrite"})));
  CHECK(read_log(out / "log.jsonl").size() == 1);
  // A folder in use by a running kiln-train (its lock held) is refused even with --overwrite.
  {
    train::OutputDir running(train::OutputPlan{out.string(), train::OutputReuse::Overwrite});
    m = run_error(with(job(out.string(), 1), {"--overwrite"}));
    CHECK(m.find("in use by a running kiln-train") != std::string::npos);
  }
  // An unwritable folder (root may write anywhere else) fails before training starts.
  m = run_error(with(job("/proc/self", 1), {"--overwrite"}));  // not empty either
  CHECK(m.find("not writable") != std::string::npos);
  const fs::path file = tmp().dir / "a-file";
  std::ofstream(file) << "x";
  m = run_error(job((file / "sub").string(), 1));
  CHECK(m.find("--output") != std::string::npos);
}

TEST_CASE("kiln-train: temporary files of killed saves are removed at start") {
  const fs::path out = tmp().dir / "stale";
  fs::remove_all(out);
  fs::create_directories(out);
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  REQUIRE(child > 0);
  int status = 0;
  ::waitpid(child, &status, 0);  // a pid whose process is gone
  const fs::path stale = out / ("checkpoint.safetensors.tmp." + std::to_string(child));
  const fs::path live = out / ("checkpoint.safetensors.tmp." + std::to_string(::getppid()));
  std::ofstream(stale) << "partial";
  // Without an earlier kiln-train's lock file the name proves nothing: it may be the user's.
  CHECK(run_error(job(out.string(), 1)).find("is not empty") != std::string::npos);
  CHECK(fs::exists(stale));
  // A folder a killed kiln-train left (its lock file, a save's temporary file) counts as empty.
  std::ofstream(out / ".kiln-train.lock") << "12345";
  CHECK(train::plan_output(out.string(), train::OutputReuse::New, {}).dir == out.string());
  std::ofstream(live) << "someone else's";
  // One whose writer is alive does not: it may be another program's file.
  CHECK(run_error(job(out.string(), 1)).find("is not empty") != std::string::npos);
  train::run(train::parse_args(with(job(out.string(), 1), {"--overwrite"})));
  CHECK_FALSE(fs::exists(stale));
  CHECK(fs::exists(live));  // its writer is alive
}

TEST_CASE("kiln-train: the epoch's checkpoint is saved before the evaluation") {
  // val/ holds only unreadable files: the evaluation fails after the training epoch.
  const fs::path root = tmp().dir / "badval";
  fs::remove_all(root);
  fs::create_directories(root / "val");
  fs::create_directory_symlink(fs::path(image_folder()) / "train", root / "train");
  for (const auto& e : fs::directory_iterator(fs::path(image_folder()) / "train")) {
    fs::create_directories(root / "val" / e.path().filename());
    std::ofstream(root / "val" / e.path().filename() / "bad.png") << "not a png";
  }
  const fs::path out = tmp().dir / "badval-out";
  fs::remove_all(out);
  const std::string m = run_error(with(job(out.string(), 1), {"--data", root.string()}));
  CHECK(m.find("bad.png") != std::string::npos);
  auto model_ptr = job_model();
  models::ResNet& model = *model_ptr;
  TrainingState st;
  st.model = &model;
  optim::ParamGroup proto;
  proto.momentum = 0.9;
  optim::FusedSGD opt(optim::split_weight_decay(model, proto));
  st.optimizer = &opt;
  load_checkpoint((out / "checkpoint.safetensors").string(), st);
  CHECK(st.epoch == 1);
}

TEST_CASE("kiln-train: unreadable files are skipped and counted per epoch, train and test") {
  const fs::path root = tmp().dir / "onebad";
  fs::remove_all(root);
  fs::copy(image_folder(), root, fs::copy_options::recursive);
  const fs::path first_class = fs::directory_iterator(root / "train")->path();
  std::ofstream(first_class / "zz-bad.png") << "not a png";
  std::ofstream(root / "val" / first_class.filename() / "zz-bad.png");  // zero bytes
  const fs::path out = tmp().dir / "onebad-out";
  fs::remove_all(out);
  const train::Summary s =
      train::run(train::parse_args(with(job(out.string(), 1), {"--data", root.string()})));
  CHECK(s.test_bad_files == 1);
  const std::string log = file_bytes(out / "log.jsonl");
  CHECK(log.find("\"bad_files\": 1") != std::string::npos);
  CHECK(log.find("\"test_bad_files\": 1") != std::string::npos);
}

TEST_CASE("kiln-train: a diverged run stops and never overwrites a finite checkpoint") {
  const fs::path out = tmp().dir / "diverge";
  fs::remove_all(out);
  std::string m = run_error(with(job(out.string(), 1), {"--lr", "1e6"}));
  CHECK(m.rfind("training diverged: ", 0) == 0);
  // The user's to change (--lr): one line, no source location.
  const std::string tail =
      "no checkpoint was written; try a lower --lr or a longer --warmup-epochs";
  CHECK(m.size() > tail.size());
  CHECK(m.compare(m.size() - tail.size(), tail.size(), tail) == 0);
  CHECK_FALSE(fs::exists(out / "checkpoint.safetensors"));
  // Resuming a good checkpoint at that lr keeps the good checkpoint byte for byte.
  fs::remove_all(out);
  train::run(train::parse_args(job(out.string(), 1)));
  const std::string good = file_bytes(out / "checkpoint.safetensors");
  m = run_error(with(job(out.string(), 2),
                     {"--lr", "1e6", "--resume", (out / "checkpoint.safetensors").string()}));
  CHECK(m.find("diverged") != std::string::npos);
  CHECK(file_bytes(out / "checkpoint.safetensors") == good);
  CHECK(read_log(out / "log.jsonl").size() == 1);
}

TEST_CASE("kiln-train: non-finite metrics are reported as such, logged as null") {
  auto model = job_model();
  {
    NoGradGuard ng;
    for (auto& [name, t] : model->named_parameters())
      if (name == "fc.bias") t.fill_(std::nan(""));
  }
  // The evaluation of a diverged model (kiln-train refuses such a file as --weights).
  train::Config c = train::parse_args(job((tmp().dir / "nan-eval").string(), 1));
  train::DataOptions dopt;
  dopt.data = c.data;
  dopt.image_size = c.image_size;
  dopt.batch_size = c.batch_size;
  dopt.workers = 1;
  dopt.device = Device::cpu();
  const train::TrainData data(dopt);
  const std::vector<double> ev = train::evaluate(*model, data);
  CHECK(ev[3] == 100);
  CHECK(std::isnan(ev[0]));
  CHECK(std::isnan(ev[1]));  // not 100%: NaN > target is false for every logit
  CHECK(std::isnan(ev[2]));
  CHECK(json::number(std::nan("")) == "null");
  CHECK(json::number(INFINITY) == "null");
  CHECK(json::parse("{\"a\": " + json::number(std::nan("")) + "}").at("a").kind() ==
        json::Value::Kind::Null);
  CHECK(train::fmt_metric(std::nan(""), 100, 2) == "nan");
  CHECK(train::fmt_metric(0.5, 100, 2) == "50.00");
  CHECK(train::fmt_time(-2) == "?");
  CHECK(train::first_non_finite(*model) == "fc.bias");
  CHECK(train::first_non_finite(*job_model()).empty());
  // Infinities of either sign, in every floating dtype; the largest finite values are finite.
  for (DType dt : {DType::f16, DType::bf16, DType::f32, DType::f64}) {
    CAPTURE(dtype_name(dt));
    auto m = job_model();
    m->to(dt);
    CHECK(train::first_non_finite(*m).empty());
    const Tensor w = m->named_parameters().back().second;
    NoGradGuard ng;
    const double biggest = dt == DType::f16 ? 65504.0 : dt == DType::bf16 ? 3.38e38 : 3.4e38;
    w.fill_(biggest);
    CHECK(train::first_non_finite(*m).empty());
    w.fill_(-INFINITY);
    CHECK(train::first_non_finite(*m) == m->named_parameters().back().first);
    w.fill_(INFINITY);
    CHECK(train::first_non_finite(*m) == m->named_parameters().back().first);
  }
}

TEST_CASE("kiln-train: flag ranges and contradictions fail early") {
  auto err = [](std::vector<std::string> args) {
    try {
      train::parse_args(args);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(err({"--workers", "10000"}).find("--workers") != std::string::npos);
  CHECK(err({"--workers", "2147483648"}).find("--workers") != std::string::npos);
  CHECK(err({"--nproc", "4294967297"}).find("--nproc") != std::string::npos);
  CHECK(err({"--evaluate"}).find("--weights or --resume") != std::string::npos);
  CHECK(err({"--resume", "kiln-output/checkpoint.safetensors", "--overwrite"}).find("contradict") !=
        std::string::npos);
  CHECK(err({"--resume", "a/checkpoint.safetensors", "--output", "a/", "--overwrite"})
            .find("contradict") != std::string::npos);
  // Another run's checkpoint continued in a new folder, replacing what that folder holds.
  CHECK(err({"--resume", "a/checkpoint.safetensors", "--output", "b", "--overwrite"}).empty());
  CHECK(err({"--resume", "x", "--pretrained", "y"}).find("give one") != std::string::npos);
  CHECK(err({"--resume", "x", "--weights", "y"}).find("give one") != std::string::npos);
  CHECK(err({"--workers", "1024", "--nproc", "1024"}).empty());
  CHECK(err({"--zero-init-residual", "--arch", "vit_b_16"}).find("applies to ResNets") !=
        std::string::npos);
  CHECK(err({"--zero-init-residual", "--pretrained", "y"}).find("--pretrained replaces") !=
        std::string::npos);
  CHECK(err({"--zero-init-residual", "--weights", "y"}).find("--weights replaces") !=
        std::string::npos);
  CHECK(err({"--zero-init-residual", "--arch", "resnet50"}).empty());
  train::Config c;
  c.workers = -1;  // a Config built in code is validated by run() too
  CHECK_THROWS_WITH_AS(train::run(c), doctest::Contains("--workers"), Error);
}

TEST_CASE("kiln-train: resume with another batch size keeps the schedule; bad checkpoints fail") {
  const fs::path out = tmp().dir / "rebatch";
  fs::remove_all(out);
  train::run(train::parse_args(job(out.string(), 1)));  // batch 32: 9 steps
  // Batch 64 (4 steps per epoch), 3 epochs: epoch 2 ends at step 8 of 12, lr well above 0.
  auto args = job(out.string(), 3);
  *std::find(args.begin(), args.end(), "32") = "64";
  args.push_back("--resume");
  args.push_back((out / "checkpoint.safetensors").string());
  train::run(train::parse_args(args));
  const auto log = read_log(out / "log.jsonl");
  REQUIRE(log.size() == 3);
  CHECK(log[1].at("lr").number() > 0.01);

  // A checkpoint with a negative epoch.
  auto model = job_model();
  TrainingState st;
  st.model = model.get();
  st.epoch = -5;
  const fs::path neg = tmp().dir / "negative.safetensors";
  save_checkpoint(neg.string(), st);
  TrainingState back;
  back.model = model.get();
  CHECK_THROWS_WITH_AS(load_checkpoint(neg.string(), back), doctest::Contains("negative"), Error);

  // A FIFO as --weights is refused at once (it used to block forever).
  const fs::path fifo = tmp().dir / "weights.fifo";
  fs::remove(fifo);
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string m = run_error(
      with(job((tmp().dir / "fifo-out").string(), 1), {"--evaluate", "--weights", fifo.string()}));
  CHECK(m.find("not a regular file") != std::string::npos);
}

TEST_CASE("kiln-train: IDX labels are validated when the data is opened") {
  const fs::path dir = tmp().dir / "idx-stray";
  std::vector<uint8_t> train(40);
  for (size_t i = 0; i < train.size(); ++i) train[i] = uint8_t(i % 10);
  train[17] = 255;
  write_idx_split(dir, "train", train);
  write_idx_split(dir, "t10k", {0, 1, 2});
  std::string m = run_error(
      with(job((tmp().dir / "idx-out").string(), 1), {"--data", dir.string(), "--overwrite"}));
  CHECK(m.find("train-labels-idx1-ubyte") != std::string::npos);
  CHECK(m.find("label 255 at index 17") != std::string::npos);
  train[17] = 7;
  write_idx_split(dir, "train", train);
  write_idx_split(dir, "t10k", {0, 1, 12});
  m = run_error(
      with(job((tmp().dir / "idx-out").string(), 1), {"--data", dir.string(), "--overwrite"}));
  CHECK(m.find("t10k-labels-idx1-ubyte") != std::string::npos);
  CHECK(m.find("label 12 at index 2") != std::string::npos);
  write_idx_split(dir, "t10k", {});
  m = run_error(
      with(job((tmp().dir / "idx-out").string(), 1), {"--data", dir.string(), "--overwrite"}));
  CHECK(m.find("holds no images") != std::string::npos);
}

// ---------------- no finished run is replaced, nothing is written into the data ----------------

namespace {

// Every file under `dir` (relative name -> bytes): what "left as it was" compares.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> files;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec))
    if (e.is_regular_file()) files[fs::relative(e.path(), dir).string()] = file_bytes(e.path());
  return files;
}

// A finished one-epoch run in a fresh folder `name`.
fs::path finished_run(const std::string& name) {
  const fs::path out = tmp().dir / name;
  fs::remove_all(out);
  train::run(train::parse_args(job(out.string(), 1)));
  REQUIRE(fs::exists(out / "model.safetensors"));
  return out;
}

}  // namespace

TEST_CASE("kiln-train: --output is written only when empty, with --overwrite, or resuming its own") {
  const fs::path a = finished_run("rule-a");
  const auto before = snapshot(a);
  const std::string ckpt = (a / "checkpoint.safetensors").string();

  SUBCASE("--start-epoch into a finished run is a new run, refused") {
    for (const char* e : {"0", "1"}) {
      const std::string m = run_error(with(job(a.string(), 2), {"--start-epoch", e}));
      CHECK(m.find("already holds a run") != std::string::npos);
      CHECK(m.find(" [") == std::string::npos);  // a user error: no source location
    }
  }
  SUBCASE("--resume of another run's checkpoint into a finished run, refused") {
    const fs::path b = finished_run("rule-b");
    const auto b_before = snapshot(b);
    const std::string m =
        run_error(with(job(b.string(), 2), {"--resume", ckpt}));
    CHECK(m.find("already holds a run") != std::string::npos);
    CHECK(snapshot(b) == b_before);
  }
  SUBCASE("--resume of another run's checkpoint into a new folder continues it there") {
    const fs::path c = tmp().dir / "rule-c";
    fs::remove_all(c);
    const train::Summary s =
        train::run(train::parse_args(with(job(c.string(), 2), {"--resume", ckpt})));
    CHECK(s.epochs_done == 2);
    const auto log = read_log(c / "log.jsonl");  // a's epoch 1, then c's epoch 2
    REQUIRE(log.size() == 2);
    CHECK(log[0].at("epoch").number() == 1);
    CHECK(log[1].at("epoch").number() == 2);
    CHECK(read_log(c / "steps.jsonl").size() == 18);
    CHECK(read_log(c / "steps.jsonl").front().at("step").number() == 1);
  }
  SUBCASE("a run killed before its first checkpoint (steps.jsonl only) is not replaced") {
    const fs::path k = tmp().dir / "rule-killed";
    fs::remove_all(k);
    fs::create_directories(k);
    std::ofstream(k / "steps.jsonl") << "{\"step\": 1, \"epoch\": 1, \"loss\": 2.3}\n";
    const auto k_before = snapshot(k);
    const std::string m = run_error(job(k.string(), 1));
    CHECK(m.find("already holds a run (steps.jsonl)") != std::string::npos);
    CHECK(snapshot(k) == k_before);
    // Someone else's file: not a run, but not empty either.
    const fs::path o = tmp().dir / "rule-other";
    fs::remove_all(o);
    fs::create_directories(o);
    std::ofstream(o / "notes.txt") << "mine";
    CHECK(run_error(job(o.string(), 1)).find("is not empty (it holds notes.txt)") !=
          std::string::npos);
    CHECK(snapshot(o) == std::map<std::string, std::string>{{"notes.txt", "mine"}});
  }
  SUBCASE("--overwrite followed by divergence leaves no file of the old run") {
    const std::string m = run_error(with(job(a.string(), 1), {"--overwrite", "--lr", "1e6"}));
    CHECK(m.find("diverged") != std::string::npos);
    CHECK(m.find("no checkpoint was written") != std::string::npos);
    for (const char* f : {"log.jsonl", "checkpoint.safetensors", "model.safetensors"})
      CHECK_MESSAGE(!fs::exists(a / f), f);
    for (const auto& line : read_log(a / "steps.jsonl"))  // the new run's steps only
      CHECK(line.at("lr").number() > 1.0);
    return;  // `a` changed on purpose
  }
  SUBCASE("--overwrite with a bad --pretrained leaves the old run as it was") {
    const fs::path bad = tmp().dir / "rule-bad.safetensors";
    std::ofstream(bad) << "not safetensors";
    CHECK(run_error(with(job(a.string(), 1), {"--overwrite", "--pretrained", bad.string()}))
              .find("--pretrained") != std::string::npos);
  }
  CHECK(snapshot(a) == before);
}

TEST_CASE("kiln-train: nothing is created in the data or before the data is read") {
  // The data set copied so that its folders can be checked byte for byte.
  const fs::path root = tmp().dir / "data-tree";
  fs::remove_all(root);
  fs::copy(image_folder(), root, fs::copy_options::recursive);
  const auto data_before = snapshot(root);
  for (const fs::path& inside : {root / "train" / "kiln-output", root / "val", root / "out",
                                 root / "train" / "0 T-shirt-top" / "x"}) {
    const std::string m =
        run_error(with(job(inside.string(), 1), {"--data", root.string()}));
    CHECK_MESSAGE(m.find("lies inside the data") != std::string::npos, m);
  }
  // The default --output, relative to a working directory inside train/: refused too.
  const pid_t child = ::fork();
  if (child == 0) {
    if (::chdir((root / "train").c_str()) != 0) ::_exit(3);
    const int rc = train::main({"--data", root.string(), "--epochs", "1", "--device", "cpu",
                                "--quiet", "--arch", "resnet_small", "--width", "8",
                                "--image-size", "16"});
    ::_exit(rc == 1 ? 0 : 4);
  }
  int status = -1;
  ::waitpid(child, &status, 0);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(snapshot(root) == data_before);
  CHECK_FALSE(fs::exists(root / "train" / "kiln-output"));

  // A wrong --data creates no --output; nor does a set-up that fails after the data was read.
  const fs::path out = tmp().dir / "never-made";
  fs::remove_all(out);
  CHECK(run_error(with(job(out.string(), 1), {"--data", (tmp().dir / "nope").string()}))
            .find("--data") != std::string::npos);
  CHECK_FALSE(fs::exists(out));
  const fs::path missing = tmp().dir / "missing-weights.safetensors";
  CHECK(run_error(with(job(out.string(), 1), {"--pretrained", missing.string()}))
            .find("--pretrained") != std::string::npos);
  CHECK_FALSE(fs::exists(out));
}

TEST_CASE("kiln-train: weights that cannot be right are refused at load, naming file and tensor") {
  const fs::path dir = tmp().dir / "bad-weights";
  fs::create_directories(dir);
  auto model = job_model();
  const fs::path good = dir / "good.safetensors";
  save_weights(good.string(), *model);
  {
    NoGradGuard ng;
    for (auto& [name, t] : model->named_parameters())
      if (name == "layer2.0.conv1.weight") t.narrow(0, 1, 1).fill_(INFINITY);
  }
  const fs::path inf = dir / "inf.safetensors";
  save_weights(inf.string(), *model);
  const fs::path out = dir / "out";
  for (const char* flag : {"--weights", "--pretrained"}) {
    for (bool eval : {true, false}) {
      auto args = with(job(out.string(), 1), {flag, inf.string()});
      if (eval) args.push_back("--evaluate");
      const std::string m = run_error(args);
      INFO(flag, " ", eval, ": ", m);
      CHECK(m.find(std::string(flag) + " '" + inf.string() + "'") != std::string::npos);
      CHECK(m.find("'layer2.0.conv1.weight' holds NaN or infinite values") != std::string::npos);
      CHECK(m.find(" [") == std::string::npos);
      CHECK_FALSE(fs::exists(out));
    }
  }
  // -e with --pretrained of another class count would evaluate a random classifier.
  auto five = models::resnet_small(5, 8, 1, 3);
  const fs::path other = dir / "five-classes.safetensors";
  save_weights(other.string(), *five);
  std::string m = run_error(
      with(job(out.string(), 1), {"--evaluate", "--pretrained", other.string()}));
  CHECK(m.find("classifies 5 classes, the data has 10") != std::string::npos);
  // Fine-tuning from it is what --pretrained is for (the classifier is re-initialised).
  m = run_error(with(job(out.string(), 1), {"--pretrained", other.string()}));
  CHECK_MESSAGE(m.empty(), m);
  CHECK(fs::exists(out / "model.safetensors"));
  // The good file evaluates.
  CHECK(run_error(with(job(out.string(), 1), {"--evaluate", "--weights", good.string()})).empty());
}

TEST_CASE("kiln-train: --resume names what does not fit: optimizer, --freeze-backbone, arch") {
  const fs::path a = finished_run("fit-a");
  const std::string ckpt = (a / "checkpoint.safetensors").string();
  const auto before = snapshot(a);
  std::string m = run_error(with(job(a.string(), 2), {"--resume", ckpt, "--freeze-backbone"}));
  CHECK(m.find("trained without --freeze-backbone") != std::string::npos);
  CHECK(m.find("state.") == std::string::npos);  // no internal key
  m = run_error(with(job(a.string(), 2), {"--resume", ckpt, "--optimizer", "adamw"}));
  CHECK(m.find("--optimizer sgd") != std::string::npos);
  CHECK(snapshot(a) == before);
  // A checkpoint written before the run's optimizer was recorded: the mismatch is still named.
  auto model = job_model();
  optim::ParamGroup proto;
  proto.momentum = 0.9;
  optim::FusedSGD opt(optim::split_weight_decay(*model, proto));
  TrainingState st;
  st.model = model.get();
  st.optimizer = &opt;
  st.epoch = 1;
  st.step = 9;
  st.metadata["arch"] = "resnet_small";
  const fs::path old = tmp().dir / "fit-old" / "checkpoint.safetensors";
  fs::create_directories(old.parent_path());
  save_checkpoint(old.string(), st);
  m = run_error(with(job(old.parent_path().string(), 2),
                     {"--resume", old.string(), "--freeze-backbone"}));
  CHECK(m.find("does not fit this run's") != std::string::npos);
  CHECK(m.find("--freeze-backbone") != std::string::npos);
}

// ---------------- hostile files in --output: planted links, FIFOs, what a refusal leaves ----------------

namespace {

// Ends this test process with a message should a run hang (reading a FIFO that has no writer
// waits forever), so that ctest fails instead of waiting: armed for `seconds` while in scope.
class Watchdog {
 public:
  explicit Watchdog(unsigned seconds) {
    ::signal(SIGALRM, [](int) {
      const char msg[] = "test_kiln_train: watchdog: a run hung (a FIFO opened for reading?)\n";
      [[maybe_unused]] const ssize_t n = ::write(2, msg, sizeof msg - 1);
      ::_exit(124);
    });
    ::alarm(seconds);
  }
  ~Watchdog() { ::alarm(0); }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
};

// A pid whose process is gone (a child that exited and was reaped).
pid_t dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  REQUIRE(child > 0);
  int status = 0;
  ::waitpid(child, &status, 0);
  return child;
}

size_t entries(const fs::path& dir) {
  size_t n = 0;
  for (auto it = fs::directory_iterator(dir); it != fs::directory_iterator(); ++it) ++n;
  return n;
}

}  // namespace

TEST_CASE("kiln-train: a .kiln-train.lock that is a link or a FIFO is refused, never written") {
  Watchdog dog(120);
  // The link points at a file of a (fake) data set: the pid written through it would damage it.
  const fs::path data = tmp().dir / "lock-data";
  fs::remove_all(data);
  fs::create_directories(data);
  const fs::path victim = data / "train-labels-idx1-ubyte";
  std::ofstream(victim, std::ios::binary) << "labels, not a pid";
  const fs::path out = tmp().dir / "lock-link";
  fs::remove_all(out);
  fs::create_directories(out);
  fs::create_symlink(victim, out / ".kiln-train.lock");
  std::string m = run_error(job(out.string(), 1));
  CHECK(m == "--output '" + out.string() + "': '" + (out / ".kiln-train.lock").string() +
                 "' is not a regular file (a link, FIFO or device); remove it or choose another "
                 "--output");
  CHECK(file_bytes(victim) == "labels, not a pid");
  CHECK(fs::is_symlink(out / ".kiln-train.lock"));
  CHECK(entries(out) == 1);  // no probe, no log

  // The same link beside a finished run, with --overwrite: refused, the run left as it was.
  const fs::path a = finished_run("lock-link-run");
  const fs::path lock = a / ".kiln-train.lock";
  fs::remove(lock);
  fs::create_symlink(victim, lock);
  auto before = snapshot(a);
  m = run_error(with(job(a.string(), 1), {"--overwrite"}));
  CHECK(m.find("'" + lock.string() + "' is not a regular file") != std::string::npos);
  CHECK(snapshot(a) == before);
  CHECK(fs::is_symlink(lock));
  CHECK(file_bytes(victim) == "labels, not a pid");
  // A FIFO in its place is refused at once: opening it does not wait for a writer.
  fs::remove(lock);
  REQUIRE(::mkfifo(lock.c_str(), 0600) == 0);
  before = snapshot(a);
  m = run_error(with(job(a.string(), 1), {"--overwrite"}));
  CHECK(m.find("'" + lock.string() + "' is not a regular file") != std::string::npos);
  CHECK(fs::is_fifo(fs::symlink_status(lock)));
  CHECK(snapshot(a) == before);
}

TEST_CASE("kiln-train: an --overwrite refused during set-up leaves the folder byte for byte") {
  const fs::path a = finished_run("setup-fails");
  // What earlier kiln-trains left: the lock file, holding a pid that is not this process's (the
  // refused run writes its own there, then must put this back), and a killed save's temporary
  // file (removed only once a run begins).
  std::ofstream(a / ".kiln-train.lock", std::ios::trunc) << "4242";
  const fs::path stale = a / ("checkpoint.safetensors.tmp." + std::to_string(dead_pid()));
  std::ofstream(stale) << "partial";
  const auto before = snapshot(a);
  REQUIRE(before.count(".kiln-train.lock") == 1);
  REQUIRE(before.count(stale.filename().string()) == 1);
  // Weights holding a NaN: refused while the model is built, after --output was claimed.
  auto model = job_model();
  {
    NoGradGuard ng;
    for (auto& [name, t] : model->named_parameters())
      if (name == "fc.weight") t.narrow(0, 2, 1).fill_(std::nan(""));
  }
  const fs::path nan = tmp().dir / "setup-fails-nan.safetensors";
  save_weights(nan.string(), *model);
  std::string m = run_error(with(job(a.string(), 1), {"--overwrite", "--weights", nan.string()}));
  CHECK(m.find("'fc.weight' holds NaN or infinite values") != std::string::npos);
  CHECK(snapshot(a) == before);
  // An architecture kiln does not have: refused at the same point.
  m = run_error(with(job(a.string(), 1), {"--overwrite", "-a", "resnet9"}));
  CHECK(m.find("resnet9") != std::string::npos);
  CHECK(snapshot(a) == before);
  // A lock file holding text kiln-train did not write (64 bytes or more) is not touched at all.
  const std::string note(100, 'n');
  std::ofstream(a / ".kiln-train.lock", std::ios::trunc) << note;
  m = run_error(with(job(a.string(), 1), {"--overwrite", "--weights", nan.string()}));
  CHECK(m.find("'fc.weight' holds NaN or infinite values") != std::string::npos);
  CHECK(file_bytes(a / ".kiln-train.lock") == note);
  CHECK(file_bytes(stale) == "partial");
}

TEST_CASE("kiln-train: --resume of a run whose log.jsonl is a FIFO fails at once, naming it") {
  const fs::path a = finished_run("fifo-log");
  const fs::path log = a / "log.jsonl";
  fs::remove(log);
  REQUIRE(::mkfifo(log.c_str(), 0600) == 0);
  Watchdog dog(120);  // a regression would block in the read
  const std::string m =
      run_error(with(job(a.string(), 2), {"--resume", (a / "checkpoint.safetensors").string()}));
  CHECK(m.rfind("cannot read '" + log.string() + "': it is not a regular file", 0) == 0);
  CHECK(m.find(" [") == std::string::npos);  // the user's file: no source location
  CHECK(fs::is_fifo(fs::symlink_status(log)));
}

TEST_CASE("kiln-train: --resume never writes through a link planted as its steps.jsonl") {
  const fs::path a = finished_run("linked-steps");
  // The run's steps moved elsewhere, a link left in their place.
  const fs::path elsewhere = tmp().dir / "linked-steps-elsewhere.jsonl";
  fs::remove(elsewhere);
  fs::rename(a / "steps.jsonl", elsewhere);
  fs::create_symlink(elsewhere, a / "steps.jsonl");
  const std::string target = file_bytes(elsewhere);
  REQUIRE(read_log(elsewhere).size() == 9);
  const std::string log = file_bytes(a / "log.jsonl");
  Watchdog dog(120);
  const std::string m =
      run_error(with(job(a.string(), 2), {"--resume", (a / "checkpoint.safetensors").string()}));
  CHECK(m == "cannot write '" + (a / "steps.jsonl").string() +
                 "': it is a symbolic link (kiln-train writes its own files only)");
  CHECK(file_bytes(elsewhere) == target);
  CHECK(fs::is_symlink(a / "steps.jsonl"));
  CHECK(file_bytes(a / "log.jsonl") == log);  // refused before the first step
}

// ---------------- small photos (CIFAR-10's layout): decoded once, the small stem ----------------

TEST_CASE("kiln-train: an ImageFolder of small photos with train/ and test/ trains as CIFAR-10") {
  // 12x12 RGB PNGs: class 0 reddish, class 1 bluish, with noise; 48 to train, 16 to test.
  const fs::path data = tmp().dir / "small-photos";
  fs::remove_all(data);
  Generator g(11);
  for (const auto& [split, n] : {std::pair<std::string, int>{"train", 48}, {"test", 16}})
    for (int i = 0; i < n; ++i) {
      const int c = i % 2;
      data::Image im;
      im.height = im.width = 12;
      im.pixels.resize(12 * 12 * 3);
      for (size_t p = 0; p < im.pixels.size(); ++p)
        im.pixels[p] = uint8_t((p % 3 == size_t(2 * c) ? 150 : 40) + g.below(80));
      const fs::path f = data / split / (c ? "b_blue" : "a_red") / (std::to_string(i) + ".png");
      fs::create_directories(f.parent_path());
      data::write_png(f.string(), im);
    }
  const auto before = snapshot(data);
  const fs::path out = tmp().dir / "small-photos-run";
  fs::remove_all(out);
  // No --image-size: the photos' own size, the small stem, per-channel statistics of the data.
  const train::Summary s = train::run(train::parse_args(
      {"--data", data.string(), "-a", "resnet18", "-b", "16", "--epochs", "2", "--workers", "1",
       "--device", "cpu", "--lr", "0.02", "--output", out.string(), "--quiet"}));
  CHECK(s.epochs_done == 2);
  CHECK(std::isfinite(s.test_loss));
  CHECK(s.test_top1 >= 0.75);  // the colours separate the classes: it learns
  const SafetensorsData m = load_safetensors((out / "model.safetensors").string());
  CHECK(m.at("conv1.weight").shape() == Shape{64, 3, 3, 3});
  CHECK(m.metadata.at("stem") == "small");
  CHECK(m.metadata.at("image_size") == "12");
  CHECK(m.metadata.at("resize_size") == "12");
  CHECK(m.metadata.at("class_names") == R"(["a_red", "b_blue"])");
  const json::Value mean = json::parse(m.metadata.at("mean"));
  REQUIRE(mean.array().size() == 3);
  // Red is high in class 0 and low in class 1: the mean of red is about (190 + 80) / 2 / 255.
  CHECK(mean.array()[0].number() == doctest::Approx(135.0 / 255).epsilon(0.05));
  CHECK(snapshot(data) == before);  // nothing written into the data

  // With --image-size the same folder takes ImageNet's recipe: the 7x7 stem.
  const fs::path big = tmp().dir / "small-photos-224";
  fs::remove_all(big);
  train::run(train::parse_args({"--data", data.string(), "-a", "resnet18", "--image-size", "16",
                                "-b", "16", "--epochs", "1", "--workers", "1", "--device", "cpu",
                                "--output", big.string(), "--quiet"}));
  const SafetensorsData b = load_safetensors((big / "model.safetensors").string());
  CHECK(b.at("conv1.weight").shape() == Shape{64, 3, 7, 7});
  CHECK(b.metadata.at("stem") == "imagenet");

  // A vision transformer on 4x4 patches of the 12x12 photos (9 patches + the class token), the
  // transformer recipe by default; a 16x16 patch ViT refuses the size, naming it.
  const fs::path vit = tmp().dir / "small-photos-vit";
  fs::remove_all(vit);
  const train::Summary sv = train::run(train::parse_args(
      {"--data", data.string(), "-a", "vit_t_4", "-b", "16", "--epochs", "1", "--workers", "1",
       "--device", "cpu", "--output", vit.string(), "--quiet"}));
  CHECK(sv.epochs_done == 1);
  CHECK(std::isfinite(sv.test_loss));
  const SafetensorsData v = load_safetensors((vit / "model.safetensors").string());
  CHECK(v.metadata.at("arch") == "vit_t_4");
  CHECK(v.at("encoder.pos_embedding").shape() == Shape{1, 10, 192});
  CHECK(v.at("conv_proj.weight").shape() == Shape{192, 3, 4, 4});
  CHECK_THROWS_WITH(train::run(train::parse_args({"--data", data.string(), "-a", "vit_s_16",
                                                  "--epochs", "1", "--device", "cpu", "--output",
                                                  (tmp().dir / "vit-s-12px").string(), "--quiet"})),
                    doctest::Contains("16x16 patches: the input size 12"));
}

namespace {

// What a run resumed after a stop must equal: the same job never stopped.
void check_same_run(const fs::path& straight, const fs::path& resumed) {
  check_same_bits(load_safetensors((straight / "model.safetensors").string()),
                  load_safetensors((resumed / "model.safetensors").string()));
  check_same_bits(load_safetensors((straight / "checkpoint.safetensors").string()),
                  load_safetensors((resumed / "checkpoint.safetensors").string()));
  const SafetensorsData best_a = load_safetensors((straight / "model_best.safetensors").string());
  const SafetensorsData best_b = load_safetensors((resumed / "model_best.safetensors").string());
  check_same_bits(best_a, best_b);
  CHECK(best_b.metadata.at("epochs") == best_a.metadata.at("epochs"));
  CHECK(best_b.metadata.at("test_top1") == best_a.metadata.at("test_top1"));
  const auto a = read_log(straight / "steps.jsonl"), b = read_log(resumed / "steps.jsonl");
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CAPTURE(i);
    CHECK(b[i].at("step").number() == a[i].at("step").number());
    CHECK(b[i].at("loss").number() == a[i].at("loss").number());
    CHECK(b[i].at("lr").number() == a[i].at("lr").number());
  }
}

// The kiln-train binary built beside this test (empty when KILN_TOOLS=OFF built none). A forked
// copy of this process could not train: its OpenMP pool's threads are gone in the child.
fs::path kiln_train_exe() {
  const fs::path exe = fs::read_symlink("/proc/self/exe").parent_path() / "kiln-train";
  return fs::exists(exe) ? exe : fs::path();
}

// Starts kiln-train with `args`, waits until `dir` holds a checkpoint, sends `sig`, and returns
// the process's wait status.
int signal_after_checkpoint(const fs::path& exe, std::vector<std::string> args, const fs::path& dir,
                            int sig) {
  args.insert(args.begin(), exe.string());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t child = -1;
  REQUIRE(::posix_spawn(&child, exe.c_str(), nullptr, nullptr, argv.data(), environ) == 0);
  for (int i = 0; i < 60000 && !fs::exists(dir / "checkpoint.safetensors"); ++i) ::usleep(1000);
  ::kill(child, sig);
  int status = -1;
  ::waitpid(child, &status, 0);
  return status;
}

}  // namespace

TEST_CASE("kiln-train: a signal stops a run with a checkpoint; --resume continues it bit for bit") {
  Watchdog dog(600);
  const fs::path a = tmp().dir / "sig-straight";
  train::run(train::parse_args(with(job(a.string(), 3), {"--overwrite"})));
  REQUIRE(read_log(a / "steps.jsonl").size() == 27);  // 9 steps per epoch
  // model_best.safetensors: the weights of the first epoch with the highest test top-1.
  const auto epochs_a = read_log(a / "log.jsonl");
  REQUIRE(epochs_a.size() == 3);
  size_t best = 0;
  for (size_t e = 1; e < 3; ++e)
    if (epochs_a[e].at("test_top1").number() > epochs_a[best].at("test_top1").number()) best = e;
  const SafetensorsData best_file = load_safetensors((a / "model_best.safetensors").string());
  CHECK(best_file.metadata.at("epochs") == std::to_string(best + 1));
  CHECK(std::stod(best_file.metadata.at("test_top1")) ==
        doctest::Approx(epochs_a[best].at("test_top1").number()).epsilon(1e-12));
  CHECK(best_file.metadata.at("arch") == "resnet_small");
  if (best == 2) check_same_bits(best_file, load_safetensors((a / "model.safetensors").string()));

  // KILN_TRAIN_TEST_STOP=N raises SIGTERM after step N: in epoch 1; at epoch 1's last batch (the
  // epoch ends, is evaluated and logged, then the run stops); in epoch 2.
  for (int64_t stop : {4, 9, 12}) {
    CAPTURE(stop);
    const fs::path b = tmp().dir / ("sig-stopped-" + std::to_string(stop));
    const std::string ckpt = (b / "checkpoint.safetensors").string();
    ::setenv("KILN_TRAIN_TEST_STOP", std::to_string(stop).c_str(), 1);
    const int rc = train::main(with(job(b.string(), 3), {"--overwrite"}));
    ::unsetenv("KILN_TRAIN_TEST_STOP");
    CHECK(rc == 128 + SIGTERM);
    CHECK_FALSE(fs::exists(b / "model.safetensors"));  // not a finished run
    const SafetensorsData saved = load_safetensors(ckpt);
    const int64_t batches = stop % 9;
    const auto it = saved.metadata.find("epoch_batches_done");
    if (batches == 0) {
      CHECK(it == saved.metadata.end());
    } else {
      REQUIRE(it != saved.metadata.end());
      CHECK(it->second == std::to_string(batches));
    }
    CHECK(read_log(b / "steps.jsonl").size() == size_t(stop));
    CHECK(read_log(b / "log.jsonl").size() == size_t(stop / 9));
    if (batches > 0) {  // the rest of the epoch needs its batches: the same batch size
      const std::string m = run_error(with(job(b.string(), 3), {"-b", "16", "--resume", ckpt}));
      CHECK_MESSAGE(m.find("the same batch size") != std::string::npos, m);
      CHECK_MESSAGE(m.find("after batch " + std::to_string(batches)) != std::string::npos, m);
      // Evaluating its weights needs no batches of the epoch: any batch size.
      const train::Summary ev = train::run(
          train::parse_args(with(job(b.string(), 3), {"-b", "16", "-e", "--resume", ckpt})));
      CHECK(std::isfinite(ev.test_loss));
    }
    const train::Summary s =
        train::run(train::parse_args(with(job(b.string(), 3), {"--resume", ckpt})));
    CHECK(s.stop_signal == 0);
    CHECK(s.epochs_done == 3);
    check_same_run(a, b);
    const auto epochs = read_log(b / "log.jsonl");
    REQUIRE(epochs.size() == 3);
    if (batches > 0) CHECK(epochs[size_t(stop / 9)].at("first_batch").number() == batches);
  }

  // A real SIGINT from another process, whenever it lands after epoch 1's checkpoint: the tool
  // exits with 130 after writing a checkpoint, and resuming gives the uninterrupted run's bits.
  const fs::path exe = kiln_train_exe();
  if (exe.empty()) {
    MESSAGE("no kiln-train beside this test (KILN_TOOLS=OFF): the real-signal part not run");
    return;
  }
  const fs::path c = tmp().dir / "sig-int";
  fs::remove_all(c);
  const int status = signal_after_checkpoint(exe, job(c.string(), 3), c, SIGINT);
  REQUIRE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 0) {
    MESSAGE("the run finished before SIGINT reached it; nothing to resume");
  } else {
    CHECK(WEXITSTATUS(status) == 128 + SIGINT);
    CHECK_FALSE(fs::exists(c / "model.safetensors"));
    train::run(train::parse_args(
        with(job(c.string(), 3), {"--resume", (c / "checkpoint.safetensors").string()})));
    check_same_run(a, c);
  }
}

TEST_CASE(
    "kiln-train --checkpoint-steps: checkpoints inside epochs change nothing; a killed run "
    "resumes from the last one bit for bit") {
  Watchdog dog(600);
  const fs::path a = tmp().dir / "ckpt-straight", b = tmp().dir / "ckpt-every-4";
  train::run(train::parse_args(with(job(a.string(), 3), {"--overwrite"})));
  train::run(
      train::parse_args(with(job(b.string(), 3), {"--overwrite", "--checkpoint-steps", "4"})));
  check_same_run(a, b);  // the saves (and the log flushes before them) do not touch training
  CHECK(run_error(with(job(b.string(), 1), {"--checkpoint-steps", "-1"}))
            .find("--checkpoint-steps") != std::string::npos);

  // The tool killed outright (SIGKILL) once its first checkpoint is on disk, wherever it then is.
  const fs::path exe = kiln_train_exe();
  if (exe.empty()) {
    MESSAGE("no kiln-train beside this test (KILN_TOOLS=OFF): the killed-run part not run");
    return;
  }
  const fs::path c = tmp().dir / "ckpt-killed";
  fs::remove_all(c);
  const int status = signal_after_checkpoint(
      exe, with(job(c.string(), 3), {"--checkpoint-steps", "2"}), c, SIGKILL);
  if (WIFEXITED(status)) {
    MESSAGE("the run finished before SIGKILL reached it; nothing to resume");
    return;
  }
  CHECK(WIFSIGNALED(status));
  const std::string ckpt = (c / "checkpoint.safetensors").string();
  const SafetensorsData saved = load_safetensors(ckpt);  // whole: written atomically
  MESSAGE("killed after the checkpoint of step " << saved.metadata.at("kiln.step"));
  train::run(train::parse_args(with(job(c.string(), 3), {"--resume", ckpt})));
  check_same_run(a, c);
}
