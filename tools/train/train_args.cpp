// kiln-train's flags (tools/train/trainer.h): PyTorch ImageNet example names where they exist.
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "core/error.h"
#include "data/fashion_mnist.h"
#include "tools/train/trainer.h"

namespace kiln::train {

std::string usage() {
  return std::string(
             "usage: kiln-train [flags]\n"
             "Trains an image classifier; with no flags, a small ResNet on Fashion-MNIST.\n\n"
             "  --arch NAME          resnet_small (default), resnet18, resnet34, resnet50, "
             "resnet101,\n"
             "                       resnet152 (28x28 IDX inputs use a 3x3 stem, no max pool)\n"
             "  --data PATH          'fashion-mnist' (default: ") +
         data::kFashionMnistDir +
         "),\n"
         "                       a folder of MNIST-style IDX files (train-images-idx3-ubyte[.gz], "
         "...),\n"
         "                       or an ImageFolder root holding train/ and val/ class folders\n"
         "  --image-size N       ImageFolder crop size (default 224; eval resizes to N*256/224)\n"
         "  --width N            resnet_small's base width (default 32)\n"
         "  --epochs N           total number of epochs (default 1)\n"
         "  -b, --batch-size N   batch size per process (default 32)\n"
         "  --lr LR              peak learning rate (default 0.05)\n"
         "  --momentum M         SGD momentum (default 0.9)\n"
         "  --wd WD              weight decay, not applied to BN parameters and biases (default "
         "5e-4)\n"
         "  --warmup-epochs E    linear warmup length in epochs, may be fractional (default 0.05)\n"
         "  --optimizer NAME     sgd (default) or adamw\n"
         "  --schedule NAME      cosine (default), step (x0.1 at 50%, 75%), or constant\n"
         "  --label-smoothing E  cross-entropy label smoothing (default 0)\n"
         "  --augment            IDX data: random crop (padding 4) and horizontal flip\n"
         "  --seed N             seed for initial weights, shuffling and augmentation (default 0)\n"
         "  --workers N          data-loading threads (default 2)\n"
         "  --decoder NAME       ImageFolder JPEGs: auto (default: nvjpeg on a GPU when built\n"
         "                       with nvJPEG, else cpu), cpu, nvjpeg, stb or turbo\n"
         "  --host-decode-fraction F  with nvjpeg: that share of the JPEGs is decoded by the\n"
         "                       CPU workers instead (default 0)\n"
         "  --device DEV         auto (default: cuda if present, else cpu), cpu, cuda, cuda:N\n"
         "  --print-freq N       progress line every N steps (default 50)\n"
         "  --output DIR         checkpoint.safetensors (each epoch), model.safetensors and\n"
         "                       log.jsonl go here (default kiln-output)\n"
         "  --resume PATH        continue from a checkpoint written by --output\n"
         "  --overwrite          replace a previous run in --output (default: refuse)\n"
         "  --weights PATH       start from weights (safetensors, torchvision names, strict)\n"
         "  --evaluate           evaluate only (with --weights or --resume)\n"
         "  --nproc N            data-parallel over N local GPUs (CUDA + NCCL builds); under\n"
         "                       torchrun, mpirun or srun leave it out (README: launching)\n"
         "  --sync-bn            data-parallel: BatchNorm statistics over the global batch of\n"
         "                       all processes (SyncBN); does nothing with one process\n"
         "  --profile            per-op GPU time table after the first epoch (cuda, --graph off)\n"
         "  --amp on|off         FP16 storage with FP32 master weights and loss scaling\n"
         "                       (default: on for cuda, off for cpu)\n"
         "  --graph on|off       capture the whole training step as a CUDA graph and replay it\n"
         "                       (default: on for cuda; off for cpu)\n"
         "  --quiet              no progress lines\n"
         "  --version            kiln's version and build (CUDA architectures)\n"
         "  -h, --help           this text\n";
}

namespace {

int64_t to_int(const std::string& flag, const std::string& v, int64_t lo) {
  char* end = nullptr;
  errno = 0;
  long long x = std::strtoll(v.c_str(), &end, 10);
  KILN_CHECK(!v.empty() && *end == '\0' && errno == 0 && x >= lo, "flag ", flag,
             ": expected an integer >= ", lo, ", got '", v, "'");
  return int64_t(x);
}

double to_double(const std::string& flag, const std::string& v, double lo) {
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  KILN_CHECK(!v.empty() && *end == '\0' && std::isfinite(x) && x >= lo, "flag ", flag,
             ": expected a number >= ", lo, ", got '", v, "'");
  return x;
}

std::string one_of(const std::string& flag, const std::string& v,
                   std::initializer_list<const char*> choices) {
  std::string list;
  for (const char* c : choices) {
    if (v == c) return v;
    list += list.empty() ? c : std::string(", ") + c;
  }
  KILN_FAIL("flag ", flag, ": expected one of ", list, "; got '", v, "'");
}

}  // namespace

Config parse_args(const std::vector<std::string>& argv, bool* help, bool* version) {
  Config a;
  if (help) *help = false;
  if (version) *version = false;
  std::vector<std::string> args;  // "--flag=value" split into two words
  for (const std::string& w : argv) {
    size_t eq = w.find('=');
    if (w.rfind("--", 0) == 0 && eq != std::string::npos) {
      args.push_back(w.substr(0, eq));
      args.push_back(w.substr(eq + 1));
    } else {
      args.push_back(w);
    }
  }
  const size_t n = args.size();
  for (size_t i = 0; i < n; ++i) {
    const std::string& f = args[i];
    auto need = [&]() -> std::string {
      KILN_CHECK(i + 1 < n, "flag ", f, " needs a value (see --help)");
      return args[++i];
    };
    if (f == "-h" || f == "--help") {
      if (help) *help = true;
    } else if (f == "--version") {
      if (version) *version = true;
    } else if (f == "--arch")
      a.arch = need();
    else if (f == "--data")
      a.data = need();
    else if (f == "--image-size")
      a.image_size = to_int(f, need(), 8);
    else if (f == "--width")
      a.width = to_int(f, need(), 1);
    else if (f == "--epochs")
      a.epochs = to_int(f, need(), 1);
    else if (f == "-b" || f == "--batch-size")
      a.batch_size = to_int(f, need(), 1);
    else if (f == "--lr")
      a.lr = to_double(f, need(), 0.0);
    else if (f == "--momentum")
      a.momentum = to_double(f, need(), 0.0);
    else if (f == "--wd" || f == "--weight-decay")
      a.wd = to_double(f, need(), 0.0);
    else if (f == "--warmup-epochs")
      a.warmup_epochs = to_double(f, need(), 0.0);
    else if (f == "--optimizer")
      a.optimizer = one_of(f, need(), {"sgd", "adamw"});
    else if (f == "--schedule")
      a.schedule = one_of(f, need(), {"cosine", "step", "constant"});
    else if (f == "--label-smoothing") {
      a.label_smoothing = to_double(f, need(), 0.0);
      KILN_CHECK(a.label_smoothing < 1.0, "flag --label-smoothing: must be < 1");
    } else if (f == "--amp")
      a.amp = one_of(f, need(), {"on", "off", "auto"});
    else if (f == "--graph")
      a.graph = one_of(f, need(), {"on", "off", "auto"});
    else if (f == "--profile")
      a.profile = true;
    else if (f == "--augment")
      a.augment = true;
    else if (f == "--evaluate" || f == "-e")
      a.evaluate = true;
    else if (f == "--quiet")
      a.quiet = true;
    else if (f == "--sync-bn")
      a.sync_bn = true;
    else if (f == "--seed")
      a.seed = uint64_t(to_int(f, need(), 0));
    else if (f == "--workers" || f == "-j")
      a.workers = to_int(f, need(), 0);
    else if (f == "--decoder")
      a.decoder = one_of(f, need(), {"auto", "cpu", "nvjpeg", "stb", "turbo"});
    else if (f == "--host-decode-fraction")
      a.host_decode_fraction = to_double(f, need(), 0.0);
    else if (f == "--device")
      a.device = need();
    else if (f == "--print-freq" || f == "-p")
      a.print_freq = to_int(f, need(), 1);
    else if (f == "--output")
      a.output = need();
    else if (f == "--resume")
      a.resume = need();
    else if (f == "--weights")
      a.weights = need();
    else if (f == "--nproc")
      a.nproc = to_int(f, need(), 1);
    else if (f == "--overwrite")
      a.overwrite = true;
    else
      KILN_FAIL("unknown flag '", f, "' (see --help)");
  }
  validate(a);
  return a;
}

void validate(const Config& a) {
  KILN_CHECK(!a.output.empty(), "flag --output: empty path");
  KILN_CHECK(a.workers >= 0 && a.workers <= kMaxWorkers, "flag --workers: expected 0..",
             kMaxWorkers, " data-loading threads, got ", a.workers);
  KILN_CHECK(a.nproc >= 1 && a.nproc <= kMaxProcesses, "flag --nproc: expected 1..", kMaxProcesses,
             " processes, got ", a.nproc);
  KILN_CHECK(a.epochs >= 1, "flag --epochs: expected an integer >= 1, got ", a.epochs);
  KILN_CHECK(a.batch_size >= 1, "flag --batch-size: expected an integer >= 1, got ", a.batch_size);
  KILN_CHECK(a.print_freq >= 1, "flag --print-freq: expected an integer >= 1, got ", a.print_freq);
  KILN_CHECK(!a.evaluate || !a.weights.empty() || !a.resume.empty(),
             "flag --evaluate: needs --weights or --resume (otherwise a randomly initialised "
             "model would be evaluated)");
  KILN_CHECK(a.resume.empty() || !a.overwrite,
             "flags --resume and --overwrite contradict each other: --resume continues the run "
             "in --output, --overwrite replaces it");
}

}  // namespace kiln::train
