#pragma once
// The image-classifier training job behind tools/kiln-train, callable in-process (tests):
//
//   kiln::train::Config c = kiln::train::parse_args({"--data", root, "--epochs", "1"});
//   kiln::train::Summary s = kiln::train::run(c);
//   int rc = kiln::train::main({"--data", root});   // the tool: errors -> message, exit code 1
//
// Data (--data), detected from the folder's contents:
//   "fashion-mnist"   Debian's dataset-fashion-mnist (data/fashion_mnist.h);
//   IDX folder        MNIST-style train-/t10k-images-idx3-ubyte[.gz] and labels (data/idx.h);
//   ImageFolder root  holding train/ and val/ (or test/) class folders (data/image_folder.h):
//                     decoded by data/image_loader.h, RandomResizedCrop(image_size) + flip for
//                     training, Resize(image_size·256/224) + CenterCrop(image_size) for
//                     evaluation, normalised with ImageNet statistics on the device
//                     (data/device_batches.h);
//   small photos      an ImageFolder whose images are at most 64 px a side (CIFAR-10), when
//                     --image-size is not given: decoded once into memory at their own size
//                     (data/folder_tensors.h), then as IDX data: random crop with padding 4 +
//                     flip, normalised with the training set's per-channel statistics, held on
//                     the GPU when training there.
// 28x28 IDX data trains 1-channel models with the small 3x3 stem, small photos 3-channel models
// with it; ImageFolder data 3-channel models with torchvision's stem (resnet_small keeps its
// small stem).
//
// Output (--output DIR, rank 0 only): DIR/checkpoint.safetensors after every epoch
// (optim/checkpoint.h, atomic; model, fused-optimizer arenas, loss scaler, RNG, epoch, step),
// DIR/model.safetensors at the end (torchvision names, f32, with optim/model_file.h's metadata:
// arch, width, channels, image size, normalisation, class names), DIR/model_best.safetensors
// (the same after each evaluation that beats the best test top-1 so far: main.py's model_best;
// a run resumed in DIR compares against the one there), and the run's logs
// DIR/log.jsonl (per epoch) and DIR/steps.jsonl (per step), tools/train/run_log.h. The folder
// (tools/train/output_dir.h) is written only when it is empty or new, with --overwrite (the
// previous run's files are removed when training starts, not before), or when --resume names
// its own checkpoint; it is never inside the data, and nothing is created in it before the data
// has been read. A run that fails during set-up (bad weights, a checkpoint that does not fit)
// leaves it as it was. Each epoch's checkpoint is saved before the evaluation, so a failing
// evaluation loses no training.
//
// Divergence: evaluation metrics of non-finite logits are NaN (printed "nan", logged null),
// never a count. A checkpoint is never written from non-finite weights: the run stops with an
// error and the previous checkpoint stays. A run whose training loss is non-finite for a whole
// epoch (FP32: at all; mixed precision: every step skipped by the loss scaler) stops too.
//
// --resume PATH continues at the saved epoch with bit-identical state: an
// uninterrupted run and a run stopped and resumed at an epoch boundary give the same weights
// (CPU; on the GPU up to the nondeterminism of the kernels), as long as the schedule's length
// (--epochs) is the same or the schedule does not depend on it (constant). A different batch size
// is allowed: the schedule continues at the saved epoch's first step of the new batch size.
// PATH is DIR/checkpoint.safetensors to continue in DIR, or another run's checkpoint to continue
// it in a new --output (that run's logs up to the checkpoint are copied there). The checkpoint
// must fit: the same --arch, --optimizer and --freeze-backbone (each named when it differs).
// --start-epoch N without --resume starts a new run whose schedule begins at epoch N.
//
// Stopping (single-process runs): SIGINT, SIGTERM or SIGUSR1 lets the running step finish, writes
// a checkpoint holding the position in the epoch (metadata "epoch_batches_done": batches of the
// unfinished epoch trained; at an epoch's last batch or during its evaluation the epoch ends
// first), and run() returns with Summary::stop_signal set (main(): exit status 128 + signal).
// --resume continues from the next batch with the same bits (the same batch size and process
// count, else refused). A second signal ends the process (default action). Data-parallel runs
// keep the default actions. --checkpoint-steps N writes the same mid-epoch checkpoint every N
// steps, so a run killed outright (SIGKILL, a lost node) loses at most N steps.
//
// --deterministic: the same seed gives the same bits run after run (Config::deterministic); without
// it a GPU run's timed algorithm choices and cuDNN's unordered sums differ between processes in
// the last bits, and the trajectories part from there.
//
// --nproc N (CUDA + NCCL builds): main() re-runs the program as N processes
// (tools/train/launcher.h); each one trains on GPU LOCAL_RANK with a DistributedSampler shard of
// the data, gradients averaged by cuda::GradBucketer and the loss scaler's overflow flag agreed
// across ranks.
// --sync-bn makes every BatchNorm2d normalise with the statistics of the global batch
// (F::sync_batch_norm, an NCCL all-reduce per BN layer in forward and backward).
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kiln::train {

struct Config {
  std::string arch = "resnet_small";
  std::string data = "fashion-mnist";
  int64_t epochs = 1;
  // Defaults chosen for the built-in job: one epoch of Fashion-MNIST on 2 CPU cores reaches
  // 88.4% with batch 32 / lr 0.05 (87.1% with batch 128 / lr 0.1); see docs/lab/fashion-mnist.md.
  int64_t batch_size = 32;
  double lr = 0.05;
  double momentum = 0.9;
  double wd = 5e-4;
  double warmup_epochs = 0.05;
  std::string optimizer = "sgd";    // sgd | adamw
  std::string schedule = "cosine";  // cosine | step | constant
  double label_smoothing = 0.0;
  bool augment = false;      // IDX data: random crop (padding 4) + flip
  int64_t image_size = 0;  // ImageFolder data (0: auto, train_data.h); --dummy: 224 when 0
  int64_t width = 0;         // resnet_small's width (0: 32)
  uint64_t seed = 0;
  int64_t workers = 2;  // 0..kMaxWorkers
  std::string decoder = "auto";  // ImageFolder: auto | cpu | nvjpeg | stb | turbo (issue 15)
  // --decoder nvjpeg: the share of JPEGs decoded on the CPU instead; -1: adaptive (auto, the
  // default; data::GpuJpegLoader::kAdaptiveHostShare). Parsed from host_decode_share.
  double host_decode_fraction = -1.0;
  std::string host_decode_share = "auto";
  std::string device = "auto";
  int64_t print_freq = 50;
  std::string output = "kiln-output";
  int64_t checkpoint_steps = 0;  // > 0: also a checkpoint every that many steps inside an epoch
  bool profile = false;
  std::string amp = "auto";    // auto | on | off
  std::string precision = "f16";  // with amp: f16 (and the loss scaler) | bf16 (no scaler)
  double clip_grad = 0.0;         // > 0: the gradients' total L2 norm is capped at this
  std::string graph = "auto";  // auto | on | off
  std::string resume;          // checkpoint path
  std::string weights;         // safetensors weights (torchvision names), strict
  std::string pretrained;      // weights to fine-tune from: a classifier of another size is reset
  bool freeze_backbone = false;  // train the classifier only
  bool evaluate = false;       // evaluate only
  bool nesterov = false;       // SGD with Nesterov momentum
  bool zero_init_residual = false;  // ResNets: each block's last BN weight starts at 0
  int gpu = -1;                // --gpu N: device cuda:N
  int64_t start_epoch = -1;    // main.py's --start-epoch: first epoch to run (-1: 0 or resume's)
  bool dummy = false;          // synthetic data (train_data.h)
  int64_t dummy_images = 1281167;
  int64_t nproc = 1;           // 1..kMaxProcesses
  bool overwrite = false;      // --overwrite: replace a previous run in --output
  bool sync_bn = false;  // BatchNorm statistics over all ranks' batches (no-op with one rank)
  // main.py's process-group flags, mapped onto torchrun's variables by launch_env: this process
  // is rank `rank` of `world_size`, rendezvous at dist_url (tcp://HOST:PORT, tcp://[IPv6]:PORT
  // or env://).
  int world_size = -1, rank = -1;
  std::string dist_url = "env://";
  std::string dist_backend = "nccl";
  bool multiprocessing_distributed = false;  // main.py's: one process per local GPU (--nproc)
  bool quiet = false;  // no progress lines; the final result is still printed
  // The same bits on every run of the same command (seed, data, machine, kiln build): on a GPU,
  // cuda::set_conv_deterministic for the run (deterministic cuDNN algorithms chosen without
  // timing, kiln's fixed-order statistics, cuBLASLt's first heuristic algorithm), ImageFolder
  // JPEGs on the CPU decoder unless --decoder nvjpeg (then a fixed --host-decode-fraction, 0
  // for auto). The CPU path is deterministic anyway.
  bool deterministic = false;
};

inline constexpr int64_t kMaxWorkers = 1024;
// Per process: far beyond any memory (a batch of 2^20 images of 3x8x8 is already 800 MB), and
// small enough that a batch's element count cannot overflow.
inline constexpr int64_t kMaxBatchSize = int64_t(1) << 20;
inline constexpr int64_t kMaxProcesses = 1024;

// Strict parsing (tools/cli/cli.h): unknown flags, missing or malformed values throw
// cli::UsageError naming the flag, the value and what is allowed. Accepts PyTorch's ImageNet
// example's spelling (positional DATA, -a, -j, --learning-rate, -e, --gpu, ...) besides kiln's.
// "--help" or "--version" sets help; the caller prints *info (the help text or the version
// line). The result has passed validate().
Config parse_args(const std::vector<std::string>& args, bool* help = nullptr,
                  std::string* info = nullptr);
// Range and consistency checks of a Config (also run by run()): kiln::Error naming the flag and
// the accepted range (--workers 0..kMaxWorkers, --nproc 1..kMaxProcesses, --epochs >= 1,
// --batch-size 1..kMaxBatchSize, --evaluate needs --weights or --resume, --resume with
// --overwrite, ...).
void validate(const Config& config);
std::string usage();

// The environment variables (name, value) that --world-size/--rank/--dist-url/--gpu stand for
// (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); empty when --world-size is not given
// or is 1 (main.py's single-node spelling: the processes, if any, come from --nproc or
// --multiprocessing-distributed).
// MASTER_ADDR is the host bare, an IPv6 one without its brackets (as PyTorch's init_method).
// Throws cli::UsageError for an inconsistent set (rank outside the world, a bad URL, --nproc).
std::vector<std::pair<std::string, std::string>> launch_env(const Config& c);

struct Summary {
  int64_t epochs_done = 0;  // epoch counter at the end (resumed epochs included)
  double test_loss = 0, test_top1 = 0, test_top5 = 0;  // last evaluation
  int64_t test_bad_files = 0;  // unreadable test files the last evaluation skipped
  // The signal that stopped the run before its last epoch (SIGINT, SIGTERM or SIGUSR1; a
  // checkpoint of where it stopped was written, no model file); 0 when it ran to the end.
  int stop_signal = 0;
};

// Runs the job in this process (one rank when WORLD_SIZE is set). Throws kiln::Error.
Summary run(const Config& config);

// The tool: parses, launches --nproc children or runs, prints errors; returns the exit code.
int main(const std::vector<std::string>& args);

}  // namespace kiln::train
