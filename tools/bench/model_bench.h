#pragma once
// kiln-bench --model: end-to-end training throughput (see model_bench.cpp).
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::bench {

struct ModelBenchOptions {
  std::string model = "resnet50";
  std::vector<int64_t> batches = {32, 64, 128, 256};
  int64_t image_size = 224;
  bool eager = true, graph = true;
  bool profile = false;  // after the eager rows: a per-op table of a few eager steps
  int warmup = 8, windows = 5, steps_per_window = 10;
  double gflop_per_image = 24.3;  // ResNet-50 forward + backward at 224x224
  double peak_tflops = 765.0;     // measured FP16 dense matmul on the H200
};

struct ModelRow {
  std::string model, mode;
  int64_t batch = 0;
  double step_ms = 0, images_per_s = 0, mfu = 0, host_ms = 0;
  double peak_allocated_gib = 0, reserved_gib = 0, final_scale = 0;
  int64_t skipped_steps = 0, total_steps = 0;  // loss-scaler skips over the row's steps
  int gpus = 1;  // data-parallel ranks; batch is per GPU, images_per_s over all of them
};

std::vector<ModelRow> bench_model(const ModelBenchOptions& opts);
std::string rows_json(const std::vector<ModelRow>& rows);

}  // namespace kiln::bench
