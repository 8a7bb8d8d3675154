#include "optim/amp.h"

#include <algorithm>

#include <cstring>
#include <set>

#include "core/autograd.h"
#include "models/nn.h"
#include "ops/ops.h"
#include "core/backend.h"

#ifdef KILN_WITH_CUDA
#include "cuda/check.h"
#include "cuda/runtime.h"
#endif

namespace kiln::amp {

Precision default_precision(Device device) {
  return device.is_cuda() ? Precision::Mixed16 : Precision::FP32;
}

DType compute_dtype(Precision p) {
  switch (p) {
    case Precision::FP32: return DType::f32;
    case Precision::Mixed16: return DType::f16;
    case Precision::MixedBF16: return DType::bf16;
  }
  KILN_FAIL("amp: bad precision ", int(p));
}

void prepare_model(nn::Module& model, Device device, Precision precision) {
  KILN_CHECK(precision == Precision::FP32 || device.is_cuda(),
             "amp::prepare_model: mixed precision needs a CUDA device (the CPU backend computes "
             "in f32), got ", device);
  model.to(device);
  model.to(DType::f32);
  if (precision == Precision::FP32) return;
  // What each module names (Module::half_parameters: Conv2d, Linear, the attention's
  // projections, ...) computes in 16 bits; normalisation parameters and statistics stay f32.
  std::vector<std::pair<std::string, bool>> half;  // name, channels-last
  for (const auto& [prefix, m] : model.named_modules()) {
    const bool conv = dynamic_cast<const nn::Conv2d*>(m) != nullptr;
    for (const std::string& n : m->half_parameters()) {
      const auto& own = m->own_parameters();
      auto it = std::find_if(own.begin(), own.end(), [&](const auto& p) { return p.first == n; });
      KILN_CHECK(it != own.end(), "amp::prepare_model: ", m->type_name(), " '", prefix,
                 "' names no parameter '", n, "' among its own");
      half.emplace_back(prefix.empty() ? n : prefix + "." + n, conv && it->second.dim() == 4);
    }
  }
  const DType low = compute_dtype(precision);
  for (const auto& [name, nhwc] : half)
    model.convert(name, low, device, nhwc ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous);
}

Tensor prepare_input(const Tensor& x, Device device, Precision precision) {
  NoGradGuard no_grad;
  Tensor y = x.detach().to(device);
  if (precision == Precision::FP32) return y.to(DType::f32).contiguous();
  KILN_CHECK(device.is_cuda(), "amp::prepare_input: mixed precision needs a CUDA device");
  y = y.to(compute_dtype(precision));
  if (y.dim() != 4) return y.contiguous();
  // contiguous(ChannelsLast) keeps plain strides that address NHWC too (one channel); the
  // network's layers follow what their input suggests, so such a batch gets NHWC strides.
  return y.suggest_memory_format() == MemoryFormat::ChannelsLast
             ? y
             : y.clone(MemoryFormat::ChannelsLast);
}

// ---------------- AsyncScalars ----------------

struct AsyncScalars::Impl {
  std::vector<DType> dtypes;
  std::vector<double> host_values;  // CPU sources
  bool on_cuda = false;
  uint64_t* pinned = nullptr;  // one 8-byte cell per source
  size_t capacity = 0;
#ifdef KILN_WITH_CUDA
  cudaEvent_t event = nullptr;
#endif
  ~Impl() {
#ifdef KILN_WITH_CUDA
    if (event) cudaEventDestroy(event);
    if (pinned) cuda::free_pinned(pinned);
#endif
  }
};

AsyncScalars::AsyncScalars() : impl_(new Impl) {}
AsyncScalars::~AsyncScalars() { delete impl_; }

void AsyncScalars::record(const std::vector<Tensor>& sources) {
  Impl& s = *impl_;
  s.dtypes.clear();
  s.host_values.clear();
  s.on_cuda = !sources.empty() && sources[0].is_cuda();
  for (const Tensor& t : sources) {
    KILN_CHECK(t.defined() && t.numel() == 1 && t.device() == sources[0].device(),
               "AsyncScalars: sources must be one-element tensors on one device, got ",
               t.defined() ? t.desc() : std::string("undefined"));
    s.dtypes.push_back(t.dtype());
  }
  if (!s.on_cuda) {
    for (const Tensor& t : sources) s.host_values.push_back(t.item());
    return;
  }
#ifdef KILN_WITH_CUDA
  cudaStream_t stream = cuda::current_stream();
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &st));
  KILN_CHECK(st == cudaStreamCaptureStatusNone, "AsyncScalars::record while capturing a graph");
  if (s.capacity < sources.size()) {
    if (s.pinned) {
      if (s.event) CUDA_CHECK(cudaEventSynchronize(s.event));  // earlier copies still land here
      cuda::free_pinned(s.pinned);
    }
    s.pinned = static_cast<uint64_t*>(cuda::alloc_pinned(sources.size() * sizeof(uint64_t)));
    s.capacity = sources.size();
  }
  if (!s.event) CUDA_CHECK(cudaEventCreateWithFlags(&s.event, cudaEventDisableTiming));
  for (size_t i = 0; i < sources.size(); ++i)
    CUDA_CHECK(cudaMemcpyAsync(&s.pinned[i], sources[i].raw_data(), sources[i].element_size(),
                               cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaEventRecord(s.event, stream));
#else
  KILN_FAIL("AsyncScalars: cuda tensors, but kiln was built without CUDA");
#endif
}

bool AsyncScalars::ready() const {
  if (!impl_->on_cuda) return true;
#ifdef KILN_WITH_CUDA
  const cudaError_t e = cudaEventQuery(impl_->event);
  if (e == cudaErrorNotReady) return false;
  CUDA_CHECK(e);
#endif
  return true;
}

std::vector<double> AsyncScalars::values() {
  Impl& s = *impl_;
  if (!s.on_cuda) return s.host_values;
  std::vector<double> out;
#ifdef KILN_WITH_CUDA
  CUDA_CHECK(cudaEventSynchronize(s.event));
  for (size_t i = 0; i < s.dtypes.size(); ++i) {
    out.push_back(dispatch_all(s.dtypes[i], [&]<typename T>() {
      T v;
      std::memcpy(static_cast<void*>(&v), &s.pinned[i], sizeof(T));  // T may be Half: bytes
      return convert<double>(v);
    }));
  }
#endif
  return out;
}

}  // namespace kiln::amp

namespace kiln::optim {

DynamicLossScaler::DynamicLossScaler(Device device, LossScalerOptions opts)
    : device_(device), opts_(opts) {
  KILN_CHECK(opts.init_scale > 0.0 && opts.init_scale <= 3.4028234663852886e38,
             "DynamicLossScaler: init_scale must be in (0, FLT_MAX], got ", opts.init_scale);
  KILN_CHECK(opts.growth_factor > 1.0, "DynamicLossScaler: growth_factor must be > 1, got ",
             opts.growth_factor);
  KILN_CHECK(opts.backoff_factor > 0.0 && opts.backoff_factor < 1.0,
             "DynamicLossScaler: backoff_factor must be in (0, 1), got ", opts.backoff_factor);
  KILN_CHECK(opts.growth_interval >= 1, "DynamicLossScaler: growth_interval must be >= 1, got ",
             opts.growth_interval);
  const TensorOptions f32 = TensorOptions(DType::f32).with_device(device);
  const TensorOptions i32 = TensorOptions(DType::i32).with_device(device);
  scale_ = full({1}, opts.init_scale, f32);
  growth_ = zeros({1}, i32);
  found_inf_ = zeros({1}, f32);
  skipped_ = zeros({1}, i32);
}

Tensor DynamicLossScaler::scale(const Tensor& loss) const {
  if (!enabled()) return loss;
  KILN_CHECK(loss.dtype() == DType::f32 && loss.device() == device_,
             "DynamicLossScaler::scale: loss must be f32 on ", device_, ", got ", loss.desc());
  return F::mul(loss, loss.dim() == 0 ? scale_.view({}) : scale_);
}

void DynamicLossScaler::unscale_(FusedOptimizer& opt) {
  if (!enabled()) return;
  KILN_CHECK(opt.device() == device_, "DynamicLossScaler::unscale_: optimizer on ", opt.device(),
             ", scaler on ", device_);
  KILN_CHECK(!opt.unscaled(), "DynamicLossScaler::unscale_: already called since the last step");
  NoGradGuard no_grad;
  found_inf_.zero_();
  opt.check_grads(found_inf_);
  opt.set_unscale(scale_, found_inf_);
  checked_ = true;
}

void DynamicLossScaler::step(FusedOptimizer& opt) { opt.step(enabled() ? this : nullptr); }

fused::ScalerArgs DynamicLossScaler::args() {
  fused::ScalerArgs a;
  a.scale = scale_.data<float>();
  a.growth_tracker = growth_.data<int32_t>();
  a.skipped = skipped_.data<int32_t>();
  a.found_inf = found_inf_.data<float>();
  a.growth_factor = float(opts_.growth_factor);
  a.backoff_factor = float(opts_.backoff_factor);
  a.growth_interval = opts_.growth_interval;
  return a;
}

void DynamicLossScaler::update() {
  if (!enabled()) return;
  KILN_CHECK(checked_, "DynamicLossScaler::update: no unscale_/step since the last update (the "
             "overflow check never ran)");
  const fused::ScalerArgs a = args();
  backend(device_).loss_scaler_update(a);
  checked_ = false;
}

double DynamicLossScaler::scale_value() const { return scale_.item(); }

std::map<std::string, Tensor> DynamicLossScaler::state_dict() const {
  return {{"scale", scale_}, {"growth_tracker", growth_}, {"skipped", skipped_}};
}

void DynamicLossScaler::load_state_dict(const std::map<std::string, Tensor>& dict) {
  NoGradGuard no_grad;
  for (const auto& [key, dst] : state_dict()) {
    auto it = dict.find(key);
    KILN_CHECK(it != dict.end(), "DynamicLossScaler::load_state_dict: missing '", key, "'");
    KILN_CHECK(it->second.numel() == 1, "DynamicLossScaler::load_state_dict: '", key,
               "' must have one element, got ", it->second.desc());
    dst.copy_(it->second.reshape({1}));
  }
}

Tensor clip_grad_norm_(FusedOptimizer& opt, double max_norm) { return opt.clip_grad_norm(max_norm); }

}  // namespace kiln::optim
