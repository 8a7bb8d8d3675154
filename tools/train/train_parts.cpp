#include "tools/train/train_parts.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>

#include "ops/ops.h"
#include "optim/checkpoint.h"
#ifdef KILN_WITH_CUDA
#include "cuda/runtime.h"
#endif

namespace kiln::train {

Device pick_device(const std::string& s, const DistEnv& env) {
#ifdef KILN_WITH_CUDA
  if (env.distributed()) {
    KILN_CHECK(s == "auto" || s == "cuda", "--device ", s,
               ": data-parallel ranks use GPU "
               "LOCAL_RANK; leave --device at auto");
    KILN_CHECK(env.local_rank < cuda::device_count(), "this process is ", env.describe(),
               ", so it uses GPU ", env.local_rank, ", but only ", cuda::device_count(),
               " CUDA device(s) are visible to it");
    cuda::set_device(env.local_rank);
    return Device::cuda(env.local_rank);
  }
  if (s == "auto") return cuda::device_count() > 0 ? Device::cuda(0) : Device::cpu();
  Device d = Device::parse(s);
  if (d.is_cuda())
    KILN_CHECK(d.index < cuda::device_count(), "--device ", s, ": only ", cuda::device_count(),
               " CUDA device(s) present");
  return d;
#else
  if (s == "auto") return Device::cpu();
  Device d = Device::parse(s);
  KILN_CHECK(d.is_cpu(), "--device ", s, ": this kiln was built without CUDA");
  return d;
#endif
}

std::shared_ptr<models::ResNet> build_model(const Config& c, const TrainData& d) {
  struct Spec {
    models::BlockKind kind;
    std::vector<int64_t> layers;
  };
  static const std::map<std::string, Spec> specs = {
      {"resnet_small", {models::BlockKind::Basic, {1, 1, 1}}},
      {"resnet18", {models::BlockKind::Basic, {2, 2, 2, 2}}},
      {"resnet34", {models::BlockKind::Basic, {3, 4, 6, 3}}},
      {"resnet50", {models::BlockKind::Bottleneck, {3, 4, 6, 3}}},
      {"resnet101", {models::BlockKind::Bottleneck, {3, 4, 23, 3}}},
      {"resnet152", {models::BlockKind::Bottleneck, {3, 8, 36, 3}}}};
  auto it = specs.find(c.arch);
  if (it == specs.end()) models::make_model(c.arch, 10);  // throws, listing valid names
  KILN_CHECK(c.width == 0 || c.arch == "resnet_small", "--width applies to resnet_small only");
  models::ResNetOptions o;
  o.num_classes = d.num_classes();
  o.in_channels = d.channels();
  o.imagenet_stem = d.kind() == DataKind::ImageFolder && c.arch != "resnet_small";
  o.seed = c.seed;
  if (c.arch == "resnet_small") o.width = c.width > 0 ? c.width : 32;
  return std::make_shared<models::ResNet>(it->second.kind, it->second.layers, o);
}

std::string fmt_time(double s) {
  if (!std::isfinite(s) || s < 0 || s > 1e9) return "?";
  char buf[32];
  const int m = int(s) / 60;
  std::snprintf(buf, sizeof buf, "%d:%02d", m, int(s) - 60 * m);
  return buf;
}

std::vector<double> evaluate(nn::Module& model, const TrainData& data) {
  NoGradGuard ng;
  model.eval();
  double loss = 0, top1 = 0, top5 = 0, seen = 0;
  bool diverged = false;
  auto stream = data.test_epoch();
  while (std::optional<data::DeviceBatch> b = stream->next()) {
    Tensor logits = model(b->x).to(DType::f32).to(Device::cpu()).contiguous();
    Tensor y = b->y.to(Device::cpu());
    const int64_t n = logits.size(0), k = logits.size(1);
    const float* l = logits.data<float>();
    const int64_t* t = y.data<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      const float* row = l + i * k;
      KILN_CHECK(t[i] >= 0 && t[i] < k, "evaluate: label ", t[i], " of test sample ",
                 int64_t(seen) + i, " is outside the model's ", k, " classes");
      const float target = row[t[i]];
      float mx = row[0];
      int64_t above = 0;
      bool finite = true;
      for (int64_t j = 0; j < k; ++j) {
        finite &= std::isfinite(row[j]);
        mx = std::max(mx, row[j]);
        above += row[j] > target;
      }
      if (!finite) {  // NaN compares false: `above` would call this sample a hit
        diverged = true;
        continue;
      }
      double sum = 0;
      for (int64_t j = 0; j < k; ++j) sum += std::exp(double(row[j]) - mx);
      loss += std::log(sum) + mx - target;
      top1 += above < 1;
      top5 += above < 5;
    }
    seen += double(n);
  }
  model.train();
  if (diverged) loss = top1 = top5 = std::numeric_limits<double>::quiet_NaN();
  return {loss, top1, top5, seen};
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string fmt_metric(double v, double factor, int decimals) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v * factor);
  return buf;
}

std::string first_non_finite(const nn::Module& model) {
  NoGradGuard ng;
  for (const auto& [name, t] : state_dict(model)) {
    if (!is_floating(t.dtype())) continue;
    const Tensor h = t.detach().to(Device::cpu()).to(DType::f64).contiguous();
    const double* p = h.data<double>();
    for (int64_t i = 0; i < h.numel(); ++i)
      if (!std::isfinite(p[i])) return name;
  }
  return "";
}

}  // namespace kiln::train
