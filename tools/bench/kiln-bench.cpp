// kiln-bench: speed of kiln on the GPU, printed as a table and written as JSON.
//
//   kiln-bench --model resnet50 [--batches 32,64,128,256] [--eager-only|--graph-only] [--json out.json]
//       end-to-end training throughput, eager and CUDA graph (tools/bench/model_bench.cpp).
//
//   kiln-bench --model resnet50 --verify-graph [--batches 64] [--verify-steps 12]
//       is a CUDA-graph replay of the training step bit-identical to eager steps? Exit status 0
//       when it is at every batch, 1 otherwise (tools/bench/verify_graph.cpp).
//
//   kiln-bench --ops [-b 256] [--dtype f16|f32] [--back-to-back 10] [--json out.json]
//       every distinct ResNet-50 layer at the given batch: conv fwd / dgrad / wgrad, batch norm
//       fwd / bwd, pooling, linear, softmax-cross-entropy; median time over repeats, TFLOP/s
//       (or GB/s for memory-bound ops) against the measured ceilings of the H200.
//       --ops-filter TEXT: only the convolution rows whose shape contains TEXT (with
//       KILN_CUDNN_FIND_LOG=1, the tuner's log for those problems).
//
// Timing: 5 warm-up runs, then two medians of `repeat` samples on the compute stream:
//   single: CUDA events around one call, so host work inside the call that outlasts the GPU work
//           (descriptor set-up, look-ups, allocation) shows as idle GPU time;
//   b2b:    CUDA events around N calls back to back, divided by N: the host runs ahead of the
//           GPU, so this is (close to) the GPU time alone.
// Rates and % peak use the b2b time. tools/bench/bench_torch_ops.py prints the same columns.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "core/device_query.h"
#include "core/error.h"
#include "core/json.h"
#include "core/serialization.h"
#include "core/tensor.h"
#include "core/version.h"
#include "ops/ops.h"
#include "models/zoo.h"
#include "tools/bench/kernel_trace.h"
#include "tools/bench/model_bench.h"
#include "tools/cli/cli.h"
#include "tools/train/dist_env.h"
#include "tools/train/launcher.h"
#ifdef KILN_WITH_CUDA
#include "cuda/check.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"
#endif

namespace {
int g_back_to_back = 10;

// Measured on the H200 (the project's shared/GPU.md, outside this repository).
constexpr double kPeakTflops = 765.0;  // FP16 dense matmul
constexpr double kPeakGBps = 4200.0;   // device-to-device copy, read + write

struct Timing {
  double single = 0, b2b = 0;  // median ms per call: one call alone, N calls back to back
};

struct Row {
  std::string op, shape;
  Timing ms;
  double flops = 0;  // 0 for memory-bound rows
  double bytes = 0;
};

#ifdef KILN_WITH_CUDA
using namespace kiln;


// Median ms over `repeat` samples of `calls` calls each, divided by `calls`.
double median_ms(const std::function<void()>& fn, int repeat, int calls, cudaEvent_t a,
                 cudaEvent_t b) {
  cudaStream_t s = cuda::current_stream();
  std::vector<float> t;
  for (int i = 0; i < repeat; ++i) {
    CUDA_CHECK(cudaEventRecord(a, s));
    for (int c = 0; c < calls; ++c) fn();
    CUDA_CHECK(cudaEventRecord(b, s));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms / float(calls));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

Timing time_ms(const std::function<void()>& fn, int repeat) {
  for (int i = 0; i < 5; ++i) fn();
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  Timing r;
  r.single = median_ms(fn, repeat, 1, a, b);
  r.b2b = median_ms(fn, repeat, g_back_to_back, a, b);
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  return r;
}

struct ConvShape {
  int64_t cin, cout, k, stride, hw;  // hw: input spatial size
};

std::vector<ConvShape> resnet50_convs() {
  std::vector<ConvShape> v = {{3, 64, 7, 2, 224}};
  struct Stage { int64_t in, mid, out, hw, stride; };
  // stage: first block's input channels, bottleneck width, output channels, input size, stride
  for (Stage s : {Stage{64, 64, 256, 56, 1}, Stage{256, 128, 512, 56, 2},
                  Stage{512, 256, 1024, 28, 2}, Stage{1024, 512, 2048, 14, 2}}) {
    int64_t out_hw = s.hw / s.stride;
    v.push_back({s.in, s.mid, 1, 1, s.hw});            // first block conv1
    v.push_back({s.mid, s.mid, 3, s.stride, s.hw});    // first block conv2 (v1.5 stride)
    v.push_back({s.mid, s.out, 1, 1, out_hw});         // conv3
    v.push_back({s.in, s.out, 1, s.stride, s.hw});     // downsample
    v.push_back({s.out, s.mid, 1, 1, out_hw});         // later blocks conv1
    if (s.stride != 1) v.push_back({s.mid, s.mid, 3, 1, out_hw});  // later blocks conv2
  }
  return v;
}

// filter: when not empty, only the convolution rows whose shape contains it.
std::vector<Row> bench_ops(int64_t batch, DType dt, int repeat, const std::string& filter) {
  std::vector<Row> rows;
  const TensorOptions o = TensorOptions(dt).with_device(Device::cuda(0));
  const TensorOptions nhwc = o.with_memory_format(MemoryFormat::ChannelsLast);
  const double es = double(dtype_size(dt));
  NoGradGuard ng;
  for (const ConvShape& c : resnet50_convs()) {
    const int64_t pad = c.k / 2, out = (c.hw + 2 * pad - c.k) / c.stride + 1;
    char shape[96];
    std::snprintf(shape, sizeof shape, "%ldx%ldx%ld %ldx%ld/%ld -> %ld", long(c.cin), long(c.hw),
                  long(c.hw), long(c.k), long(c.k), long(c.stride), long(c.cout));
    if (!filter.empty() && std::string(shape).find(filter) == std::string::npos) continue;
    Tensor x = randn({batch, c.cin, c.hw, c.hw}, nhwc);
    Tensor w = randn({c.cout, c.cin, c.k, c.k}, nhwc);
    Tensor y = empty({batch, c.cout, out, out}, nhwc);
    Tensor dx = empty_like(x), dw = empty_like(w);
    ConvParams p;
    p.stride_h = p.stride_w = c.stride;
    p.pad_h = p.pad_w = pad;
    const double flops = 2.0 * double(batch * c.cout * out * out) * double(c.cin * c.k * c.k);
    rows.push_back({"conv fwd", shape,
                    time_ms([&] { cuda::conv2d_forward(y, x, w, Tensor(), p); }, repeat), flops});
    rows.push_back({"conv dgrad", shape,
                    time_ms([&] { cuda::conv2d_backward_data(dx, y, w, p); }, repeat), flops});
    rows.push_back({"conv wgrad", shape,
                    time_ms([&] { cuda::conv2d_backward_weight(dw, y, x, p); }, repeat), flops});
  }
  if (!filter.empty()) return rows;
  // Batch norm (training) at each distinct activation size of ResNet-50.
  for (auto [ch, hw] : std::vector<std::pair<int64_t, int64_t>>{
           {64, 112}, {64, 56}, {256, 56}, {128, 28}, {512, 28}, {256, 14}, {1024, 14},
           {512, 7}, {2048, 7}}) {
    Tensor x = randn({batch, ch, hw, hw}, nhwc), y = empty_like(x), dx = empty_like(x);
    TensorOptions f = TensorOptions(DType::f32).with_device(Device::cuda(0));
    Tensor wgt = ones({ch}, f), bias = zeros({ch}, f), rm = zeros({ch}, f), rv = ones({ch}, f);
    Tensor sm = empty({ch}, f), si = empty({ch}, f), dwt = empty({ch}, f), db = empty({ch}, f);
    const double n = double(x.numel()) * es;
    std::string shape = std::to_string(ch) + "x" + std::to_string(hw) + "x" + std::to_string(hw);
    rows.push_back({"bn fwd", shape, time_ms([&] {
                      cuda::batch_norm_forward_training(y, sm, si, x, wgt, bias, rm, rv, 0.1, 1e-5);
                    }, repeat), 0, 2 * n});
    rows.push_back({"bn bwd", shape, time_ms([&] {
                      cuda::batch_norm_backward(dx, dwt, db, y, x, wgt, sm, si);
                    }, repeat), 0, 3 * n});
  }
  {
    Tensor x = randn({batch, 64, 112, 112}, nhwc), y = empty({batch, 64, 56, 56}, nhwc);
    Tensor dx = empty_like(x);
    PoolParams p;
    p.kernel_h = p.kernel_w = 3;
    p.stride_h = p.stride_w = 2;
    p.pad_h = p.pad_w = 1;
    Tensor idx = empty(y.shape(), TensorOptions(max_pool2d_indices_dtype(p))
                                      .with_device(Device::cuda(0))
                                      .with_memory_format(MemoryFormat::ChannelsLast));
    const double n = double(x.numel() + y.numel()) * es;
    const double ib = double(idx.numel()) * double(dtype_size(idx.dtype()));
    // fwd: reads x, writes y and the indices; bwd: reads dy and the indices, writes dx.
    rows.push_back({"maxpool fwd", "64x112x112 3x3/2",
                    time_ms([&] { cuda::max_pool2d_forward(y, idx, x, p); }, repeat), 0, n + ib});
    rows.push_back({"maxpool bwd", "64x112x112 3x3/2",
                    time_ms([&] { cuda::max_pool2d_backward(dx, y, idx, p); }, repeat), 0,
                    n + ib});
  }
  {
    Tensor x = randn({batch, 2048, 7, 7}, nhwc), y = empty({batch, 2048, 1, 1}, nhwc);
    Tensor dx = empty_like(x);
    const double n = double(x.numel() + y.numel()) * es;
    rows.push_back({"avgpool fwd", "2048x7x7",
                    time_ms([&] { cuda::adaptive_avg_pool2d_forward(y, x); }, repeat), 0, n});
    rows.push_back({"avgpool bwd", "2048x7x7",
                    time_ms([&] { cuda::adaptive_avg_pool2d_backward(dx, y); }, repeat), 0, n});
  }
  {
    Tensor x = randn({batch, 2048}, o), w = randn({1000, 2048}, o), b = randn({1000}, o);
    Tensor y = empty({batch, 1000}, o), dx = empty_like(x), dw = empty_like(w), db = empty_like(b);
    const double flops = 2.0 * double(batch) * 2048 * 1000;
    rows.push_back({"linear fwd", "2048 -> 1000",
                    time_ms([&] { cuda::linear_forward(y, x, w, b); }, repeat), flops});
    rows.push_back({"linear bwd", "2048 -> 1000",
                    time_ms([&] { cuda::linear_backward(dx, dw, db, y, x, w); }, repeat),
                    2 * flops});
  }
  {
    Tensor logits = randn({batch, 1000}, o), grad = empty_like(logits);
    Tensor target = randint(0, 1000, {batch}, TensorOptions(DType::i64).with_device(Device::cuda(0)));
    TensorOptions dev = TensorOptions().with_device(Device::cuda(0));
    Tensor loss = empty({}, dev), correct = empty({}, dev.with_dtype(DType::i64));
    rows.push_back({"softmax-CE fwd+bwd", "1000 classes", time_ms([&] {
                      cuda::cross_entropy_fused(loss, grad, correct, logits, target, 0.0, 1.0);
                    }, repeat), 0, 2.0 * double(logits.numel()) * es});
  }
  return rows;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  return kiln::cli::run_tool("kiln-bench", [&]() -> int {
    int64_t batch = 256;
    std::string dtype = "f16", json_path;
    int repeat = 20;
    std::string model;
    int nproc = 1;
    bool ops = false, eager_only = false, graph_only = false, any_conv = false;
    kiln::bench::ModelBenchOptions mo;
    kiln::cli::Parser p(
        "kiln-bench",
        "--model NAME [--batches B1,B2,...] [--eager-only|--graph-only] [--json PATH]\n"
        "       kiln-bench --model NAME --verify-graph [--batches B1,...] [--verify-steps K]\n"
        "       kiln-bench --ops [-b BATCH] [--dtype f16|f32] [--repeat N] [--back-to-back N]\n"
        "                        [--ops-filter TEXT]",
        "Speed of kiln on the GPU, as a table and JSON.");
    p.version(kiln::version_line("kiln-bench"));
    p.value("--model", "NAME", &model,
            "per-step training throughput of a model (resnet18 ... resnet152,\n"
            "vit_s_16, vit_b_16) on synthetic data, mixed precision, eager and\n"
            "whole-step CUDA graph (ResNets: SGD; ViTs: AdamW)");
    std::string precision = "f16";
    p.choice("--precision", &precision, {"f16", "bf16"},
             "with --model: f16 with the loss scaler, or bf16 without");
    p.list("--batches", "B1,B2,...", &mo.batches, "batch sizes for --model", 1);
    p.flag("--eager-only", &eager_only, "with --model: eager rows only");
    p.flag("--graph-only", &graph_only, "with --model: CUDA-graph rows only");
    p.flag("--profile", &mo.profile, "with --model: per-op GPU time table of a few eager steps");
    p.flag("--profile-by-input", &mo.profile_by_input,
           "with --profile: also a row per op and input shape");
    p.value("--trace-kernels", "PATH", &mo.trace_path,
            "with --model, one batch, graph rows: after timing, replay the step\n"
            "3 times with every kernel's start and end recorded (CUPTI; nothing\n"
            "serialised) and write them to PATH as CSV (summary:\n"
            "tools/bench/kernel_trace_summary.py)");
    p.flag("--trace-back-to-back", &mo.trace_back_to_back,
           "with --trace-kernels: 10 replays issued back to back, as the\n"
           "timing issues them (no sync between), and the gaps between them");
    p.value("--nproc", "N", &nproc,
            "with --model: data-parallel over N local GPUs (batch per GPU);\n"
            "under torchrun, mpirun or srun leave it out (README: launching)",
            1);
    p.flag("--verify-graph", &mo.verify_graph,
           "with --model: K eager steps against K whole-step CUDA graph\n"
           "steps (3 warm-up, capture, replays) per batch, deterministic\n"
           "convolutions; compares loss, loss scale, skips, parameters,\n"
           "buffers, gradients and optimizer state bitwise after every step;\n"
           "exit status 0 only when all are equal");
    p.value("--verify-steps", "K", &mo.verify_steps,
            "steps per side for --verify-graph (3 warm-up steps, a capture, a replay)", 5);
    p.flag("--verify-any-conv", &any_conv,
           "--verify-graph with bench's (fastest, not necessarily\n"
           "deterministic) convolutions: compare loss scale and skips, not bits");
    p.flag("--ops", &ops, "per-op benchmark of ResNet-50's layers (the default without --model)");
    p.value("-b, --batch-size", "BATCH", &batch, "batch size for --ops", 1);
    p.choice("--dtype", &dtype, {"f16", "f32"}, "data type for --ops");
    std::string ops_filter;
    p.value("--ops-filter", "TEXT", &ops_filter,
            "with --ops: only the convolution rows whose shape contains TEXT");
    p.value("--repeat", "N", &repeat, "timed repetitions per op, median reported", 1);
    p.value("--back-to-back", "N", &g_back_to_back, "calls per sample in the b2b column", 1);
    p.value("--json", "PATH", &json_path, "also write the rows as JSON");
    if (!p.parse(argc, argv)) {
      std::fputs(p.info().c_str(), stdout);
      return 0;
    }
    if (eager_only && graph_only)
      kiln::cli::usage_error("--eager-only and --graph-only exclude each other");
    if (eager_only) mo.graph = false;
    if (graph_only) mo.eager = false;
    if (any_conv) mo.verify_deterministic = false;
    if (ops && !model.empty()) kiln::cli::usage_error("--ops and --model exclude each other");
    if (nproc > 1 && model.empty()) kiln::cli::usage_error("--nproc needs --model");
    if (mo.profile_by_input && !mo.profile)
      kiln::cli::usage_error("--profile-by-input needs --profile");
    if (mo.trace_back_to_back) {
      if (mo.trace_path.empty())
        kiln::cli::usage_error("--trace-back-to-back needs --trace-kernels PATH");
      mo.trace_steps = 10;
    }
    if (!mo.trace_path.empty()) {
      if (model.empty()) kiln::cli::usage_error("--trace-kernels needs --model NAME");
      if (eager_only)
        kiln::cli::usage_error("--trace-kernels traces the graph rows; drop --eager-only");
      if (mo.batches.size() != 1)
        kiln::cli::usage_error("--trace-kernels writes one file: give one batch size with "
                               "--batches, got ", mo.batches.size());
      if (!kiln::bench::kernel_trace_available())
        kiln::cli::usage_error("--trace-kernels: this kiln-bench was built without CUPTI (the "
                               "CUDA toolkit's libcupti was not found at configure time)");
    }
    if (kiln::plan_local_launch(nproc, kiln::DistEnv::from_env(), kiln::cuda_device_count())) {
      // One child per GPU running these flags minus --nproc; the children see WORLD_SIZE.
      std::vector<std::string> args{"/proc/self/exe"};
      for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--nproc") {
          ++i;
          continue;
        }
        if (a.rfind("--nproc=", 0) == 0) continue;
        args.push_back(a);
      }
      kiln::LaunchResult r = kiln::launch_processes(args, {.nproc = nproc});
      if (!r.ok()) std::fprintf(stderr, "kiln-bench: %s\n", r.message.c_str());
      return r.exit_code;
    }
    if (mo.verify_graph && model.empty())
      kiln::cli::usage_error("--verify-graph needs --model NAME");
    if (!model.empty()) {
      kiln::cli::user_input("--model: ", [&] { return kiln::models::family_of(model); });
      mo.model = model;
      mo.image_size = kiln::models::default_image_size(model);
      mo.precision = precision == "bf16" ? kiln::amp::Precision::MixedBF16
                                         : kiln::amp::Precision::Mixed16;
      // 0 when unknown: the rows then report MFU 0 rather than ResNet-50's count.
      mo.gflop_per_image = kiln::models::train_gflop_per_image(model);
#ifdef KILN_WITH_CUDA
      if (kiln::cuda::device_count() == 0)
        kiln::cli::usage_error(mo.verify_graph ? "--verify-graph" : "--model",
                               " runs on a CUDA device, and no CUDA device is visible");
#endif
      if (mo.verify_graph) return kiln::bench::verify_graph(mo) ? 0 : 1;
      auto rows = kiln::bench::bench_model(mo);
      if (!json_path.empty() && kiln::DistEnv::from_env().rank == 0) {
        kiln::write_file_atomic(json_path, kiln::bench::rows_json(rows));
        std::printf("wrote %s\n", json_path.c_str());
      }
      return 0;
    }
#ifdef KILN_WITH_CUDA
    if (kiln::cuda::device_count() == 0)
      kiln::cli::usage_error("--ops times CUDA kernels, and no CUDA device is visible");
    auto rows = bench_ops(batch, dtype == "f16" ? kiln::DType::f16 : kiln::DType::f32, repeat,
                          ops_filter);
    std::printf("%-20s %-28s %10s %10s %10s %8s\n", "op", "shape", "single ms", "b2b ms",
                "TFLOP/s", "% peak");
    std::string json = "[";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      auto rate_of = [&](double ms) {
        return r.flops > 0 ? r.flops / (ms * 1e-3) / 1e12 : r.bytes / (ms * 1e-3) / 1e9;
      };
      const double peak = r.flops > 0 ? kPeakTflops : kPeakGBps;
      const double rate = rate_of(r.ms.b2b), pct = 100.0 * rate / peak;
      const double rate1 = rate_of(r.ms.single), pct1 = 100.0 * rate1 / peak;
      std::printf("%-20s %-28s %10.4f %10.4f %10.1f%s %6.1f%%\n", r.op.c_str(), r.shape.c_str(),
                  r.ms.single, r.ms.b2b, rate, r.flops > 0 ? "" : " GB/s", pct);
      const char* unit = r.flops > 0 ? "tflops" : "gbps";
      char buf[512];
      std::snprintf(buf, sizeof buf,
                    "%s{\"op\":%s,\"shape\":%s,\"ms\":%.5f,\"%s\":%.2f,\"pct_peak\":%.2f,"
                    "\"ms_b2b\":%.5f,\"%s_b2b\":%.2f,\"pct_peak_b2b\":%.2f,\"b2b_calls\":%d}",
                    i ? "," : "", kiln::json::quote(r.op).c_str(),
                    kiln::json::quote(r.shape).c_str(), r.ms.single, unit, rate1, pct1, r.ms.b2b,
                    unit, rate, pct, g_back_to_back);
      json += buf;
    }
    json += "]\n";
    if (!json_path.empty()) {
      std::ofstream(json_path) << json;
      std::printf("wrote %s\n", json_path.c_str());
    }
    return 0;
#else
    kiln::cli::usage_error("kiln-bench measures the GPU backend, and this kiln was built without CUDA");
#endif
  });
}
