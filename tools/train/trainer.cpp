#include "tools/train/trainer.h"

#include <stdlib.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>

#include "core/device_query.h"
#include "core/serialization.h"
#include "core/version.h"
#include "cuda/profiler.h"
#include "ops/ops.h"
#include "optim/checkpoint.h"
#include "optim/model_file.h"
#include "optim/schedule.h"
#include "optim/train_step.h"
#include "tools/cli/cli.h"
#include "tools/train/dist_env.h"
#include "tools/train/launcher.h"
#include "tools/train/output_dir.h"
#include "tools/train/train_data.h"
#include "tools/train/train_dist.h"
#include "tools/train/train_parts.h"
#ifdef KILN_WITH_CUDA
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

}  // namespace

Summary run(const Config& c) {
  validate(c);
  const DistEnv env = DistEnv::from_env();
  const Device dev = pick_device(c.device, env);
  const bool lead = env.rank == 0;
  const bool talk = lead && !c.quiet;
  manual_seed(c.seed);

  const bool mixed = c.amp == "on" || (c.amp == "auto" && dev.is_cuda());
  const bool use_graph = c.graph == "on" || (c.graph == "auto" && dev.is_cuda());
  if (mixed && !dev.is_cuda())
    cli::usage_error("--amp on needs a CUDA device; the device is ", dev);
  if (use_graph && !dev.is_cuda())
    cli::usage_error("--graph on needs a CUDA device; the device is ", dev);
  if (c.profile && !dev.is_cuda()) cli::usage_error("--profile times GPU ops; the device is ", dev);
  if (use_graph && c.profile)
    cli::usage_error("--profile times ops one by one; use it with --graph off");
  if (c.nesterov && (c.optimizer != "sgd" || c.momentum <= 0.0))
    cli::usage_error("--nesterov needs --optimizer sgd and --momentum > 0");
  const amp::Precision precision = mixed ? amp::Precision::Mixed16 : amp::Precision::FP32;

  // Claim --output before anything expensive: a locked, unwritable or already used folder fails
  // now, not after an epoch of training.
  if (!c.dummy) detect_data(c.data);  // a wrong --data fails first, before a folder is created
  std::unique_ptr<OutputDir> out_dir;
  if (lead && !c.evaluate) {
    // --start-epoch restarts a run in its folder, as --resume does.
    const OutputReuse reuse = !c.resume.empty() || c.start_epoch >= 0 ? OutputReuse::Resume
                              : c.overwrite                          ? OutputReuse::Overwrite
                                                                     : OutputReuse::Refuse;
    out_dir = std::make_unique<OutputDir>(c.output, reuse);
    if (talk && out_dir->stale_temp_files_removed() > 0)
      std::printf("kiln-train: removed %ld temporary file(s) of interrupted saves in %s\n",
                  long(out_dir->stale_temp_files_removed()), c.output.c_str());
  }

  DataOptions dopt;
  dopt.data = c.data;
  dopt.dummy = c.dummy;
  dopt.dummy_images = c.dummy_images;
  dopt.batch_size = c.batch_size;
  dopt.image_size = c.image_size;
  dopt.augment = c.augment;
  dopt.seed = c.seed;
  dopt.workers = int(c.workers);
  dopt.decoder = c.decoder;
  dopt.host_decode_fraction = c.host_decode_fraction;
  dopt.rank = env.rank;
  dopt.world_size = env.world_size;
  dopt.device = dev;
  dopt.precision = precision;
  TrainData data(dopt);

  const ModelInfo info = model_info(c, data);
  auto model = build_model(c, data);
  if (!c.weights.empty()) {
    SafetensorsData w;
    try {
      w = load_safetensors(c.weights);
    } catch (const Error& e) {
      cli::usage_error("--weights: ", cli::without_location(e.what()));
    }
    if (w.contains("fc.weight") && w.at("fc.weight").dim() == 2 &&
        w.at("fc.weight").size(0) != info.num_classes)
      cli::usage_error("--weights '", c.weights, "' has ", w.at("fc.weight").size(0),
                       " classes, the data ", info.num_classes,
                       " (--pretrained loads all but the classifier, for fine-tuning)");
    try {
      load_state(w.tensors, *model, KeyMatch::Strict, c.weights);
    } catch (const Error& e) {
      cli::usage_error("--weights: ", cli::without_location(e.what()));
    }
  }
  const std::string pretrained_note =
      c.pretrained.empty() ? "" : load_pretrained(c.pretrained, *model);
  amp::prepare_model(*model, dev, precision);
  std::vector<Tensor> trained;  // --freeze-backbone: the classifier's parameters only
  if (c.freeze_backbone) trained = freeze_backbone(*model);
  std::unique_ptr<DataParallel> dp;
  if (env.distributed()) dp = std::make_unique<DataParallel>(env, *model);  // broadcasts rank 0's
  const int64_t sync_bn_layers = c.sync_bn && dp ? dp->enable_sync_batch_norm(*model) : 0;

  optim::ParamGroup proto;
  proto.lr = c.lr;
  proto.momentum = c.momentum;
  proto.weight_decay = c.wd;
  proto.nesterov = c.nesterov;
  auto groups = optim::split_weight_decay(*model, proto);
  if (c.freeze_backbone) {
    groups = {proto, proto};
    groups[1].weight_decay = 0.0;
    for (const Tensor& p : trained) groups[p.dim() <= 1 ? 1 : 0].params.push_back(p);
  }
  std::unique_ptr<optim::FusedOptimizer> opt;
  if (c.optimizer == "sgd")
    opt = std::make_unique<optim::FusedSGD>(groups);
  else
    opt = std::make_unique<optim::FusedAdamW>(groups);
  optim::LossScalerOptions so;
  so.enabled = mixed;
  optim::DynamicLossScaler scaler(dev, so);

  std::map<std::string, std::string> meta = model_metadata(info);
  meta["data"] = c.dummy ? "dummy" : c.data;
  meta["batch_size"] = std::to_string(c.batch_size * env.world_size);
  const int64_t steps_per_epoch = data.steps_per_epoch();
  int64_t start_epoch = 0, step = 0;
  if (!c.resume.empty()) {
    TrainingState st;
    st.model = model.get();
    st.optimizer = opt.get();
    cli::user_input("--resume: ", [&] { load_checkpoint(c.resume, st); });
    auto arch = st.metadata.find("arch");
    if (arch != st.metadata.end() && arch->second != c.arch)
      cli::usage_error("--resume '", c.resume, "' holds a ", arch->second, ", but --arch is ",
                       c.arch);
    scaler.load_state_dict(st.scaler);
    start_epoch = st.epoch;
    // Checkpoints are written at epoch ends, so the schedule continues at the epoch's first step
    // for this run's batch size (another batch size saved another step count).
    step = start_epoch * steps_per_epoch;
    if (talk && st.step != step) {
      auto bs = st.metadata.find("batch_size");
      std::printf(
          "kiln-train: '%s' was saved after %ld steps%s; at %ld steps per epoch the "
          "schedule continues at step %ld\n",
          c.resume.c_str(), long(st.step),
          bs == st.metadata.end() ? "" : (" of batch " + bs->second).c_str(), long(steps_per_epoch),
          long(step));
    }
  }
  if (c.start_epoch >= 0) {  // main.py's --start-epoch: the schedule continues from there
    start_epoch = c.start_epoch;
    step = start_epoch * steps_per_epoch;
  }

  const int64_t total = steps_per_epoch * c.epochs;
  const int64_t world = env.world_size;
  optim::Warmup warm{int64_t(std::llround(c.warmup_epochs * double(steps_per_epoch))), 0.0};
  std::unique_ptr<optim::LRSchedule> sched;
  if (c.schedule == "cosine")
    sched = std::make_unique<optim::CosineLR>(std::max(total, warm.steps + 1), 0.0, warm);
  else if (c.schedule == "step")
    sched = std::make_unique<optim::MultiStepLR>(std::vector<int64_t>{total / 2, total * 3 / 4},
                                                 0.1, warm);
  else
    sched = std::make_unique<optim::StepLR>(total + 1, 1.0, warm);

  if (talk) {
    std::printf(
        "kiln-train: %s on %s (%ld train / %ld test images, %ld classes), %s%s, %ld "
        "parameters, %s%s\n",
        c.arch.c_str(), data.description().c_str(), long(data.train_size()), long(data.test_size()),
        long(data.num_classes()), dev.str().c_str(),
        world > 1 ? (" x " + std::to_string(world) + " processes").c_str() : "",
        long(model->num_parameters()), mixed ? "mixed precision (fp16/fp32 masters)" : "fp32",
        use_graph ? ", whole-step CUDA graph" : "");
    std::printf(
        "  epochs %ld, batch %ld%s, %s lr %g momentum %g wd %g, warmup %ld steps, %s "
        "schedule%s%s\n",
        long(c.epochs), long(c.batch_size), world > 1 ? " per process" : "", c.optimizer.c_str(),
        c.lr, c.momentum, c.wd, long(warm.steps), c.schedule.c_str(),
        c.augment ? ", crop+flip augmentation" : "",
        start_epoch > 0 ? (", starting after epoch " + std::to_string(start_epoch)).c_str() : "");
    if (!pretrained_note.empty()) std::printf("  %s\n", pretrained_note.c_str());
    if (c.freeze_backbone)
      std::printf("  --freeze-backbone: training fc only (%ld of %ld parameters)\n",
                  long(trained[0].numel() + (trained.size() > 1 ? trained[1].numel() : 0)),
                  long(model->num_parameters()));
    if (c.sync_bn && dp)
      std::printf("  sync BN: %ld BatchNorm2d layers normalise with the statistics of all %ld "
                  "processes' batches\n",
                  long(sync_bn_layers), long(world));
    else if (c.sync_bn)
      std::printf("  --sync-bn: one process, so its batch is the global batch: nothing to "
                  "synchronise\n");
    std::fflush(stdout);
  }
  if (lead && !talk && !pretrained_note.empty()) {  // fine-tuning is said even with --quiet
    std::printf("%s\n", pretrained_note.c_str());
    std::fflush(stdout);
  }

  Summary sum;
  sum.epochs_done = start_epoch;
  const int64_t test_steps = data.test_steps();
  auto run_eval = [&] {
    if (dp) dp->sync_buffers(*model);
    const auto eval_start = Clock::now();
    std::vector<double> ev = evaluate(*model, data, [&](int64_t i) {
      if (talk && (i % c.print_freq == 0 || i == test_steps)) {
        const double eta = seconds_since(eval_start) / double(i) * double(test_steps - i);
        std::printf("  evaluating: step %4ld/%ld  ETA %s\n", long(i), long(test_steps),
                    fmt_time(eta).c_str());
        std::fflush(stdout);
      }
    });
    if (dp) dp->sum_host(ev);
    if (ev[3] <= 0) cli::usage_error("--data '", c.data, "': the evaluation saw no test images");
    sum.test_loss = ev[0] / ev[3];
    sum.test_top1 = ev[1] / ev[3];
    sum.test_top5 = ev[2] / ev[3];
    sum.test_bad_files = int64_t(ev[4]);
  };
  if (c.evaluate) {
    run_eval();
    if (lead)  // with --quiet too
      std::printf("evaluation: test loss %s top-1 %s%% top-5 %s%%\n",
                  fmt_metric(sum.test_loss, 1, 4).c_str(),
                  fmt_metric(sum.test_top1, 100, 2).c_str(),
                  fmt_metric(sum.test_top5, 100, 2).c_str());
    return sum;
  }

  // steps.jsonl: a resumed (or --start-epoch) run first drops the lines past its starting point
  // (a run stopped mid-epoch wrote them), a new run starts the file afresh.
  std::FILE* steps_log = nullptr;
  if (lead) {
    const std::string path = out_dir->file("steps.jsonl");
    const bool continues = !c.resume.empty() || c.start_epoch >= 0;
    if (continues) {
      trim_jsonl(out_dir->file("log.jsonl"), "epoch", double(start_epoch));
      trim_jsonl(path, "step", double(step));
    }
    steps_log = std::fopen(path.c_str(), continues ? "a" : "w");
    if (steps_log == nullptr) cli::usage_error("cannot write '", path, "': ", std::strerror(errno));
  }
  struct CloseFile {
    std::FILE*& f;
    ~CloseFile() {
      if (f) std::fclose(f);
    }
  } close_steps_log{steps_log};

  // Static inputs: every step copies its batch into them (the graph reads these addresses).
  Tensor x_static = amp::prepare_input(
      zeros({c.batch_size, data.channels(), data.height(), data.width()}), dev, precision);
  Tensor y_static = zeros({c.batch_size}, TensorOptions(DType::i64).with_device(dev));
  optim::ClassifierStep plain_step(*model, *opt, scaler, c.label_smoothing);
  std::unique_ptr<StepRunner> dp_step;
  if (dp) dp_step = dp->make_step(*model, *opt, scaler, c.label_smoothing);
  const Tensor& loss_sum = dp_step ? dp_step->loss_sum() : plain_step.loss_sum();
  const Tensor& correct_sum = dp_step ? dp_step->correct_sum() : plain_step.correct_sum();
  std::function<void()> step_fn = [&] {
    if (dp_step)
      dp_step->run(x_static, y_static);
    else
      plain_step.run(x_static, y_static);
  };
#ifdef KILN_WITH_CUDA
  std::unique_ptr<cuda::GraphStep> graph;
  if (use_graph) graph = std::make_unique<cuda::GraphStep>(step_fn, cuda::GraphOptions{});
#endif
  if (c.profile) cuda::enable_profiler(true);

  BackgroundWriter checkpoints;
  amp::AsyncScalars metrics;  // the epoch's totals
  // Rank 0 reads each step's device accumulators kMetricLag steps late, each in-flight step
  // through its own AsyncScalars, so the host can run that many steps ahead of the device (one
  // step ahead is not enough when a step is shorter than the host's work for it: small batches).
  constexpr size_t kMetricLag = 4;
  std::vector<std::unique_ptr<amp::AsyncScalars>> step_metrics;
  for (size_t i = 0; i < kMetricLag; ++i)
    step_metrics.push_back(std::make_unique<amp::AsyncScalars>());
  const auto start = Clock::now();
  const int64_t first_step = step;
  // `pending`: the steps whose values are in flight, oldest first.
  struct Pending {
    int64_t step, index, batch, seen;
    double lr, data_s, period_s;
  };
  // What a diverged run leaves behind, for its error message.
  auto kept = [&](int64_t epoch) {
    return (c.resume.empty() && epoch == 0 ? std::string("no checkpoint was written")
                                           : "the last checkpoint in '" + c.output + "' is kept") +
           "; try a lower --lr or a longer --warmup-epochs";
  };
  // A non-finite training loss: FP32 weights are already poisoned, so stop; with mixed precision
  // the scaler skips such steps, so stop only when it skipped every step (skipped_in_window).
  auto check_loss = [&](double loss, int64_t epoch, int64_t steps_in_window,
                        int64_t skipped_in_window) {
    if (std::isfinite(loss) || (mixed && skipped_in_window < steps_in_window)) return;
    // What to change is the user's (--lr, --warmup-epochs): one line, no source location.
    cli::usage_error("training diverged: the training loss is ", fmt_metric(loss, 1, 4),
                     " in epoch ", epoch + 1,
                     mixed ? " and the loss scaler skipped every step" : "", " (lr ",
                     opt->param_groups[0].lr, "); stopping: ", kept(epoch));
  };
  auto skipped_steps = [&]() -> int64_t {
    return mixed ? int64_t(scaler.skipped_steps().to(DType::f64).item()) : 0;
  };
  // The next epoch's batches start before this epoch's checkpoint and evaluation, so the input
  // path (JPEG decoding above all) fills its prefetch while those run, not at the next epoch's
  // start. A loader runs one epoch at a time: the finished epoch's stream is dropped first.
  std::unique_ptr<BatchStream> next_stream;
  for (int64_t epoch = start_epoch; epoch < c.epochs; ++epoch) {
    model->train();
    const int64_t skipped_at_start = skipped_steps(), step_at_start = step;
    const auto epoch_start = Clock::now();
    if (dp_step)
      dp_step->reset_metrics();
    else
      plain_step.reset_metrics();
    int64_t seen = 0, window_images = 0;
    double window_s = 0, window_data_s = 0, prev_loss = 0, prev_correct = 0;
    std::deque<std::pair<Pending, amp::AsyncScalars*>> pending;
    auto emit = [&](const Pending& p, amp::AsyncScalars& source) {
      const std::vector<double> m = source.values();  // cumulative over the epoch
      const double loss = (m[0] - prev_loss) / double(p.batch);
      const double top1 = (m[1] - prev_correct) / double(p.batch);
      prev_loss = m[0];
      prev_correct = m[1];
      std::fprintf(steps_log,
                   "{\"step\": %ld, \"epoch\": %ld, \"epoch_frac\": %s, \"loss\": %s, "
                   "\"top1\": %s, \"lr\": %s, \"loss_scale\": %s, \"images_per_s\": %s, "
                   "\"ms_compute\": %s, \"ms_data\": %s}\n",
                   long(p.step), long(epoch + 1),
                   json_number(double(epoch) + double(p.index) / double(steps_per_epoch)).c_str(),
                   json_number(loss).c_str(), json_number(top1).c_str(), json_number(p.lr).c_str(),
                   json_number(mixed ? m[2] : 1.0).c_str(),
                   json_number(double(p.batch * world) / p.period_s).c_str(),
                   json_number(1e3 * (p.period_s - p.data_s)).c_str(),
                   json_number(1e3 * p.data_s).c_str());
      window_images += p.batch;
      window_s += p.period_s;
      window_data_s += p.data_s;
      if (!mixed && !dp) check_loss(m[0], epoch, 1, 0);  // ranks stop together at epoch ends
      if (talk && (p.index % c.print_freq == 0 || p.index == steps_per_epoch)) {
        const double eta =
            seconds_since(start) / double(p.step - first_step) * double(total - p.step);
        std::printf(
            "epoch %ld/%ld step %4ld/%ld  loss %s  acc %s%%  lr %.4f%s  %.0f img/s  "
            "data wait %.0f%%  ETA %s\n",
            long(epoch + 1), long(c.epochs), long(p.index), long(steps_per_epoch),
            fmt_metric(m[0] / double(p.seen), 1, 4).c_str(),
            fmt_metric(std::isfinite(m[0]) ? m[1] / double(p.seen) : NAN, 100, 2).c_str(), p.lr,
            mixed ? (" scale " + std::to_string(int64_t(m[2]))).c_str() : "",
            double(window_images * world) / window_s, 100.0 * window_data_s / window_s,
            fmt_time(eta).c_str());
        std::fflush(stdout);
        std::fflush(steps_log);
        window_images = 0;
        window_s = window_data_s = 0;
      }
    };
    auto tick = Clock::now();  // end of the previous step's iteration
    std::unique_ptr<BatchStream> stream =
        next_stream ? std::move(next_stream) : data.train_epoch(epoch);
    while (true) {
      const auto fetch = Clock::now();
      std::optional<data::DeviceBatch> b = stream->next();
      const double data_s = seconds_since(fetch);
      if (!b) break;
      sched->apply(*opt, step);
      x_static.copy_(b->x);
      y_static.copy_(b->y);
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
      seen += b->y.size(0);
      if (!lead) continue;
      if (pending.size() == kMetricLag) {  // waits for a step kMetricLag back, not this one
        emit(pending.front().first, *pending.front().second);
        pending.pop_front();
      }
      const auto now = Clock::now();
      amp::AsyncScalars* slot = step_metrics[size_t(step) % kMetricLag].get();  // just freed
      pending.emplace_back(Pending{step, b->index + 1, b->y.size(0), seen,
                                   opt->param_groups[0].lr, data_s,
                                   std::chrono::duration<double>(now - tick).count()},
                           slot);
      tick = now;
      slot->record({loss_sum, correct_sum, scaler.scale_tensor()});
    }
    for (; !pending.empty(); pending.pop_front())
      emit(pending.front().first, *pending.front().second);
    metrics.record({loss_sum, correct_sum});
    std::vector<double> m = metrics.values();
    m.push_back(double(seen));
    m.push_back(double(stream->bad_files()));  // m[3]
    const double host_share = stream->host_decode_share();  // this rank's
    if (dp) dp->sum_host(m);
    const double epoch_s = seconds_since(epoch_start);
    stream.reset();
    if (epoch + 1 < c.epochs) next_stream = data.train_epoch(epoch + 1);
    if (c.profile && epoch == start_epoch) {
      if (talk) std::printf("%s", cuda::profiler_report().c_str());
      cuda::enable_profiler(false);
    }
    const double train_loss = m[0] / m[2], ips = m[2] / epoch_s;
    check_loss(train_loss, epoch, step - step_at_start, skipped_steps() - skipped_at_start);
    // Argmax hits of non-finite logits mean nothing.
    const double train_top1 = std::isfinite(train_loss) ? m[1] / m[2] : NAN;
    // Every rank holds the same weights; all check, so all stop together.
    const std::string bad = first_non_finite(*model);
    if (!bad.empty())
      cli::usage_error("training diverged: after epoch ", epoch + 1,
                       " the weights hold non-finite values (the first in '", bad,
                       "'); stopping without saving them: ", kept(epoch));
    // The checkpoint before the evaluation: a failing evaluation loses no training.
    if (steps_log) std::fflush(steps_log);
    const auto save_start = Clock::now();
    if (lead) {
      TrainingState st;
      st.model = model.get();
      st.optimizer = opt.get();
      st.scaler = scaler.state_dict();
      st.epoch = epoch + 1;
      st.step = step;
      st.metadata = meta;
      const std::string path = out_dir->file("checkpoint.safetensors");
      checkpoints.write(path, checkpoint_host(path, st));
    }
    const double save_s = seconds_since(save_start);  // the training thread's share of the save
    const auto eval_start = Clock::now();
    run_eval();
    const double eval_s = seconds_since(eval_start);
    sum.epochs_done = epoch + 1;
    if (talk) {
      std::printf(
          "epoch %ld/%ld done in %s (%.0f img/s): train loss %s acc %s%% | test loss "
          "%s top-1 %s%% top-5 %s%%\n",
          long(epoch + 1), long(c.epochs), fmt_time(epoch_s).c_str(), ips,
          fmt_metric(train_loss, 1, 4).c_str(), fmt_metric(train_top1, 100, 2).c_str(),
          fmt_metric(sum.test_loss, 1, 4).c_str(), fmt_metric(sum.test_top1, 100, 2).c_str(),
          fmt_metric(sum.test_top5, 100, 2).c_str());
      if (std::isfinite(host_share))
        std::printf("epoch %ld/%ld: the CPU workers decoded %.0f%% of the training JPEGs, nvJPEG "
                    "the rest\n",
                    long(epoch + 1), long(c.epochs), 100.0 * host_share);
      // The epoch's unreadable files, each named in a warning when first met.
      if (m[3] > 0 || sum.test_bad_files > 0)
        std::printf("epoch %ld/%ld: skipped %ld unreadable training file(s) and %ld test file(s), "
                    "each replaced by the next readable one (named in the warnings above)\n",
                    long(epoch + 1), long(c.epochs), long(m[3]), long(sum.test_bad_files));
      std::fflush(stdout);
    }
    if (lead)
      out_dir->append_log("{\"epoch\": " + std::to_string(epoch + 1) + ", \"train_loss\": " +
                          json_number(train_loss) + ", \"train_top1\": " + json_number(train_top1) +
                          ", \"test_loss\": " + json_number(sum.test_loss) +
                          ", \"test_top1\": " + json_number(sum.test_top1) + ", \"test_top5\": " +
                          json_number(sum.test_top5) + ", \"images_per_s\": " + json_number(ips) +
                          ", \"seconds\": " + json_number(epoch_s) +
                          ", \"checkpoint_seconds\": " + json_number(save_s) +
                          ", \"eval_seconds\": " + json_number(eval_s) +
                          ", \"lr\": " + json_number(opt->param_groups[0].lr) +
                          ", \"bad_files\": " + std::to_string(int64_t(m[3])) +
                          (std::isfinite(host_share)
                               ? ", \"host_decode_share\": " + json_number(host_share)
                               : std::string()) +
                          ", \"test_bad_files\": " + std::to_string(sum.test_bad_files) + "}");
  }

  if (sum.epochs_done == start_epoch) run_eval();  // resumed a finished run: nothing trained
  checkpoints.finish();
  if (lead) {
    std::map<std::string, std::string> wmeta = meta;
    wmeta["epochs"] = std::to_string(sum.epochs_done);
    wmeta["test_top1"] = json_number(sum.test_top1);
    const std::string path = out_dir->file("model.safetensors");
    save_weights(path, *model, WeightsDType::Float32, wmeta);
    std::printf("final test top-1 %s%% top-5 %s%% after %ld epoch(s), %s; model saved to %s\n",
                fmt_metric(sum.test_top1, 100, 2).c_str(),
                fmt_metric(sum.test_top5, 100, 2).c_str(), long(sum.epochs_done),
                fmt_time(seconds_since(start)).c_str(), path.c_str());
  }
  return sum;
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
    run(c);
    return 0;
  });
}

}  // namespace kiln::train
