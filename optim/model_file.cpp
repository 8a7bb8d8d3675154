#include "optim/model_file.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "core/json.h"
#include "core/text.h"
#include "models/vit.h"
#include "models/zoo.h"
#include "optim/checkpoint.h"

namespace kiln {

namespace {

constexpr const char* kModelFormat = "kiln-model-1";

struct Spec {
  models::BlockKind kind;
  std::vector<int64_t> layers;
};

const std::map<std::string, Spec>& specs() {
  static const std::map<std::string, Spec> s = {
      {"resnet_small", {models::BlockKind::Basic, {1, 1, 1}}},
      {"resnet18", {models::BlockKind::Basic, {2, 2, 2, 2}}},
      {"resnet34", {models::BlockKind::Basic, {3, 4, 6, 3}}},
      {"resnet50", {models::BlockKind::Bottleneck, {3, 4, 6, 3}}},
      {"resnet101", {models::BlockKind::Bottleneck, {3, 4, 23, 3}}},
      {"resnet152", {models::BlockKind::Bottleneck, {3, 8, 36, 3}}}};
  return s;
}

std::string float_list(const std::vector<float>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.6g", double(v[i]));
    s += (i ? ", " : "") + std::string(buf);
  }
  return s + "]";
}

// A metadata value for a message: control characters escaped, at most 80 bytes.
std::string shown(const std::string& text) {
  return text::printable(text.substr(0, 80)) + (text.size() > 80 ? "..." : "");
}

std::string arch_list() {
  std::string list;
  for (const auto& name : models::all_model_names()) list += (list.empty() ? "" : ", ") + name;
  return list;
}

bool known_arch(const std::string& arch) {
  const auto names = models::all_model_names();
  return std::find(names.begin(), names.end(), arch) != names.end();
}

bool is_vit(const std::string& arch) { return models::is_vit_name(arch); }

int64_t meta_int(const std::string& text, const std::string& key, const std::string& source,
                 int64_t lo, int64_t hi, const char* range = nullptr) {
  int64_t v = 0;
  const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  KILN_CHECK(r.ec == std::errc() && r.ptr == text.data() + text.size() && v >= lo && v <= hi, "'",
             source, "': metadata '", key, "' = '", shown(text), "' is not an integer in ", lo,
             "..", hi, range ? range : "");
  return v;
}

json::Value meta_array(const std::string& text, const std::string& key, const std::string& source) {
  json::Value v;
  try {
    v = json::parse(text);
  } catch (const Error&) {
    KILN_FAIL("'", source, "': metadata '", key, "' is not a JSON array: ", shown(text));
  }
  KILN_CHECK(v.kind() == json::Value::Kind::Array, "'", source, "': metadata '", key,
             "' is not a JSON array: ", shown(text));
  return v;
}

// The range check of one mean or std value; `what` names it for the message.
void check_norm(double x, bool is_std, const std::string& what) {
  if (is_std)
    KILN_CHECK(x >= kMinStd && x <= kMaxNorm, what, " holds ", x, ", outside ", kMinStd, "..",
               kMaxNorm);
  else
    KILN_CHECK(x >= -kMaxNorm && x <= kMaxNorm, what, " holds ", x, ", outside ", -kMaxNorm, "..",
               kMaxNorm);
}

}  // namespace

std::string class_name_problem(const std::string& name) {
  if (name.empty()) return "is empty";
  if (const size_t bad = text::invalid_utf8_at(name); bad != std::string::npos) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "is not valid UTF-8 (byte 0x%02x at offset %zu)",
                  unsigned(static_cast<unsigned char>(name[bad])), bad);
    return buf;
  }
  bool blank = true;
  char32_t cp;
  for (size_t i = 0, n; i < name.size(); i += n) {
    n = text::decode_utf8(name, i, &cp);
    if (text::is_control(cp)) {
      char buf[48];
      std::snprintf(buf, sizeof buf, "holds control character U+%04X", unsigned(cp));
      return buf;
    }
    blank = blank && text::is_space(cp);
  }
  return blank ? "is only whitespace" : "";
}

void check_class_names(const std::vector<std::string>& names, const std::string& source) {
  std::map<std::string, size_t> seen;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string problem = class_name_problem(names[i]);
    KILN_CHECK(problem.empty(), source, ": class ", i, " '", shown(names[i]), "' ", problem);
    const auto [it, fresh] = seen.emplace(names[i], i);
    KILN_CHECK(fresh, source, ": class ", i, " '", shown(names[i]), "' repeats class ", it->second);
  }
}

void check_model_info(const ModelInfo& m, const std::string& source) {
  KILN_CHECK(known_arch(m.arch), source, ": arch '", shown(m.arch), "' is not one of ",
             arch_list());
  const int64_t patch = is_vit(m.arch) ? models::vit_options(m.arch, 1, 224).patch_size : 1;
  KILN_CHECK(m.image_size % patch == 0, source, ": image_size ", m.image_size, " of a ", m.arch,
             " must be a multiple of its patch size ", patch);
  auto in = [&](const char* field, int64_t v, int64_t lo, int64_t hi) {
    KILN_CHECK(v >= lo && v <= hi, source, ": ", field, " ", v, " is outside ", lo, "..", hi);
  };
  in("num_classes", m.num_classes, 1, kMaxClasses);
  in("in_channels", m.in_channels, 1, kMaxInChannels);
  in("width", m.width, 1, kMaxWidth);
  in("image_size", m.image_size, 1, kMaxImageSize);
  in("resize_size", m.resize_size, m.image_size, kMaxResizeSize);
  for (const bool is_std : {false, true}) {
    const std::vector<float>& v = is_std ? m.std : m.mean;
    const char* key = is_std ? "std" : "mean";
    KILN_CHECK(v.size() == size_t(m.in_channels), source, ": ", key, " has ", v.size(),
               " values for ", m.in_channels, " input channel(s)");
    for (float x : v) check_norm(double(x), is_std, source + ": " + key);
  }
  KILN_CHECK(m.class_names.empty() || m.class_names.size() == size_t(m.num_classes), source, ": ",
             m.class_names.size(), " class names for ", m.num_classes, " classes");
  check_class_names(m.class_names, source);
}

std::map<std::string, std::string> model_metadata(const ModelInfo& m) {
  check_model_info(m, "model metadata");
  std::string names = "[";
  for (size_t i = 0; i < m.class_names.size(); ++i)
    names += (i ? ", " : "") + json::quote(m.class_names[i]);
  names += "]";
  std::map<std::string, std::string> meta = {{"format", kModelFormat},
                                             {"arch", m.arch},
                                             {"num_classes", std::to_string(m.num_classes)},
                                             {"in_channels", std::to_string(m.in_channels)},
                                             {"width", std::to_string(m.width)},
                                             {"stem", m.imagenet_stem ? "imagenet" : "small"},
                                             {"image_size", std::to_string(m.image_size)},
                                             {"resize_size", std::to_string(m.resize_size)},
                                             {"mean", float_list(m.mean)},
                                             {"std", float_list(m.std)}};
  if (!m.class_names.empty()) meta["class_names"] = names;
  return meta;
}

ModelInfo read_model_metadata(const std::map<std::string, std::string>& meta,
                              const std::string& source, const ModelInfo& defaults,
                              std::vector<std::string>* absent) {
  ModelInfo m = defaults;
  auto get = [&](const char* key) -> const std::string* {
    auto it = meta.find(key);
    if (it != meta.end()) return &it->second;
    if (absent) absent->push_back(key);
    return nullptr;
  };
  if (const std::string* v = get("arch")) {
    KILN_CHECK(known_arch(*v), "'", source, "': metadata 'arch' = '", shown(*v),
               "' is not one of ", arch_list());
    m.arch = *v;
  }
  if (const std::string* v = get("num_classes"))
    m.num_classes = meta_int(*v, "num_classes", source, 1, kMaxClasses);
  if (const std::string* v = get("in_channels"))
    m.in_channels = meta_int(*v, "in_channels", source, 1, kMaxInChannels);
  if (const std::string* v = get("width")) m.width = meta_int(*v, "width", source, 1, kMaxWidth);
  if (const std::string* v = get("stem")) {
    KILN_CHECK(*v == "imagenet" || *v == "small", "'", source, "': metadata 'stem' = '", shown(*v),
               "', expected imagenet or small");
    m.imagenet_stem = *v == "imagenet";
  }
  if (const std::string* v = get("image_size"))
    m.image_size = meta_int(*v, "image_size", source, 1, kMaxImageSize);
  if (const std::string* v = get("resize_size"))
    m.resize_size =
        meta_int(*v, "resize_size", source, m.image_size, kMaxResizeSize, " (at least image_size)");
  else
    m.resize_size = std::max(m.resize_size, m.image_size);
  for (const bool is_std : {false, true}) {
    const char* key = is_std ? "std" : "mean";
    std::vector<float>& out = is_std ? m.std : m.mean;
    if (const std::string* v = get(key)) {
      out.clear();
      const json::Value list = meta_array(*v, key, source);
      for (const json::Value& x : list.array()) {
        KILN_CHECK(x.kind() == json::Value::Kind::Number, "'", source, "': metadata '", key,
                   "' holds a non-number");
        check_norm(x.number(), is_std, "'" + source + "': metadata '" + key + "'");
        out.push_back(float(x.number()));
      }
    }
    KILN_CHECK(out.size() == size_t(m.in_channels), "'", source, "': metadata '", key, "' has ",
               out.size(), " values for ", m.in_channels, " input channel(s)",
               meta.count(key) ? "" : " (it is absent: these are the defaults)");
  }
  if (const std::string* v = get("class_names")) {
    m.class_names.clear();
    const json::Value list = meta_array(*v, "class_names", source);
    for (const json::Value& x : list.array()) {
      KILN_CHECK(x.kind() == json::Value::Kind::String, "'", source,
                 "': metadata 'class_names' holds a non-string");
      m.class_names.push_back(x.str());
    }
    KILN_CHECK(m.class_names.size() == size_t(m.num_classes), "'", source, "': metadata has ",
               m.class_names.size(), " class names for ", m.num_classes, " classes");
  }
  return m;
}

void check_metadata_matches_weights(const ModelInfo& meta, const ModelInfo& weights,
                                    const std::string& source) {
  auto agree = [&](const char* key, const std::string& a, const std::string& b) {
    KILN_CHECK(a == b, "'", source, "': metadata '", key, "' = '", shown(a),
               "' but its weights hold ", b);
  };
  agree("arch", meta.arch, weights.arch);
  agree("num_classes", std::to_string(meta.num_classes), std::to_string(weights.num_classes));
  agree("in_channels", std::to_string(meta.in_channels), std::to_string(weights.in_channels));
  agree("width", std::to_string(meta.width), std::to_string(weights.width));
  agree("stem", meta.imagenet_stem ? "imagenet" : "small",
        weights.imagenet_stem ? "imagenet" : "small");
}

std::string classifier_prefix(const std::string& arch) {
  return is_vit(arch) ? "heads.head." : "fc.";
}

std::shared_ptr<nn::Module> build_model(const ModelInfo& info, uint64_t seed) {
  if (is_vit(info.arch)) {
    models::ViTOptions o = models::vit_options(info.arch, info.num_classes, info.image_size);
    o.in_channels = info.in_channels;
    Generator g(seed);
    return std::make_shared<models::VisionTransformer>(o, &g);
  }
  auto it = specs().find(info.arch);
  if (it == specs().end()) models::family_of(info.arch);  // throws, listing valid names
  models::ResNetOptions o;
  o.num_classes = info.num_classes;
  o.in_channels = info.in_channels;
  o.width = info.width;
  o.imagenet_stem = info.imagenet_stem;
  o.seed = seed;
  return std::make_shared<models::ResNet>(it->second.kind, it->second.layers, o);
}

ModelInfo infer_model_info(const NamedTensors& weights, const std::string& source,
                           const ModelInfo& defaults) {
  auto find = [&](const std::string& name) -> const Tensor* {
    for (const auto& [n, t] : weights)
      if (n == name) return &t;
    return nullptr;
  };
  if (const Tensor* token = find("class_token")) {  // a vision transformer
    const Tensor* proj = find("conv_proj.weight");
    const Tensor* head = find("heads.head.weight");
    const Tensor* pos = find("encoder.pos_embedding");
    KILN_CHECK(token->dim() == 3 && proj && proj->dim() == 4 && head && head->dim() == 2 && pos &&
                   pos->dim() == 3,
               "'", source, "' holds a class_token but not torchvision's ViT names (conv_proj, "
               "encoder.pos_embedding, heads.head)");
    ModelInfo m = defaults;
    const int64_t hidden = token->size(2);
    KILN_CHECK(hidden == 768 || hidden == 384 || hidden == 192, "'", source, "': a ViT of width ",
               hidden, " is none of vit_b_16 (768), vit_s_16 (384), vit_t_4 (192)");
    m.arch = hidden == 768 ? "vit_b_16" : hidden == 384 ? "vit_s_16" : "vit_t_4";
    const int64_t patch = models::vit_options(m.arch, 1, 224).patch_size;
    KILN_CHECK(proj->size(2) == patch && proj->size(3) == patch, "'", source, "': ", m.arch,
               "'s conv_proj cuts ", patch, "x", patch, " patches, this one ", proj->size(2), "x",
               proj->size(3));
    m.width = hidden;
    m.imagenet_stem = true;
    m.num_classes = head->size(0);
    m.in_channels = proj->size(1);
    const int64_t grid = int64_t(std::llround(std::sqrt(double(pos->size(1) - 1))));
    KILN_CHECK(grid * grid + 1 == pos->size(1), "'", source, "': encoder.pos_embedding holds ",
               pos->size(1), " positions, not a square grid plus the class token");
    m.image_size = grid * proj->size(2);
    m.resize_size = std::max(m.resize_size, m.image_size);
    if (m.mean.size() != size_t(m.in_channels)) {
      m.mean.assign(size_t(m.in_channels), 0.5f);
      m.std.assign(size_t(m.in_channels), 0.5f);
    }
    return m;
  }
  const Tensor* conv1 = find("conv1.weight");
  const Tensor* fc = find("fc.weight");
  KILN_CHECK(conv1 && fc && conv1->dim() == 4 && fc->dim() == 2, "'", source,
             "' does not hold a ResNet or ViT with torchvision's names (conv1.weight, fc.weight; "
             "class_token, conv_proj.weight)");
  ModelInfo m = defaults;
  m.num_classes = fc->size(0);
  m.width = conv1->size(0);
  m.in_channels = conv1->size(1);
  m.imagenet_stem = conv1->size(2) == 7;
  if (m.mean.size() != size_t(m.in_channels)) {
    // `defaults`' preprocessing is for another channel count: Fashion-MNIST's (kiln-train's
    // default job) for 1-channel models, else 0.5 per channel.
    if (m.in_channels == 1) {
      m.image_size = m.resize_size = 28;
      m.mean = {0.2860f};
      m.std = {0.3530f};
    } else {
      m.mean.assign(size_t(m.in_channels), 0.5f);
      m.std.assign(size_t(m.in_channels), 0.5f);
    }
  }
  const bool bottleneck = find("layer1.0.conv3.weight") != nullptr;
  std::vector<int64_t> layers;
  for (int stage = 1; find("layer" + std::to_string(stage) + ".0.conv1.weight"); ++stage) {
    int64_t blocks = 0;
    while (find("layer" + std::to_string(stage) + "." + std::to_string(blocks) + ".conv1.weight"))
      ++blocks;
    layers.push_back(blocks);
  }
  m.arch.clear();
  for (const auto& [name, spec] : specs())
    if (spec.layers == layers && (spec.kind == models::BlockKind::Bottleneck) == bottleneck)
      m.arch = name;
  KILN_CHECK(!m.arch.empty(), "'", source, "': its blocks per stage match none of kiln's ResNets");
  return m;
}

LoadedModel load_model_file(const std::string& path) {
  SafetensorsData file = load_safetensors(path);
  if (file.metadata.count("kiln.format")) {  // a training checkpoint: its "model." tensors
    NamedTensors model;
    for (auto& [name, t] : file.tensors)
      if (name.rfind("model.", 0) == 0) model.emplace_back(name.substr(6), t);
    file.tensors = std::move(model);
  }
  check_finite(file, "model file");
  LoadedModel out;
  std::vector<std::string> absent;
  const ModelInfo shape = infer_model_info(file.tensors, path);
  const bool described =
      file.metadata.count("format") && file.metadata.at("format") == kModelFormat;
  out.info = described ? read_model_metadata(file.metadata, path, shape, &absent) : shape;
  if (described) check_metadata_matches_weights(out.info, shape, path);
  if (!described) {
    out.notes = "'" + path + "' has no kiln model metadata: " + out.info.arch +
                " read off its weights; using image size " + std::to_string(out.info.image_size) +
                ", " +
                (out.info.in_channels == 1   ? "Fashion-MNIST's"
                 : out.info.in_channels == 3 ? "ImageNet's"
                                             : "mean 0.5, std 0.5") +
                " normalisation, numbered classes";
  } else if (!absent.empty() && !(absent.size() == 1 && absent[0] == "class_names")) {
    std::string keys;
    for (const std::string& k : absent) keys += (keys.empty() ? "" : ", ") + k;
    out.notes = "'" + path + "': metadata lacks " + keys + "; defaults used";
  }
  out.model = build_model(out.info);
  load_state(file.tensors, *out.model, KeyMatch::Strict, path);
  out.model->eval();
  return out;
}

}  // namespace kiln
