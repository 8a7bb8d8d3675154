// kiln-train's flags (tools/train/trainer.h) on the shared parser (tools/cli/cli.h): PyTorch's
// ImageNet example's spelling (examples/imagenet/main.py) plus kiln's own flags.
#include <algorithm>
#include <cstdlib>

#include "core/version.h"
#include "data/fashion_mnist.h"
#include "models/zoo.h"
#include "optim/model_file.h"
#include "tools/cli/cli.h"
#include "tools/train/output_dir.h"
#include "tools/train/trainer.h"

namespace kiln::train {

namespace {

constexpr const char* kDescription =
    "Trains an image classifier; with no arguments, a small ResNet on Fashion-MNIST.";

// Registers every flag of kiln-train on `p`, writing into `c`; positional DATA into `data`.
void add_flags(cli::Parser& p, Config& c, std::vector<std::string>& data) {
  p.positional("DATA", &data,
               std::string("'fashion-mnist' (") + data::kFashionMnistDir +
                   "),\n"
                   "a folder of MNIST-style IDX files (train-images-idx3-ubyte[.gz], ...;\n"
                   "a classes.txt beside them names the classes), or an ImageFolder\n"
                   "root holding train/ and val/ class folders; same as --data",
               0, 1);
  p.section("Model and data:");
  p.value("-a, --arch", "NAME", &c.arch,
          "resnet_small, resnet18, resnet34, resnet50, resnet101, resnet152,\n"
          "vit_s_16, vit_b_16, vit_t_4 (4x4 patches, for 32x32 photos)\n"
          "(28x28 IDX inputs use a 3x3 stem, no max pool;\n"
          "a ViT takes the transformer recipe: AdamW lr 1e-3, wd 0.05, 5\n"
          "warm-up epochs, label smoothing 0.1, --clip-grad 1, unless given)");
  p.value("--data", "PATH", &c.data, "the data set, as DATA");
  p.flag("--dummy", &c.dummy, "synthetic data: random 3 x image-size² images, 1000 classes");
  p.value("--dummy-images", "N", &c.dummy_images, "synthetic training images per epoch", 1);
  p.value("--image-size", "N", &c.image_size,
          "ImageFolder crop size (evaluation resizes to N*256/224); by default 224,\n"
          "or for small photos (at most 64 px a side, as CIFAR-10's 32x32) their own\n"
          "size: decoded once into memory, pad-4 crop + flip, the small stem",
          8, kMaxImageSize);
  p.value("--width", "N", &c.width, "resnet_small's base width (default 32)", 1, kMaxWidth);
  p.flag("--augment", &c.augment, "IDX data: random crop (padding 4) and horizontal flip");
  p.value("-j, --workers", "N", &c.workers, "data-loading threads", 0, kMaxWorkers);
  p.choice("--decoder", &c.decoder, {"auto", "cpu", "nvjpeg", "stb", "turbo"},
           "ImageFolder JPEGs: nvJPEG on the GPU, libjpeg-turbo (cpu, turbo) or stb on the CPU\n"
           "(stb for comparisons: it can read out of bounds on a corrupt JPEG);\n"
           "auto: epoch 1 on the CPU, epoch 2 on nvJPEG, then whichever trained faster\n"
           "(with nvJPEG and a CUDA device; else cpu). Should nvJPEG stop responding, the\n"
           "CPU takes over after 120 s and the run goes on (docs/lab/input-pipeline.md)");
  p.value("--host-decode-fraction", "F|auto", &c.host_decode_share,
          "with nvjpeg: that share (0..1) of the JPEGs is decoded by the CPU workers\n"
          "instead; auto steers it so that neither side keeps the step waiting\n"
          "(fastest; which decoder meets a file then depends on timing) (default auto)");
  p.section("Optimisation:");
  p.value("--epochs", "N", &c.epochs, "total number of epochs", 1);
  p.value("--start-epoch", "N", &c.start_epoch,
          "first epoch to run, counting from 0 (the schedule starts there;\n"
          "with --resume it replaces the checkpoint's epoch) (default 0)",
          0);
  p.value("-b, --batch-size", "N", &c.batch_size,
          "batch size PER PROCESS (main.py's -b is per node: with --nproc N\n"
          "the global batch is N times this)",
          1, kMaxBatchSize);
  p.value("--lr, --learning-rate", "LR", &c.lr, "peak learning rate", 0.0);
  p.value("--momentum", "M", &c.momentum, "SGD momentum", 0.0);
  p.flag("--nesterov", &c.nesterov, "SGD with Nesterov momentum");
  p.value("--wd, --weight-decay", "WD", &c.wd,
          "weight decay, not applied to BN parameters and biases", 0.0);
  p.value("--warmup-epochs", "E", &c.warmup_epochs, "linear warmup in epochs, may be fractional",
          0.0);
  p.choice("--optimizer", &c.optimizer, {"sgd", "adamw"}, "optimizer");
  p.choice("--schedule", &c.schedule, {"cosine", "step", "constant"},
           "learning-rate schedule (step: x0.1 at 50% and 75%)");
  p.value("--label-smoothing", "E", &c.label_smoothing, "cross-entropy label smoothing", 0.0, 1.0,
          cli::Upper::Open);
  p.value("--clip-grad", "N", &c.clip_grad,
          "cap the gradients' total L2 norm at N (0: off)", 0.0);
  p.value("--seed", "N", &c.seed, "seed for initial weights, shuffling and augmentation");
  p.section("Weights and checkpoints:");
  p.value("--output", "DIR", &c.output,
          "checkpoint.safetensors (each epoch), model.safetensors,\n"
          "model_best.safetensors (best test top-1), log.jsonl (per\n"
          "epoch) and steps.jsonl (per step) go here");
  p.value("--resume", "PATH", &c.resume,
          "continue from a checkpoint written by --output (Ctrl-C, SIGTERM\n"
          "or SIGUSR1 stop a run after its step, with a checkpoint of where\n"
          "it stopped; exit status 128 + signal)");
  p.value("--checkpoint-steps", "N", &c.checkpoint_steps,
          "also write the checkpoint every N steps inside an epoch, so a\n"
          "run killed outright loses at most N steps; --resume continues\n"
          "from the step (0: at epoch ends only)",
          0);
  p.flag("--overwrite", &c.overwrite, "replace a previous run in --output (default: refuse)");
  p.value("--pretrained", "PATH", &c.pretrained,
          "start from these weights (torchvision names); a classifier\n"
          "with another class count is re-initialised (fine-tuning)");
  p.flag("--freeze-backbone", &c.freeze_backbone,
         "train the classifier (fc) only; the rest keeps its weights");
  p.value("--weights", "PATH", &c.weights, "start from weights that must match exactly");
  p.flag("--zero-init-residual", &c.zero_init_residual,
         "ResNets: each residual block's last batch norm starts at weight 0\n"
         "(torchvision's zero_init_residual)");
  p.flag("-e, --evaluate", &c.evaluate, "evaluate only (with --weights, --pretrained or --resume)");
  p.section("Devices and processes:");
  p.value("--device", "DEV", &c.device, "auto (cuda if present, else cpu), cpu, cuda, cuda:N");
  p.value("--gpu", "N", &c.gpu, "GPU to use, as --device cuda:N (default auto)", 0);
  p.choice("--amp", &c.amp, {"auto", "on", "off"},
           "16-bit storage with FP32 master weights (auto: on for cuda)");
  p.choice("--precision", &c.precision, {"f16", "bf16"},
           "with --amp: f16 with dynamic loss scaling, or bf16 (no scaling)");
  p.choice("--graph", &c.graph, {"auto", "on", "off"},
           "whole training step as one CUDA graph (auto: on for cuda)");
  p.value("--nproc", "N", &c.nproc,
          "data-parallel over N local GPUs (CUDA + NCCL builds); under\n"
          "torchrun, mpirun or srun leave it out (README: launching)",
          1, kMaxProcesses);
  p.flag("--deterministic", &c.deterministic,
         "the same bits on every run with the same seed: on a GPU,\n"
         "deterministic cuDNN algorithms chosen without timing and\n"
         "fixed-order batch-norm sums (slower); JPEGs on the CPU decoder\n"
         "unless --decoder nvjpeg (then --host-decode-fraction auto is 0)");
  p.flag("--sync-bn", &c.sync_bn,
         "data-parallel: BatchNorm statistics over all processes' batches");
  p.value("--world-size", "N", &c.world_size,
          "main.py's: this job's number of processes (WORLD_SIZE; start\n"
          "each with its --rank) (default: from the environment)",
          1);
  p.value("--rank", "R", &c.rank, "main.py's: this process's rank (RANK) (default 0)", 0);
  p.value("--dist-url", "URL", &c.dist_url,
          "main.py's: tcp://HOST:PORT (MASTER_ADDR, MASTER_PORT) or env://");
  p.choice("--dist-backend", &c.dist_backend, {"nccl"}, "main.py's; kiln always uses NCCL");
  p.flag("--multiprocessing-distributed", &c.multiprocessing_distributed,
         "main.py's: one process per GPU of this node (as --nproc <GPUs>)");
  p.section("Output:");
  p.value("-p, --print-freq", "N", &c.print_freq, "progress line every N steps", 1);
  p.flag("--profile", &c.profile, "per-op GPU time table after the first epoch (--graph off)");
  p.flag("--quiet", &c.quiet, "no progress lines; the final result is still printed");
  p.version(version_line("kiln-train"));
}

}  // namespace

std::string usage() {
  Config c;
  std::vector<std::string> data;
  cli::Parser p("kiln-train", "[DATA] [flags]", kDescription);
  add_flags(p, c, data);
  return p.help();
}

Config parse_args(const std::vector<std::string>& args, bool* help, std::string* info) {
  Config c;
  std::vector<std::string> data;
  cli::Parser p("kiln-train", "[DATA] [flags]", kDescription);
  add_flags(p, c, data);
  const bool run = p.parse(args);
  if (help) *help = !run;
  if (info && !run) *info = p.info();
  if (c.host_decode_share == "auto") {
    c.host_decode_fraction = -1.0;
  } else {
    char* end = nullptr;
    const double f = std::strtod(c.host_decode_share.c_str(), &end);
    if (c.host_decode_share.empty() || *end != '\0' || !(f >= 0.0 && f <= 1.0))
      cli::usage_error("--host-decode-fraction '", c.host_decode_share,
                       "': expected auto or a number between 0 and 1");
    c.host_decode_fraction = f;
  }
  if (!data.empty()) {
    if (p.given("--data") && c.data != data[0])
      cli::usage_error("DATA '", data[0], "' and --data '", c.data, "' disagree; give one");
    c.data = data[0];
  }
  if (c.gpu >= 0) {
    if (p.given("--device") && c.device != "cuda:" + std::to_string(c.gpu))
      cli::usage_error("--gpu ", c.gpu, " and --device ", c.device, " disagree; give one");
    c.device = "cuda:" + std::to_string(c.gpu);
  }
  if (c.dummy && p.given("--data")) cli::usage_error("--dummy replaces --data; give one");
  if (c.dummy && !data.empty()) cli::usage_error("--dummy replaces DATA '", data[0], "'; give one");
  if (c.freeze_backbone && c.pretrained.empty() && c.weights.empty() && c.resume.empty())
    cli::usage_error("--freeze-backbone keeps the backbone's weights: give --pretrained PATH");
  if (!c.pretrained.empty() && !c.weights.empty())
    cli::usage_error("--pretrained and --weights both name starting weights; give one");
  if (c.start_epoch >= c.epochs)
    cli::usage_error("--start-epoch ", c.start_epoch, ": must be below --epochs ", c.epochs);
  if (c.rank >= 0 && c.world_size < 0) cli::usage_error("--rank ", c.rank, " needs --world-size");
  if (p.given("--dist-url") && c.world_size < 0) cli::usage_error("--dist-url needs --world-size");
  if (c.multiprocessing_distributed && p.given("--nproc"))
    cli::usage_error(
        "--multiprocessing-distributed and --nproc both set the process count; "
        "give one");
  // The transformer recipe (DeiT's, torchvision's ViT reference): whatever the user did not set.
  if (models::is_vit_name(c.arch)) {
    if (!p.given("--optimizer")) c.optimizer = "adamw";
    if (!p.given("--lr")) c.lr = 1e-3;
    if (!p.given("--wd")) c.wd = 0.05;
    if (!p.given("--warmup-epochs")) c.warmup_epochs = std::min(5.0, 0.1 * double(c.epochs));
    if (!p.given("--label-smoothing")) c.label_smoothing = 0.1;
    if (!p.given("--clip-grad")) c.clip_grad = 1.0;
  }
  if (run) validate(c);
  return c;
}

void validate(const Config& a) {
  if (a.output.empty()) cli::usage_error("--output: empty path");
  if (a.workers < 0 || a.workers > kMaxWorkers)
    cli::usage_error("--workers ", a.workers, ": expected an integer between 0 and ", kMaxWorkers);
  if (a.nproc < 1 || a.nproc > kMaxProcesses)
    cli::usage_error("--nproc ", a.nproc, ": expected an integer between 1 and ", kMaxProcesses);
  if (a.epochs < 1) cli::usage_error("--epochs ", a.epochs, ": expected an integer >= 1");
  if (a.batch_size < 1 || a.batch_size > kMaxBatchSize)
    cli::usage_error("--batch-size ", a.batch_size, ": expected an integer between 1 and ",
                     kMaxBatchSize);
  if (a.checkpoint_steps < 0)
    cli::usage_error("--checkpoint-steps ", a.checkpoint_steps, ": expected an integer >= 0");
  if (a.print_freq < 1)
    cli::usage_error("--print-freq ", a.print_freq, ": expected an integer >= 1");
  if (a.evaluate && a.weights.empty() && a.pretrained.empty() && a.resume.empty())
    cli::usage_error("--evaluate needs --pretrained, --weights or --resume (otherwise a randomly "
                     "initialised model would be evaluated)");
  if (!a.resume.empty() && a.overwrite && resumes_own_run(a.output, a.resume))
    cli::usage_error("--resume and --overwrite contradict each other: --resume '", a.resume,
                     "' continues the run in --output, --overwrite would replace it");
  if (!a.resume.empty() && !a.pretrained.empty())
    cli::usage_error("--resume and --pretrained both name starting weights (--resume continues a "
                     "run with its own); give one");
  if (!a.resume.empty() && !a.weights.empty())
    cli::usage_error("--resume and --weights both name starting weights (--resume continues a "
                     "run with its own); give one");
  if (a.zero_init_residual && models::is_vit_name(a.arch))
    cli::usage_error("--zero-init-residual applies to ResNets (--arch is ", a.arch, ")");
  if (a.zero_init_residual && (!a.weights.empty() || !a.pretrained.empty()))
    cli::usage_error("--zero-init-residual sets starting weights that --",
                     a.weights.empty() ? "pretrained" : "weights", " replaces; give one");
}

std::vector<std::pair<std::string, std::string>> launch_env(const Config& c) {
  if (c.world_size < 0) return {};
  const int rank = c.rank < 0 ? 0 : c.rank;
  if (rank >= c.world_size)
    cli::usage_error("--rank ", rank, ": must be below --world-size ", c.world_size);
  if (c.multiprocessing_distributed && c.world_size > 1)
    cli::usage_error("--multiprocessing-distributed with --world-size ", c.world_size,
                     ": kiln-train launches the processes of one node only; across nodes start "
                     "it with torchrun, mpirun or srun (README)");
  if (c.world_size == 1) return {};
  if (c.nproc > 1 && c.world_size > 1)
    cli::usage_error("--nproc ", c.nproc, " with --world-size ", c.world_size,
                     ": give one (--nproc launches a local job; --world-size describes one "
                     "process of a job started elsewhere)");
  std::vector<std::pair<std::string, std::string>> env = {
      {"WORLD_SIZE", std::to_string(c.world_size)},
      {"RANK", std::to_string(rank)},
      {"LOCAL_RANK", std::to_string(c.gpu >= 0 ? c.gpu : rank)}};
  if (c.dist_url != "env://") {
    // tcp://HOST:PORT, an IPv6 HOST in brackets (tcp://[::1]:29500); MASTER_ADDR gets it bare,
    // as getaddrinfo takes it (PyTorch's init_method does the same).
    const std::string prefix = "tcp://";
    const std::string rest =
        c.dist_url.rfind(prefix, 0) == 0 ? c.dist_url.substr(prefix.size()) : std::string();
    std::string host, port;
    if (!rest.empty() && rest[0] == '[') {
      const size_t close = rest.find(']');
      if (close != std::string::npos && close + 1 < rest.size() && rest[close + 1] == ':') {
        host = rest.substr(1, close - 1);
        port = rest.substr(close + 2);
      }
    } else if (const size_t colon = rest.rfind(':'); colon != std::string::npos) {
      host = rest.substr(0, colon);
      port = rest.substr(colon + 1);
      if (host.find(':') != std::string::npos)
        cli::usage_error("--dist-url '", c.dist_url,
                         "': an IPv6 address goes in brackets, tcp://[ADDRESS]:PORT");
    }
    const bool digits = !port.empty() && port.size() <= 5 &&
                        port.find_first_not_of("0123456789") == std::string::npos;
    const long p = digits ? std::strtol(port.c_str(), nullptr, 10) : 0;
    if (host.empty() || host.find_first_of("[]/") != std::string::npos || p < 1 || p > 65535)
      cli::usage_error("--dist-url '", c.dist_url,
                       "': expected tcp://HOST:PORT (port 1..65535; IPv6: tcp://[::1]:PORT) or "
                       "env://");
    env.emplace_back("MASTER_ADDR", host);
    env.emplace_back("MASTER_PORT", port);
  } else if (c.world_size > 1 && (!std::getenv("MASTER_ADDR") || !std::getenv("MASTER_PORT"))) {
    cli::usage_error("--dist-url env:// with --world-size ", c.world_size,
                     ": MASTER_ADDR and MASTER_PORT must be set (or give --dist-url "
                     "tcp://HOST:PORT)");
  }
  return env;
}

}  // namespace kiln::train
