#include "tools/train/train_parts.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>

#include "core/json.h"
#include "core/serialization.h"
#include "models/vit.h"
#include "ops/ops.h"
#include "optim/checkpoint.h"
#include "tools/cli/cli.h"
#ifdef KILN_WITH_CUDA
#include "cuda/runtime.h"
#endif

namespace kiln::train {

namespace {

Device parse_device(const std::string& s) {
  try {
    return Device::parse(s);
  } catch (const Error&) {
    cli::usage_error("--device '", s, "': expected auto, cpu, cuda or cuda:N");
  }
}

}  // namespace

Device pick_device(const std::string& s, const DistEnv& env) {
#ifdef KILN_WITH_CUDA
  if (env.distributed()) {
    if (s != "auto" && s != "cuda" && s != "cuda:" + std::to_string(env.local_rank))
      cli::usage_error("--device ", s,
                       ": data-parallel ranks use GPU LOCAL_RANK; leave --device at auto");
    if (env.local_rank >= cuda::device_count())
      cli::usage_error("this process is ", env.describe(), ", so it uses GPU ", env.local_rank,
                       ", but only ", cuda::device_count(), " CUDA device(s) are visible to it");
    cuda::set_device(env.local_rank);
    return Device::cuda(env.local_rank);
  }
  Device d = s == "auto" ? (cuda::device_count() > 0 ? Device::cuda(0) : Device::cpu())
                         : parse_device(s);
  if (d.is_cuda() && d.index >= cuda::device_count())
    cli::usage_error("--device ", s, ": only ", cuda::device_count(), " CUDA device(s) present");
  // The chosen GPU becomes the current one: the loaders that make batches on the device
  // (DeviceLoader, GpuJpegLoader) and the graph executor work on the current device.
  if (d.is_cuda()) cuda::set_device(d.index);
  return d;
#else
  if (s == "auto") return Device::cpu();
  Device d = parse_device(s);
  if (!d.is_cpu()) cli::usage_error("--device ", s, ": this kiln was built without CUDA");
  return d;
#endif
}

ModelInfo model_info(const Config& c, const TrainData& d) {
  const std::vector<std::string> archs = models::all_model_names();
  if (std::find(archs.begin(), archs.end(), c.arch) == archs.end()) {
    std::string list;
    for (const std::string& a : archs) list += (list.empty() ? "" : ", ") + a;
    cli::usage_error("--arch '", c.arch, "': expected one of ", list);
  }
  if (c.width != 0 && c.arch != "resnet_small")
    cli::usage_error("--width applies to resnet_small only (--arch is ", c.arch, ")");
  const bool vit = models::family_of(c.arch) == models::Family::ViT;
  const int64_t patch = vit ? models::vit_options(c.arch, 1, 224).patch_size : 1;
  if (vit && d.height() % patch != 0)
    cli::usage_error("--arch ", c.arch, " cuts images into ", patch, "x", patch,
                     " patches: the input size ", d.height(), " is not a multiple of ", patch,
                     " (give ImageFolder data an --image-size like 224 or 32)");
  ModelInfo m;
  m.arch = c.arch;
  m.num_classes = d.num_classes();
  m.in_channels = d.channels();
  m.imagenet_stem = vit || (!d.small_images() && c.arch != "resnet_small");
  m.width = vit ? models::vit_options(c.arch, 1, 224).hidden_dim
                : c.arch == "resnet_small" ? (c.width > 0 ? c.width : 32) : 64;
  m.image_size = d.height();
  m.resize_size = d.resize_size();
  m.mean = d.mean();
  m.std = d.stddev();
  if (m.mean.size() == 1 && m.in_channels > 1) {
    m.mean.assign(size_t(m.in_channels), m.mean[0]);
    m.std.assign(size_t(m.in_channels), m.std[0]);
  }
  m.class_names = d.class_names();
  // Now, not when the first checkpoint is written: values model_metadata would refuse.
  try {
    check_model_info(m, "the model");
  } catch (const Error& e) {
    cli::usage_error(cli::without_location(e.what()));
  }
  return m;
}

std::shared_ptr<nn::Module> build_model(const Config& c, const TrainData& d) {
  return kiln::build_model(model_info(c, d), c.seed);
}

std::string load_pretrained(const std::string& path, nn::Module& model, const ModelInfo& info,
                            Classifier classifier) {
  SafetensorsData file;
  try {
    file = load_safetensors(path);
  } catch (const Error& e) {
    cli::usage_error("--pretrained: ", cli::without_location(e.what()));
  }
  check_finite(file, "--pretrained");
  auto arch = file.metadata.find("arch");
  const std::string head = classifier_prefix(info.arch);  // "fc." or "heads.head."
  const std::string head_w = head + "weight", head_b = head + "bias";
  const Tensor* fc = file.contains(head_w) ? &file.at(head_w) : nullptr;
  const int64_t classes = info.num_classes;
  if (classifier == Classifier::MustMatch && fc != nullptr && fc->dim() == 2 &&
      fc->size(0) != classes)
    cli::usage_error("--pretrained '", path, "' classifies ", fc->size(0), " classes, the data has ",
                     classes, ": --evaluate needs a model trained on these classes (otherwise a "
                     "re-initialised classifier would be evaluated)");
  if (fc == nullptr || fc->dim() != 2 || fc->size(0) == classes) {
    try {
      load_state(file.tensors, model, KeyMatch::Strict, path);
    } catch (const Error& e) {
      cli::usage_error("--pretrained: ", cli::without_location(e.what()));
    }
    return "--pretrained " + path + ": loaded all " + std::to_string(file.tensors.size()) +
           " tensors";
  }
  NamedTensors body;
  for (auto& [name, t] : file.tensors)
    if (name != head_w && name != head_b) body.emplace_back(name, t);
  try {
    LoadReport r = load_state(body, model, KeyMatch::Lenient, path);
    const std::vector<std::string> classifier = {head_w, head_b};
    if (r.missing_keys != classifier || !r.unexpected_keys.empty()) {
      std::string keys;
      for (const auto& k : r.missing_keys) keys += (keys.empty() ? "" : ", ") + k;
      for (const auto& k : r.unexpected_keys) keys += (keys.empty() ? "" : ", ") + k;
      KILN_FAIL("keys that do not match the model: ", keys.substr(0, 300));
    }
  } catch (const Error& e) {
    cli::usage_error(
        "--pretrained '", path, "'", arch != file.metadata.end() ? " (a " + arch->second + ")" : "",
        " does not fit the model beyond its classifier: ", cli::without_location(e.what()));
  }
  return "--pretrained " + path + ": loaded all but the classifier (" +
         std::to_string(fc->size(0)) + " classes in the file, " + std::to_string(classes) +
         " here); the classifier re-initialised for fine-tuning";
}

std::vector<Tensor> freeze_backbone(nn::Module& model, const std::string& arch) {
  const std::string head = classifier_prefix(arch);
  std::vector<Tensor> trained;
  for (auto& [name, p] : model.named_parameters()) {
    const bool classifier = name.rfind(head, 0) == 0;
    p.set_requires_grad(classifier);
    if (classifier) trained.push_back(p);
  }
  return trained;
}

std::string fmt_time(double s) {
  if (!std::isfinite(s) || s < 0 || s > 1e9) return "?";
  char buf[40];
  const long t = long(s);
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%ld:%02ld", t / 60, t % 60);
  return buf;
}

std::vector<double> evaluate(nn::Module& model, const TrainData& data,
                             const std::function<void(int64_t)>& progress) {
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
    if (progress) progress(b->index + 1);
  }
  model.train();
  if (diverged) loss = top1 = top5 = std::numeric_limits<double>::quiet_NaN();
  return {loss, top1, top5, seen, double(stream->bad_files())};
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
  return kiln::first_non_finite(state_dict(model));
}

}  // namespace kiln::train
