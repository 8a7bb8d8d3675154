// CPU reference of the fused optimizer kernels (and the CPU path of FusedSGD/FusedAdamW and the
// loss scaler). Chunks are visited in order; within a chunk elements go in order, so results
// are deterministic. The formulas live in core/fused_optim.h.
#include <cmath>

#include "core/fused_optim.h"

namespace kiln::fused::ref {
namespace {

float load(const uint8_t* base, DType t, int64_t i) {
  switch (t) {
    case DType::f16: return float(reinterpret_cast<const Half*>(base)[i]);
    case DType::bf16: return float(reinterpret_cast<const BFloat16*>(base)[i]);
    default: return reinterpret_cast<const float*>(base)[i];
  }
}

void store(void* base, DType t, int64_t i, float v) {
  switch (t) {
    case DType::f16: static_cast<Half*>(base)[i] = Half(v); break;
    case DType::bf16: static_cast<BFloat16*>(base)[i] = BFloat16(v); break;
    default: static_cast<float*>(base)[i] = v; break;
  }
}

bool skipped(const GradScaling& s) { return s.found_inf && *s.found_inf != 0.0f; }

// Calls f(slot, group, element index in the slot, gradient) for every element, chunk by chunk.
template <typename F>
void sweep(const StepArgs& a, F&& f) {
  bool apply = false;
  const float mul = grad_multiplier(a.scaling, apply);
  for (int64_t c = 0; c < a.table.num_chunks; ++c) {
    const Chunk ch = a.table.chunks[c];
    const Slot& s = a.table.slots[ch.slot];
    const uint8_t* g = a.grads + s.grad;
    f.begin(s);
    for (int64_t i = ch.begin; i < ch.end; ++i) {
      float gi = load(g, s.dtype, i);
      if (apply) gi = mul_rn(gi, mul);
      f(s, i, gi);
    }
  }
}

}  // namespace

void check_grads(const CheckArgs& a) {
  for (int64_t c = 0; c < a.table.num_chunks; ++c) {
    const Chunk ch = a.table.chunks[c];
    const Slot& s = a.table.slots[ch.slot];
    float sum = 0.0f;
    bool bad = false;
    for (int64_t i = ch.begin; i < ch.end; ++i) {
      const float g = load(a.grads + s.grad, s.dtype, i);
      bad |= !std::isfinite(g);
      sum = muladd(g, g, sum);
    }
    if (bad) *a.found_inf = 1.0f;
    a.partial_sumsq[c] = sum;
  }
}

void clip_coef(const float* partial, int64_t n, const float* scale, float max_norm, float* norm,
               float* coef) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += double(partial[i]);
  double nrm = std::sqrt(sum);
  if (scale) nrm /= double(*scale);
  *norm = float(nrm);
  *coef = clip_coefficient(*norm, max_norm);
}

void step_begin(int32_t* step, const float* found_inf) {
  if (!found_inf || *found_inf == 0.0f) *step += 1;
}

void sgd_step(const StepArgs& a) {
  if (skipped(a.scaling)) return;
  struct {
    const StepArgs& a;
    SGDScalars s{};
    void begin(const Slot& slot) {
      s = sgd_scalars(a.table.groups[slot.group], a.table.lr[slot.group], *a.step);
    }
    void operator()(const Slot& slot, int64_t i, float g) {
      float& p = a.master[slot.master + i];
      float dummy = 0.0f;
      float& buf = a.state0 ? a.state0[slot.master + i] : dummy;
      sgd_update(p, buf, g, s);
      store(slot.param, slot.dtype, i, p);
    }
  } f{a};
  sweep(a, f);
}

void adamw_step(const StepArgs& a) {
  if (skipped(a.scaling)) return;
  struct {
    const StepArgs& a;
    AdamWScalars s{};
    void begin(const Slot& slot) {
      s = adamw_scalars(a.table.groups[slot.group], a.table.lr[slot.group], *a.step);
    }
    void operator()(const Slot& slot, int64_t i, float g) {
      const int64_t k = slot.master + i;
      adamw_update(a.master[k], a.state0[k], a.state1[k], g, s);
      store(slot.param, slot.dtype, i, a.master[k]);
    }
  } f{a};
  sweep(a, f);
}

void update_scale(const ScalerArgs& a) { scaler_update(a); }

}  // namespace kiln::fused::ref
