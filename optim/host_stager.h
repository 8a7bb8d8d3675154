#pragma once
// Host values copied into device memory on the current stream without the host waiting for the
// device: the learning rates a scheduled step reads (FusedOptimizer's, Muon's). Each stage goes
// through one of kSlots pinned host slots in turn, and a slot is rewritten only after the copy
// that last read it has run (an event, practically always already done). On the CPU the values
// are written directly.
#include <cstddef>
#include <memory>

#include "core/tensor.h"

namespace kiln::optim {

class HostStager {
 public:
  // Stages of `count` f64 values into f64 device tensors of `count` elements.
  explicit HostStager(size_t count);
  ~HostStager();
  HostStager(const HostStager&) = delete;
  HostStager& operator=(const HostStager&) = delete;
  // dst[0..count) = values[0..count), on the current stream for a CUDA dst. Not while capturing
  // a CUDA graph (the slot could be rewritten before the replay reads it): stage before replays.
  void stage(const double* values, const Tensor& dst);

 private:
  struct Ring;
  size_t count_;
  std::unique_ptr<Ring> ring_;
};

}  // namespace kiln::optim
