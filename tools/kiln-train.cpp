// kiln-train: trains an image classifier. With no arguments it trains a small ResNet on
// Fashion-MNIST (Debian's dataset-fashion-mnist) on the GPU if there is one, else on the CPU,
// prints progress and the test accuracy after each epoch, and saves the final model.
// Flags follow PyTorch's ImageNet example; see usage() or --help.
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/autograd.h"
#include "core/generator.h"
#include "core/json.h"
#include "core/module.h"
#include "core/serialization.h"
#include "data/fashion_mnist.h"
#include "data/loader.h"
#include "models/resnet.h"
#include "ops/ops.h"
#include "optim/amp.h"
#include "optim/fused.h"
#include "optim/schedule.h"
#include "optim/train_step.h"
#include "cuda/profiler.h"
#ifdef KILN_WITH_CUDA
#include "cuda/graph.h"
#include "cuda/runtime.h"
#endif

namespace {

using namespace kiln;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string arch = "resnet_small";
  std::string data = "fashion-mnist";
  int64_t epochs = 1;
  int64_t batch_size = 128;
  double lr = 0.1;
  double momentum = 0.9;
  double wd = 5e-4;
  double warmup_epochs = 0.1;
  std::string optimizer = "sgd";
  std::string schedule = "cosine";
  double label_smoothing = 0.0;
  bool augment = false;
  uint64_t seed = 0;
  int workers = 2;
  std::string device = "auto";
  int64_t print_freq = 50;
  std::string output = "kiln-output";
  bool profile = false;
  std::string amp = "auto";    // auto: on for cuda; on; off
  std::string graph = "auto";  // auto: on for cuda; on; off
};

void usage(FILE* f) {
  std::fprintf(f,
      "usage: kiln-train [flags]\n"
      "Trains an image classifier; with no flags, a small ResNet on Fashion-MNIST.\n\n"
      "  --arch NAME          model: resnet_small (default), resnet18, resnet34, resnet50,\n"
      "                       resnet101, resnet152 (28x28 inputs use a 3x3 stem, no max pool)\n"
      "  --data PATH          'fashion-mnist' (default: %s) or a folder holding\n"
      "                       MNIST-style IDX files (train-images-idx3-ubyte[.gz], ...)\n"
      "  --epochs N           number of epochs (default 1)\n"
      "  -b, --batch-size N   batch size (default 128)\n"
      "  --lr LR              peak learning rate (default 0.1)\n"
      "  --momentum M         SGD momentum (default 0.9)\n"
      "  --wd WD              weight decay, not applied to BN parameters and biases (default 5e-4)\n"
      "  --warmup-epochs E    linear warmup length in epochs, may be fractional (default 0.1)\n"
      "  --optimizer NAME     sgd (default) or adamw\n"
      "  --schedule NAME      cosine (default), step (x0.1 at 50%% and 75%%), or constant\n"
      "  --label-smoothing E  cross-entropy label smoothing (default 0)\n"
      "  --augment            random crop (padding 4) and horizontal flip\n"
      "  --seed N             seed for initial weights, shuffling and augmentation (default 0)\n"
      "  --workers N          data-loading threads (default 2)\n"
      "  --device DEV         auto (default: cuda if present, else cpu), cpu, cuda, cuda:N\n"
      "  --print-freq N       progress line every N steps (default 50)\n"
      "  --output DIR         where the final model is written (default kiln-output)\n"
      "  --profile            per-op GPU time table after the first epoch (cuda only)\n"
      "  --amp on|off         FP16 storage with FP32 master weights and loss scaling\n"
      "                       (default: on for cuda, off for cpu)\n"
      "  --graph on|off       capture the whole training step as a CUDA graph and replay it\n"
      "                       (default: on for cuda; off for cpu, where it does not exist)\n"
      "  -h, --help           this text\n",
      data::kFashionMnistDir);
}

// Parses argv strictly: unknown flags, missing or malformed values are errors naming the flag.
Args parse_args(int argc, char** argv) {
  Args a;
  std::vector<std::string> args;  // "--flag=value" split into two words
  for (int i = 1; i < argc; ++i) {
    std::string w = argv[i];
    size_t eq = w.find('=');
    if (w.rfind("--", 0) == 0 && eq != std::string::npos) {
      args.push_back(w.substr(0, eq));
      args.push_back(w.substr(eq + 1));
    } else {
      args.push_back(w);
    }
  }
  const int n = int(args.size());
  auto need = [&](int& i, const std::string& flag) -> std::string {
    KILN_CHECK(i + 1 < n, "flag ", flag, " needs a value (see --help)");
    return args[size_t(++i)];
  };
  auto to_int = [](const std::string& flag, const std::string& v, int64_t lo) {
    char* end = nullptr;
    errno = 0;
    long long x = std::strtoll(v.c_str(), &end, 10);
    KILN_CHECK(!v.empty() && *end == '\0' && errno == 0 && x >= lo, "flag ", flag,
               ": expected an integer >= ", lo, ", got '", v, "'");
    return int64_t(x);
  };
  auto to_double = [](const std::string& flag, const std::string& v, double lo) {
    char* end = nullptr;
    double x = std::strtod(v.c_str(), &end);
    KILN_CHECK(!v.empty() && *end == '\0' && std::isfinite(x) && x >= lo, "flag ", flag,
               ": expected a number >= ", lo, ", got '", v, "'");
    return x;
  };
  for (int i = 0; i < n; ++i) {
    const std::string& f = args[size_t(i)];
    if (f == "-h" || f == "--help") {
      usage(stdout);
      std::exit(0);
    } else if (f == "--arch") {
      a.arch = need(i, f);
    } else if (f == "--data") {
      a.data = need(i, f);
    } else if (f == "--epochs") {
      a.epochs = to_int(f, need(i, f), 1);
    } else if (f == "-b" || f == "--batch-size") {
      a.batch_size = to_int(f, need(i, f), 1);
    } else if (f == "--lr") {
      a.lr = to_double(f, need(i, f), 0.0);
    } else if (f == "--momentum") {
      a.momentum = to_double(f, need(i, f), 0.0);
    } else if (f == "--wd" || f == "--weight-decay") {
      a.wd = to_double(f, need(i, f), 0.0);
    } else if (f == "--warmup-epochs") {
      a.warmup_epochs = to_double(f, need(i, f), 0.0);
    } else if (f == "--optimizer") {
      a.optimizer = need(i, f);
      KILN_CHECK(a.optimizer == "sgd" || a.optimizer == "adamw",
                 "flag --optimizer: expected sgd or adamw, got '", a.optimizer, "'");
    } else if (f == "--schedule") {
      a.schedule = need(i, f);
      KILN_CHECK(a.schedule == "cosine" || a.schedule == "step" || a.schedule == "constant",
                 "flag --schedule: expected cosine, step or constant, got '", a.schedule, "'");
    } else if (f == "--label-smoothing") {
      a.label_smoothing = to_double(f, need(i, f), 0.0);
      KILN_CHECK(a.label_smoothing < 1.0, "flag --label-smoothing: must be < 1");
    } else if (f == "--amp" || f == "--graph") {
      std::string v = need(i, f);
      KILN_CHECK(v == "on" || v == "off" || v == "auto", "flag ", f, ": expected on, off or auto, got '", v, "'");
      (f == "--amp" ? a.amp : a.graph) = v;
    } else if (f == "--profile") {
      a.profile = true;
    } else if (f == "--augment") {
      a.augment = true;
    } else if (f == "--seed") {
      a.seed = uint64_t(to_int(f, need(i, f), 0));
    } else if (f == "--workers" || f == "-j") {
      a.workers = int(to_int(f, need(i, f), 0));
    } else if (f == "--device") {
      a.device = need(i, f);
    } else if (f == "--print-freq" || f == "-p") {
      a.print_freq = to_int(f, need(i, f), 1);
    } else if (f == "--output") {
      a.output = need(i, f);
    } else {
      KILN_FAIL("unknown flag '", f, "' (see --help)");
    }
  }
  return a;
}

Device pick_device(const std::string& s) {
  if (s == "auto") {
#ifdef KILN_WITH_CUDA
    if (cuda::device_count() > 0) return Device::cuda(0);
#endif
    return Device::cpu();
  }
  Device d = Device::parse(s);
#ifdef KILN_WITH_CUDA
  if (d.is_cuda())
    KILN_CHECK(d.index < cuda::device_count(), "--device ", s, ": only ", cuda::device_count(),
               " CUDA device(s) present");
#else
  KILN_CHECK(d.is_cpu(), "--device ", s, ": this kiln was built without CUDA");
#endif
  return d;
}

// 28x28 single-channel inputs: torchvision's ResNets get a 3x3 stem without max pool.
std::shared_ptr<models::ResNet> build_model(const std::string& arch, int64_t classes,
                                            int64_t in_channels, uint64_t seed) {
  if (arch == "resnet_small") return models::resnet_small(classes, 32, 1, in_channels);
  struct Spec { models::BlockKind kind; std::vector<int64_t> layers; };
  static const std::map<std::string, Spec> specs = {
      {"resnet18", {models::BlockKind::Basic, {2, 2, 2, 2}}},
      {"resnet34", {models::BlockKind::Basic, {3, 4, 6, 3}}},
      {"resnet50", {models::BlockKind::Bottleneck, {3, 4, 6, 3}}},
      {"resnet101", {models::BlockKind::Bottleneck, {3, 4, 23, 3}}},
      {"resnet152", {models::BlockKind::Bottleneck, {3, 8, 36, 3}}}};
  auto it = specs.find(arch);
  if (it == specs.end()) models::make_model(arch, classes);  // throws, listing valid names
  models::ResNetOptions o;
  o.num_classes = classes;
  o.in_channels = in_channels;
  o.imagenet_stem = false;
  o.seed = seed;
  return std::make_shared<models::ResNet>(it->second.kind, it->second.layers, o);
}

std::string fmt_time(double s) {
  char buf[32];
  int m = int(s) / 60;
  std::snprintf(buf, sizeof buf, "%d:%02d", m, int(s) - 60 * m);
  return buf;
}

struct EvalResult {
  double loss = 0, accuracy = 0;
};

EvalResult evaluate(nn::Module& model, const data::DataLoader& loader, Device dev,
                    amp::Precision precision) {
  NoGradGuard ng;
  model.eval();
  double loss_sum = 0;
  int64_t correct = 0, seen = 0;
  for (data::Batch& b : loader.epoch(0)) {
    Tensor x = amp::prepare_input(b.x, dev, precision), y = b.y.to(dev);
    Tensor logits = model(x);
    loss_sum += F::cross_entropy(logits, y).item() * double(b.y.size(0));
    correct += int64_t(F::sum(F::eq(F::argmax(logits, 1), y).to(DType::f32)).item());
    seen += b.y.size(0);
  }
  model.train();
  return {loss_sum / double(seen), double(correct) / double(seen)};
}

int run(const Args& a) {
  const Device dev = pick_device(a.device);
  manual_seed(a.seed);
  const std::string dir = a.data == "fashion-mnist" ? data::kFashionMnistDir : a.data;
  const bool is_fmnist = a.data == "fashion-mnist";
  auto load = [&](data::Split s) {
    return is_fmnist ? data::load_fashion_mnist(dir, s) : data::load_mnist(dir, s);
  };
  data::IdxPair train_set = load(data::Split::Train), test_set = load(data::Split::Test);

  data::LoaderOptions lo;
  lo.batch_size = a.batch_size;
  lo.shuffle = true;
  lo.drop_last = true;
  lo.seed = a.seed;
  lo.workers = a.workers;
  // Fashion-MNIST's pixel mean and std over the training set.
  lo.mean = {0.2860f};
  lo.stddev = {0.3530f};
  if (a.augment) {
    lo.crop_padding = 4;
    lo.horizontal_flip = true;
  }
  data::DataLoader train(data::TensorDataset(train_set.images, train_set.labels), lo);
  data::LoaderOptions eo = lo;
  eo.shuffle = false;
  eo.drop_last = false;
  eo.crop_padding = 0;
  eo.horizontal_flip = false;
  eo.batch_size = 1000;
  data::DataLoader test(data::TensorDataset(test_set.images, test_set.labels), eo);

  auto model = build_model(a.arch, 10, 1, a.seed);
  const bool mixed = a.amp == "on" || (a.amp == "auto" && dev.is_cuda());
  const bool use_graph = a.graph == "on" || (a.graph == "auto" && dev.is_cuda());
  KILN_CHECK(!mixed || dev.is_cuda(), "--amp on needs a CUDA device; the device is ", dev);
  KILN_CHECK(!use_graph || dev.is_cuda(), "--graph on needs a CUDA device; the device is ", dev);
  KILN_CHECK(!(use_graph && a.profile), "--profile times ops one by one; use it with --graph off");
  const amp::Precision precision = mixed ? amp::Precision::Mixed16 : amp::Precision::FP32;
  amp::prepare_model(*model, dev, precision);

  optim::ParamGroup proto;
  proto.lr = a.lr;
  proto.momentum = a.momentum;
  proto.weight_decay = a.wd;
  auto groups = optim::split_weight_decay(*model, proto);
  std::unique_ptr<optim::FusedOptimizer> opt;
  if (a.optimizer == "sgd") opt = std::make_unique<optim::FusedSGD>(groups);
  else opt = std::make_unique<optim::FusedAdamW>(groups);
  optim::LossScalerOptions so;
  so.enabled = mixed;
  optim::DynamicLossScaler scaler(dev, so);
  optim::ClassifierStep train_step(*model, *opt, scaler, a.label_smoothing);

  const int64_t steps_per_epoch = train.num_batches();
  const int64_t total = steps_per_epoch * a.epochs;
  optim::Warmup warm{int64_t(std::llround(a.warmup_epochs * double(steps_per_epoch))), 0.0};
  std::unique_ptr<optim::LRSchedule> sched;
  if (a.schedule == "cosine") sched = std::make_unique<optim::CosineLR>(total, 0.0, warm);
  else if (a.schedule == "step")
    sched = std::make_unique<optim::MultiStepLR>(std::vector<int64_t>{total / 2, total * 3 / 4},
                                                 0.1, warm);
  else sched = std::make_unique<optim::StepLR>(total + 1, 1.0, warm);

  std::printf("kiln-train: %s on %s (%ld train / %ld test images), %s, %ld parameters, %s%s\n",
              a.arch.c_str(), dir.c_str(), long(train_set.images.size(0)),
              long(test_set.images.size(0)), dev.str().c_str(), long(model->num_parameters()),
              mixed ? "mixed precision (fp16/fp32 masters)" : "fp32",
              use_graph ? ", whole-step CUDA graph" : "");
  std::printf("  epochs %ld, batch %ld, %s lr %g momentum %g wd %g, warmup %ld steps, %s schedule%s\n",
              long(a.epochs), long(a.batch_size), a.optimizer.c_str(), a.lr, a.momentum, a.wd,
              long(warm.steps), a.schedule.c_str(), a.augment ? ", crop+flip augmentation" : "");
  std::fflush(stdout);

  // Static inputs: every step copies its batch into them (the graph reads these addresses).
  Tensor x_static = amp::prepare_input(zeros({a.batch_size, 1, train_set.images.size(1),
                                              train_set.images.size(2)}), dev, precision);
  Tensor y_static = zeros({a.batch_size}, TensorOptions(DType::i64).with_device(dev));
  std::function<void()> step_fn = [&] { train_step.run(x_static, y_static); };
#ifdef KILN_WITH_CUDA
  std::unique_ptr<cuda::GraphStep> graph;
  if (use_graph) graph = std::make_unique<cuda::GraphStep>(step_fn, cuda::GraphOptions{});
#endif
  if (a.profile) {
    KILN_CHECK(dev.is_cuda(), "--profile times GPU ops; the device is ", dev);
    cuda::enable_profiler(true);
  }
  amp::AsyncScalars metrics;
  const auto start = Clock::now();
  int64_t step = 0;
  double last_acc = 0;
  for (int64_t epoch = 0; epoch < a.epochs; ++epoch) {
    model->train();
    const auto epoch_start = Clock::now();
    train_step.reset_metrics();
    int64_t seen = 0, window_images = 0;
    auto window_start = Clock::now();
    for (data::Batch& b : train.epoch(epoch)) {
      sched->apply(*opt, step);
      x_static.copy_(amp::prepare_input(b.x, dev, precision));
      y_static.copy_(b.y);
#ifdef KILN_WITH_CUDA
      if (graph) {
        opt->stage_lr();
        graph->run();
      } else {
        step_fn();
      }
#else
      step_fn();
#endif
      ++step;
      seen += b.y.size(0);
      window_images += b.y.size(0);
      const int64_t i = b.index + 1;
      if (i % a.print_freq == 0 || i == steps_per_epoch) {
        // One read of the device accumulators per progress line.
        metrics.record({train_step.loss_sum(), train_step.correct_sum(), scaler.scale_tensor()});
        std::vector<double> m = metrics.values();
        const double now = std::chrono::duration<double>(Clock::now() - start).count();
        const double win = std::chrono::duration<double>(Clock::now() - window_start).count();
        const double eta = now / double(step) * double(total - step);
        std::printf("epoch %ld/%ld step %4ld/%ld  loss %.4f  acc %.2f%%  lr %.4f%s  %.0f img/s  ETA %s\n",
                    long(epoch + 1), long(a.epochs), long(i), long(steps_per_epoch),
                    m[0] / double(seen), 100.0 * m[1] / double(seen), opt->param_groups[0].lr,
                    mixed ? (" scale " + std::to_string(int64_t(m[2]))).c_str() : "",
                    double(window_images) / win, fmt_time(eta).c_str());
        std::fflush(stdout);
        window_images = 0;
        window_start = Clock::now();
      }
    }
    metrics.record({train_step.loss_sum(), train_step.correct_sum()});
    std::vector<double> m = metrics.values();
    const double epoch_s = std::chrono::duration<double>(Clock::now() - epoch_start).count();
    if (a.profile && epoch == 0) {
      std::printf("%s", cuda::profiler_report().c_str());
      cuda::enable_profiler(false);
    }
    EvalResult ev = evaluate(*model, test, dev, precision);
    last_acc = ev.accuracy;
    std::printf("epoch %ld/%ld done in %s (%.0f img/s): train loss %.4f acc %.2f%% | test loss %.4f acc %.2f%%\n",
                long(epoch + 1), long(a.epochs), fmt_time(epoch_s).c_str(),
                double(seen) / epoch_s, m[0] / double(seen), 100.0 * m[1] / double(seen),
                ev.loss, 100.0 * ev.accuracy);
    std::fflush(stdout);
  }

  std::filesystem::create_directories(a.output);
  const std::string path = a.output + "/model.safetensors";
  NamedTensors weights;
  for (auto& [name, t] : model->state()) weights.emplace_back(name, t);
  char acc[32];
  std::snprintf(acc, sizeof acc, "%.4f", last_acc);
  save_safetensors(path, weights,
                   {{"arch", a.arch}, {"epochs", std::to_string(a.epochs)}, {"test_accuracy", acc}});
  const double total_s = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("final test accuracy %.2f%% after %ld epoch(s), %s total; model saved to %s\n",
              100.0 * last_acc, long(a.epochs), fmt_time(total_s).c_str(), path.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_args(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln-train: error: %s\n", e.what());
    return 1;
  }
}
