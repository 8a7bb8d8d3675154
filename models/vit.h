#pragma once
// Vision transformers in torchvision's VisionTransformer layout and names, so that torchvision's
// weights load strictly (optim/checkpoint.h) and give the same logits:
//
//   conv_proj.{weight, bias}                      the patch embedding, Conv2d(3, hidden, p, p)
//   class_token (1, 1, hidden)
//   encoder.pos_embedding (1, seq, hidden)        seq = (image/patch)² + 1
//   encoder.layers.encoder_layer_N.{ln_1, self_attention, ln_2, mlp.0, mlp.3}
//                                                 (models/transformer.h's EncoderBlock)
//   encoder.ln.{weight, bias}
//   heads.head.{weight, bias}
//
// x (N, 3, image, image) -> logits (N, classes): patches embedded, the class token prepended,
// positions added, the encoder blocks, the final LayerNorm, the class token's row through the
// head. Initialisation as torchvision's: conv_proj trunc-normal std sqrt(1/fan_in), bias 0;
// class_token 0; pos_embedding N(0, 0.02²); the head 0.
#include "models/transformer.h"

namespace kiln::models {

struct ViTOptions {
  int64_t image_size = 224;
  int64_t patch_size = 16;
  int64_t num_layers = 12;
  int64_t num_heads = 12;
  int64_t hidden_dim = 768;
  int64_t mlp_dim = 3072;
  int64_t num_classes = 1000;
  int64_t in_channels = 3;
  double dropout = 0.0;
  double attention_dropout = 0.0;
};

class VisionTransformer : public nn::Module {
 public:
  explicit VisionTransformer(const ViTOptions& o, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "VisionTransformer"; }
  std::string describe() const override;
  const ViTOptions& options() const { return o_; }
  std::vector<std::string> half_parameters() const override { return {"class_token"}; }
  std::vector<std::string> no_weight_decay() const override { return {"class_token"}; }

 private:
  class Encoder;
  ViTOptions o_;
  std::shared_ptr<nn::Conv2d> conv_proj_;
  Tensor class_token_;
  std::shared_ptr<Encoder> encoder_;
  std::shared_ptr<nn::Sequential> heads_;
};

// torchvision's configurations: vit_b_16 (12 layers, 12 heads, 768, MLP 3072) and vit_s_16
// (12 layers, 6 heads, 384, MLP 1536; DeiT-S's shape); and vit_t_4 for small photos: DeiT-Ti's
// shape (12 layers, 3 heads, 192, MLP 768) on 4x4 patches (a 32x32 image: 64 patches + the
// class token).
ViTOptions vit_b_16_options(int64_t num_classes = 1000, int64_t image_size = 224);
ViTOptions vit_s_16_options(int64_t num_classes = 1000, int64_t image_size = 224);
ViTOptions vit_t_4_options(int64_t num_classes = 10, int64_t image_size = 32);
// One of the above by name ("vit_b_16", "vit_s_16", "vit_t_4"); throws for another name.
ViTOptions vit_options(const std::string& name, int64_t num_classes, int64_t image_size);
std::shared_ptr<VisionTransformer> vit_b_16(int64_t num_classes = 1000, Generator* gen = nullptr);
std::shared_ptr<VisionTransformer> vit_s_16(int64_t num_classes = 1000, Generator* gen = nullptr);

}  // namespace kiln::models
