// kiln-bench --model NAME: end-to-end training throughput on synthetic data (random inputs and
// labels made on the GPU), mixed precision (FP16 NHWC activations and weights, FP32 masters),
// fused SGD with momentum and weight decay, dynamic loss scaling, for each batch size:
//   eager: the step run op by op;   graph: the same step captured once and replayed.
// Reported per row: step time (median over windows of CUDA-event-timed steps), images/s, MFU
// against 24.3 GFLOP per 224x224 image (ResNet-50 forward + backward) and 765 TFLOP/s, host
// CPU time per step (the launching thread, in the timed windows, and to issue one step onto an
// idle device: "issue"), and peak allocated / reserved device memory.
#include "tools/bench/model_bench.h"

#include "core/serialization.h"
#include "tools/bench/kernel_trace.h"

#include "tools/cli/cli.h"

#include <time.h>

#include <algorithm>
#include <cstdio>

#include "tools/train/dist_env.h"
#include "core/json.h"
#include "models/zoo.h"
#include "ops/ops.h"
#include "optim/amp.h"
#include "optim/fused.h"
#include "tools/train/train_dist.h"
#include "optim/train_step.h"
#ifdef KILN_WITH_CUDA
#include <cuda_profiler_api.h>

#include "cuda/allocator.h"
#include "cuda/check.h"
#include "cuda/conv.h"
#include "cuda/graph.h"
#include "cuda/profiler.h"
#include "cuda/runtime.h"
#endif

namespace kiln::bench {

TrainSetup make_train_setup(const std::string& model, Device device, amp::Precision precision,
                            double dropout) {
  TrainSetup s;
  s.model = models::create_model(model, 1000, nullptr, dropout);
  amp::prepare_model(*s.model, device, precision);
  optim::ParamGroup proto;
  if (models::family_of(model) == models::Family::ViT) {  // the transformer recipe's optimizer
    proto.lr = 1e-3;
    proto.weight_decay = 0.05;
    s.opt = std::make_unique<optim::FusedAdamW>(optim::split_weight_decay(*s.model, proto));
  } else {
    proto.lr = 0.1;
    proto.momentum = 0.9;
    proto.weight_decay = 5e-5;
    s.opt = std::make_unique<optim::FusedSGD>(optim::split_weight_decay(*s.model, proto));
  }
  optim::LossScalerOptions so;
  so.enabled = precision == amp::Precision::Mixed16;  // bf16 needs no loss scaling
  s.scaler = std::make_unique<optim::DynamicLossScaler>(device, so);
  s.step = std::make_unique<optim::ClassifierStep>(*s.model, *s.opt, *s.scaler);
  return s;
}

#ifdef KILN_WITH_CUDA
namespace {

double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

struct Timing {
  double step_ms = 0, host_ms = 0, launch_ms = 0;
};

// Runs `step` warmup times, then `windows` windows of `per_window` steps between two events on
// the current stream; returns the median window's time per step and the host CPU time per step.
template <typename Fn>
Timing time_steps(Fn&& step, int warmup, int windows, int per_window) {
  for (int i = 0; i < warmup; ++i) step();
  cudaStream_t s = cuda::current_stream();
  CUDA_CHECK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> ms;
  double host = 0;
  for (int w = 0; w < windows; ++w) {
    CUDA_CHECK(cudaEventRecord(a, s));
    const double c0 = thread_cpu_seconds();
    for (int i = 0; i < per_window; ++i) step();
    host += thread_cpu_seconds() - c0;
    CUDA_CHECK(cudaEventRecord(b, s));
    CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(double(t) / per_window);
  }
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  // With the GPU the bottleneck, launches in a window wait for room in the launch queue, and
  // the thread spins there, so `host` above includes waiting. The host's own cost of a step is
  // what one step takes to issue onto an idle device: median of 5.
  std::vector<double> launch;
  for (int i = 0; i < 5; ++i) {
    CUDA_CHECK(cudaStreamSynchronize(s));
    const double c0 = thread_cpu_seconds();
    step();
    launch.push_back(thread_cpu_seconds() - c0);
  }
  CUDA_CHECK(cudaStreamSynchronize(s));
  std::sort(launch.begin(), launch.end());
  return {ms[ms.size() / 2], 1e3 * host / double(windows * per_window), 1e3 * launch[2]};
}

}  // namespace

std::vector<ModelRow> bench_model(const ModelBenchOptions& o) {
  std::vector<ModelRow> rows;
  // Under a launcher (kiln-bench --nproc N, torchrun, mpirun, srun) every rank runs the same
  // rows data-parallel (train::DataParallel: bucketed FP16 gradient all-reduce overlapping
  // backward, agreed found-inf) with `batch` images per GPU; rank 0 reports.
  const DistEnv env = DistEnv::from_env();
  if (env.distributed() && env.local_rank >= cuda::device_count())
    cli::usage_error("this process is ", env.describe(), ", so it uses GPU ", env.local_rank,
                     ", but only ", cuda::device_count(), " CUDA device(s) are visible to it");
  if (env.distributed()) cuda::set_device(env.local_rank);
  const Device dev = Device::cuda(env.distributed() ? env.local_rank : 0);
  const bool report = env.rank == 0;
  std::unique_ptr<train::DataParallel> dp;
  for (int64_t batch : o.batches) {
    for (bool graph : {false, true}) {
      if (graph ? !o.graph : !o.eager) continue;
      // A fresh model, optimizer and scaler per row: rows do not share warm-up or state.
      TrainSetup setup = make_train_setup(o.model, dev, o.precision, o.dropout);
      optim::FusedOptimizer& opt = *setup.opt;
      optim::DynamicLossScaler& scaler = *setup.scaler;
      optim::ClassifierStep& step = *setup.step;
      // The first row's model is rank 0's start for every rank; later rows' models differ per
      // rank, which changes nothing in the work a step does.
      if (env.distributed() && !dp) dp = std::make_unique<train::DataParallel>(env, *setup.model);
      std::unique_ptr<train::StepRunner> dp_step =
          dp ? dp->make_step(*setup.model, opt, scaler, 0.0) : nullptr;
      auto step_once = [&](const Tensor& xs, const Tensor& ys) {
        if (dp_step) dp_step->run(xs, ys); else step.run(xs, ys);
      };
      Tensor x = amp::prepare_input(randn({batch, 3, o.image_size, o.image_size}), dev, o.precision);
      Tensor y = randint(0, 1000, {batch}, TensorOptions(DType::i64).with_device(dev));
      cuda::synchronize();
      cuda::reset_peak_stats();
      Timing t;
      if (!graph) {
        t = time_steps([&] { step_once(x, y); }, o.warmup, o.windows, o.steps_per_window);
        if (o.profile) {  // every rank steps (their collectives pair up); rank 0 prints
          // One step between cudaProfilerStart/Stop, for a kernel-level profiler attached with
          // its capture starting off (`ncu --profile-from-start off`); a no-op otherwise.
          CUDA_CHECK(cudaStreamSynchronize(cuda::current_stream()));
          CUDA_CHECK(cudaProfilerStart());
          step_once(x, y);
          CUDA_CHECK(cudaStreamSynchronize(cuda::current_stream()));
          CUDA_CHECK(cudaProfilerStop());
          cuda::profiler_reset();
          cuda::enable_profiler(true);
          for (int i = 0; i < 5; ++i) step_once(x, y);
          cuda::enable_profiler(false);
          if (report)
            std::printf("per-op profile of 5 eager steps, %s batch %ld:\n%s", o.model.c_str(),
                      long(batch), cuda::profiler_report().c_str());
          if (report && o.profile_by_input)
            std::printf("the same steps by op and input:\n%s", cuda::profiler_report(true).c_str());
        }
      } else {
        cuda::GraphStep g([&] { step_once(x, y); }, {.warmup_steps = 3});
        t = time_steps([&] {
          opt.stage_lr();
          g.run();
        }, o.warmup, o.windows, o.steps_per_window);
        if (!o.trace_path.empty()) {
          // Rank 0 traces; the other ranks replay as many steps, so that the collectives inside
          // the graph pair up.
          auto replay = [&] {
            opt.stage_lr();
            g.run();
          };
          if (report) {
            const std::vector<TracedKernel> k =
                trace_kernels(replay, o.trace_steps, o.trace_back_to_back);
            write_file_atomic(o.trace_path, trace_csv(k));
            std::printf("%swrote %s (%s batch %ld, %d replays%s)\n",
                        trace_summary(k, o.trace_back_to_back).c_str(), o.trace_path.c_str(),
                        o.model.c_str(), long(batch), o.trace_steps,
                        o.trace_back_to_back ? ", back to back" : "");
          } else {
            for (int i = 0; i < o.trace_steps; ++i) replay();
          }
        }
      }
      cuda::synchronize();
      const cuda::AllocatorStats st = cuda::allocator_stats();
      ModelRow r;
      r.model = o.model;
      r.batch = batch;
      r.mode = graph ? "graph" : "eager";
      r.step_ms = t.step_ms;
      r.host_ms = t.host_ms;
      r.launch_ms = t.launch_ms;
      r.gpus = env.world_size;
      r.images_per_s = double(batch) * env.world_size / (t.step_ms * 1e-3);
      r.mfu = r.images_per_s / env.world_size * o.gflop_per_image * 1e9 / (o.peak_tflops * 1e12);
      r.peak_allocated_gib = double(st.peak_allocated_bytes) / double(1ull << 30);
      r.reserved_gib = double(st.reserved_bytes) / double(1ull << 30);
      r.peak_reserved_gib = double(st.peak_reserved_bytes) / double(1ull << 30);
      // A step the loss scaler skipped still runs forward and backward, so its time looks
      // normal: report the skips, and flag a row where most steps were skipped (the run is then
      // not training and its figure is not a valid measurement).
      r.final_scale = scaler.scale_value();
      r.skipped_steps = int64_t(scaler.skipped_steps().item());
      r.total_steps = o.warmup + int64_t(o.windows) * o.steps_per_window + 5 +  // + issue probes
                      (o.profile && !graph ? 6 : 0) +                          // + profiled
                      (graph && !o.trace_path.empty() ? o.trace_steps : 0);  // + traced
      rows.push_back(r);
      if (!report) continue;
      if (r.gpus > 1) std::printf("[%d GPUs, batch per GPU] ", r.gpus);
      std::printf("%-10s batch %4ld %-5s  %8.2f ms/step  %8.0f img/s  MFU %5.1f%%  host %6.2f ms/step"
                  " (issue %5.2f)"
                  "  peak %6.2f GiB  reserved %6.2f GiB (peak %.2f)  scale %g  skipped %ld/%ld%s\n",
                  r.model.c_str(), long(batch), r.mode.c_str(), r.step_ms, r.images_per_s,
                  100 * r.mfu, r.host_ms, r.launch_ms, r.peak_allocated_gib, r.reserved_gib, r.peak_reserved_gib, r.final_scale,
                  long(r.skipped_steps), long(r.total_steps),
                  2 * r.skipped_steps > r.total_steps ? "  INVALID: most steps skipped" : "");
      std::fflush(stdout);
    }
  }
  return rows;
}
#else
std::vector<ModelRow> bench_model(const ModelBenchOptions&) {
  cli::usage_error("--model measures the GPU backend, and this kiln was built without CUDA");
}
#endif

std::string rows_json(const std::vector<ModelRow>& rows) {
  std::string out = "[";
  for (size_t i = 0; i < rows.size(); ++i) {
    const ModelRow& r = rows[i];
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "%s{\"model\":%s,\"batch\":%ld,\"mode\":\"%s\",\"step_ms\":%.4f,"
                  "\"images_per_s\":%.1f,\"mfu\":%.4f,\"host_ms_per_step\":%.4f,"
                  "\"host_issue_ms\":%.4f,"
                  "\"peak_allocated_gib\":%.3f,\"reserved_gib\":%.3f,\"peak_reserved_gib\":%.3f,\"skipped_steps\":%ld,"
                  "\"gpus\":%d}",
                  i ? "," : "", json::quote(r.model).c_str(), long(r.batch), r.mode.c_str(),
                  r.step_ms, r.images_per_s, r.mfu, r.host_ms, r.launch_ms, r.peak_allocated_gib,
                  r.reserved_gib, r.peak_reserved_gib, long(r.skipped_steps), r.gpus);
    out += buf;
  }
  return out + "]\n";
}

}  // namespace kiln::bench
