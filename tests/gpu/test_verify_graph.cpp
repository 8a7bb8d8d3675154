// The check behind "a replayed whole-step CUDA graph is bit-identical to eager steps"
// (kiln-bench --model NAME --verify-graph, tools/bench/verify_graph.cpp), on real models at a
// small batch: ResNet-50 (SGD, f16 with the loss scaler, deterministic convolutions) and
// vit_s_16 (AdamW, dropout 0.1 drawing fresh masks inside the graph). Every parameter, buffer,
// gradient, optimizer and scaler state and the loss must be equal bit for bit after every step.
#include <doctest/doctest.h>

#include "tools/bench/model_bench.h"

using namespace kiln;

TEST_CASE("verify_graph: ResNet-50, eager steps and graph replays bit for bit") {
  bench::ModelBenchOptions o;
  o.model = "resnet50";
  o.batches = {8};
  o.verify_steps = 6;
  CHECK(bench::verify_graph(o));
}

TEST_CASE("verify_graph: vit_s_16 with dropout, f16 and bf16") {
  for (amp::Precision p : {amp::Precision::Mixed16, amp::Precision::MixedBF16}) {
    bench::ModelBenchOptions o;
    o.model = "vit_s_16";
    o.batches = {8};
    o.verify_steps = 6;
    o.precision = p;
    CHECK(bench::verify_graph(o));
  }
}
