// kiln-train's job, top to bottom: Trainer's constructor sets everything up (device, data, the
// --output folder, model and starting weights, optimizer, resume, schedule) without writing a
// byte of the run; run() then either evaluates, or begins the run in its folder and loops over
// epochs: train_epoch, save_checkpoint, evaluate, the epoch's log line; the model file last.
#include "tools/train/trainer.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>

#include "core/device_query.h"
#include "core/json.h"
#include "core/serialization.h"
#include "core/text.h"
#include "core/version.h"
#include "cuda/profiler.h"
#include "data/fashion_mnist.h"
#include "data/gpu_jpeg.h"
#include "models/resnet.h"
#include "ops/ops.h"
#include "optim/checkpoint.h"
#include "optim/model_file.h"
#include "optim/schedule.h"
#include "optim/train_step.h"
#include "tools/cli/cli.h"
#include "tools/train/dist_env.h"
#include "tools/train/launcher.h"
#include "tools/train/output_dir.h"
#include "tools/train/run_log.h"
#include "tools/train/train_data.h"
#include "tools/train/train_dist.h"
#include "tools/train/train_parts.h"
#ifdef KILN_WITH_CUDA
#include "cuda/conv.h"
#include "cuda/graph.h"
#include "cuda/runtime.h"
#endif

namespace kiln::train {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Epoch checkpoints are written on a background thread: the state is copied to the host at the
// epoch's end (the caller's thread, so they are the epoch's weights), and laying out the bytes
// and the temporary file's write, fsync and rename (write_file_atomic) run while evaluation and
// the next epoch do. One write at a time: the next write and finish() wait for the previous one
// and rethrow its error. A crash mid-write leaves the previous checkpoint whole, as a
// synchronous save would.
class BackgroundWriter {
 public:
  BackgroundWriter() = default;
  BackgroundWriter(const BackgroundWriter&) = delete;
  BackgroundWriter& operator=(const BackgroundWriter&) = delete;
  ~BackgroundWriter() {  // unwinding from another error: let the write complete, keep that error
    if (pending_.valid()) {
      try {
        pending_.get();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "kiln-train: %s\n", e.what());
      }
    }
  }
  void write(std::string path, SafetensorsHost state) {
    finish();
    pending_ = std::async(std::launch::async, [p = std::move(path), h = std::move(state)] {
      write_file_atomic(p, h.join());
    });
  }
  void finish() {
    if (pending_.valid()) pending_.get();
  }

 private:
  std::future<void> pending_;
};

// ---- stopping on a signal ----
//
// In a single-process run, SIGINT (Ctrl-C), SIGTERM (a scheduler's preemption or time limit) and
// SIGUSR1 (Slurm's --signal) end the run after the step that is running: the step finishes, a
// checkpoint with the position in the epoch is written, and kiln-train exits with 128 + the
// signal's number; --resume continues from the next batch, bit for bit as if never stopped. A
// second signal ends the process at once (the default action; the checkpoint already written
// stays whole). Data-parallel runs keep the default actions: their ranks would have to agree on
// the step, and the launcher ends a failed rank's siblings with SIGTERM.
volatile std::sig_atomic_t g_stop_signal = 0;

constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGUSR1};

// The handler realigns its stack: an x86-64 kernel enters a handler with the stack 16-byte
// aligned as the ABI asks, but qemu-user 7.2 (Debian 12's; also what runs amd64 containers on
// other CPUs) misaligns the frame by 8, and the compiler's aligned SSE stores into `dfl` then
// fault: kiln-train died with SIGSEGV instead of stopping (docs/lab/ci.md, 2026-12-05).
#if defined(__x86_64__) || defined(__i386__)
#define KILN_SIGNAL_HANDLER __attribute__((force_align_arg_pointer))
#else
#define KILN_SIGNAL_HANDLER
#endif

extern "C" KILN_SIGNAL_HANDLER void on_stop_signal(int sig) {
  if (g_stop_signal == 0) {
    g_stop_signal = sig;
    const char msg[] =
        "kiln-train: stopping after this step to save a checkpoint (signal again to end at "
        "once)\n";
    [[maybe_unused]] const ssize_t n = ::write(2, msg, sizeof msg - 1);
  }
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int s : kStopSignals) ::sigaction(s, &dfl, nullptr);
}

// Installs on_stop_signal for kStopSignals while in scope; the previous actions come back after.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    // A thread inside a system call when the signal lands (a loader's read, a library's) carries
    // on rather than seeing EINTR; kiln's own readers retry on EINTR as well.
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < std::size(kStopSignals); ++i)
      ::sigaction(kStopSignals[i], &sa, &previous_[i]);
  }
  ~StopSignals() {
    for (size_t i = 0; i < std::size(kStopSignals); ++i)
      ::sigaction(kStopSignals[i], &previous_[i], nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction previous_[std::size(kStopSignals)]{};
};

const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGUSR1:
      return "SIGUSR1";
    default:
      return "a signal";
  }
}

// Tests (tests/test_kiln_train.cpp): KILN_TRAIN_TEST_STOP=N raises SIGTERM in the training loop
// once global step N has run, where the stop handlers are installed. 0: never.
int64_t test_stop_step() {
  const char* v = std::getenv("KILN_TRAIN_TEST_STOP");
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  KILN_CHECK(*end == '\0' && n >= 0, "KILN_TRAIN_TEST_STOP must be a step number, got '", v, "'");
  return int64_t(n);
}

// The test top-1 of the model_best.safetensors in `out` (-1 when there is none, or it cannot be
// read: the next evaluation then writes one).
double best_so_far(const OutputDir& out) {
  const std::string path = out.file("model_best.safetensors");
  if (!std::filesystem::exists(path)) return -1.0;
  try {
    const SafetensorsData f = load_safetensors(path);
    auto it = f.metadata.find("test_top1");
    if (it == f.metadata.end()) return -1.0;
    const double v = std::strtod(it->second.c_str(), nullptr);
    return std::isfinite(v) ? v : -1.0;
  } catch (const Error&) {
    return -1.0;
  }
}

// The checkpoint metadata key of a mid-epoch checkpoint: batches of its epoch already trained.
constexpr const char* kEpochBatchesKey = "epoch_batches_done";

// Rank 0 reads each step's device accumulators kMetricLag steps late, each in-flight step
// through its own AsyncScalars, so the host can run that many steps ahead of the device (one
// step ahead is not enough when a step is shorter than the host's work for it: small batches).
constexpr size_t kMetricLag = 4;

// A step whose metrics are still on their way to the host.
struct PendingStep {
  int64_t step, index, batch, seen;  // global step, step in the epoch (from 1), its batch, seen
  double lr, data_s, period_s;
  amp::AsyncScalars* metrics;
};

// One epoch's running totals on the host.
struct EpochProgress {
  int64_t epoch = 0, seen = 0;
  double prev_loss = 0, prev_correct = 0;  // cumulative sums at the last logged step
  int64_t window_images = 0;               // since the last progress line
  double window_s = 0, window_data_s = 0;
};

// What an epoch's training leaves for its log line.
struct EpochResult {
  int64_t first_batch = 0;    // where the epoch began (a run resumed mid-epoch: > 0)
  int64_t stopped_after = 0;  // > 0: a signal stopped training after this many of its batches
  double train_loss = 0, train_top1 = 0, images_per_s = 0, seconds = 0;
  int64_t bad_files = 0;
  double host_decode_share = NAN;
};

// The folders kiln-train reads, which --output must stay out of.
std::vector<std::string> data_roots(const Config& c) {
  if (c.dummy) return {};
  if (c.data == "fashion-mnist") return {data::kFashionMnistDir};
  return {c.data};
}

class Trainer {
 public:
  explicit Trainer(const Config& config);
  Summary run();

 private:
  // Set-up, in the order the constructor runs it.
  void choose_device();
  void open_data();
  void build_model();
  void build_optimizer();
  void resume_or_start();
  void build_schedule();
  void print_plan() const;
  // The run.
  Summary evaluate_only();
  void prepare_steps();
  EpochResult train_epoch(int64_t epoch);
  void log_step(const PendingStep& p, EpochProgress& ep);
  void check_loss(double loss, int64_t epoch, int64_t steps, int64_t skipped) const;
  // epochs_done whole epochs and `batches` of the next (a run stopped mid-epoch: > 0).
  void save_checkpoint(int64_t epochs_done, int64_t batches = 0);
  Summary stopped(int64_t epoch, int64_t batches);
  void evaluate();
  void log_epoch(int64_t epoch, const EpochResult& r, double save_s, double eval_s);
  void save_model();
  void save_best(int64_t epoch);
  std::string what_is_kept(int64_t epoch) const;
  int64_t skipped_steps() const;

  // --deterministic on a GPU: cuDNN's deterministic mode for the run's lifetime, then as before.
  struct DeterministicKernels {
    bool on = false, before = false;
    void enable() {
#ifdef KILN_WITH_CUDA
      before = cuda::conv_deterministic();
      on = true;
      cuda::set_conv_deterministic(true);
#endif
    }
    DeterministicKernels() = default;
    DeterministicKernels(const DeterministicKernels&) = delete;
    DeterministicKernels& operator=(const DeterministicKernels&) = delete;
    ~DeterministicKernels() {
#ifdef KILN_WITH_CUDA
      if (on) cuda::set_conv_deterministic(before);
#endif
    }
  };

  const Config c_;
  DistEnv env_;
  Device dev_;
  DeterministicKernels deterministic_;
  bool lead_ = true, talk_ = true, mixed_ = false, use_graph_ = false;
  bool scaled_ = false;  // f16 mixed precision: the dynamic loss scaler runs (and may skip)
  amp::Precision precision_ = amp::Precision::FP32;

  std::unique_ptr<TrainData> data_;
  std::unique_ptr<OutputDir> out_;  // rank 0 of a training run only
  ModelInfo info_;
  std::shared_ptr<nn::Module> model_;
  std::string pretrained_note_;
  std::vector<Tensor> trained_;  // --freeze-backbone: the classifier's parameters
  std::unique_ptr<DataParallel> dp_;
  int64_t sync_bn_layers_ = 0;
  std::unique_ptr<optim::FusedOptimizer> opt_;
  std::unique_ptr<optim::DynamicLossScaler> scaler_;
  std::map<std::string, std::string> meta_;  // the checkpoint's and model file's metadata

  int64_t steps_per_epoch_ = 0, total_steps_ = 0, warmup_steps_ = 0;
  int64_t start_epoch_ = 0, step_ = 0;
  int64_t start_batch_ = 0;   // a mid-epoch checkpoint: start_epoch_'s batches already trained
  std::string resumed_from_;  // the folder of --resume's checkpoint
  std::unique_ptr<optim::LRSchedule> sched_;
  Summary sum_;

  // Training state, made by prepare_steps() once the run has begun.
  std::unique_ptr<RunLog> log_;
  Tensor x_static_, y_static_;  // every step copies its batch here (a graph reads these)
  std::unique_ptr<optim::ClassifierStep> plain_step_;
  std::unique_ptr<StepRunner> dp_step_;
  std::function<void()> step_fn_;
#ifdef KILN_WITH_CUDA
  std::unique_ptr<cuda::GraphStep> graph_;
#endif
  std::vector<std::unique_ptr<amp::AsyncScalars>> step_metrics_;
  amp::AsyncScalars epoch_metrics_;
  BackgroundWriter checkpoints_;
  std::unique_ptr<BatchStream> next_stream_;
  Clock::time_point start_ = Clock::now();
  int64_t first_step_ = 0;
  bool stoppable_ = false;  // run() installed the stop handlers (StopSignals)
  int64_t saved_step_ = -1;  // the step of the last checkpoint written
  double best_top1_ = -1.0;  // the highest test top-1 in model_best.safetensors (-1: none yet)
  int64_t test_stop_step_ = 0;
};

// ---- set-up ----

Trainer::Trainer(const Config& config) : c_(config) {
  validate(c_);
  env_ = DistEnv::from_env();
  lead_ = env_.rank == 0;
  talk_ = lead_ && !c_.quiet;
  choose_device();
  manual_seed(c_.seed);
  // --output is checked before anything is read or created (plan_output only reads), claimed
  // once the data has been read (so nothing is made in a folder the data check would refuse),
  // and written only from run()'s begin(): a failing set-up leaves it as it was.
  OutputPlan plan;
  const bool writes = lead_ && !c_.evaluate;
  if (writes) {
    if (!c_.dummy) detect_data(c_.data);  // a wrong --data is named before --output
    const OutputReuse reuse = resumes_own_run(c_.output, c_.resume) ? OutputReuse::Resume
                              : c_.overwrite                        ? OutputReuse::Overwrite
                                                                    : OutputReuse::New;
    plan = plan_output(c_.output, reuse, data_roots(c_));
  }
  open_data();
  if (writes) {
    out_ = std::make_unique<OutputDir>(plan);
  }
  build_model();
  build_optimizer();
  resume_or_start();
  build_schedule();
  print_plan();
}

void Trainer::choose_device() {
  dev_ = pick_device(c_.device, env_);
  mixed_ = c_.amp == "on" || (c_.amp == "auto" && dev_.is_cuda());
  use_graph_ = c_.graph == "on" || (c_.graph == "auto" && dev_.is_cuda());
  if (mixed_ && !dev_.is_cuda())
    cli::usage_error("--amp on needs a CUDA device; the device is ", dev_);
  if (use_graph_ && !dev_.is_cuda())
    cli::usage_error("--graph on needs a CUDA device; the device is ", dev_);
  if (c_.profile && !dev_.is_cuda())
    cli::usage_error("--profile times GPU ops; the device is ", dev_);
  if (use_graph_ && c_.profile)
    cli::usage_error("--profile times ops one by one; use it with --graph off");
  if (c_.nesterov && (c_.optimizer != "sgd" || c_.momentum <= 0.0))
    cli::usage_error("--nesterov needs --optimizer sgd and --momentum > 0");
  precision_ = !mixed_ ? amp::Precision::FP32
               : c_.precision == "bf16" ? amp::Precision::MixedBF16
                                        : amp::Precision::Mixed16;
  if (c_.precision == "bf16" && !mixed_)
    cli::usage_error("--precision bf16 is a mixed precision: it needs --amp on (a CUDA device)");
  scaled_ = precision_ == amp::Precision::Mixed16;
  if (c_.deterministic && dev_.is_cuda()) deterministic_.enable();
}

void Trainer::open_data() {
  DataOptions o;
  o.data = c_.data;
  o.dummy = c_.dummy;
  o.dummy_images = c_.dummy_images;
  o.batch_size = c_.batch_size;
  o.image_size = c_.image_size;
  o.augment = c_.augment;
  o.seed = c_.seed;
  o.workers = int(c_.workers);
  // --deterministic: no choice made by timing. auto would pick the decoder by speed, and nvJPEG's
  // adaptive share which files the CPU decodes (the two decoders' pixels differ in the last bits).
  o.decoder = c_.deterministic && c_.decoder == "auto" ? "cpu" : c_.decoder;
  o.host_decode_fraction = c_.deterministic && c_.host_decode_fraction < 0.0
                               ? 0.0 : c_.host_decode_fraction;
  o.rank = env_.rank;
  o.world_size = env_.world_size;
  o.device = dev_;
  o.precision = precision_;
  data_ = std::make_unique<TrainData>(o);
  steps_per_epoch_ = data_->steps_per_epoch();
}

void Trainer::build_model() {
  info_ = model_info(c_, *data_);
  model_ = train::build_model(c_, *data_);
  if (c_.zero_init_residual) models::zero_init_residual_bns(*model_);
  if (!c_.weights.empty()) {
    SafetensorsData w;
    try {
      w = load_safetensors(c_.weights);
    } catch (const Error& e) {
      cli::usage_error("--weights: ", cli::without_location(e.what()));
    }
    const std::string head = classifier_prefix(info_.arch) + "weight";
    if (w.contains(head) && w.at(head).dim() == 2 && w.at(head).size(0) != info_.num_classes)
      cli::usage_error("--weights '", c_.weights, "' has ", w.at(head).size(0),
                       " classes, the data ", info_.num_classes,
                       c_.evaluate ? "" : " (--pretrained loads all but the classifier, for "
                                          "fine-tuning)");
    check_finite(w, "--weights");
    try {
      load_state(w.tensors, *model_, KeyMatch::Strict, c_.weights);
    } catch (const Error& e) {
      cli::usage_error("--weights: ", cli::without_location(e.what()));
    }
  }
  if (!c_.pretrained.empty())
    pretrained_note_ = load_pretrained(
        c_.pretrained, *model_, info_,
        c_.evaluate ? Classifier::MustMatch : Classifier::ResetWhenDifferent);
  amp::prepare_model(*model_, dev_, precision_);
  if (c_.freeze_backbone) trained_ = freeze_backbone(*model_, info_.arch);
  if (env_.distributed())
    dp_ = std::make_unique<DataParallel>(env_, *model_);  // every rank gets rank 0's weights
  if (c_.sync_bn && dp_) sync_bn_layers_ = dp_->enable_sync_batch_norm(*model_);
}

void Trainer::build_optimizer() {
  optim::ParamGroup proto;
  proto.lr = c_.lr;
  proto.momentum = c_.momentum;
  proto.weight_decay = c_.wd;
  proto.nesterov = c_.nesterov;
  auto groups = optim::split_weight_decay(*model_, proto);
  if (c_.freeze_backbone) {
    groups = {proto, proto};
    groups[1].weight_decay = 0.0;
    for (const Tensor& p : trained_) groups[p.dim() <= 1 ? 1 : 0].params.push_back(p);
  }
  if (c_.optimizer == "sgd")
    opt_ = std::make_unique<optim::FusedSGD>(groups);
  else
    opt_ = std::make_unique<optim::FusedAdamW>(groups);
  optim::LossScalerOptions so;
  so.enabled = precision_ == amp::Precision::Mixed16;  // bf16's range needs no loss scaling
  scaler_ = std::make_unique<optim::DynamicLossScaler>(dev_, so);

  meta_ = model_metadata(info_);
  // A safetensors header is UTF-8 JSON: a path that is not UTF-8 is kept with its bad bytes
  // written \xNN (save_safetensors would refuse it at the first checkpoint).
  meta_["data"] = c_.dummy                          ? "dummy"
                  : text::is_valid_utf8(c_.data) ? c_.data
                                                 : text::printable(c_.data);
  meta_["batch_size"] = std::to_string(c_.batch_size * env_.world_size);
  meta_["world_size"] = std::to_string(env_.world_size);  // a mid-epoch resume needs as many
  meta_["optimizer"] = c_.optimizer;  // a resume must use the same (resume_or_start)
  meta_["freeze_backbone"] = c_.freeze_backbone ? "1" : "0";
}

// Why the checkpoint at `path` cannot continue this run, from its metadata ("" when they agree).
std::string checkpoint_mismatch(const std::string& path, const Config& c) {
  SafetensorsData file;
  try {
    file = load_safetensors(path);
  } catch (const Error&) {
    return "";
  }
  auto said = [&](const char* key) {
    auto it = file.metadata.find(key);
    return it == file.metadata.end() ? std::string() : it->second;
  };
  if (!said("arch").empty() && said("arch") != c.arch)
    return "it holds a " + said("arch") + ", but --arch is " + c.arch;
  if (!said("optimizer").empty() && said("optimizer") != c.optimizer)
    return "its run trained with --optimizer " + said("optimizer") + ", this one with " +
           c.optimizer + "; resume with the same optimizer";
  const std::string frozen = said("freeze_backbone");
  if (!frozen.empty() && (frozen == "1") != c.freeze_backbone)
    return std::string("its run trained ") + (frozen == "1" ? "with" : "without") +
           " --freeze-backbone; resume it " + (frozen == "1" ? "with" : "without") + " the flag";
  return "";
}

void Trainer::resume_or_start() {
  if (!c_.resume.empty()) {
    TrainingState st;
    st.model = model_.get();
    st.optimizer = opt_.get();
    try {
      load_checkpoint(c_.resume, st);
    } catch (const Error& e) {
      const std::string why = checkpoint_mismatch(c_.resume, c_);
      if (!why.empty()) cli::usage_error("--resume '", c_.resume, "': ", why);
      const std::string what = cli::without_location(e.what());
      if (what.find("optimizer state") != std::string::npos)
        cli::usage_error("--resume '", c_.resume, "': its optimizer state does not fit this run's "
                         "(was it trained with another --optimizer or --freeze-backbone?): ",
                         what);
      cli::usage_error("--resume: ", what);
    }
    const std::string why = checkpoint_mismatch(c_.resume, c_);
    if (!why.empty()) cli::usage_error("--resume '", c_.resume, "': ", why);
    const std::string bad = first_non_finite(*model_);
    if (!bad.empty())
      cli::usage_error("--resume '", c_.resume, "': tensor '", bad,
                       "' holds NaN or infinite values");
    scaler_->load_state_dict(st.scaler);
    start_epoch_ = st.epoch;
    // Epoch-end checkpoints: the schedule continues at the epoch's first step for this run's
    // batch size (another batch size saved another step count).
    step_ = start_epoch_ * steps_per_epoch_;
    // A checkpoint of a run stopped mid-epoch: the epoch goes on from its next batch, which
    // needs the same batches (the same global batch size and process count, the same data);
    // --evaluate only reads the weights.
    if (auto it = st.metadata.find(kEpochBatchesKey); it != st.metadata.end()) {
      char* end = nullptr;
      const long long k = std::strtoll(it->second.c_str(), &end, 10);
      if (it->second.empty() || *end != '\0' || k < 0)
        cli::usage_error("--resume '", c_.resume, "': its metadata '", kEpochBatchesKey, "' is '",
                         it->second, "', not a batch count");
      if (k > 0 && !c_.evaluate) {
        const std::string where = "it was saved in epoch " + std::to_string(start_epoch_ + 1) +
                                  " after batch " + std::to_string(k);
        auto bs = st.metadata.find("batch_size");
        const std::string mine = std::to_string(c_.batch_size * env_.world_size);
        if (bs != st.metadata.end() && bs->second != mine)
          cli::usage_error("--resume '", c_.resume, "': ", where, " of batch size ", bs->second,
                           "; continuing that epoch needs the same batch size (this run's is ",
                           mine, ")");
        auto ws = st.metadata.find("world_size");
        const std::string procs = std::to_string(env_.world_size);
        if (ws != st.metadata.end() && ws->second != procs)
          cli::usage_error("--resume '", c_.resume, "': ", where, " by ", ws->second,
                           " process(es); continuing that epoch needs as many (this run has ",
                           procs, ")");
        if (k >= steps_per_epoch_)
          cli::usage_error("--resume '", c_.resume, "': ", where, ", but --data gives ",
                           steps_per_epoch_, " batches per epoch (is it the same data?)");
        start_batch_ = k;
        step_ += k;
      }
    }
    resumed_from_ = std::filesystem::path(c_.resume).parent_path().string();
    if (resumed_from_.empty()) resumed_from_ = ".";
    if (talk_ && st.step != step_) {
      auto bs = st.metadata.find("batch_size");
      std::printf(
          "kiln-train: '%s' was saved after %ld steps%s; at %ld steps per epoch the "
          "schedule continues at step %ld\n",
          c_.resume.c_str(), long(st.step),
          bs == st.metadata.end() ? "" : (" of batch " + bs->second).c_str(),
          long(steps_per_epoch_), long(step_));
    }
  }
  if (c_.start_epoch >= 0) {  // main.py's --start-epoch: the schedule continues from there
    start_epoch_ = c_.start_epoch;
    start_batch_ = 0;
    step_ = start_epoch_ * steps_per_epoch_;
  }
  sum_.epochs_done = start_epoch_;
}

void Trainer::build_schedule() {
  total_steps_ = steps_per_epoch_ * c_.epochs;
  // Clamped below 2^53: a warm-up of 1e308 epochs is "never ends", not an overflow.
  warmup_steps_ =
      int64_t(std::llround(std::min(c_.warmup_epochs * double(steps_per_epoch_), 0x1p53)));
  const optim::Warmup warm{warmup_steps_, 0.0};
  if (c_.schedule == "cosine")
    sched_ = std::make_unique<optim::CosineLR>(std::max(total_steps_, warm.steps + 1), 0.0, warm);
  else if (c_.schedule == "step")
    sched_ = std::make_unique<optim::MultiStepLR>(
        std::vector<int64_t>{total_steps_ / 2, total_steps_ * 3 / 4}, 0.1, warm);
  else
    sched_ = std::make_unique<optim::StepLR>(total_steps_ + 1, 1.0, warm);
}

void Trainer::print_plan() const {
  if (lead_ && !talk_ && !pretrained_note_.empty()) {  // fine-tuning is said even with --quiet
    std::printf("%s\n", pretrained_note_.c_str());
    std::fflush(stdout);
  }
  if (!talk_) return;
  const int64_t world = env_.world_size;
  std::printf(
      "kiln-train: %s on %s (%ld train / %ld test images, %ld classes), %s%s, %ld "
      "parameters, %s%s%s\n",
      c_.arch.c_str(), data_->description().c_str(), long(data_->train_size()),
      long(data_->test_size()), long(data_->num_classes()), dev_.str().c_str(),
      world > 1 ? (" x " + std::to_string(world) + " processes").c_str() : "",
      long(model_->num_parameters()),
      !mixed_ ? "fp32" : scaled_ ? "mixed precision (fp16/fp32 masters)"
                                 : "mixed precision (bf16/fp32 masters)",
      use_graph_ ? ", whole-step CUDA graph" : "", c_.deterministic ? ", deterministic" : "");
  std::printf(
      "  epochs %ld, batch %ld%s, %s lr %g momentum %g wd %g, warmup %ld steps, %s "
      "schedule%s%s%s\n",
      long(c_.epochs), long(c_.batch_size), world > 1 ? " per process" : "", c_.optimizer.c_str(),
      c_.lr, c_.momentum, c_.wd, long(warmup_steps_), c_.schedule.c_str(),
      c_.augment || (data_->small_images() && data_->kind() == DataKind::ImageFolder)
          ? ", crop+flip augmentation"
          : "",
      c_.zero_init_residual ? ", residual BNs zero-initialised" : "",
      start_batch_ > 0 ? (", continuing epoch " + std::to_string(start_epoch_ + 1) +
                          " after batch " + std::to_string(start_batch_))
                             .c_str()
      : start_epoch_ > 0 ? (", starting after epoch " + std::to_string(start_epoch_)).c_str()
                         : "");
  if (!pretrained_note_.empty()) std::printf("  %s\n", pretrained_note_.c_str());
  if (c_.freeze_backbone) {
    int64_t n = 0;
    for (const Tensor& p : trained_) n += p.numel();
    std::printf("  --freeze-backbone: training the classifier only (%ld of %ld parameters)\n", long(n),
                long(model_->num_parameters()));
  }
  if (c_.sync_bn && dp_)
    std::printf("  sync BN: %ld BatchNorm2d layers normalise with the statistics of all %ld "
                "processes' batches\n",
                long(sync_bn_layers_), long(world));
  else if (c_.sync_bn)
    std::printf("  --sync-bn: one process, so its batch is the global batch: nothing to "
                "synchronise\n");
  std::fflush(stdout);
}

// ---- the run ----

Summary Trainer::run() {
  if (c_.evaluate) return evaluate_only();
  if (out_) {
    out_->begin();  // the commit point: --overwrite's old run goes now, not before
    if (talk_ && out_->stale_temp_files_removed() > 0)
      std::printf("kiln-train: removed %ld temporary file(s) of interrupted saves in %s\n",
                  long(out_->stale_temp_files_removed()), c_.output.c_str());
    log_ = std::make_unique<RunLog>(*out_, start_epoch_, step_,
                                    out_->reuse() == OutputReuse::Resume ? "" : resumed_from_);
    if (out_->reuse() == OutputReuse::Resume) best_top1_ = best_so_far(*out_);
  }
  prepare_steps();
  std::optional<StopSignals> signals;
  if (env_.world_size == 1) {
    signals.emplace();
    stoppable_ = true;
    test_stop_step_ = test_stop_step();
  }
  for (int64_t epoch = start_epoch_; epoch < c_.epochs; ++epoch) {
    const EpochResult r = train_epoch(epoch);
    if (r.stopped_after > 0) return stopped(epoch, r.stopped_after);
    const auto save_start = Clock::now();
    save_checkpoint(epoch + 1);  // before the evaluation: a failing evaluation loses no training
    const double save_s = seconds_since(save_start);
    const auto eval_start = Clock::now();
    evaluate();
    const double eval_s = seconds_since(eval_start);
    sum_.epochs_done = epoch + 1;
    save_best(epoch);
    log_epoch(epoch, r, save_s, eval_s);
    if (g_stop_signal != 0 && stoppable_ && epoch + 1 < c_.epochs) return stopped(epoch + 1, 0);
  }
  if (sum_.epochs_done == start_epoch_) evaluate();  // resumed a finished run: nothing trained
  checkpoints_.finish();
  save_model();
  return sum_;
}

Summary Trainer::evaluate_only() {
  evaluate();
  if (lead_)  // with --quiet too
    std::printf("evaluation: test loss %s top-1 %s%% top-5 %s%%\n",
                fmt_metric(sum_.test_loss, 1, 4).c_str(),
                fmt_metric(sum_.test_top1, 100, 2).c_str(),
                fmt_metric(sum_.test_top5, 100, 2).c_str());
  return sum_;
}

void Trainer::prepare_steps() {
  x_static_ = amp::prepare_input(
      zeros({c_.batch_size, data_->channels(), data_->height(), data_->width()}), dev_,
      precision_);
  y_static_ = zeros({c_.batch_size}, TensorOptions(DType::i64).with_device(dev_));
  if (dp_)
    dp_step_ = dp_->make_step(*model_, *opt_, *scaler_, c_.label_smoothing, c_.clip_grad);
  else
    plain_step_ = std::make_unique<optim::ClassifierStep>(*model_, *opt_, *scaler_,
                                                          c_.label_smoothing, c_.clip_grad);
  step_fn_ = [this] {
    if (dp_step_)
      dp_step_->run(x_static_, y_static_);
    else
      plain_step_->run(x_static_, y_static_);
  };
#ifdef KILN_WITH_CUDA
  if (use_graph_) graph_ = std::make_unique<cuda::GraphStep>(step_fn_, cuda::GraphOptions{});
#endif
  if (c_.profile) cuda::enable_profiler(true);
  for (size_t i = 0; i < kMetricLag; ++i)
    step_metrics_.push_back(std::make_unique<amp::AsyncScalars>());
  start_ = Clock::now();
  first_step_ = step_;
}

EpochResult Trainer::train_epoch(int64_t epoch) {
  model_->train();
  const int64_t skipped_at_start = skipped_steps(), step_at_start = step_;
  const auto epoch_start = Clock::now();
  if (dp_step_)
    dp_step_->reset_metrics();
  else
    plain_step_->reset_metrics();
  const Tensor& loss_sum = dp_step_ ? dp_step_->loss_sum() : plain_step_->loss_sum();
  const Tensor& correct_sum = dp_step_ ? dp_step_->correct_sum() : plain_step_->correct_sum();
  EpochProgress ep;
  ep.epoch = epoch;
  std::deque<PendingStep> pending;  // oldest first
  auto tick = Clock::now();          // end of the previous step's iteration
  // The next epoch's batches start before this epoch's checkpoint and evaluation, so the input
  // path (JPEG decoding above all) fills its prefetch while those run. A loader runs one epoch
  // at a time: the finished epoch's stream is dropped first.
  EpochResult r;
  r.first_batch = std::exchange(start_batch_, 0);
  std::unique_ptr<BatchStream> stream =
      next_stream_ ? std::move(next_stream_) : data_->train_epoch(epoch, r.first_batch);
  while (true) {
    const auto fetch = Clock::now();
    std::optional<data::DeviceBatch> b = stream->next();
    const double data_s = seconds_since(fetch);
    if (!b) break;
    sched_->apply(*opt_, step_);
    x_static_.copy_(b->x);
    y_static_.copy_(b->y);
#ifdef KILN_WITH_CUDA
    if (graph_) {
      opt_->stage_lr();
      graph_->run();
    } else {
      step_fn_();
    }
#else
    step_fn_();
#endif
    ++step_;
    ep.seen += b->y.size(0);
    if (!lead_) continue;
    if (pending.size() == kMetricLag) {  // waits for a step kMetricLag back, not this one
      log_step(pending.front(), ep);
      pending.pop_front();
    }
    const auto now = Clock::now();
    amp::AsyncScalars* slot = step_metrics_[size_t(step_) % kMetricLag].get();  // just freed
    slot->record({loss_sum, correct_sum, scaler_->scale_tensor()});
    pending.push_back({step_, b->index + 1, b->y.size(0), ep.seen, opt_->param_groups[0].lr,
                       data_s, std::chrono::duration<double>(now - tick).count(), slot});
    tick = now;
    // --checkpoint-steps: every rank counts the same steps; rank 0 writes, the logs complete
    // up to this step first (a resume keeps the log lines up to its step).
    if (c_.checkpoint_steps > 0 && step_ % c_.checkpoint_steps == 0 &&
        b->index + 1 < steps_per_epoch_) {
      for (; !pending.empty(); pending.pop_front()) log_step(pending.front(), ep);
      save_checkpoint(epoch, b->index + 1);
    }
    if (!stoppable_) continue;
    if (step_ == test_stop_step_) ::raise(SIGTERM);
    // A signal: stop here unless this was the epoch's last batch (then the epoch ends as usual).
    if (g_stop_signal != 0 && b->index + 1 < steps_per_epoch_) {
      r.stopped_after = b->index + 1;
      break;
    }
  }
  for (; !pending.empty(); pending.pop_front()) log_step(pending.front(), ep);

  epoch_metrics_.record({loss_sum, correct_sum});
  std::vector<double> m = epoch_metrics_.values();  // Σ loss·N, Σ correct
  m.push_back(double(ep.seen));
  m.push_back(double(stream->bad_files()));
  r.host_decode_share = stream->host_decode_share();  // this rank's
  if (dp_) dp_->sum_host(m);
  r.seconds = seconds_since(epoch_start);
  stream.reset();
  if (epoch + 1 < c_.epochs && r.stopped_after == 0) next_stream_ = data_->train_epoch(epoch + 1);
  if (c_.profile && epoch == start_epoch_) {
    if (talk_) std::printf("%s", cuda::profiler_report().c_str());
    cuda::enable_profiler(false);
  }
  r.train_loss = m[0] / m[2];
  r.images_per_s = m[2] / r.seconds;
  r.bad_files = int64_t(m[3]);
  check_loss(r.train_loss, epoch, step_ - step_at_start, skipped_steps() - skipped_at_start);
  // Argmax hits of non-finite logits mean nothing.
  r.train_top1 = std::isfinite(r.train_loss) ? m[1] / m[2] : NAN;
  // Every rank holds the same weights; all check, so all stop together.
  const std::string bad = first_non_finite(*model_);
  if (!bad.empty())
    cli::usage_error("training diverged: after epoch ", epoch + 1,
                     " the weights hold non-finite values (the first in '", bad,
                     "'); stopping without saving them: ", what_is_kept(epoch));
  return r;
}

// One steps.jsonl line, and every print_freq steps a progress line.
void Trainer::log_step(const PendingStep& p, EpochProgress& ep) {
  const std::vector<double> m = p.metrics->values();  // cumulative over the epoch
  const double loss = (m[0] - ep.prev_loss) / double(p.batch);
  const double top1 = (m[1] - ep.prev_correct) / double(p.batch);
  ep.prev_loss = m[0];
  ep.prev_correct = m[1];
  const int64_t world = env_.world_size;
  json::ObjectWriter line;
  line.integer("step", p.step)
      .integer("epoch", ep.epoch + 1)
      .number("epoch_frac", double(ep.epoch) + double(p.index) / double(steps_per_epoch_))
      .number("loss", loss)
      .number("top1", top1)
      .number("lr", p.lr)
      .number("loss_scale", scaled_ ? m[2] : 1.0)
      .number("images_per_s", double(p.batch * world) / p.period_s)
      .number("ms_compute", 1e3 * (p.period_s - p.data_s))
      .number("ms_data", 1e3 * p.data_s);
  log_->step(line);
  ep.window_images += p.batch;
  ep.window_s += p.period_s;
  ep.window_data_s += p.data_s;
  if (!scaled_ && !dp_) check_loss(m[0], ep.epoch, 1, 0);  // ranks stop together at epoch ends
  if (talk_ && (p.index % c_.print_freq == 0 || p.index == steps_per_epoch_)) {
    const double eta = seconds_since(start_) / double(p.step - first_step_) *
                       double(total_steps_ - p.step);
    std::printf(
        "epoch %ld/%ld step %4ld/%ld  loss %s  acc %s%%  lr %.4f%s  %.0f img/s  "
        "data wait %.0f%%  ETA %s\n",
        long(ep.epoch + 1), long(c_.epochs), long(p.index), long(steps_per_epoch_),
        fmt_metric(m[0] / double(p.seen), 1, 4).c_str(),
        fmt_metric(std::isfinite(m[0]) ? m[1] / double(p.seen) : NAN, 100, 2).c_str(), p.lr,
        scaled_ ? (" scale " + std::to_string(int64_t(m[2]))).c_str() : "",
        double(ep.window_images * world) / ep.window_s, 100.0 * ep.window_data_s / ep.window_s,
        fmt_time(eta).c_str());
    std::fflush(stdout);
    log_->flush();
    ep.window_images = 0;
    ep.window_s = ep.window_data_s = 0;
  }
}

// A non-finite training loss: FP32 weights are already poisoned, so stop; with mixed precision
// the scaler skips such steps, so stop only when it skipped every step of the window.
void Trainer::check_loss(double loss, int64_t epoch, int64_t steps, int64_t skipped) const {
  if (std::isfinite(loss) || (scaled_ && skipped < steps)) return;
  cli::usage_error("training diverged: the training loss is ", fmt_metric(loss, 1, 4),
                   " in epoch ", epoch + 1,
                   scaled_ ? " and the loss scaler skipped every step" : "", " (lr ",
                   opt_->param_groups[0].lr, "); stopping: ", what_is_kept(epoch));
}

std::string Trainer::what_is_kept(int64_t epoch) const {
  // --output holds a checkpoint once this run saved one, or when it is the resumed run's own.
  const bool saved = epoch > start_epoch_ || resumes_own_run(c_.output, c_.resume);
  return (saved ? "the last checkpoint in '" + c_.output + "' is kept"
                : std::string("no checkpoint was written")) +
         "; try a lower --lr or a longer --warmup-epochs";
}

int64_t Trainer::skipped_steps() const {
  return scaled_ ? int64_t(scaler_->skipped_steps().to(DType::f64).item()) : 0;
}

void Trainer::save_checkpoint(int64_t epochs_done, int64_t batches) {
  if (log_) log_->flush();
  if (!lead_) return;
  TrainingState st;
  st.model = model_.get();
  st.optimizer = opt_.get();
  st.scaler = scaler_->state_dict();
  st.epoch = epochs_done;
  st.step = step_;
  st.metadata = meta_;
  if (batches > 0) st.metadata[kEpochBatchesKey] = std::to_string(batches);
  saved_step_ = step_;
  const std::string path = out_->file("checkpoint.safetensors");
  checkpoints_.write(path, checkpoint_host(path, st));
}

// A signal stopped the run after `batches` batches of epoch `epoch` (0: at the epoch's start,
// after the previous epoch's checkpoint and evaluation): the checkpoint is written, the logs
// flushed, the way on printed; no model file (the run has not finished).
Summary Trainer::stopped(int64_t epoch, int64_t batches) {
  if (batches > 0 && saved_step_ != step_) save_checkpoint(epoch, batches);
  checkpoints_.finish();
  if (log_) log_->flush();
  sum_.stop_signal = int(g_stop_signal);
  const std::string ckpt = out_ ? out_->file("checkpoint.safetensors") : std::string();
  if (batches > 0)
    std::fprintf(stderr,
                 "kiln-train: stopped by %s in epoch %ld/%ld after batch %ld of %ld (step %ld); "
                 "checkpoint saved to %s: rerun with --resume %s to continue from the next "
                 "batch\n",
                 signal_name(sum_.stop_signal), long(epoch + 1), long(c_.epochs), long(batches),
                 long(steps_per_epoch_), long(step_), ckpt.c_str(), ckpt.c_str());
  else
    std::fprintf(stderr,
                 "kiln-train: stopped by %s after epoch %ld/%ld; checkpoint saved to %s: rerun "
                 "with --resume %s to continue\n",
                 signal_name(sum_.stop_signal), long(epoch), long(c_.epochs), ckpt.c_str(),
                 ckpt.c_str());
  std::fflush(nullptr);
  return sum_;
}

void Trainer::evaluate() {
  if (dp_) dp_->sync_buffers(*model_);
  const auto eval_start = Clock::now();
  const int64_t test_steps = data_->test_steps();
  std::vector<double> ev = train::evaluate(*model_, *data_, [&](int64_t i) {
    if (talk_ && (i % c_.print_freq == 0 || i == test_steps)) {
      const double eta = seconds_since(eval_start) / double(i) * double(test_steps - i);
      std::printf("  evaluating: step %4ld/%ld  ETA %s\n", long(i), long(test_steps),
                  fmt_time(eta).c_str());
      std::fflush(stdout);
    }
  });
  if (dp_) dp_->sum_host(ev);
  if (ev[3] <= 0) cli::usage_error("--data '", c_.data, "': the evaluation saw no test images");
  sum_.test_loss = ev[0] / ev[3];
  sum_.test_top1 = ev[1] / ev[3];
  sum_.test_top5 = ev[2] / ev[3];
  sum_.test_bad_files = int64_t(ev[4]);
}

void Trainer::log_epoch(int64_t epoch, const EpochResult& r, double save_s, double eval_s) {
  if (talk_) {
    std::printf(
        "epoch %ld/%ld done in %s (%.0f img/s): train loss %s acc %s%% | test loss "
        "%s top-1 %s%% top-5 %s%%\n",
        long(epoch + 1), long(c_.epochs), fmt_time(r.seconds).c_str(), r.images_per_s,
        fmt_metric(r.train_loss, 1, 4).c_str(), fmt_metric(r.train_top1, 100, 2).c_str(),
        fmt_metric(sum_.test_loss, 1, 4).c_str(), fmt_metric(sum_.test_top1, 100, 2).c_str(),
        fmt_metric(sum_.test_top5, 100, 2).c_str());
    if (std::isfinite(r.host_decode_share))
      std::printf("epoch %ld/%ld: the CPU workers decoded %.0f%% of the training JPEGs, nvJPEG "
                  "the rest\n",
                  long(epoch + 1), long(c_.epochs), 100.0 * r.host_decode_share);
    // The epoch's unreadable files, the first ten named in a warning when first met.
    if (r.bad_files > 0 || sum_.test_bad_files > 0)
      std::printf("epoch %ld/%ld: skipped %ld unreadable training file(s) and %ld test file(s), "
                  "each replaced by the next readable one (the first named in the warnings "
                  "above)\n",
                  long(epoch + 1), long(c_.epochs), long(r.bad_files),
                  long(sum_.test_bad_files));
    std::fflush(stdout);
  }
  if (!log_) return;
  json::ObjectWriter line;
  line.integer("epoch", epoch + 1)
      .number("train_loss", r.train_loss)
      .number("train_top1", r.train_top1)
      .number("test_loss", sum_.test_loss)
      .number("test_top1", sum_.test_top1)
      .number("test_top5", sum_.test_top5)
      .number("images_per_s", r.images_per_s)
      .number("seconds", r.seconds)
      .number("checkpoint_seconds", save_s)
      .number("eval_seconds", eval_s)
      .number("lr", opt_->param_groups[0].lr)
      .integer("bad_files", r.bad_files);
  // A run resumed mid-epoch: the figures above are of this epoch's batches from here on.
  if (r.first_batch > 0) line.integer("first_batch", r.first_batch);
  if (std::isfinite(r.host_decode_share)) line.number("host_decode_share", r.host_decode_share);
  line.integer("test_bad_files", sum_.test_bad_files);
  log_->epoch(line);
}

// main.py's model_best: after an evaluation whose test top-1 beats every earlier one of this
// folder's runs (the value in model_best.safetensors' metadata when a run resumes there), that
// epoch's weights, as model.safetensors holds them, written on the checkpoint writer's thread.
void Trainer::save_best(int64_t epoch) {
  if (!lead_ || !out_ || !std::isfinite(sum_.test_top1) || sum_.test_top1 <= best_top1_) return;
  best_top1_ = sum_.test_top1;
  std::map<std::string, std::string> meta = meta_;
  meta["epochs"] = std::to_string(epoch + 1);
  meta["test_top1"] = json::number(sum_.test_top1);
  const std::string path = out_->file("model_best.safetensors");
  checkpoints_.write(path, safetensors_host(path, weights_state(*model_), meta));
}

void Trainer::save_model() {
  if (!lead_) return;
  std::map<std::string, std::string> meta = meta_;
  meta["epochs"] = std::to_string(sum_.epochs_done);
  meta["test_top1"] = json::number(sum_.test_top1);
  const std::string path = out_->file("model.safetensors");
  save_weights(path, *model_, WeightsDType::Float32, meta);
  std::printf("final test top-1 %s%% top-5 %s%% after %ld epoch(s), %s; model saved to %s\n",
              fmt_metric(sum_.test_top1, 100, 2).c_str(),
              fmt_metric(sum_.test_top5, 100, 2).c_str(), long(sum_.epochs_done),
              fmt_time(seconds_since(start_)).c_str(), path.c_str());
  std::fflush(stdout);
}

}  // namespace

Summary run(const Config& config) {
  auto trainer = std::make_unique<Trainer>(config);
  Summary s = trainer->run();
  // After an nvJPEG failover, tearing the trainer down (pinned buffers, graphs, streams) could
  // wait for the stuck decode stream: on the H200 its AsyncScalars' cudaFreeHost waited until
  // the stream drained. Its files are written and closed; the process's exit takes the rest.
  if (data::gpu_jpeg_failed_over()) (void)trainer.release();
  return s;
}

int main(const std::vector<std::string>& args) {
  return cli::run_tool("kiln-train", [&] {
    bool help = false;
    std::string info;
    const Config parsed = parse_args(args, &help, &info);
    if (help) {
      std::fputs(info.c_str(), stdout);
      return 0;
    }
    Config c = parsed;
    for (const auto& [name, value] : launch_env(c))  // main.py's --world-size/--rank/--dist-url
      ::setenv(name.c_str(), value.c_str(), 1);
    if (c.multiprocessing_distributed && !DistEnv::from_env().distributed()) {
      c.nproc = cuda_device_count();  // main.py's: one process per GPU of this node
      if (c.nproc < 1 || !data_parallel_available())
        cli::usage_error(
            "--multiprocessing-distributed: needs a kiln built with CUDA and NCCL, "
            "and a GPU");
    }
    if (c.nproc > 1 && !data_parallel_available())
      cli::usage_error("--nproc ", c.nproc,
                       ": data-parallel training needs a kiln built with CUDA and NCCL");
    if (plan_local_launch(int(c.nproc), DistEnv::from_env(), cuda_device_count())) {
      std::vector<std::string> argv = {"/proc/self/exe"};
      argv.insert(argv.end(), args.begin(), args.end());
      LaunchOptions lo;
      lo.nproc = int(c.nproc);
      LaunchResult r = launch_processes(argv, lo);
      if (!r.ok()) std::fprintf(stderr, "kiln-train: %s\n", r.message.c_str());
      return r.exit_code;
    }
    const Summary s = run(c);
    // Stopped by a signal: the shell's status for that signal, the checkpoint written.
    const int rc = s.stop_signal != 0 ? 128 + s.stop_signal : 0;
    // After an nvJPEG failover the CUDA context's teardown at exit could wait for ever for the
    // stuck decode stream (data/gpu_jpeg.h); the run's files are all written and closed here.
    if (data::gpu_jpeg_failed_over()) {
      std::fflush(nullptr);
      std::_Exit(rc);
    }
    return rc;
  });
}

}  // namespace kiln::train
