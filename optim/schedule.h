#pragma once
// Learning-rate schedules as pure functions of a step counter t = 0, 1, 2, ... The unit of t
// is the caller's: call apply(opt, t) once per iteration with everything counted in
// iterations, or once per epoch with everything counted in epochs. Being stateless, a
// schedule resumes from a checkpoint by calling apply with the saved t.
//
// factor(t) multiplies each group's initial_lr. Linear warmup over W steps (W = 0: none) gives
//   factor(t) = start_factor + (1 - start_factor)·t/W          for t < W
// (PyTorch's LinearLR: start_factor at t = 0, the full lr from t = W on), then the schedule:
//   StepLR:      gamma^floor(t / step_size)
//   MultiStepLR: gamma^(number of milestones <= t)
//   CosineLR:    min_factor + (1 - min_factor)·(1 + cos(π·(t - W)/(T - W)))/2 for W <= t < T,
//                min_factor for t >= T
//   LinearLR:    1 + (end_factor - 1)·(t - W)/(T - W) for W <= t < T, end_factor for t >= T
//                (with warmup, the triangle of one-cycle schedules: up, then straight down)
// Step and multi-step milestones count from t = 0 (warmup included), as in Goyal et al.'s
// "warmup 5 epochs, decay at 30, 60, 80"; the cosine anneals over the steps after warmup.
#include <cstdint>
#include <vector>

#include "optim/optimizer.h"

namespace kiln::optim {

struct Warmup {
  int64_t steps = 0;          // W
  double start_factor = 0.0;  // factor at t = 0, in [0, 1]
};

class LRSchedule {
 public:
  explicit LRSchedule(Warmup warmup);
  virtual ~LRSchedule() = default;
  // Multiplier of the base lr at step t (t >= 0).
  double factor(int64_t t) const;
  double lr(int64_t t, double base_lr) const { return base_lr * factor(t); }
  // Sets every group's lr to initial_lr · factor(t).
  void apply(Optimizer& opt, int64_t t) const;
  const Warmup& warmup() const { return warmup_; }

 protected:
  // The schedule after warmup (called for t >= W).
  virtual double main_factor(int64_t t) const = 0;

 private:
  Warmup warmup_;
};

class StepLR : public LRSchedule {
 public:
  StepLR(int64_t step_size, double gamma = 0.1, Warmup warmup = {});

 protected:
  double main_factor(int64_t t) const override;

 private:
  int64_t step_size_;
  double gamma_;
};

class MultiStepLR : public LRSchedule {
 public:
  MultiStepLR(std::vector<int64_t> milestones, double gamma = 0.1, Warmup warmup = {});

 protected:
  double main_factor(int64_t t) const override;

 private:
  std::vector<int64_t> milestones_;  // sorted
  double gamma_;
};

class CosineLR : public LRSchedule {
 public:
  // total_steps T > W.
  CosineLR(int64_t total_steps, double min_factor = 0.0, Warmup warmup = {});

 protected:
  double main_factor(int64_t t) const override;

 private:
  int64_t total_;
  double min_factor_;
};

class LinearLR : public LRSchedule {
 public:
  // total_steps T > W, end_factor >= 0.
  LinearLR(int64_t total_steps, double end_factor = 0.0, Warmup warmup = {});

 protected:
  double main_factor(int64_t t) const override;

 private:
  int64_t total_;
  double end_factor_;
};

}  // namespace kiln::optim
