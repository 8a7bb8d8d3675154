#include "optim/muon.h"

#include <cmath>

#include "core/autograd.h"
#include "ops/ops.h"
#include "optim/amp.h"
#include "optim/host_stager.h"

#ifdef KILN_WITH_CUDA
#include "cuda/runtime.h"
#endif

namespace kiln::optim {
namespace {

// The quintic's coefficients: the slope at zero as large as keeps the iteration stable.
constexpr double kA = 3.4445, kB = -4.7750, kC = 2.0315;
constexpr double kNormEps = 1e-7;

}  // namespace

Muon::Muon(FusedOptimizer& base, size_t group, const MuonOptions& opts)
    : lr(opts.lr), base_(base), opts_(opts) {
  KILN_CHECK(group < base.param_groups.size(), "Muon: group ", group, " of ", base.name(),
             ", which has ", base.param_groups.size(), " groups");
  const ParamGroup& g = base.param_groups[group];
  KILN_CHECK(g.lr == 0.0 && g.weight_decay == 0.0, "Muon: ", base.name(), "'s group ", group,
             " must have lr 0 and weight_decay 0 (Muon updates it), got lr ", g.lr,
             " and weight_decay ", g.weight_decay);
  KILN_CHECK(!g.params.empty(), "Muon: ", base.name(), "'s group ", group, " has no parameters");
  KILN_CHECK(opts.lr >= 0.0 && opts.momentum >= 0.0 && opts.momentum < 1.0 && opts.ns_steps >= 1,
             "Muon: lr ", opts.lr, ", momentum ", opts.momentum, ", ns_steps ", opts.ns_steps,
             " (expected lr >= 0, 0 <= momentum < 1, ns_steps >= 1)");
  KILN_CHECK(opts.ns_dtype == DType::f32 ||
                 (base.device().is_cuda() && (opts.ns_dtype == DType::bf16 ||
                                              opts.ns_dtype == DType::f16)),
             "Muon: ns_dtype ", dtype_name(opts.ns_dtype), " on ", base.device(),
             " (f32, or bf16 / f16 on CUDA)");
  size_t first = 0;
  for (size_t k = 0; k < group; ++k) first += base.param_groups[k].params.size();
  NoGradGuard no_grad;
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(base.device());
  for (size_t j = 0; j < g.params.size(); ++j) {
    const Tensor& p = g.params[j];
    KILN_CHECK(p.dim() >= 2, "Muon: parameter ", j, " of group ", group, " is ", p.desc(),
               "; Muon takes matrices and convolution filters (2-D or more)");
    index_.push_back(first + j);
    params_.push_back(p);
    momentum_.push_back(zeros(p.shape(), f32));
  }
  lr_ = full({1}, opts.lr, TensorOptions(DType::f64).with_device(base.device()));
  zero_ = zeros({1}, f32);
  if (base.device().is_cuda()) stager_ = std::make_unique<HostStager>(1);
}

Muon::~Muon() = default;

bool Muon::capturing() const {
#ifdef KILN_WITH_CUDA
  return base_.device().is_cuda() && cuda::is_capturing();
#else
  return false;
#endif
}

void Muon::stage_lr() {
  if (!stager_) {
    lr_.data<double>()[0] = lr;
    return;
  }
  stager_->stage(&lr, lr_);
}

Tensor Muon::newton_schulz(const Tensor& d, int steps, DType dtype) {
  KILN_CHECK(d.dim() == 2, "Muon::newton_schulz: expected a matrix, got ", d.desc());
  NoGradGuard no_grad;
  const Tensor d32 = d.to(DType::f32);
  const Tensor norm = F::add(F::sqrt(F::sum(F::mul(d32, d32))), kNormEps);
  Tensor x = F::div(d32, norm).to(dtype);
  const bool tall = d.size(0) > d.size(1);
  if (tall) x = x.t();
  for (int s = 0; s < steps; ++s) {
    const Tensor a = F::matmul(x, x.t());
    const Tensor b = F::add(F::mul(a, kB), F::matmul(a, a), kC);
    x = F::add(F::mul(x, kA), F::matmul(b, x));
  }
  return tall ? x.t() : x;
}

void Muon::step(const DynamicLossScaler* scaler) {
  NoGradGuard no_grad;
  if (!capturing()) stage_lr();  // a replay reads lr_ as stage_lr() left it
  // Unscaling and skipping, read on the device: inv = 1/scale, keep = 1 - found_inf.
  Tensor inv, keep, found;
  if (scaler != nullptr && scaler->enabled()) {
    inv = F::rdiv(scaler->scale_tensor(), 1.0);
    keep = F::rsub(scaler->found_inf(), 1.0);
    found = F::gt(scaler->found_inf(), 0.0);
  }
  Tensor step_lr = lr_.to(DType::f32);
  if (keep.defined()) step_lr = F::mul(step_lr, keep);
  const double mu = opts_.momentum;
  for (size_t i = 0; i < index_.size(); ++i) {
    const size_t k = index_[i];
    Tensor grad = base_.grad(k).to(DType::f32);
    if (inv.defined()) grad = F::where(found, zero_, F::mul(grad, inv));  // finite when skipped
    Tensor& buf = momentum_[i];
    const Tensor next = F::add(F::mul(buf, mu), grad);
    if (keep.defined())
      F::add_(buf, F::mul(F::sub(next, buf), keep));
    else
      buf.copy_(next);
    const Tensor d = opts_.nesterov ? F::add(grad, next, mu) : next;
    const int64_t rows = d.size(0), cols = d.numel() / rows;
    const Tensor x = newton_schulz(d.contiguous().reshape({rows, cols}), opts_.ns_steps,
                                   opts_.ns_dtype)
                         .contiguous()
                         .reshape(d.shape())
                         .to(DType::f32);
    const Tensor master = base_.master(k);
    if (opts_.normalize_weights) {
      // W · sqrt(rows) / ‖W‖, or 1 on a skipped step.
      Tensor factor = F::rdiv(F::sqrt(F::sum(F::mul(master, master))), std::sqrt(double(rows)));
      if (keep.defined()) factor = F::add(F::mul(F::add(factor, -1.0), keep), 1.0);
      F::mul_(master, factor);
    }
    F::add_(master, F::mul(x, step_lr), -1.0);
    params_[i].copy_(master);
  }
}

void Muon::reset_state() {
  NoGradGuard no_grad;
  for (Tensor& b : momentum_) b.zero_();
}

std::map<std::string, Tensor> Muon::state_dict() const {
  std::map<std::string, Tensor> out;
  for (size_t i = 0; i < momentum_.size(); ++i)
    out["muon." + std::to_string(i) + ".momentum_buffer"] = momentum_[i];
  return out;
}

void Muon::load_state_dict(const std::map<std::string, Tensor>& dict) {
  KILN_CHECK(dict.size() == momentum_.size(), "Muon::load_state_dict: ", dict.size(),
             " entries for ", momentum_.size(), " parameters");
  for (size_t i = 0; i < momentum_.size(); ++i) {
    const std::string key = "muon." + std::to_string(i) + ".momentum_buffer";
    auto it = dict.find(key);
    KILN_CHECK(it != dict.end(), "Muon::load_state_dict: missing key '", key, "'");
    KILN_CHECK(it->second.shape() == momentum_[i].shape(), "Muon::load_state_dict: '", key,
               "' is ", it->second.desc(), ", expected shape ", shape_str(momentum_[i].shape()));
  }
  NoGradGuard no_grad;
  for (size_t i = 0; i < momentum_.size(); ++i)
    momentum_[i].copy_(dict.at("muon." + std::to_string(i) + ".momentum_buffer"));
}

}  // namespace kiln::optim
