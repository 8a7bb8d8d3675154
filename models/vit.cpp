#include "models/vit.h"

#include <cmath>
#include <sstream>

namespace kiln::models {

// torchvision's Encoder: pos_embedding, dropout, layers (encoder_layer_0 ...), ln.
class VisionTransformer::Encoder : public nn::Module {
 public:
  Encoder(const ViTOptions& o, int64_t seq, Generator* gen) {
    pos_embedding_ = register_parameter("pos_embedding", empty({1, seq, o.hidden_dim}));
    nn::init::normal_(pos_embedding_, 0.0, 0.02, gen);
    dropout_ = register_module("dropout", std::make_shared<nn::Dropout>(o.dropout));
    layers_ = register_module("layers", std::make_shared<nn::Sequential>());
    for (int64_t i = 0; i < o.num_layers; ++i)
      layers_->register_module("encoder_layer_" + std::to_string(i),
                               std::make_shared<nn::EncoderBlock>(o.num_heads, o.hidden_dim,
                                                                  o.mlp_dim, o.dropout,
                                                                  o.attention_dropout, 1e-6, gen));
    ln_ = register_module("ln", std::make_shared<nn::LayerNorm>(o.hidden_dim, 1e-6));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = (*dropout_)(F::add(x, pos_embedding_));
    for (const auto& [name, layer] : layers_->named_children()) h = (*layer)(h);
    return (*ln_)(h);
  }
  std::string type_name() const override { return "Encoder"; }
  std::vector<std::string> half_parameters() const override { return {"pos_embedding"}; }
  std::vector<std::string> no_weight_decay() const override { return {"pos_embedding"}; }

 private:
  Tensor pos_embedding_;
  std::shared_ptr<nn::Dropout> dropout_;
  std::shared_ptr<nn::Sequential> layers_;
  std::shared_ptr<nn::LayerNorm> ln_;
};

VisionTransformer::VisionTransformer(const ViTOptions& o, Generator* gen) : o_(o) {
  KILN_CHECK(o.image_size > 0 && o.patch_size > 0 && o.image_size % o.patch_size == 0,
             "VisionTransformer: image_size ", o.image_size, " must be a positive multiple of "
             "patch_size ", o.patch_size);
  KILN_CHECK(o.num_layers > 0 && o.num_classes > 0 && o.mlp_dim > 0 && o.in_channels > 0,
             "VisionTransformer: layers, classes, mlp_dim and in_channels must be positive");
  conv_proj_ = register_module("conv_proj",
                               std::make_shared<nn::Conv2d>(o.in_channels, o.hidden_dim,
                                                            o.patch_size, o.patch_size, 0, 1, 1,
                                                            true, gen));
  const int64_t fan_in = o.in_channels * o.patch_size * o.patch_size;
  nn::init::trunc_normal_(conv_proj_->weight(), 0.0, std::sqrt(1.0 / double(fan_in)), -2.0, 2.0,
                          gen);
  nn::init::constant_(conv_proj_->bias(), 0.0);
  class_token_ = register_parameter("class_token", zeros({1, 1, o.hidden_dim}));
  const int64_t grid = o.image_size / o.patch_size;
  encoder_ = register_module("encoder", std::make_shared<Encoder>(o, grid * grid + 1, gen));
  auto head = std::make_shared<nn::Linear>(o.hidden_dim, o.num_classes, true, gen);
  nn::init::constant_(head->weight(), 0.0);
  nn::init::constant_(head->bias(), 0.0);
  heads_ = register_module("heads", std::make_shared<nn::Sequential>());
  heads_->register_module("head", head);
}

Tensor VisionTransformer::forward(const Tensor& x) {
  KILN_CHECK(x.dim() == 4 && x.size(1) == o_.in_channels && x.size(2) == o_.image_size &&
                 x.size(3) == o_.image_size,
             "VisionTransformer: x must be (N, ", o_.in_channels, ", ", o_.image_size, ", ",
             o_.image_size, "), got ", x.desc());
  const int64_t n = x.size(0);
  // (N, hidden, g, g) -> (N, g·g, hidden): a view when the convolution wrote channels-last.
  const Tensor p = (*conv_proj_)(x);
  const Tensor tokens = p.permute({0, 2, 3, 1}).reshape({n, p.size(2) * p.size(3), o_.hidden_dim});
  const Tensor cls = class_token_.expand({n, 1, o_.hidden_dim});
  const Tensor h = (*encoder_)(F::cat({cls, tokens}, 1));
  return (*heads_)(h.select(1, 0));
}

std::string VisionTransformer::describe() const {
  std::ostringstream os;
  os << "VisionTransformer(image=" << o_.image_size << ", patch=" << o_.patch_size
     << ", layers=" << o_.num_layers << ", heads=" << o_.num_heads << ", hidden=" << o_.hidden_dim
     << ", mlp=" << o_.mlp_dim << ", classes=" << o_.num_classes << ")";
  return os.str();
}

ViTOptions vit_b_16_options(int64_t num_classes, int64_t image_size) {
  ViTOptions o;
  o.num_classes = num_classes;
  o.image_size = image_size;
  return o;
}

ViTOptions vit_s_16_options(int64_t num_classes, int64_t image_size) {
  ViTOptions o = vit_b_16_options(num_classes, image_size);
  o.num_heads = 6;
  o.hidden_dim = 384;
  o.mlp_dim = 1536;
  return o;
}

ViTOptions vit_t_4_options(int64_t num_classes, int64_t image_size) {
  ViTOptions o = vit_b_16_options(num_classes, image_size);
  o.patch_size = 4;
  o.num_heads = 3;
  o.hidden_dim = 192;
  o.mlp_dim = 768;
  return o;
}

ViTOptions vit_options(const std::string& name, int64_t num_classes, int64_t image_size) {
  if (name == "vit_b_16") return vit_b_16_options(num_classes, image_size);
  if (name == "vit_s_16") return vit_s_16_options(num_classes, image_size);
  KILN_CHECK(name == "vit_t_4", "unknown vision transformer '", name,
             "'; valid names: vit_b_16, vit_s_16, vit_t_4");
  return vit_t_4_options(num_classes, image_size);
}

std::shared_ptr<VisionTransformer> vit_b_16(int64_t num_classes, Generator* gen) {
  return std::make_shared<VisionTransformer>(vit_b_16_options(num_classes), gen);
}

std::shared_ptr<VisionTransformer> vit_s_16(int64_t num_classes, Generator* gen) {
  return std::make_shared<VisionTransformer>(vit_s_16_options(num_classes), gen);
}

}  // namespace kiln::models
