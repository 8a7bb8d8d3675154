#include "optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace kiln::optim {

LRSchedule::LRSchedule(Warmup warmup) : warmup_(warmup) {
  KILN_CHECK(warmup.steps >= 0 && warmup.start_factor >= 0.0 && warmup.start_factor <= 1.0,
             "LR schedule: warmup needs steps >= 0 and start_factor in [0, 1], got steps ",
             warmup.steps, ", start_factor ", warmup.start_factor);
}

double LRSchedule::factor(int64_t t) const {
  KILN_CHECK(t >= 0, "LR schedule: step must be >= 0, got ", t);
  if (t < warmup_.steps) {
    const double s = warmup_.start_factor;
    return s + (1.0 - s) * double(t) / double(warmup_.steps);
  }
  return main_factor(t);
}

void LRSchedule::apply(Optimizer& opt, int64_t t) const {
  const double f = factor(t);
  for (ParamGroup& g : opt.param_groups) g.lr = g.initial_lr * f;
}

StepLR::StepLR(int64_t step_size, double gamma, Warmup warmup)
    : LRSchedule(warmup), step_size_(step_size), gamma_(gamma) {
  KILN_CHECK(step_size > 0, "StepLR: step_size must be > 0, got ", step_size);
}

double StepLR::main_factor(int64_t t) const { return std::pow(gamma_, double(t / step_size_)); }

MultiStepLR::MultiStepLR(std::vector<int64_t> milestones, double gamma, Warmup warmup)
    : LRSchedule(warmup), milestones_(std::move(milestones)), gamma_(gamma) {
  std::sort(milestones_.begin(), milestones_.end());
}

double MultiStepLR::main_factor(int64_t t) const {
  auto passed = std::upper_bound(milestones_.begin(), milestones_.end(), t) - milestones_.begin();
  return std::pow(gamma_, double(passed));
}

CosineLR::CosineLR(int64_t total_steps, double min_factor, Warmup warmup)
    : LRSchedule(warmup), total_(total_steps), min_factor_(min_factor) {
  KILN_CHECK(total_steps > warmup.steps, "CosineLR: total_steps (", total_steps,
             ") must exceed the warmup steps (", warmup.steps, ")");
}

double CosineLR::main_factor(int64_t t) const {
  if (t >= total_) return min_factor_;
  const int64_t w = warmup().steps;
  const double progress = double(t - w) / double(total_ - w);
  return min_factor_ + (1.0 - min_factor_) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

LinearLR::LinearLR(int64_t total_steps, double end_factor, Warmup warmup)
    : LRSchedule(warmup), total_(total_steps), end_factor_(end_factor) {
  KILN_CHECK(total_steps > warmup.steps, "LinearLR: total_steps (", total_steps,
             ") must exceed the warmup steps (", warmup.steps, ")");
  KILN_CHECK(end_factor >= 0.0, "LinearLR: end_factor must be >= 0, got ", end_factor);
}

double LinearLR::main_factor(int64_t t) const {
  if (t >= total_) return end_factor_;
  const int64_t w = warmup().steps;
  return 1.0 + (end_factor_ - 1.0) * double(t - w) / double(total_ - w);
}

}  // namespace kiln::optim
