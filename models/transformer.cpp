#include "models/transformer.h"

#include <cmath>
#include <sstream>

namespace kiln::nn {

namespace init {

const Tensor& xavier_uniform_(const Tensor& t, double gain, Generator* gen) {
  const auto [fan_in, fan_out] = fan_in_out(t);
  const double bound = gain * std::sqrt(6.0 / double(fan_in + fan_out));
  return uniform_(t, -bound, bound, gen);
}

const Tensor& trunc_normal_(const Tensor& t, double mean, double std, double a, double b,
                            Generator* gen) {
  KILN_CHECK(a < b && std > 0, "init::trunc_normal_: bounds [", a, ", ", b, "] and std ", std);
  Generator& g = gen ? *gen : default_generator();
  std::vector<double> v(size_t(t.numel()));
  for (double& x : v) {
    int tries = 0;
    do {
      x = mean + std * g.normal();
      KILN_CHECK(++tries < 1000, "init::trunc_normal_: [", a, ", ", b,
                 "] holds almost none of N(", mean, ", ", std, "²)");
    } while (x < a || x > b);
  }
  NoGradGuard no_grad;
  t.copy_(from_vector(v, t.shape(), DType::f64));
  return t;
}

}  // namespace init

// ---------------- LayerNorm ----------------
LayerNorm::LayerNorm(int64_t features, double eps, bool affine) : features_(features), eps_(eps) {
  KILN_CHECK(features > 0, "LayerNorm: features ", features, " must be positive");
  if (affine) {
    weight_ = register_parameter("weight", ones({features}));
    bias_ = register_parameter("bias", zeros({features}));
  }
}

Tensor LayerNorm::forward(const Tensor& x) {
  return F::layer_norm(x, {features_}, weight_, bias_, eps_);
}

std::string LayerNorm::describe() const {
  std::ostringstream os;
  os << "LayerNorm(" << features_ << ", eps=" << eps_ << (weight_.defined() ? "" : ", affine=false")
     << ")";
  return os.str();
}

// ---------------- Dropout, Embedding ----------------
Dropout::Dropout(double p) : p_(p) {
  KILN_CHECK(p >= 0.0 && p <= 1.0, "Dropout: p ", p, " must be in [0, 1]");
}

std::string Dropout::describe() const {
  std::ostringstream os;
  os << "Dropout(p=" << p_ << ")";
  return os.str();
}

Embedding::Embedding(int64_t num, int64_t dim, Generator* gen) : num_(num), dim_(dim) {
  KILN_CHECK(num > 0 && dim > 0, "Embedding: (", num, ", ", dim, ") must be positive");
  weight_ = register_parameter("weight", empty({num, dim}));
  init::normal_(weight_, 0.0, 1.0, gen);
}

std::string Embedding::describe() const {
  std::ostringstream os;
  os << "Embedding(" << num_ << ", " << dim_ << ")";
  return os.str();
}

// ---------------- MultiheadAttention ----------------
MultiheadAttention::MultiheadAttention(int64_t embed_dim, int64_t num_heads, double dropout,
                                       bool bias, Generator* gen)
    : embed_(embed_dim), heads_(num_heads), dropout_(dropout) {
  KILN_CHECK(embed_dim > 0 && num_heads > 0 && embed_dim % num_heads == 0,
             "MultiheadAttention: embed_dim ", embed_dim, " must be a positive multiple of "
             "num_heads ", num_heads);
  KILN_CHECK(dropout >= 0 && dropout < 1, "MultiheadAttention: dropout ", dropout,
             " must be in [0, 1)");
  in_proj_weight_ = register_parameter("in_proj_weight", empty({3 * embed_dim, embed_dim}));
  init::xavier_uniform_(in_proj_weight_, 1.0, gen);
  if (bias) in_proj_bias_ = register_parameter("in_proj_bias", zeros({3 * embed_dim}));
  out_proj_ = register_module("out_proj", std::make_shared<Linear>(embed_dim, embed_dim, bias, gen));
  if (bias) init::constant_(out_proj_->bias(), 0.0);
}

Tensor MultiheadAttention::forward(const Tensor& x, bool causal) {
  KILN_CHECK(x.dim() == 3 && x.size(2) == embed_, "MultiheadAttention: x must be (batch, length, ",
             embed_, "), got ", x.desc());
  const int64_t B = x.size(0), L = x.size(1), D = embed_ / heads_;
  // (B·L, 3E) -> (B, L, 3, H, D): the attention reads q, k, v in place and its backward writes
  // their gradients into one tensor of this shape.
  const Tensor qkv = F::linear(x.reshape({B * L, embed_}), in_proj_weight_, in_proj_bias_)
                         .view({B, L, 3, heads_, D});
  const Tensor o = F::packed_attention(qkv, causal, is_training() ? dropout_ : 0.0);
  return (*out_proj_)(o.view({B * L, embed_})).view({B, L, embed_});  // (B, L, H, D) dense
}

std::string MultiheadAttention::describe() const {
  std::ostringstream os;
  os << "MultiheadAttention(" << embed_ << ", heads=" << heads_ << ", dropout=" << dropout_ << ")";
  return os.str();
}

// ---------------- EncoderBlock ----------------
EncoderBlock::EncoderBlock(int64_t num_heads, int64_t hidden, int64_t mlp_dim, double dropout,
                           double attention_dropout, double eps, Generator* gen) {
  ln_1_ = register_module("ln_1", std::make_shared<LayerNorm>(hidden, eps));
  attn_ = register_module("self_attention", std::make_shared<MultiheadAttention>(
                                                hidden, num_heads, attention_dropout, true, gen));
  dropout_ = register_module("dropout", std::make_shared<Dropout>(dropout));
  ln_2_ = register_module("ln_2", std::make_shared<LayerNorm>(hidden, eps));
  fc1_ = std::make_shared<Linear>(hidden, mlp_dim, true, gen);
  auto fc2 = std::make_shared<Linear>(mlp_dim, hidden, true, gen);
  for (const auto& fc : {fc1_, fc2}) {  // torchvision's MLPBlock init
    init::xavier_uniform_(fc->weight(), 1.0, gen);
    init::normal_(fc->bias(), 0.0, 1e-6, gen);
  }
  mlp_ = register_module("mlp", std::make_shared<Sequential>(std::initializer_list<ModulePtr>{
                                    fc1_, std::make_shared<GELU>(), std::make_shared<Dropout>(dropout),
                                    fc2, std::make_shared<Dropout>(dropout)}));
}

Tensor EncoderBlock::forward(const Tensor& x) {
  const Tensor h = F::add(x, (*dropout_)((*attn_)((*ln_1_)(x))));
  return F::add(h, mlp_forward((*ln_2_)(h)));
}

// mlp.0 (Linear) and mlp.1 (GELU) as one op, F::linear_gelu (on CUDA the bias is added in the
// GELU's pass, not in the GEMM's epilogue), then mlp.2 onwards in order.
Tensor EncoderBlock::mlp_forward(const Tensor& x) {
  Shape shape = x.shape();
  Tensor m = F::linear_gelu(x.reshape({-1, shape.back()}), fc1_->weight(), fc1_->bias());
  shape.back() = m.size(1);
  m = m.view(shape);
  for (size_t i = 2; i < mlp_->size(); ++i) m = (*(*mlp_)[i])(m);
  return m;
}

}  // namespace kiln::nn
