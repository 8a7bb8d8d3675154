// Self-describing model files (optim/model_file.h), kiln-convert reading them, fine-tuning with
// --pretrained / --freeze-backbone, kiln-train's steps.jsonl and output, kiln-predict on a tiny
// model trained here (CPU), and kiln-plot's answers. Data: real Fashion-MNIST PNGs.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/json.h"
#include "data/export_images.h"
#include "data/fashion_mnist.h"
#include "optim/checkpoint.h"
#include "optim/model_file.h"
#include "tools/cli/cli.h"
#include "tools/predict/predict.h"
#include "tools/train/train_parts.h"
#include "tools/train/trainer.h"
#include "tests/train_test_util.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

using testutil::image_folder;
using testutil::tmp;

// resnet_small of width 8 on 16x16 crops, batch 32: 9 steps per epoch.
std::vector<std::string> job(const fs::path& out, int64_t epochs,
                             const std::vector<std::string>& more = {}) {
  std::vector<std::string> a = {image_folder(),
                                "-a",
                                "resnet_small",
                                "--width",
                                "8",
                                "--image-size",
                                "16",
                                "-b",
                                "32",
                                "--epochs",
                                std::to_string(epochs),
                                "-j",
                                "1",
                                "--device",
                                "cpu",
                                "--output",
                                out.string(),
                                "--quiet"};
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

std::vector<json::Value> read_jsonl(const fs::path& p) {
  std::ifstream f(p);
  std::vector<json::Value> lines;
  for (std::string line; std::getline(f, line);) lines.push_back(json::parse(line));
  return lines;
}

// Everything written to stdout (fd 1) while alive.
class CaptureStdout {
 public:
  CaptureStdout() {
    std::fflush(stdout);
    saved_ = ::dup(1);
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::close(fd);
  }
  ~CaptureStdout() { restore(); }
  std::string text() {
    restore();
    std::ifstream f(path_);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }

 private:
  void restore() {
    if (saved_ < 0) return;
    std::fflush(stdout);
    ::dup2(saved_, 1);
    ::close(saved_);
    saved_ = -1;
  }
  std::string path_ = (tmp().dir / "stdout.txt").string();
  int saved_ = -1;
};

struct Run {
  int code = -1;
  std::string output;
};

// Runs `cmd` with sh; stdout (and stderr, unless `merge_stderr` is false and the command
// redirects it itself) comes back in output.
Run run_command(const std::string& cmd, bool merge_stderr = true) {
  Run r;
  std::FILE* p = ::popen((merge_stderr ? cmd + " 2>&1" : cmd).c_str(), "r");
  REQUIRE(p != nullptr);
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string tool_path(const std::string& name) {
  const fs::path exe = fs::read_symlink("/proc/self/exe").parent_path() / name;
  REQUIRE_MESSAGE(fs::exists(exe), exe.string(), " is missing: build the tools first");
  return exe.string();
}

bool same_values(const Tensor& a, const Tensor& b) {
  const Tensor ca = a.to(DType::f32).contiguous(), cb = b.to(DType::f32).contiguous();
  return ca.shape() == cb.shape() && std::memcmp(ca.raw_data(), cb.raw_data(), ca.nbytes()) == 0;
}

ModelInfo small_info(int64_t classes, int64_t in_channels = 3, int64_t width = 8) {
  ModelInfo m;
  m.arch = "resnet_small";
  m.num_classes = classes;
  m.in_channels = in_channels;
  m.width = width;
  m.imagenet_stem = false;
  m.image_size = 16;
  m.resize_size = 18;
  if (in_channels == 1) {
    m.mean = {0.3f};
    m.std = {0.4f};
  }
  return m;
}

}  // namespace

TEST_CASE("model files: metadata round trip, files without metadata, malformed metadata") {
  ModelInfo m = small_info(4, 1, 4);
  m.image_size = m.resize_size = 28;
  m.class_names = {"T-shirt/top", "a \"quoted\" name", "Ünïcode", "back\\slash"};
  const ModelInfo r = read_model_metadata(model_metadata(m), "mem");
  CHECK(r.arch == m.arch);
  CHECK(r.num_classes == 4);
  CHECK(r.in_channels == 1);
  CHECK(r.width == 4);
  CHECK_FALSE(r.imagenet_stem);
  CHECK(r.image_size == 28);
  CHECK(r.resize_size == 28);
  CHECK(r.mean == m.mean);
  CHECK(r.std == m.std);
  CHECK(r.class_names == m.class_names);

  // Written with the weights, read back into an equal model.
  auto model = build_model(m, 3);
  const std::string with = (tmp().dir / "with_meta.safetensors").string();
  save_weights(with, *model, WeightsDType::Float32, model_metadata(m));
  LoadedModel l = load_model_file(with);
  CHECK(l.notes.empty());
  CHECK(l.info.class_names == m.class_names);
  CHECK(l.info.mean == m.mean);
  const NamedTensors a = state_dict(*model), b = state_dict(*l.model);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) CHECK(same_values(a[i].second, b[i].second));

  // No metadata: the shape is read off the weights, preprocessing falls back and says so.
  const std::string without = (tmp().dir / "no_meta.safetensors").string();
  save_weights(without, *model);
  LoadedModel n = load_model_file(without);
  CHECK(n.notes.find("has no kiln model metadata") != std::string::npos);
  CHECK(n.info.arch == "resnet_small");
  CHECK(n.info.num_classes == 4);
  CHECK(n.info.in_channels == 1);
  CHECK(n.info.width == 4);
  CHECK(n.info.image_size == 28);
  CHECK(n.info.class_names.empty());
  auto r18 = models::resnet18(7);
  const ModelInfo i18 = infer_model_info(state_dict(*r18), "r18");
  CHECK(i18.arch == "resnet18");
  CHECK(i18.num_classes == 7);
  CHECK(i18.imagenet_stem);
  CHECK(i18.width == 64);

  // Malformed metadata and non-ResNet files: errors naming the file and the key.
  auto meta = model_metadata(m);
  meta["class_names"] = "[\"only one\"]";
  CHECK_THROWS_WITH_AS(read_model_metadata(meta, "f.safetensors"),
                       doctest::Contains("'f.safetensors': metadata has 1 class names for 4"),
                       Error);
  meta = model_metadata(m);
  meta["mean"] = "0.5";
  CHECK_THROWS_WITH_AS(read_model_metadata(meta, "f"),
                       doctest::Contains("'mean' is not a JSON array"), Error);
  meta = model_metadata(m);
  meta["num_classes"] = "ten";
  CHECK_THROWS_WITH_AS(read_model_metadata(meta, "f"),
                       doctest::Contains("'num_classes' = 'ten' is not an integer"), Error);
  const std::string other = (tmp().dir / "other.safetensors").string();
  save_safetensors(other, {{"w", zeros({2})}});
  CHECK_THROWS_WITH_AS(load_model_file(other), doctest::Contains("does not hold a ResNet"), Error);
}

TEST_CASE("kiln-convert: reads the metadata, builds 1-channel models, refuses a class mismatch") {
  const std::string convert = tool_path("kiln-convert");
  ModelInfo m = small_info(4, 1, 4);
  auto model = build_model(m, 1);
  const std::string with = (tmp().dir / "c_meta.safetensors").string();
  const std::string without = (tmp().dir / "c_plain.safetensors").string();
  const std::string out = (tmp().dir / "c_out.safetensors").string();
  save_weights(with, *model, WeightsDType::Float32, model_metadata(m));
  save_weights(without, *model);

  Run r = run_command(convert + " --in " + with + " --out " + out);
  CHECK(r.code == 0);
  CHECK(r.output.find("4 classes, 1 input channel(s), from its metadata") != std::string::npos);
  CHECK(load_safetensors(out).metadata.at("in_channels") == "1");

  r = run_command(convert + " --in " + with + " --out " + out + " --num-classes 5");
  CHECK(r.code == 1);
  CHECK(r.output ==
        "kiln-convert: error: --num-classes 5 but '" + with + "' holds 4 (its metadata)\n");

  r = run_command(convert + " --in " + without + " --out " + out +
                  " --arch resnet_small --num-classes 4 --in-channels 1 --width 4");
  CHECK(r.code == 0);
  r = run_command(convert + " --in " + without + " --out " + out);  // read off the weights
  CHECK(r.code == 0);
  CHECK(r.output.find("from its weights") != std::string::npos);

  const auto before = fs::last_write_time(out);
  r = run_command(convert + " --in " + without + " --out " + out +
                  " --arch resnet_small --num-classes 10 --in-channels 1 --width 4");
  CHECK(r.code == 1);
  CHECK(r.output.find("fc.weight") != std::string::npos);
  CHECK(r.output.find(".cpp:") == std::string::npos);
  CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
  CHECK(fs::last_write_time(out) == before);  // nothing overwritten
}

TEST_CASE("kiln-train: steps.jsonl, evaluation progress, --quiet's final line, --start-epoch") {
  const fs::path out = tmp().dir / "steps";
  std::string text;
  {
    std::vector<std::string> args = job(out, 1, {"-p", "3"});
    args.erase(std::find(args.begin(), args.end(), "--quiet"));
    CaptureStdout cap;
    train::run(train::parse_args(args));
    text = cap.text();
  }
  CHECK(text.find("data wait") != std::string::npos);
  CHECK(text.find("  evaluating: step    3/4") != std::string::npos);
  CHECK(text.find("  evaluating: step    4/4") != std::string::npos);

  const std::vector<json::Value> steps = read_jsonl(out / "steps.jsonl");
  const std::vector<json::Value> log = read_jsonl(out / "log.jsonl");
  REQUIRE(steps.size() == 9);
  REQUIRE(log.size() == 1);
  double loss = 0, top1 = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const json::Value& s = steps[i];
    INFO("line ", i);
    CHECK(s.at("step").number() == double(i + 1));
    CHECK(s.at("epoch").number() == 1);
    CHECK(s.at("epoch_frac").number() == doctest::Approx(double(i + 1) / 9.0).epsilon(1e-5));
    CHECK(std::isfinite(s.at("loss").number()));
    CHECK(s.at("loss").number() > 0);
    CHECK(s.at("top1").number() >= 0);
    CHECK(s.at("top1").number() <= 1);
    CHECK(s.at("loss_scale").number() == 1);
    CHECK(s.at("images_per_s").number() > 0);
    CHECK(s.at("ms_compute").number() > 0);
    CHECK(s.at("ms_data").number() >= 0);
    loss += s.at("loss").number() / 9.0;
    top1 += s.at("top1").number() / 9.0;
  }
  // The per-step values add up to the epoch's (equal batches).
  CHECK(loss == doctest::Approx(log[0].at("train_loss").number()).epsilon(1e-4));
  CHECK(top1 == doctest::Approx(log[0].at("train_top1").number()).epsilon(1e-4));
  CHECK(steps[0].at("lr").number() == 0.05);  // no warmup step at 0.05 epochs of 9 steps: the peak
  CHECK(steps[8].at("lr").number() == doctest::Approx(log[0].at("lr").number()).epsilon(1e-5));

  // --quiet: exactly the final line.
  const fs::path q = tmp().dir / "quiet";
  {
    CaptureStdout cap;
    train::run(train::parse_args(job(q, 2)));
    text = cap.text();
  }
  CHECK(text.rfind("final test top-1 ", 0) == 0);
  CHECK(std::count(text.begin(), text.end(), '\n') == 1);
  CHECK(read_jsonl(q / "steps.jsonl").size() == 18);

  // --start-epoch 1 again (the run's own checkpoint continued from epoch 1): the logs lose what
  // came after epoch 1 before they grow. Without --resume it would be a new run, refused there.
  train::run(train::parse_args(job(
      q, 2, {"--start-epoch", "1", "--resume", (q / "checkpoint.safetensors").string()})));
  const std::vector<json::Value> again = read_jsonl(q / "steps.jsonl");
  REQUIRE(again.size() == 18);
  for (size_t i = 0; i < again.size(); ++i) CHECK(again[i].at("step").number() == double(i + 1));
  const std::vector<json::Value> epochs = read_jsonl(q / "log.jsonl");
  REQUIRE(epochs.size() == 2);
  CHECK(epochs[1].at("epoch").number() == 2);

  CHECK(train::fmt_time(65) == "1:05");
  CHECK(train::fmt_time(3725) == "1:02:05");
  CHECK(train::fmt_time(100 * 3600) == "100:00:00");
}

TEST_CASE("kiln-train: --pretrained fine-tunes a model of another class count; strict otherwise") {
  // A 4-class "pretrained" model with the job's backbone.
  auto base = build_model(small_info(4), 5);
  const std::string pre = (tmp().dir / "pre4.safetensors").string();
  save_weights(pre, *base, WeightsDType::Float32, model_metadata(small_info(4)));

  const fs::path out = tmp().dir / "finetune";
  std::string text;
  {
    CaptureStdout cap;
    train::run(train::parse_args(job(out, 1, {"--pretrained", pre, "--freeze-backbone"})));
    text = cap.text();
  }
  CHECK(text.find("--pretrained " + pre +
                  ": loaded all but the classifier (4 classes in the file, 10 here); the "
                  "classifier re-initialised for fine-tuning\n") == 0);
  const SafetensorsData tuned = load_safetensors((out / "model.safetensors").string());
  const SafetensorsData orig = load_safetensors(pre);
  for (const char* frozen : {"conv1.weight", "bn1.weight", "layer1.0.conv2.weight",
                             "layer3.0.downsample.0.weight", "layer3.0.bn2.bias"}) {
    INFO(frozen);
    CHECK(same_values(tuned.at(frozen), orig.at(frozen)));
  }
  CHECK(tuned.at("fc.weight").shape() == Shape{10, 32});
  CHECK(tuned.metadata.at("num_classes") == "10");

  // Without --freeze-backbone the backbone trains.
  const fs::path out2 = tmp().dir / "finetune_all";
  train::run(train::parse_args(job(out2, 1, {"--pretrained", pre})));
  CHECK_FALSE(
      same_values(load_safetensors((out2 / "model.safetensors").string()).at("conv1.weight"),
                  orig.at("conv1.weight")));

  // Same class count: everything loads, so evaluating reproduces the file's accuracy.
  train::Summary e1 = train::run(train::parse_args(
      job(out, 1, {"--evaluate", "--pretrained", (out / "model.safetensors").string()})));
  train::Summary e2 = train::run(train::parse_args(
      job(out, 1, {"--evaluate", "--weights", (out / "model.safetensors").string()})));
  CHECK(e1.test_top1 == e2.test_top1);

  // Another backbone: refused, naming the key and both shapes, no source location.
  auto wide = build_model(small_info(4, 3, 16), 5);
  const std::string pre16 = (tmp().dir / "pre16.safetensors").string();
  save_weights(pre16, *wide);
  try {
    train::run(train::parse_args(job(tmp().dir / "bad", 1, {"--pretrained", pre16})));
    FAIL("expected an error");
  } catch (const cli::UsageError& e) {
    const std::string w = e.what();
    CHECK(w.find("does not fit the model beyond its classifier") != std::string::npos);
    CHECK(w.find("conv1.weight") != std::string::npos);
    CHECK(w.find(".cpp:") == std::string::npos);
  }
  // --weights stays strict and says what to use instead.
  CHECK_THROWS_WITH_AS(train::run(train::parse_args(job(tmp().dir / "bad", 1, {"--weights", pre}))),
                       doctest::Contains("has 4 classes, the data 10 (--pretrained loads all but "
                                         "the classifier"),
                       cli::UsageError);
  CHECK_THROWS_WITH_AS(
      train::run(train::parse_args(job(tmp().dir / "bad", 1, {"--pretrained", "/no/such/file"}))),
      doctest::Contains("--pretrained: "), cli::UsageError);
  CHECK_THROWS_WITH_AS(
      train::run(train::parse_args(job(tmp().dir / "bad", 1, {"--weights", "/no/such/file"}))),
      doctest::Contains("--weights: "), cli::UsageError);
}

TEST_CASE("kiln-train: --nesterov changes the update; --dummy trains on synthetic data") {
  const fs::path a = tmp().dir / "plain", b = tmp().dir / "nesterov";
  train::run(train::parse_args(job(a, 1)));
  train::run(train::parse_args(job(b, 1, {"--nesterov"})));
  CHECK_FALSE(same_values(load_safetensors((a / "model.safetensors").string()).at("conv1.weight"),
                          load_safetensors((b / "model.safetensors").string()).at("conv1.weight")));
  CHECK_THROWS_WITH_AS(
      train::run(train::parse_args(job(b, 1, {"--nesterov", "--optimizer", "adamw"}))),
      doctest::Contains("--nesterov needs --optimizer sgd"), cli::UsageError);

  const fs::path d = tmp().dir / "dummy";
  train::Summary s = train::run(train::parse_args(
      {"--dummy", "--dummy-images", "64", "-b", "32", "--image-size", "16", "-a", "resnet_small",
       "--width", "4", "--device", "cpu", "--output", d.string(), "--quiet"}));
  CHECK(s.epochs_done == 1);
  CHECK(read_jsonl(d / "steps.jsonl").size() == 2);
  CHECK(load_safetensors((d / "model.safetensors").string()).metadata.at("num_classes") == "1000");
}

TEST_CASE(
    "kiln-predict: a model trained here names the validation images as the trainer scored them") {
  const fs::path out = tmp().dir / "predict_model";
  train::Summary s = train::run(train::parse_args(job(out, 2, {"--lr", "0.1"})));
  const std::string weights = (out / "model.safetensors").string();
  LoadedModel m = load_model_file(weights);
  CHECK(m.notes.empty());
  REQUIRE(m.info.class_names.size() == 10);
  CHECK(m.info.class_names[9] == "9_Ankle_boot");  // the ImageFolder's folder names
  CHECK(m.info.image_size == 16);
  CHECK(m.info.resize_size == 18);

  // The run's checkpoint describes the same model.
  LoadedModel ck = load_model_file((out / "checkpoint.safetensors").string());
  CHECK(ck.notes.empty());
  CHECK(ck.info.class_names == m.info.class_names);
  CHECK(same_values(state_dict(*ck.model)[0].second, state_dict(*m.model)[0].second));

  const std::string val = image_folder() + "/val";
  const std::vector<std::string> images = predict::collect_images({val}).images;
  REQUIRE(images.size() == 100);
  const std::vector<predict::Prediction> p = predict::predict(m, images, Device::cpu(), 5);
  REQUIRE(p.size() == 100);
  int hits = 0;
  for (const predict::Prediction& r : p) {
    REQUIRE(r.error.empty());
    REQUIRE(r.classes.size() == 5);
    double sum = 0;
    for (size_t j = 0; j < 5; ++j) {
      sum += r.probabilities[j];
      if (j > 0) CHECK(r.probabilities[j] <= r.probabilities[j - 1]);
    }
    CHECK(sum <= 1.0 + 1e-9);
    // The folder the image sits in is its label.
    hits += fs::path(r.path).parent_path().filename().string() ==
            predict::class_name(m.info, r.classes[0]);
  }
  // Same preprocessing and weights as the trainer's evaluation (batch 1 vs batch 32 may move a
  // near-tie).
  CHECK(double(hits) / 100.0 == doctest::Approx(s.test_top1).epsilon(0.021));

  // The tool: output, bad input.
  const std::string tool = tool_path("kiln-predict");
  const std::string one = images.back();
  Run r = run_command(tool + " --weights " + weights + " " + one);
  CHECK(r.code == 0);
  CHECK(r.output.rfind(one + "\n", 0) == 0);
  CHECK(std::count(r.output.begin(), r.output.end(), '%') == 5);

  r = run_command(tool + " --weights " + weights + " " + val + "/missing.png");
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-predict: error: no such image or folder: '" + val + "/missing.png'\n");

  const fs::path empty = tmp().dir / "no_images";
  fs::create_directories(empty);
  r = run_command(tool + " --weights " + weights + " " + empty.string());
  CHECK(r.code == 1);
  CHECK(r.output ==
        "kiln-predict: error: folder '" + empty.string() + "' holds no .jpg, .jpeg or .png file\n");

  const std::string broken = (tmp().dir / "broken.png").string();
  std::ofstream(broken) << "not an image";
  r = run_command(tool + " --weights " + weights + " " + broken + " " + one);
  CHECK(r.code == 1);
  CHECK(r.output.find("kiln-predict: error: image '" + broken) != std::string::npos);
  CHECK(r.output.find("kiln-predict: 1 error(s) above; 1 of 2 image(s) predicted\n") !=
        std::string::npos);
  CHECK(r.output.find(one + "\n") != std::string::npos);  // the good image is still predicted
  CHECK(r.output.find(".cpp:") == std::string::npos);

  r = run_command(tool + " --weights " + (tmp().dir / "nope.safetensors").string() + " " + one);
  CHECK(r.code == 1);
  CHECK(r.output.rfind("kiln-predict: error: --weights: ", 0) == 0);
  CHECK(r.output.find(".cpp:") == std::string::npos);

  r = run_command(tool + " " + one);
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-predict: error: --weights PATH is required (see kiln-predict --help)\n");

  // A file without metadata still predicts, and says what it assumed.
  const std::string plain = (tmp().dir / "plain_model.safetensors").string();
  save_weights(plain, *m.model);
  r = run_command(tool + " --weights " + plain + " " + one);
  CHECK(r.code == 0);
  CHECK(r.output.find("kiln-predict: note: '" + plain + "' has no kiln model metadata") !=
        std::string::npos);
  CHECK(r.output.find("class ") != std::string::npos);  // numbered classes
}

TEST_CASE("kiln-train: classes.txt beside IDX files names the classes in the model file") {
  const fs::path dir = tmp().dir / "idx";
  fs::create_directories(dir);
  for (const char* f : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                        "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"})
    fs::create_symlink(fs::path(data::kFashionMnistDir) / f, dir / f);
  train::DataOptions o;
  o.data = dir.string();
  o.batch_size = 64;
  o.device = Device::cpu();
  {
    const train::TrainData plain(o);
    CHECK(plain.class_names().empty());
    REQUIRE(plain.mean().size() == 1);
    // Not the 'fashion-mnist' data set by name, so its statistics are computed: Fashion-MNIST's
    // training pixels, whose mean and std are known (0.2860, 0.3530 to four places).
    CHECK(plain.mean()[0] == doctest::Approx(0.2860).epsilon(2e-4));
    CHECK(plain.stddev()[0] == doctest::Approx(0.3530).epsilon(2e-4));
  }
  std::ofstream names(dir / "classes.txt");
  for (int k = 0; k < 10; ++k) names << "kind " << k << (k == 3 ? "\r\n" : "\n");
  names.close();
  const train::TrainData d(o);
  REQUIRE(d.class_names().size() == 10);
  CHECK(d.class_names()[3] == "kind 3");
  train::Config c;
  c.data = dir.string();
  const ModelInfo m = train::model_info(c, d);
  CHECK(m.in_channels == 1);
  CHECK_FALSE(m.imagenet_stem);
  CHECK(m.image_size == 28);
  CHECK(m.resize_size == 28);
  CHECK(m.class_names[9] == "kind 9");
  CHECK(read_model_metadata(model_metadata(m), "m").class_names == m.class_names);

  std::ofstream(dir / "classes.txt") << "only\ntwo\n";
  CHECK_THROWS_WITH_AS(train::TrainData{o},
                       doctest::Contains("classes.txt' names 2 classes, but the labels have 10"),
                       cli::UsageError);
}

TEST_CASE("kiln-train: classes.txt is checked line by line; class folders are checked too") {
  const fs::path dir = tmp().dir / "idx_names";
  fs::create_directories(dir);
  for (const char* f : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                        "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"})
    fs::create_symlink(fs::path(data::kFashionMnistDir) / f, dir / f);
  train::DataOptions o;
  o.data = dir.string();
  o.batch_size = 64;
  o.device = Device::cpu();
  const std::string file = (dir / "classes.txt").string();
  // Ten names "kind 0".."kind 9", then `tail`; `edit` changes them first.
  auto write = [&](const std::function<void(std::vector<std::string>&)>& edit,
                   const std::string& tail = "") {
    std::vector<std::string> lines;
    for (int k = 0; k < 10; ++k) lines.push_back("kind " + std::to_string(k));
    edit(lines);
    std::ofstream f(file, std::ios::binary | std::ios::trunc);
    for (const std::string& l : lines) f << l << "\n";
    f << tail;
  };
  auto error = [&]() -> std::string {
    try {
      train::TrainData d(o);
    } catch (const cli::UsageError& e) {
      return e.what();
    }
    return "(accepted)";
  };

  // Blank lines at the end, CRLF endings and a byte-order mark are fine.
  write([](auto& l) { l[0] = "\xEF\xBB\xBF" + l[0] + "\r"; }, "\n\r\n\n");
  {
    const train::TrainData d(o);
    REQUIRE(d.class_names().size() == 10);
    CHECK(d.class_names()[0] == "kind 0");
    CHECK(d.class_names()[9] == "kind 9");
  }
  // A blank line in the middle no longer ends the list quietly.
  write([](auto& l) { l.insert(l.begin() + 4, ""); });
  CHECK(error() == "'" + file +
                       "' line 5 is blank: one class name per line (blank lines may only end the "
                       "file)");
  write([](auto& l) { l[6] = "kind 2"; });
  CHECK(error() == "'" + file + "' line 7: class name 'kind 2' repeats line 3");
  write([](auto& l) { l[2] = "   "; });
  CHECK(error() == "'" + file + "' line 3: class name '   ' is only whitespace");
  write([](auto& l) { l[0] = "\x1b[2Jkind"; });
  CHECK(error() ==
        "'" + file + "' line 1: class name '\\x1b[2Jkind' holds control character U+001B");
  write([](auto& l) { l[9] = "caf\xE9"; });
  CHECK(error() ==
        "'" + file + "' line 10: class name 'caf\\xe9' is not valid UTF-8 (byte 0xe9 at offset 3)");

  // ImageFolder class names are folder names: checked before training starts.
  const fs::path root = tmp().dir / "bad_folders";
  const std::string png = predict::collect_images({image_folder() + "/val"}).images[0];
  for (const char* split : {"train", "val"})
    for (const char* cls : {"ok", "bad\x1b]0;x\x07"}) {
      fs::create_directories(root / split / cls);
      fs::copy_file(png, root / split / cls / "0.png");
    }
  o.data = root.string();
  CHECK(error() == "--data '" + root.string() +
                       "/train': class folders: class 0 'bad\\x1b]0;x\\x07' holds control "
                       "character U+001B");

  // kiln-train's size flags keep to what a model file may hold.
  CHECK_THROWS_WITH_AS(train::parse_args({"--image-size", "5000"}),
                       doctest::Contains("--image-size"), cli::UsageError);
  CHECK_THROWS_WITH_AS(train::parse_args({"--image-size", "5000"}), doctest::Contains("4096"),
                       cli::UsageError);
}

namespace {

// A kiln::Error's message without its " [file.cpp:12, ...]" suffix.
std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return cli::without_location(e.what());
  }
  return "(no error)";
}

// An untrained 3-channel resnet_small (width 4, 16x16 input) and its metadata, written to
// `name` in the test folder with `meta` (model_metadata of small_info unless given).
std::string write_model(const std::string& name, int64_t classes,
                        const std::map<std::string, std::string>* meta = nullptr) {
  const ModelInfo m = small_info(classes, 3, 4);
  auto model = build_model(m, 1);
  const std::string path = (tmp().dir / name).string();
  save_weights(path, *model, WeightsDType::Float32, meta ? *meta : model_metadata(m));
  return path;
}

// The lines of `text` that do not start with two spaces (the per-class lines).
std::vector<std::string> headline_lines(const std::string& text) {
  std::vector<std::string> out;
  size_t b = 0;
  for (size_t e; (e = text.find('\n', b)) != std::string::npos; b = e + 1)
    if (text.compare(b, 2, "  ") != 0) out.push_back(text.substr(b, e - b));
  return out;
}

}  // namespace

TEST_CASE("model files: every metadata value is range-checked, naming the file, key and range") {
  const ModelInfo m = small_info(4, 1, 4);
  auto with = [&](const std::string& key, const std::string& value) {
    auto meta = model_metadata(m);
    meta[key] = value;
    return meta;
  };
  auto error = [&](const std::string& key, const std::string& value) {
    return message_of([&] { read_model_metadata(with(key, value), "f.safetensors"); });
  };
  const std::string f = "'f.safetensors': metadata ";
  CHECK(error("image_size", "100000") ==
        f + "'image_size' = '100000' is not an integer in 1..4096");
  CHECK(error("image_size", "0") == f + "'image_size' = '0' is not an integer in 1..4096");
  CHECK(error("resize_size", "10") ==
        f + "'resize_size' = '10' is not an integer in 16..8192 (at least image_size)");
  CHECK(error("resize_size", "9000") ==
        f + "'resize_size' = '9000' is not an integer in 16..8192 (at least image_size)");
  CHECK(error("num_classes", "0") == f + "'num_classes' = '0' is not an integer in 1..1000000");
  CHECK(error("num_classes", "99999999999") ==
        f + "'num_classes' = '99999999999' is not an integer in 1..1000000");
  CHECK(error("in_channels", "65") == f + "'in_channels' = '65' is not an integer in 1..64");
  CHECK(error("width", "100000") == f + "'width' = '100000' is not an integer in 1..1024");
  CHECK(error("width", "-4") == f + "'width' = '-4' is not an integer in 1..1024");
  CHECK(error("arch", "resnet9000") ==
        f + "'arch' = 'resnet9000' is not one of resnet101, resnet152, resnet18, resnet34, "
            "resnet50, resnet_small, vit_b_16, vit_s_16, vit_t_4");
  CHECK(error("arch", "\x1b[2J") == f + "'arch' = '\\x1b[2J' is not one of resnet101, resnet152, "
                                        "resnet18, resnet34, resnet50, resnet_small, vit_b_16, "
                                        "vit_s_16, vit_t_4");
  CHECK(error("std", "[0]") == f + "'std' holds 0, outside 1e-06..1000");
  CHECK(error("std", "[-1]") == f + "'std' holds -1, outside 1e-06..1000");
  CHECK(error("mean", "[1e300]") == f + "'mean' holds 1e+300, outside -1000..1000");
  CHECK(error("mean", "[nan]") == f + "'mean' holds nan, outside -1000..1000");
  CHECK(error("mean", "[\"x\"]") == f + "'mean' holds a non-number");
  CHECK(error("mean", "[0.1, 0.2]") == f + "'mean' has 2 values for 1 input channel(s)");
  CHECK(error("in_channels", "3") == f + "'mean' has 1 values for 3 input channel(s)");
  CHECK(error("class_names", "[\"a\"]") ==
        "'f.safetensors': metadata has 1 class names for 4 classes");
  // A long value is shown cut short.
  CHECK(error("width", std::string(500, '9')) ==
        f + "'width' = '" + std::string(80, '9') + "...' is not an integer in 1..1024");

  // Without resize_size, at least image_size.
  auto meta = with("image_size", "300");
  meta.erase("resize_size");
  CHECK(read_model_metadata(meta, "f").resize_size == 300);

  // Class names from older files are taken as they are (printers escape them) ...
  const ModelInfo old =
      read_model_metadata(with("class_names", "[\"a\", \"a\", \"\\u001b[31mred\", \"\"]"), "f");
  CHECK(old.class_names[2] == "\x1b[31mred");
  // ... but never written.
  ModelInfo bad = m;
  bad.class_names = {"a", "b", "a", "c"};
  CHECK(message_of([&] { model_metadata(bad); }) == "model metadata: class 2 'a' repeats class 0");
  bad.class_names = {"a", "b", "\x1b[31mred", "c"};
  CHECK(message_of([&] { model_metadata(bad); }) ==
        "model metadata: class 2 '\\x1b[31mred' holds control character U+001B");
  bad = m;
  bad.image_size = 5000;
  CHECK(message_of([&] { model_metadata(bad); }) ==
        "model metadata: image_size 5000 is outside 1..4096");
  bad = m;
  bad.std = {0};
  CHECK(message_of([&] { model_metadata(bad); }) ==
        "model metadata: std holds 0, outside 1e-06..1000");

  // Metadata that disagrees with the weights is refused before a model is built from it.
  const ModelInfo m3 = small_info(4, 3, 4);
  auto wide = model_metadata(m3);
  wide["width"] = "1024";
  const std::string p = write_model("wide_meta.safetensors", 4, &wide);
  CHECK(message_of([&] { load_model_file(p); }) ==
        "'" + p + "': metadata 'width' = '1024' but its weights hold 4");
  auto classes = model_metadata(m3);
  classes["num_classes"] = "1000000";
  classes.erase("class_names");
  const std::string p2 = write_model("classes_meta.safetensors", 4, &classes);
  CHECK(message_of([&] { load_model_file(p2); }) ==
        "'" + p2 + "': metadata 'num_classes' = '1000000' but its weights hold 4");
}

TEST_CASE("kiln-predict: a model file it cannot use is one line: ranges, NaN weights") {
  const std::string tool = tool_path("kiln-predict");
  const std::string img = predict::collect_images({image_folder() + "/val"}).images[0];

  auto meta = model_metadata(small_info(3, 3, 4));
  meta["image_size"] = "100000";
  const std::string big = write_model("big_image.safetensors", 3, &meta);
  Run r = run_command(tool + " --weights " + big + " " + img);
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-predict: error: --weights: '" + big +
                        "': metadata 'image_size' = '100000' is not an integer in 1..4096\n");

  // NaN and infinite weights: the file and the first such tensor are named.
  auto model = build_model(small_info(3, 3, 4), 1);
  for (auto& [name, t] : state_dict(*model))
    if (name == "fc.bias") t.data<float>()[1] = std::nanf("");
  const std::string nan_path = (tmp().dir / "nan.safetensors").string();
  save_weights(nan_path, *model, WeightsDType::Float32, model_metadata(small_info(3, 3, 4)));
  const std::string refusal = "model file '" + nan_path +
                              "': tensor 'fc.bias' holds NaN or infinite values; refusing weights "
                              "that cannot have come from a finished training run";
  CHECK(message_of([&] { load_model_file(nan_path); }) == refusal);
  r = run_command(tool + " --weights " + nan_path + " " + img);
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-predict: error: --weights: " + refusal + "\n");

  for (auto& [name, t] : state_dict(*model))
    if (name == "fc.bias") t.data<float>()[1] = 0;
  for (auto& [name, t] : state_dict(*model))
    if (name == "layer1.0.conv1.weight") t.data<float>()[0] = INFINITY;
  save_weights(nan_path, *model, WeightsDType::Float32, model_metadata(small_info(3, 3, 4)));
  r = run_command(tool + " --weights " + nan_path + " " + img);
  CHECK(r.code == 1);
  CHECK(r.output.find("tensor 'layer1.0.conv1.weight' holds NaN or infinite values") !=
        std::string::npos);
}

TEST_CASE("kiln-predict: each bad input is one line naming it, the rest is predicted, exit 1") {
  const std::string tool = tool_path("kiln-predict");
  // Class names from an older file: escape sequences must not reach the terminal.
  auto meta = model_metadata(small_info(3, 3, 4));
  meta["class_names"] = "[\"plain\", \"\\u001b]0;pwned\\u0007\", \"rtl\\u202eabc\"]";
  const std::string weights = write_model("named.safetensors", 3, &meta);
  const std::vector<std::string> pngs = predict::collect_images({image_folder() + "/val"}).images;

  const fs::path d = tmp().dir / "inputs";
  fs::create_directories(d / "tree" / "a");
  fs::create_directories(d / "tree" / "b" / "c");
  fs::create_directories(d / "empty");
  fs::copy_file(pngs[0], d / "tree" / "a" / "1.png");
  fs::copy_file(pngs[1], d / "tree" / "b" / "c" / "2.png");
  fs::copy_file(pngs[2], d / "good.png");
  std::ofstream(d / "broken.png") << "not an image";
  {
    // A PNG signature and an IHDR chunk claiming 60000 x 60000 pixels.
    const unsigned char huge[] = {0x89, 'P',  'N', 'G', '\r', '\n', 0x1A, '\n', 0,    0, 0,
                                  13,   'I',  'H', 'D', 'R',  0,    0,    0xEA, 0x60, 0, 0,
                                  0xEA, 0x60, 8,   2,   0,    0,    0,    0,    0,    0, 0};
    std::ofstream(d / "huge.png", std::ios::binary)
        .write(reinterpret_cast<const char*>(huge), sizeof huge);
  }
  // An unreadable sub-folder. Root reads any folder, so as root the tool runs without the
  // capabilities that allow that (setpriv); without setpriv that part is left out.
  std::string prefix;
  bool locked = true;
  if (::geteuid() == 0) {
    if (fs::exists("/usr/bin/setpriv"))
      prefix = "/usr/bin/setpriv --inh-caps=-all --bounding-set=-dac_override,-dac_read_search ";
    else
      locked = false;
  }
  if (locked) {
    fs::create_directories(d / "tree" / "locked");
    fs::copy_file(pngs[3], d / "tree" / "locked" / "3.png");
    fs::permissions(d / "tree" / "locked", fs::perms::none);
  } else {
    MESSAGE("running as root without setpriv: the unreadable sub-folder is not tested");
  }
  const std::string D = d.string();
  Run r = run_command(prefix + tool + " --weights " + weights + " --top 3 " + D + "/missing.png " +
                      (locked ? D + "/tree/locked/3.png " : "") + D + "/tree " + D + "/empty " + D +
                      "/huge.png " + D + "/broken.png " + D + "/good.png");
  if (locked) fs::permissions(d / "tree" / "locked", fs::perms::owner_all);
  CHECK(r.code == 1);
  std::vector<std::string> expected = {"kiln-predict: error: no such image or folder: '" + D +
                                       "/missing.png'"};
  if (locked) {
    expected.push_back("kiln-predict: error: cannot access '" + D +
                       "/tree/locked/3.png': Permission denied");
    expected.push_back("kiln-predict: error: cannot list folder '" + D +
                       "/tree/locked': Permission denied (its images are not predicted)");
  }
  const std::vector<std::string> rest = {
      "kiln-predict: error: folder '" + D + "/empty' holds no .jpg, .jpeg or .png file",
      D + "/tree/a/1.png",
      D + "/tree/b/c/2.png",
      "kiln-predict: error: image '" + D +
          "/huge.png': header claims 60000x60000 pixels, over the limit (16384 per side, "
          "100000000 in all)",
      "kiln-predict: error: image '" + D +
          "/broken.png': not a readable JPEG/PNG (unknown image type)",
      D + "/good.png",
      "kiln-predict: " + std::to_string(locked ? 6 : 4) +
          " error(s) above; 3 of 5 image(s) predicted"};
  expected.insert(expected.end(), rest.begin(), rest.end());
  CHECK(headline_lines(r.output) == expected);
  // Three classes under each of the three images, the names escaped.
  CHECK(std::count(r.output.begin(), r.output.end(), '%') == 9);
  CHECK(r.output.find("%  plain\n") != std::string::npos);
  CHECK(r.output.find("%  \\x1b]0;pwned\\x07\n") != std::string::npos);
  CHECK(r.output.find("%  rtl\\u202eabc\n") != std::string::npos);
  CHECK(r.output.find('\x1b') == std::string::npos);
  CHECK(r.output.find("\xE2\x80\xAE") == std::string::npos);

  // Only missing paths: their lines, no model loaded, exit 1.
  r = run_command(tool + " --weights " + weights + " " + D + "/nope1 " + D + "/nope2");
  CHECK(r.code == 1);
  CHECK(r.output == "kiln-predict: error: no such image or folder: '" + D +
                        "/nope1'\nkiln-predict: error: no such image or folder: '" + D +
                        "/nope2'\n");
}

TEST_CASE("kiln-predict: output that cannot be written is an error, never exit code 0") {
  const std::string tool = tool_path("kiln-predict");
  const std::string weights = write_model("thousand.safetensors", 1000);
  const std::string img = predict::collect_images({image_folder() + "/val"}).images[0];
  const std::string cmd = tool + " --weights " + weights + " " + img;
  REQUIRE(fs::exists("/dev/full"));

  // stderr to the pipe, stdout elsewhere.
  Run r = run_command(cmd + " 2>&1 >/dev/full", false);
  CHECK(r.code == 1);
  CHECK(r.output ==
        "kiln-predict: error: cannot write to standard output: No space left on device\n");
  r = run_command(tool + " --help 2>&1 >/dev/full", false);
  CHECK(r.code == 1);
  CHECK(r.output ==
        "kiln-predict: error: cannot write to standard output: No space left on device\n");
  r = run_command(cmd + " 2>&1 >&-", false);
  CHECK(r.code == 1);
  CHECK(r.output ==
        "kiln-predict: error: standard output is closed: nowhere to print the predictions\n");

  // A reader that goes away: 20 images of 1000 classes is far more than a pipe holds. By
  // default SIGPIPE ends the tool quietly, as it does cat; with SIGPIPE ignored the write fails
  // with EPIPE, and that is one line and exit code 1.
  std::string many = tool + " --weights " + weights + " --top 1000";
  for (int i = 0; i < 20; ++i) many += " " + img;
  r = run_command("{ (" + many + "; echo \"rc=$?\" >&2) | head -c 1 >/dev/null; }");
  CHECK(r.output == "rc=141\n");
  r = run_command("{ trap '' PIPE; (" + many + "; echo \"rc=$?\" >&2) | head -c 1 >/dev/null; }");
  CHECK(r.output == "kiln-predict: error: cannot write to standard output: Broken pipe\nrc=1\n");
}
