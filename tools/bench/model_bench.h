#pragma once
// kiln-bench --model: end-to-end training throughput (see model_bench.cpp), and
// kiln-bench --model --verify-graph: whole-step graph replay against eager steps (verify_graph.cpp).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "models/module.h"
#include "optim/amp.h"
#include "optim/fused.h"
#include "optim/train_step.h"

namespace kiln::bench {

struct ModelBenchOptions {
  std::string model = "resnet50";
  std::vector<int64_t> batches = {32, 64, 128, 256};
  int64_t image_size = 224;
  bool eager = true, graph = true;
  bool profile = false;  // after the eager rows: a per-op table of a few eager steps
  bool profile_by_input = false;  // with profile: also a row per op and input shape
  // After a graph row: that many replays traced kernel by kernel (tools/bench/kernel_trace.h),
  // the records written to trace_path as CSV. Empty: no trace.
  std::string trace_path;
  int trace_steps = 3;
  // The traced replays issued back to back, as the timed windows issue them, with the gaps
  // between them reported (kernel_trace.h).
  bool trace_back_to_back = false;
  int warmup = 8, windows = 5, steps_per_window = 10;
  double gflop_per_image = 24.3;  // forward + backward at 224x224 (models::train_gflop_per_image)
  amp::Precision precision = amp::Precision::Mixed16;  // or MixedBF16 (no loss scaler)
  double dropout = 0.0;  // the ViTs' (torchvision's default 0); verify_graph turns it on
  double peak_tflops = 765.0;     // measured FP16 dense matmul on the H200
  bool verify_graph = false;      // run verify_graph instead of the benchmark
  int verify_steps = 12;          // steps of each side in verify_graph
  bool verify_deterministic = true;  // verify_graph: deterministic cuDNN convolutions
};

struct ModelRow {
  std::string model, mode;
  int64_t batch = 0;
  double step_ms = 0, images_per_s = 0, mfu = 0, host_ms = 0;
  double launch_ms = 0;  // host CPU time to issue one step onto an idle device
  double peak_allocated_gib = 0, reserved_gib = 0, final_scale = 0;
  double peak_reserved_gib = 0;  // since the row began (PyTorch's max_memory_reserved)
  int64_t skipped_steps = 0, total_steps = 0;  // loss-scaler skips over the row's steps
  int gpus = 1;  // data-parallel ranks; batch is per GPU, images_per_s over all of them
};

// One training setup as bench_model measures it: `model` (models::create_model, 1000 classes)
// prepared for `precision` on `device`; ResNets FusedSGD (lr 0.1, momentum 0.9, weight decay
// 5e-5), ViTs FusedAdamW (lr 1e-3, weight decay 0.05), split_weight_decay groups; a
// DynamicLossScaler (enabled for f16 only) and the ClassifierStep over them. Members are
// declared so that destruction runs step, scaler, opt, model.
struct TrainSetup {
  std::shared_ptr<nn::Module> model;
  std::unique_ptr<optim::FusedOptimizer> opt;
  std::unique_ptr<optim::DynamicLossScaler> scaler;
  std::unique_ptr<optim::ClassifierStep> step;
};
TrainSetup make_train_setup(const std::string& model, Device device,
                            amp::Precision precision = amp::Precision::Mixed16,
                            double dropout = 0.0);

std::vector<ModelRow> bench_model(const ModelBenchOptions& opts);

// For each batch of opts.batches: setup A runs opts.verify_steps eager ClassifierStep steps,
// then an identically built setup B runs as many steps through cuda::GraphStep (3 eager
// warm-up steps, one capture, replays), on the same inputs, with deterministic cuDNN
// convolutions (unless !opts.verify_deterministic: then bench_model's algorithms, and only the
// loss / scale / skip columns are meaningful). After every step both sides' parameters, buffers, gradients, optimizer state,
// loss-scaler state and the step's loss are snapshotted on the device (no host synchronisation
// between steps, like bench_model) and compared bitwise afterwards. Prints a per-step table,
// the tensors that differ at the first differing step and after the last, and one verdict line
// per batch. A ViT runs with dropout 0.1, so the check covers fresh masks drawn inside the
// graph. Returns true when every batch matched bitwise. CUDA only (KILN_FAIL otherwise).
bool verify_graph(const ModelBenchOptions& opts);
std::string rows_json(const std::vector<ModelRow>& rows);

}  // namespace kiln::bench
