#include "models/zoo.h"

#include "models/resnet.h"
#include "models/vit.h"

namespace kiln::models {

std::vector<std::string> all_model_names() {
  std::vector<std::string> names = model_names();
  names.push_back("vit_b_16");
  names.push_back("vit_s_16");
  names.push_back("vit_t_4");
  return names;
}

Family family_of(const std::string& name) {
  if (is_vit_name(name)) return Family::ViT;
  for (const std::string& n : model_names())
    if (n == name) return Family::ResNet;
  std::string valid;
  for (const auto& n : all_model_names()) valid += (valid.empty() ? "" : ", ") + n;
  KILN_FAIL("unknown model '", name, "'; valid names: ", valid);
}

bool is_vit_name(const std::string& name) {
  return name == "vit_b_16" || name == "vit_s_16" || name == "vit_t_4";
}

std::shared_ptr<nn::Module> create_model(const std::string& name, int64_t num_classes,
                                         Generator* gen, double dropout) {
  if (family_of(name) == Family::ResNet) return make_model(name, num_classes);
  ViTOptions o = name == "vit_t_4" ? vit_t_4_options(num_classes)
                                   : vit_options(name, num_classes, 224);
  o.dropout = dropout;
  return std::make_shared<VisionTransformer>(o, gen);
}

int64_t default_image_size(const std::string& name) { return name == "vit_t_4" ? 32 : 224; }

double train_gflop_per_image(const std::string& name) {
  if (name == "resnet50") return 24.3;
  if (name == "vit_b_16") return 105.9;
  if (name == "vit_s_16") return 27.6;
  if (name == "vit_t_4") return 2.19;  // at 32x32: 365 M multiply-adds forward, counted by layer
  // torchvision's published forward multiply-adds at 224x224, x 6 (two FLOPs each, forward and
  // twice as much backward).
  if (name == "resnet18") return 6 * 1.814;
  if (name == "resnet34") return 6 * 3.664;
  if (name == "resnet101") return 6 * 7.801;
  if (name == "resnet152") return 6 * 11.514;
  return 0.0;
}

}  // namespace kiln::models
