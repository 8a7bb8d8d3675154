#include "optim/checkpoint.h"

#include "core/backend.h"
#include "core/device_query.h"

#include <cstring>
#include <set>
#include <sstream>
#include <unordered_map>

#include "core/autograd.h"
#include "optim/optimizer.h"

namespace kiln {
namespace {

constexpr size_t kListedKeys = 10;
constexpr const char* kFormat = "kiln-checkpoint-1";
constexpr const char* kOptimPrefix = "optim.";
constexpr const char* kScalerPrefix = "scaler.";
constexpr const char* kModelPrefix = "model.";
constexpr const char* kRngPrefix = "kiln.rng.";

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

// "'a', 'b', ... (23 in all)": long key lists stay readable in one error line.
std::string key_list(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size() && i < kListedKeys; ++i)
    out += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > kListedKeys) out += ", ...";
  return out + " (" + std::to_string(keys.size()) + " in all)";
}

// One validated copy: file tensor -> module tensor.
struct PlannedCopy {
  Tensor dst, src;
};

// Checks every key, shape and dtype before anything is copied, so a failed load changes nothing.
std::vector<PlannedCopy> plan_load(const NamedTensors& tensors, const nn::Module& module,
                                   KeyMatch match, const std::string& source,
                                   const std::string& prefix, LoadReport* report) {
  std::unordered_map<std::string, Tensor> wanted;
  std::vector<std::string> order;
  for (const auto& [name, t] : state_dict(module)) {
    wanted.emplace(name, t);
    order.push_back(name);
  }
  std::vector<PlannedCopy> plan;
  std::set<std::string> found;
  for (const auto& [full_name, src] : tensors) {
    if (!starts_with(full_name, prefix)) continue;
    std::string name = full_name.substr(prefix.size());
    auto it = wanted.find(name);
    if (it == wanted.end()) {
      report->unexpected_keys.push_back(full_name);
      continue;
    }
    KILN_CHECK(found.insert(name).second, "'", source, "': key '", full_name, "' appears twice");
    const Tensor& dst = it->second;
    KILN_CHECK(src.shape() == dst.shape(), "'", source, "': key '", full_name, "' has shape ",
               src.shape_str(), " but the module's tensor has shape ", dst.shape_str());
    KILN_CHECK(is_floating(src.dtype()) == is_floating(dst.dtype()), "'", source, "': key '",
               full_name, "' is ", dtype_name(src.dtype()), " but the module's tensor is ",
               dtype_name(dst.dtype()), " (floating and non-floating values do not convert)");
    plan.push_back({dst, src});
  }
  for (const std::string& name : order)
    if (!found.count(name)) report->missing_keys.push_back(prefix + name);
  if (match == KeyMatch::Strict) {
    const auto& miss = report->missing_keys;
    const auto& extra = report->unexpected_keys;
    KILN_CHECK(miss.empty() && extra.empty(), "'", source, "' does not match the ",
               module.type_name(), " (strict load):",
               miss.empty() ? "" : " missing keys " + key_list(miss) + ";",
               extra.empty() ? "" : " unexpected keys " + key_list(extra) + ";");
  }
  return plan;
}

void apply_load(const std::vector<PlannedCopy>& plan) {
  NoGradGuard no_grad;
  // copy_ converts dtype and device and writes through dst's own strides (its memory format).
  for (const PlannedCopy& c : plan) c.dst.detach().copy_(c.src);
}

std::string int_meta(const std::map<std::string, std::string>& meta, const std::string& key,
                     const std::string& path) {
  auto it = meta.find(key);
  KILN_CHECK(it != meta.end(), "'", path, "': checkpoint metadata has no '", key, "'");
  return it->second;
}

int64_t parse_int(const std::string& s, const std::string& key, const std::string& path) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  KILN_CHECK(used == s.size() && !s.empty(), "'", path, "': metadata '", key, "' = '", s,
             "' is not an integer");
  return v;
}

}  // namespace

NamedTensors state_dict(const nn::Module& module) {
  NamedTensors out;
  std::set<const TensorImpl*> seen;
  for (const auto& [prefix, m] : module.named_modules()) {
    auto add = [&](const std::vector<nn::NamedTensor>& own) {
      for (const auto& [n, t] : own)
        if (seen.insert(t.impl_ptr().get()).second)
          out.emplace_back(prefix.empty() ? n : prefix + "." + n, t);
    };
    add(m->own_parameters());
    add(m->own_buffers());
  }
  return out;
}

NamedTensors weights_state(const nn::Module& module, WeightsDType dtype) {
  NoGradGuard no_grad;
  NamedTensors out;
  for (auto [name, t] : state_dict(module)) {
    t = t.detach();
    if (dtype == WeightsDType::Float32 && is_floating(t.dtype())) t = t.to(DType::f32);
    out.emplace_back(std::move(name), std::move(t));
  }
  return out;
}

void save_weights(const std::string& path, const nn::Module& module, WeightsDType dtype,
                  const std::map<std::string, std::string>& metadata) {
  save_safetensors(path, weights_state(module, dtype), metadata);
}

LoadReport load_state(const NamedTensors& tensors, nn::Module& module, KeyMatch match,
                      const std::string& source, const std::string& prefix) {
  LoadReport report;
  apply_load(plan_load(tensors, module, match, source, prefix, &report));
  return report;
}

LoadReport load_weights(const std::string& path, nn::Module& module, KeyMatch match) {
  SafetensorsData data = load_safetensors(path);
  return load_state(data.tensors, module, match, path);
}

void save_checkpoint(const std::string& path, const TrainingState& state) {
  write_file_atomic(path, checkpoint_bytes(path, state));
}

std::string checkpoint_bytes(const std::string& path, const TrainingState& state) {
  return checkpoint_host(path, state).join();
}

SafetensorsHost checkpoint_host(const std::string& path, const TrainingState& state) {
  KILN_CHECK(state.model != nullptr, "save_checkpoint '", path, "': TrainingState.model is null");
  std::map<std::string, std::string> meta;
  for (const auto& [k, v] : state.metadata) {
    KILN_CHECK(!starts_with(k, "kiln."), "save_checkpoint '", path, "': metadata key '", k,
               "' uses the reserved prefix 'kiln.'");
    meta[k] = v;
  }
  meta["kiln.format"] = kFormat;
  meta["kiln.epoch"] = std::to_string(state.epoch);
  meta["kiln.step"] = std::to_string(state.step);
  meta[std::string(kRngPrefix) + "default"] = default_generator().state();
  for (const auto& [name, gen] : state.generators) {
    KILN_CHECK(!name.empty() && name != "default" && gen != nullptr, "save_checkpoint '", path,
               "': generator '", name, "' needs a non-empty name other than 'default' and a "
               "non-null pointer");
    meta[kRngPrefix + name] = gen->state();
  }
  // Every device's dropout stream (core/generator.h's philox_stream) that has drawn.
  for (const auto& [dev, st] : philox_states())
    meta[std::string(kRngPrefix) + "philox." + dev.str()] = st;

  NoGradGuard no_grad;
  NamedTensors tensors;
  for (const auto& [name, t] : state_dict(*state.model))
    tensors.emplace_back(kModelPrefix + name, t.detach());
  if (state.optimizer)
    for (const auto& [key, t] : state.optimizer->state_dict())
      tensors.emplace_back(kOptimPrefix + key, t);
  for (const auto& [key, t] : state.scaler) tensors.emplace_back(kScalerPrefix + key, t);
  return safetensors_host(path, tensors, meta);
}

void load_checkpoint(const std::string& path, TrainingState& state) {
  KILN_CHECK(state.model != nullptr, "load_checkpoint '", path, "': TrainingState.model is null");
  SafetensorsData data = load_safetensors(path);
  const auto& meta = data.metadata;
  auto fmt = meta.find("kiln.format");
  KILN_CHECK(fmt != meta.end() && fmt->second == kFormat, "'", path,
             "' is not a kiln training checkpoint (metadata 'kiln.format' is ",
             fmt == meta.end() ? std::string("missing") : "'" + fmt->second + "'",
             ", expected '", kFormat, "'); model weights load with load_weights");

  // Validate everything that can fail before changing any live object.
  int64_t epoch = parse_int(int_meta(meta, "kiln.epoch", path), "kiln.epoch", path);
  int64_t step = parse_int(int_meta(meta, "kiln.step", path), "kiln.step", path);
  KILN_CHECK(epoch >= 0 && step >= 0, "'", path, "': metadata 'kiln.epoch' = ", epoch,
             ", 'kiln.step' = ", step, ": a checkpoint's epoch and step are never negative");
  std::vector<std::pair<Generator*, Generator>> rng;
  auto restore_rng = [&](const std::string& name, Generator* target) {
    Generator g;
    try {
      g.set_state(int_meta(meta, kRngPrefix + name, path));
    } catch (const Error& e) {
      KILN_FAIL("'", path, "': RNG state '", kRngPrefix, name, "': ", strip_location(e.what()));
    }
    rng.emplace_back(target, g);
  };
  restore_rng("default", &default_generator());
  for (const auto& [name, gen] : state.generators) {
    KILN_CHECK(gen != nullptr, "load_checkpoint '", path, "': generator '", name, "' is null");
    restore_rng(name, gen);
  }
  std::vector<std::pair<Device, std::string>> philox;
  const std::string philox_prefix = std::string(kRngPrefix) + "philox.";
  for (const auto& [k, v] : meta) {
    if (!starts_with(k, philox_prefix)) continue;
    Device d;
    try {
      d = Device::parse(k.substr(philox_prefix.size()));
    } catch (const Error&) {
      KILN_FAIL("'", path, "': metadata '", k, "' names no device");
    }
    philox.emplace_back(d, v);
  }
  LoadReport unused;
  std::vector<PlannedCopy> plan =
      plan_load(data.tensors, *state.model, KeyMatch::Strict, path, kModelPrefix, &unused);
  std::map<std::string, Tensor> optim, scaler;
  for (const auto& [name, t] : data.tensors) {
    if (starts_with(name, kOptimPrefix)) optim[name.substr(std::strlen(kOptimPrefix))] = t;
    else if (starts_with(name, kScalerPrefix)) scaler[name.substr(std::strlen(kScalerPrefix))] = t;
    else KILN_CHECK(starts_with(name, kModelPrefix), "'", path, "': unexpected tensor '", name,
                    "' (expected the prefixes model., optim. or scaler.)");
  }
  KILN_CHECK(state.optimizer != nullptr || optim.empty(), "'", path, "' holds optimizer state (",
             optim.size(), " tensors) but TrainingState.optimizer is null");
  if (state.optimizer) {
    // load_state_dict may fail part-way; the old state's tensors stay valid, so put them back.
    std::map<std::string, Tensor> previous = state.optimizer->state_dict();
    try {
      state.optimizer->load_state_dict(optim);
    } catch (const Error& e) {
      state.optimizer->load_state_dict(previous);
      KILN_FAIL("'", path, "': optimizer state: ", strip_location(e.what()));
    }
  }
  apply_load(plan);
  for (auto& [target, g] : rng) *target = g;
  for (const auto& [d, st] : philox)  // streams of devices this process has
    if (d.is_cpu() || (has_backend(d.type) && d.index < cuda_device_count()))
      set_philox_state(d, st);
  state.scaler = std::move(scaler);
  state.epoch = epoch;
  state.step = step;
  state.metadata.clear();
  for (const auto& [k, v] : meta)
    if (!starts_with(k, "kiln.")) state.metadata[k] = v;
}

}  // namespace kiln
