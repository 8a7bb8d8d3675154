#pragma once
// An exponential moving average of a model's weights, and lookahead built on it: the CIFAR-10
// speedruns train with "lookahead" (every k steps the average moves toward the weights, then the
// weights jump to the average), and the average of a run's last steps often evaluates better
// than its last weights.
//
//   optim::WeightAverage avg(model, &opt);              // after prepare_model and the optimizer
//   ... every 5 steps: avg.update(decay); avg.pull();   // lookahead
//   ... at the end:    avg.pull();                      // evaluate the average
//
// It tracks every floating parameter and buffer (batch-norm running statistics included; integer
// buffers such as num_batches_tracked are left alone), each as an f32 tensor on its device,
// starting from the current values. With a FusedOptimizer, the parameters it updates are read
// from its f32 master copy (the exact values, not their f16 rounding) and pull() writes both the
// master and the parameter, so the next step continues from the average.
//
// Every call queues device work on the current stream and never waits for it; decay is a host
// value, so update() is called eagerly (between replays of a captured step, not inside one).
#include <string>
#include <utility>
#include <vector>

#include "models/module.h"
#include "optim/fused.h"

namespace kiln::optim {

class WeightAverage {
 public:
  // `model` (and `opt` when given) must outlive the average and keep their tensors.
  explicit WeightAverage(nn::Module& model, FusedOptimizer* opt = nullptr);

  // avg = decay · avg + (1 − decay) · current, for every tracked tensor; decay in [0, 1].
  void update(double decay);
  // current = avg: parameters and buffers (rounded to their dtype), and the optimizer's masters.
  void pull();
  // The averages by the model's names (parameters, then buffers), f32.
  std::vector<std::pair<std::string, Tensor>> averages() const;

 private:
  struct Entry {
    std::string name;
    Tensor target;  // the model's parameter or buffer
    Tensor master;  // its FusedOptimizer master (f32 view), or undefined
    Tensor avg;     // f32
    const Tensor& current() const { return master.defined() ? master : target; }
  };
  std::vector<Entry> entries_;
};

}  // namespace kiln::optim
