#include "optim/fused.h"

#include <cstring>

#include "core/autograd.h"
#include "optim/amp.h"
#include "optim/host_stager.h"
#include "core/backend.h"

#ifdef KILN_WITH_CUDA
#include "cuda/check.h"
#include "cuda/runtime.h"
#endif

namespace kiln::optim {

using fused::Chunk;
using fused::GroupOptions;
using fused::Slot;

namespace {

int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

bool same_options(const GroupOptions& a, const GroupOptions& b) {
  return a.weight_decay == b.weight_decay && a.momentum == b.momentum &&
         a.dampening == b.dampening && a.beta1 == b.beta1 && a.beta2 == b.beta2 &&
         a.eps == b.eps && a.nesterov == b.nesterov;
}

#ifdef KILN_WITH_CUDA
bool is_capturing() {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(cuda::current_stream(), &st));
  return st != cudaStreamCaptureStatusNone;
}
#endif

}  // namespace

// Uploads (eager steps, and stage_lr() before a replay) go through a HostStager. A captured
// step copies nothing: its kernels read the device lr array, which stage_lr() refreshes on the
// caller's stream before each replay (a host slot read by the replay itself could be rewritten by
// the host before the replay ran).
FusedOptimizer::FusedOptimizer(std::vector<ParamGroup> groups) : Optimizer(std::move(groups)) {}

FusedOptimizer::~FusedOptimizer() = default;

void FusedOptimizer::build() {
  NoGradGuard no_grad;
  num_state_ = num_state_arenas();
  for (const ParamGroup& g : param_groups)
    for (const Tensor& p : g.params) params_.push_back(p);
  KILN_CHECK(!params_.empty(), name(), ": no parameters");
  device_ = params_[0].device();

  int64_t master_elems = 0, grad_bytes = 0;
  int32_t group = 0;
  size_t i = 0;
  for (const ParamGroup& g : param_groups) {
    for (const Tensor& p : g.params) {
      KILN_CHECK(p.device() == device_, name(), ": parameter ", i, " is ", p.desc(),
                 " but parameter 0 is on ", device_);
      const DType t = p.dtype();
      KILN_CHECK(t == DType::f32 || t == DType::f16 || t == DType::bf16, name(), ": parameter ",
                 i, " is ", p.desc(), "; fused optimizers take f32, f16 or bf16 parameters");
      KILN_CHECK(p.is_contiguous() || p.is_contiguous(MemoryFormat::ChannelsLast), name(),
                 ": parameter ", i, " ", p.desc(), " is not dense (contiguous or channels-last)");
      Slot s;
      s.master = master_elems;
      s.grad = grad_bytes;
      s.numel = p.numel();
      s.group = group;
      s.dtype = t;
      s.param = p.raw_data();
      for (int64_t b = 0; b < s.numel; b += fused::kChunk)
        chunks_.push_back({int32_t(slots_.size()), b, std::min(s.numel, b + fused::kChunk)});
      slots_.push_back(s);
      master_elems += align_up(s.numel, fused::kArenaAlignBytes / 4);
      grad_bytes += align_up(s.numel * int64_t(dtype_size(t)), fused::kArenaAlignBytes);
      ++i;
    }
    ++group;
  }

  const TensorOptions f32 = TensorOptions(DType::f32).with_device(device_);
  master_ = zeros({std::max<int64_t>(master_elems, 1)}, f32);
  grads_ = zeros({std::max<int64_t>(grad_bytes, 1)}, TensorOptions(DType::u8).with_device(device_));
  for (int k = 0; k < num_state_; ++k) state_[k] = zeros_like(master_);
  for (size_t j = 0; j < params_.size(); ++j) {
    const Tensor& p = params_[j];
    master(j).copy_(p);
    Tensor g = grad(j);
    if (p.grad().defined()) g.copy_(p.grad());
    p.set_grad(g);
  }

  // Device table: slots | chunks | group options, each 8-byte aligned.
  for (const ParamGroup& g : param_groups) group_opts_.push_back(group_options(g));
  chunk_bytes_off_ = size_t(align_up(int64_t(slots_.size() * sizeof(Slot)), 8));
  group_bytes_off_ = chunk_bytes_off_ + size_t(align_up(int64_t(chunks_.size() * sizeof(Chunk)), 8));
  const size_t table_bytes = group_bytes_off_ + group_opts_.size() * sizeof(GroupOptions);
  Tensor host = zeros({int64_t(table_bytes)}, DType::u8);
  auto* base = host.data<uint8_t>();
  std::memcpy(base, slots_.data(), slots_.size() * sizeof(Slot));
  std::memcpy(base + chunk_bytes_off_, chunks_.data(), chunks_.size() * sizeof(Chunk));
  std::memcpy(base + group_bytes_off_, group_opts_.data(), group_opts_.size() * sizeof(GroupOptions));
  table_ = host.to(device_);

  lr_ = zeros({int64_t(param_groups.size())}, TensorOptions(DType::f64).with_device(device_));
  step_count_ = zeros({1}, TensorOptions(DType::i32).with_device(device_));
  partials_ = zeros({std::max<int64_t>(num_chunks(), 1)}, f32);
  norm_ = zeros({3}, f32);
  if (device_.is_cuda()) ring_ = std::make_unique<HostStager>(param_groups.size());
}

Tensor FusedOptimizer::master(size_t i) const {
  KILN_CHECK(i < slots_.size(), name(), ": parameter index ", i, " out of range");
  const Tensor& p = params_[i];
  return make_tensor(master_.storage(), slots_[i].master, p.shape(), p.strides(), DType::f32);
}

Tensor FusedOptimizer::grad(size_t i) const {
  KILN_CHECK(i < slots_.size(), name(), ": parameter index ", i, " out of range");
  const Slot& s = slots_[i];
  const Tensor& p = params_[i];
  return make_tensor(grads_.storage(), s.grad / int64_t(dtype_size(s.dtype)), p.shape(),
                     p.strides(), s.dtype);
}

Tensor FusedOptimizer::state(size_t arena, size_t i) const {
  KILN_CHECK(int(arena) < num_state_ && i < slots_.size(), name(), ": no state arena ", arena,
             " / parameter ", i);
  const Tensor& p = params_[i];
  return make_tensor(state_[arena].storage(), slots_[i].master, p.shape(), p.strides(),
                     DType::f32);
}

std::map<std::string, Tensor> FusedOptimizer::state_dict() const {
  std::map<std::string, Tensor> out;
  for (size_t g = 0; g < param_groups.size(); ++g)
    out["group." + std::to_string(g) + ".lr"] = full({}, param_groups[g].lr, DType::f64);
  out["step"] = step_count_;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const std::string prefix = "state." + std::to_string(i) + ".";
    out[prefix + "master"] = master(i);
    for (int k = 0; k < num_state_; ++k) out[prefix + state_key(k)] = state(size_t(k), i);
  }
  return out;
}

// The arenas are live: a partial load could not be undone, so everything is checked first.
void FusedOptimizer::load_state_dict(const std::map<std::string, Tensor>& dict) {
  NoGradGuard no_grad;
  const std::map<std::string, Tensor> live = state_dict();
  for (const auto& [key, t] : dict)
    KILN_CHECK(live.count(key), name(), "::load_state_dict: unexpected key '", key, "'");
  for (const auto& [key, dst] : live) {
    auto it = dict.find(key);
    KILN_CHECK(it != dict.end(), name(), "::load_state_dict: missing key '", key, "'");
    const Tensor& src = it->second;
    KILN_CHECK(src.defined() && (dst.dim() <= 1 ? src.numel() == dst.numel()
                                                : src.shape() == dst.shape()),
               name(), "::load_state_dict: '", key, "' is ", src.desc(), " but the optimizer's is ",
               dst.desc());
    KILN_CHECK(is_floating(src.dtype()) == is_floating(dst.dtype()), name(),
               "::load_state_dict: '", key, "' is ", src.desc(), ", expected ", dst.dtype());
  }
  for (size_t g = 0; g < param_groups.size(); ++g)
    param_groups[g].lr = dict.at("group." + std::to_string(g) + ".lr").item();
  for (const auto& [key, dst] : live) {
    if (key.rfind("group.", 0) == 0) continue;
    const Tensor& src = dict.at(key);
    dst.copy_(dst.dim() <= 1 ? src.reshape(dst.shape()) : src);
  }
}

void FusedOptimizer::zero_grad(bool /*set_to_none*/) {
  NoGradGuard no_grad;
  grads_.zero_();
}

fused::Table FusedOptimizer::table() const {
  const auto* base = static_cast<const uint8_t*>(table_.raw_data());
  fused::Table t;
  t.slots = reinterpret_cast<const Slot*>(base);
  t.chunks = reinterpret_cast<const Chunk*>(base + chunk_bytes_off_);
  t.num_chunks = num_chunks();
  t.groups = reinterpret_cast<const GroupOptions*>(base + group_bytes_off_);
  t.lr = lr_.data<double>();
  return t;
}

void FusedOptimizer::validate_bindings() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    KILN_CHECK(p.raw_data() == slots_[i].param && p.dtype() == slots_[i].dtype, name(),
               ": parameter ", i, " (", p.desc(), ") was moved or converted after the optimizer "
               "was built; prepare the model first, then construct the optimizer");
    const Tensor g = p.grad();
    KILN_CHECK(g.defined() && g.shares_storage(grads_) && g.raw_data() == grad(i).raw_data(),
               name(), ": parameter ", i, "'s .grad no longer views the gradient arena (was it "
               "set to none, e.g. by Module::zero_grad()? use the optimizer's zero_grad())");
  }
}

void FusedOptimizer::upload_group_options() {
  bool changed = false;
  for (size_t g = 0; g < param_groups.size(); ++g) {
    const GroupOptions o = group_options(param_groups[g]);
    if (!same_options(o, group_opts_[g])) changed = true;
    group_opts_[g] = o;
  }
  if (!changed) return;
  const int64_t n = int64_t(group_opts_.size() * sizeof(GroupOptions));
  Tensor host = empty({n}, DType::u8);
  std::memcpy(host.data<uint8_t>(), group_opts_.data(), size_t(n));
  table_.narrow(0, int64_t(group_bytes_off_), n).copy_(host);
}

void FusedOptimizer::upload_lr() {
  const size_t G = param_groups.size();
  if (device_.is_cpu()) {
    for (size_t g = 0; g < G; ++g) lr_.data<double>()[g] = param_groups[g].lr;
    return;
  }
#ifdef KILN_WITH_CUDA
  if (is_capturing()) return;  // replays read lr_ as stage_lr() left it
  std::vector<double> v(G);
  for (size_t g = 0; g < G; ++g) v[g] = param_groups[g].lr;
  ring_->stage(v.data(), lr_);
#endif
}

void FusedOptimizer::stage_lr() { upload_lr(); }

void FusedOptimizer::check_grads(const Tensor& found_inf) {
  KILN_CHECK(found_inf.device() == device_ && found_inf.dtype() == DType::f32, name(),
             ": found_inf must be f32 on ", device_, ", got ", found_inf.desc());
  fused::CheckArgs a;
  a.table = table();
  a.grads = static_cast<const uint8_t*>(grads_.raw_data());
  a.found_inf = found_inf.data<float>();
  a.partial_sumsq = partials_.data<float>();
  backend(device_).fused_check_grads(a);
  norm_ready_ = true;
}

void FusedOptimizer::set_unscale(const Tensor& scale, const Tensor& found_inf) {
  pending_scale_ = scale;
  pending_found_inf_ = found_inf;
  pending_.scale = scale.data<float>();
  pending_.found_inf = found_inf.data<float>();
}

Tensor FusedOptimizer::clip_grad_norm(double max_norm) {
  KILN_CHECK(max_norm > 0.0, name(), ": clip_grad_norm max_norm must be > 0, got ", max_norm);
  NoGradGuard no_grad;
  if (!norm_ready_) {
    Tensor scratch = norm_.narrow(0, 2, 1);
    scratch.zero_();
    check_grads(scratch);
  }
  float* n = norm_.data<float>();
  backend(device_).fused_clip_coef(partials_.data<float>(),
                  num_chunks(), pending_.scale, float(max_norm), n, n + 1);
  pending_.clip_coef = n + 1;
  return norm_.select(0, 0).clone();
}

void FusedOptimizer::step(DynamicLossScaler* scaler) {
  NoGradGuard no_grad;
  validate_bindings();
  if (scaler && scaler->enabled() && !unscaled()) scaler->unscale_(*this);
  upload_group_options();
  upload_lr();
  int32_t* step = step_count_.data<int32_t>();
  backend(device_).fused_step_begin(step,
                  pending_.found_inf);
  fused::StepArgs a;
  a.table = table();
  a.master = master_.data<float>();
  a.state0 = num_state_ > 0 ? state_[0].data<float>() : nullptr;
  a.state1 = num_state_ > 1 ? state_[1].data<float>() : nullptr;
  a.grads = static_cast<const uint8_t*>(grads_.raw_data());
  a.scaling = pending_;
  a.step = step;
  launch(a);
  pending_ = {};
  pending_scale_ = Tensor();
  pending_found_inf_ = Tensor();
  norm_ready_ = false;
}

// ---------------- FusedSGD ----------------

static std::vector<ParamGroup> checked_sgd(std::vector<ParamGroup> groups) {
  for (size_t i = 0; i < groups.size(); ++i) {
    const ParamGroup& g = groups[i];
    KILN_CHECK(g.momentum >= 0.0, "FusedSGD: group ", i, " has momentum ", g.momentum, " < 0");
    KILN_CHECK(!g.nesterov || (g.momentum > 0.0 && g.dampening == 0.0), "FusedSGD: group ", i,
               ": nesterov requires momentum > 0 and dampening 0 (got momentum ", g.momentum,
               ", dampening ", g.dampening, ")");
  }
  return groups;
}

FusedSGD::FusedSGD(std::vector<Tensor> params, const SGDOptions& opts)
    : FusedSGD(std::vector<ParamGroup>{opts.group(std::move(params))}) {}

FusedSGD::FusedSGD(std::vector<ParamGroup> groups)
    : FusedOptimizer(checked_sgd(std::move(groups))) {
  build();
}

int FusedSGD::num_state_arenas() const {
  for (const ParamGroup& g : param_groups)
    if (g.momentum != 0.0) return 1;
  return 0;
}

GroupOptions FusedSGD::group_options(const ParamGroup& g) const {
  GroupOptions o;
  o.weight_decay = g.weight_decay;
  o.momentum = g.momentum;
  o.dampening = g.dampening;
  o.nesterov = g.nesterov ? 1 : 0;
  return o;
}

void FusedSGD::launch(const fused::StepArgs& a) {
  KILN_CHECK(a.state0 || num_state_arenas() == 0, "FusedSGD: momentum was turned on after "
             "construction; the momentum arena exists only when a group starts with momentum");
  backend(device()).fused_sgd_step(a);
}

// ---------------- FusedAdamW ----------------

static std::vector<ParamGroup> checked_adamw(std::vector<ParamGroup> groups) {
  for (size_t i = 0; i < groups.size(); ++i) {
    const ParamGroup& g = groups[i];
    KILN_CHECK(g.beta1 >= 0.0 && g.beta1 < 1.0 && g.beta2 >= 0.0 && g.beta2 < 1.0,
               "FusedAdamW: group ", i, " has betas (", g.beta1, ", ", g.beta2,
               "); both must be in [0, 1)");
    KILN_CHECK(g.eps >= 0.0, "FusedAdamW: group ", i, " has eps ", g.eps, " < 0");
  }
  return groups;
}

FusedAdamW::FusedAdamW(std::vector<Tensor> params, const AdamWOptions& opts)
    : FusedAdamW(std::vector<ParamGroup>{opts.group(std::move(params))}) {}

FusedAdamW::FusedAdamW(std::vector<ParamGroup> groups)
    : FusedOptimizer(checked_adamw(std::move(groups))) {
  build();
}

int FusedAdamW::num_state_arenas() const { return 2; }

GroupOptions FusedAdamW::group_options(const ParamGroup& g) const {
  GroupOptions o;
  o.weight_decay = g.weight_decay;
  o.beta1 = g.beta1;
  o.beta2 = g.beta2;
  o.eps = g.eps;
  return o;
}

void FusedAdamW::launch(const fused::StepArgs& a) {
  backend(device()).fused_adamw_step(a);
}

}  // namespace kiln::optim
