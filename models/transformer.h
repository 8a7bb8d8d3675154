#pragma once
// Transformer layers over kiln::F, with torch.nn's parameter names and default initialisations:
//
//   nn::LayerNorm(768, 1e-6)              weight (768) = 1, bias (768) = 0
//   nn::GELU(), nn::Dropout(0.1)
//   nn::Embedding(50257, 768)             weight ~ N(0, 1)
//   nn::MultiheadAttention(768, 12)       in_proj_weight (3·768, 768) xavier_uniform,
//                                         in_proj_bias (3·768) = 0, out_proj.{weight, bias}
//                                         (Linear init, then bias = 0), batch_first
//   nn::EncoderBlock(12, 768, 3072, ...)  torchvision's pre-norm ViT block: ln_1,
//                                         self_attention, ln_2, mlp.{0, 3} (mlp.0 and mlp.3
//                                         xavier_uniform, biases N(0, 1e-6))
//
// Activations are (batch, length, features). Under mixed precision (optim/amp.h) the
// attention's projections and the MLP's Linear layers compute in 16 bits; LayerNorm keeps f32
// parameters and statistics.
#include "models/nn.h"

namespace kiln::nn {

namespace init {
// U(±gain·sqrt(6 / (fan_in + fan_out))).
const Tensor& xavier_uniform_(const Tensor& t, double gain = 1.0, Generator* gen = nullptr);
// N(mean, std²) redrawn until inside [a, b] (torch.nn.init.trunc_normal_'s absolute bounds).
const Tensor& trunc_normal_(const Tensor& t, double mean = 0.0, double std = 1.0, double a = -2.0,
                            double b = 2.0, Generator* gen = nullptr);
}  // namespace init

// Normalises the trailing dim of x (..., features) (F::layer_norm).
class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t features, double eps = 1e-5, bool affine = true);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "LayerNorm"; }
  std::string describe() const override;
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }

 private:
  int64_t features_;
  double eps_;
  Tensor weight_, bias_;
};

class GELU : public Module {
 public:
  explicit GELU(F::GeluApproximate approximate = F::GeluApproximate::None)
      : approximate_(approximate) {}
  Tensor forward(const Tensor& x) override { return F::gelu(x, approximate_); }
  std::string type_name() const override { return "GELU"; }

 private:
  F::GeluApproximate approximate_;
};

// Zeroes elements with probability p in training (F::dropout); the identity in eval mode.
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5);
  Tensor forward(const Tensor& x) override { return F::dropout(x, p_, is_training()); }
  std::string type_name() const override { return "Dropout"; }
  std::string describe() const override;

 private:
  double p_;
};

// indices (i64, any shape) -> (indices..., dim) rows of weight (num, dim) (F::embedding).
// forward(x) takes the indices as x.
class Embedding : public Module {
 public:
  Embedding(int64_t num, int64_t dim, Generator* gen = nullptr);
  Tensor forward(const Tensor& indices) override { return F::embedding(indices, weight_); }
  std::string type_name() const override { return "Embedding"; }
  std::string describe() const override;
  const Tensor& weight() const { return weight_; }
  std::vector<std::string> half_parameters() const override { return {"weight"}; }

 private:
  int64_t num_, dim_;
  Tensor weight_;
};

// Multi-head self-attention over x (batch, length, embed_dim), PyTorch's nn.MultiheadAttention
// with batch_first: q, k, v = the three slices of x·in_proj_weightᵀ + in_proj_bias, each head
// F::scaled_dot_product_attention (dropout on its weights in training), then out_proj.
class MultiheadAttention : public Module {
 public:
  MultiheadAttention(int64_t embed_dim, int64_t num_heads, double dropout = 0.0, bool bias = true,
                     Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override { return forward(x, false); }
  // causal: position i attends to positions <= i.
  Tensor forward(const Tensor& x, bool causal);
  std::string type_name() const override { return "MultiheadAttention"; }
  std::string describe() const override;
  std::vector<std::string> half_parameters() const override {
    return {"in_proj_weight", "in_proj_bias"};
  }

 private:
  int64_t embed_, heads_;
  double dropout_;
  Tensor in_proj_weight_, in_proj_bias_;
  std::shared_ptr<Linear> out_proj_;
};

// torchvision's ViT encoder block (pre-norm): x + drop(attn(ln_1(x))), then + mlp(ln_2(x)) with
// mlp = Linear(hidden, mlp_dim), GELU, Dropout, Linear(mlp_dim, hidden), Dropout.
class EncoderBlock : public Module {
 public:
  EncoderBlock(int64_t num_heads, int64_t hidden, int64_t mlp_dim, double dropout = 0.0,
               double attention_dropout = 0.0, double eps = 1e-6, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;
  std::string type_name() const override { return "EncoderBlock"; }

 private:
  Tensor mlp_forward(const Tensor& x);

  std::shared_ptr<LayerNorm> ln_1_, ln_2_;
  std::shared_ptr<MultiheadAttention> attn_;
  std::shared_ptr<Dropout> dropout_;
  std::shared_ptr<Sequential> mlp_;  // mlp.0 Linear, mlp.1 GELU, mlp.2 Dropout, mlp.3 Linear, mlp.4
  std::shared_ptr<Linear> fc1_;      // mlp.0
};

}  // namespace kiln::nn
