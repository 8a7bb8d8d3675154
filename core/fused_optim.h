#pragma once
// The contract of the fused optimizer's kernels, shared by the CPU reference
// (ops/cpu/fused_optim.cpp, also the CPU path) and the CUDA kernels (cuda/kernels/optim.cu): plain
// structs of pointers into the arenas and the per-element update formulas, written once here
// so both backends do the same f32 arithmetic in the same order.
//
// Arenas (owned by optim::FusedOptimizer): masters and optimizer state are f32 arrays indexed
// by Slot::master + i; gradients are a byte arena where slot s holds numel elements of the
// parameter's dtype at byte offset Slot::grad. Element i of a slot is element i of the
// parameter's memory (the parameter is dense; its gradient view has the same strides).
// One kernel launch sweeps every Chunk (a slice of one slot), so all parameters are updated
// by one launch whatever their number.
//
// The formulas round after every operation, in the reference optimizers' order, so the CPU path
// equals optim::SGD/AdamW bit for bit and the CUDA kernels equal the CPU path bit for bit, on
// any CPU (see "per-element arithmetic" below).
#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "core/hostdevice.h"

namespace kiln::fused {

inline constexpr int64_t kChunk = 2048;         // elements per work item (one CUDA block)
inline constexpr int64_t kArenaAlignBytes = 64;  // slot offsets, in every arena

struct Slot {
  int64_t master = 0;  // element offset in the f32 master and state arenas
  int64_t grad = 0;    // byte offset in the gradient arena
  int64_t numel = 0;
  void* param = nullptr;  // the parameter's own (dense) data, written after each update
  int32_t group = 0;
  DType dtype = DType::f32;  // the parameter's and its gradient's: f32, f16 or bf16
};

struct Chunk {
  int32_t slot = 0;
  int64_t begin = 0, end = 0;  // elements [begin, end) of the slot
};

// Per-group options that stay fixed between steps (lr is separate: it changes every step).
struct GroupOptions {
  double weight_decay = 0, momentum = 0, dampening = 0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  int32_t nesterov = 0;
};

// All pointers are on the arenas' device (host pointers on the CPU path).
struct Table {
  const Slot* slots = nullptr;
  const Chunk* chunks = nullptr;
  int64_t num_chunks = 0;
  const GroupOptions* groups = nullptr;
  const double* lr = nullptr;  // one per group
};

// How a step reads its gradients: g = float(grad) · ((1/scale) · clip_coef) and nothing at all
// is written when *found_inf != 0. A null pointer means: scale 1, coef 1, never skip.
struct GradScaling {
  const float* scale = nullptr;
  const float* clip_coef = nullptr;
  const float* found_inf = nullptr;
};

struct StepArgs {
  Table table;
  float* master = nullptr;
  float* state0 = nullptr;  // SGD: momentum buffers (null without momentum); AdamW: exp_avg
  float* state1 = nullptr;  // AdamW: exp_avg_sq
  const uint8_t* grads = nullptr;
  GradScaling scaling;
  const int32_t* step = nullptr;  // steps taken, this one included (fused step_begin sets it)
};

// One pass over the gradients: *found_inf = 1 when any is inf/NaN (the caller zeroes it
// first; never reset here), partial_sumsq[c] = Σ g² over chunk c (raw arena values, f32).
struct CheckArgs {
  Table table;
  const uint8_t* grads = nullptr;
  float* found_inf = nullptr;
  float* partial_sumsq = nullptr;  // (num_chunks)
};

// Loss-scaler state (PyTorch GradScaler semantics) and options.
struct ScalerArgs {
  float* scale = nullptr;
  int32_t* growth_tracker = nullptr;
  int32_t* skipped = nullptr;  // steps skipped so far (+= 1 on overflow)
  const float* found_inf = nullptr;
  float growth_factor = 2.0f, backoff_factor = 0.5f;
  int32_t growth_interval = 2000;
};

// ---- per-element arithmetic (identical on both backends) ----
// Every operation rounds on its own, on both backends and on any CPU: the device side through
// the explicit __f*_rn intrinsics (nvcc never contracts those), the host side because kiln's C++
// is compiled with -ffp-contract=off (CMakeLists.txt). The reference optimizers' `a + alpha·b`
// (optim/sgd.cpp, optim/adamw.cpp through the CPU elementwise kernels) is a product and a sum,
// so muladd is too: no FMA anywhere, so the result cannot depend on whether a target has one.
KILN_HD float mul_rn(float a, float b) {  // a·b rounded on its own (never contracted)
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KILN_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
// a·b + c as the reference optimizers compute it: the product rounded, then the sum.
KILN_HD float muladd(float a, float b, float c) { return add_rn(mul_rn(a, b), c); }
KILN_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
KILN_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// The multiplier of raw gradients, or 1 (not applied) when neither is set.
KILN_HD float grad_multiplier(const GradScaling& s, bool& apply) {
  apply = s.scale != nullptr || s.clip_coef != nullptr;
  float m = s.scale ? div_rn(1.0f, *s.scale) : 1.0f;
  if (s.clip_coef) m = mul_rn(m, *s.clip_coef);
  return m;
}

// SGD scalars of one group at one step, rounded to f32 as the reference's scalar ops do.
struct SGDScalars {
  float weight_decay, momentum, one_minus_dampening, neg_lr;
  bool use_wd, use_momentum, nesterov, first;
};
KILN_HD SGDScalars sgd_scalars(const GroupOptions& g, double lr, int32_t step) {
  SGDScalars s;
  s.weight_decay = float(g.weight_decay);
  s.momentum = float(g.momentum);
  s.one_minus_dampening = float(1.0 - g.dampening);
  s.neg_lr = float(-lr);
  s.use_wd = g.weight_decay != 0.0;
  s.use_momentum = g.momentum != 0.0;
  s.nesterov = g.nesterov != 0;
  s.first = step <= 1;
  return s;
}
// torch.optim.SGD, as optim/sgd.cpp: p, buf updated in place.
KILN_HD void sgd_update(float& p, float& buf, float g, const SGDScalars& s) {
  if (s.use_wd) g = muladd(s.weight_decay, p, g);
  if (s.use_momentum) {
    buf = s.first ? g : muladd(s.one_minus_dampening, g, mul_rn(buf, s.momentum));
    g = s.nesterov ? muladd(s.momentum, buf, g) : buf;
  }
  p = muladd(s.neg_lr, g, p);
}

struct AdamWScalars {
  float decay, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, eps, neg_step_size;
  bool use_wd;
};
KILN_HD AdamWScalars adamw_scalars(const GroupOptions& g, double lr, int32_t step) {
  const double t = double(step);
  const double bc1 = 1.0 - pow(g.beta1, t);
  const double bc2_sqrt = sqrt(1.0 - pow(g.beta2, t));
  AdamWScalars s;
#if defined(__CUDA_ARCH__)
  s.decay = float(__dadd_rn(1.0, -__dmul_rn(lr, g.weight_decay)));  // adamw.cpp's 1 - lr·wd
#else
  s.decay = float(1.0 - lr * g.weight_decay);  // two roundings: the host never contracts
#endif
  s.beta1 = float(g.beta1);
  s.one_minus_beta1 = float(1.0 - g.beta1);
  s.beta2 = float(g.beta2);
  s.one_minus_beta2 = float(1.0 - g.beta2);
  s.inv_bc2_sqrt = float(1.0 / bc2_sqrt);
  s.eps = float(g.eps);
  s.neg_step_size = float(-lr / bc1);
  s.use_wd = g.weight_decay != 0.0;
  return s;
}
// torch.optim.AdamW, as optim/adamw.cpp: p, m, v updated in place.
KILN_HD void adamw_update(float& p, float& m, float& v, float g, const AdamWScalars& s) {
  if (s.use_wd) p = mul_rn(p, s.decay);
  m = muladd(s.one_minus_beta1, g, mul_rn(m, s.beta1));
  v = muladd(s.one_minus_beta2, mul_rn(g, g), mul_rn(v, s.beta2));
  const float denom = add_rn(mul_rn(sqrt_rn(v), s.inv_bc2_sqrt), s.eps);
  p = muladd(s.neg_step_size, div_rn(m, denom), p);
}

// PyTorch's _amp_update_scale_: back off and reset on overflow; grow after growth_interval
// clean steps, unless growing would overflow f32 (the scale then stays as it is).
KILN_HD void scaler_update(const ScalerArgs& a) {
  if (*a.found_inf != 0.0f) {
    *a.scale = mul_rn(*a.scale, a.backoff_factor);
    *a.growth_tracker = 0;
    *a.skipped += 1;
    return;
  }
  const int32_t successful = *a.growth_tracker + 1;
  if (successful >= a.growth_interval) {
    const float grown = mul_rn(*a.scale, a.growth_factor);
    if (grown <= 3.402823466e38f) *a.scale = grown;  // finite (NaN fails too)
    *a.growth_tracker = 0;
  } else {
    *a.growth_tracker = successful;
  }
}

// clip coefficient from the total norm (torch.nn.utils.clip_grad_norm_): min(1, max/(norm+1e-6)).
KILN_HD float clip_coefficient(float norm, float max_norm) {
  const float c = div_rn(max_norm, add_rn(norm, 1e-6f));
  return c < 1.0f ? c : 1.0f;
}

// ---- the CPU reference (ops/cpu/fused_optim.cpp); cuda/kernels.h has the same five ----
namespace ref {
void check_grads(const CheckArgs& a);
// *norm = √(Σ partial) / scale (scale null: 1), *coef = clip_coefficient(*norm, max_norm).
void clip_coef(const float* partial, int64_t n, const float* scale, float max_norm, float* norm,
               float* coef);
// *step += 1 unless *found_inf (found_inf may be null).
void step_begin(int32_t* step, const float* found_inf);
void sgd_step(const StepArgs& a);
void adamw_step(const StepArgs& a);
void update_scale(const ScalerArgs& a);
}  // namespace ref

}  // namespace kiln::fused
