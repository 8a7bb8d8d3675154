// Transformer modules and the vision transformer on the CPU: torchvision's parameter names and
// counts, shapes through the network, gradients of a block (f64 gradcheck), MultiheadAttention
// against its definition, and a small ViT that learns.
#include <doctest/doctest.h>

#include <set>

#include "models/vit.h"
#include "models/zoo.h"
#include "optim/model_file.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "tests/gradcheck.h"

using namespace kiln;
using kiln::testing::compare;
using kiln::testing::gradcheck;

TEST_CASE("vit_b_16 and vit_s_16: torchvision's names, shapes and parameter counts") {
  auto b = models::vit_b_16();
  CHECK(b->num_parameters() == 86567656);  // torchvision's vit_b_16
  auto s = models::vit_s_16();
  CHECK(s->num_parameters() == 22050664);  // DeiT-S / vit_s_16
  std::map<std::string, Shape> shapes;
  for (const auto& [n, t] : b->named_parameters()) shapes[n] = t.shape();
  CHECK(shapes.at("conv_proj.weight") == Shape{768, 3, 16, 16});
  CHECK(shapes.at("class_token") == Shape{1, 1, 768});
  CHECK(shapes.at("encoder.pos_embedding") == Shape{1, 197, 768});
  CHECK(shapes.at("encoder.layers.encoder_layer_0.ln_1.weight") == Shape{768});
  CHECK(shapes.at("encoder.layers.encoder_layer_0.self_attention.in_proj_weight") == Shape{2304, 768});
  CHECK(shapes.at("encoder.layers.encoder_layer_0.self_attention.in_proj_bias") == Shape{2304});
  CHECK(shapes.at("encoder.layers.encoder_layer_11.self_attention.out_proj.weight") == Shape{768, 768});
  CHECK(shapes.at("encoder.layers.encoder_layer_5.mlp.0.weight") == Shape{3072, 768});
  CHECK(shapes.at("encoder.layers.encoder_layer_5.mlp.3.bias") == Shape{768});
  CHECK(shapes.at("encoder.ln.bias") == Shape{768});
  CHECK(shapes.at("heads.head.weight") == Shape{1000, 768});
  CHECK(shapes.size() == 4 + 12 * 12 + 2 + 2);  // conv 2, token, pos; 12 per block; ln; head
  // The head starts at zero (torchvision), so a fresh model's logits are all equal.
  auto tiny = std::make_shared<models::VisionTransformer>(models::ViTOptions{32, 8, 2, 4, 32, 64, 10});
  Tensor logits = (*tiny)(randn({3, 3, 32, 32}));
  CHECK(logits.shape() == Shape{3, 10});
  CHECK(F::max(F::mul(logits, logits)).item() == 0.0);
  CHECK_THROWS_AS((*tiny)(randn({3, 3, 24, 24})), Error);
}

TEST_CASE("vit_t_4: DeiT-Ti's shape on 4x4 patches of 32x32 photos; its weight-decay exemptions") {
  const models::ViTOptions o = models::vit_options("vit_t_4", 10, 32);
  CHECK(o.patch_size == 4);
  CHECK(o.hidden_dim == 192);
  CHECK(o.num_heads == 3);
  CHECK(o.mlp_dim == 768);
  CHECK(o.num_layers == 12);
  CHECK_THROWS_AS(models::vit_options("vit_x_9", 10, 32), Error);
  Generator g(1);
  auto t = models::create_model("vit_t_4", 10, &g);
  // 192·48 + 192 (conv_proj), 192 (token), 65·192 (positions), 12 blocks of 444,864, 2·192 (the
  // final norm), 1,930 (the head)
  CHECK(t->num_parameters() == 9408 + 192 + 12480 + 12 * 444864 + 384 + 1930);
  CHECK((*t)(randn({2, 3, 32, 32})).shape() == Shape{2, 10});
  CHECK(models::is_vit_name("vit_t_4"));
  CHECK_FALSE(models::is_vit_name("resnet18"));
  CHECK_FALSE(models::is_vit_name("nonsense"));
  CHECK(models::default_image_size("vit_t_4") == 32);
  CHECK(models::default_image_size("vit_b_16") == 224);
  CHECK(models::train_gflop_per_image("vit_t_4") == 2.19);
  CHECK(models::train_gflop_per_image("resnet18") == doctest::Approx(10.884));
  CHECK(models::train_gflop_per_image("resnet_small") == 0.0);  // unknown: its width varies
  // split_weight_decay: biases, norms, the class token and the position embedding decay-free.
  optim::ParamGroup proto;
  proto.weight_decay = 0.05;
  const auto groups = optim::split_weight_decay(*t, proto);
  REQUIRE(groups.size() == 2);
  CHECK(groups[0].weight_decay == 0.05);
  CHECK(groups[1].weight_decay == 0.0);
  std::set<std::string> free;
  for (const auto& [n, p] : t->named_parameters())
    for (const Tensor& q : groups[1].params)
      if (q.is_same(p)) free.insert(n);
  CHECK(free.count("class_token") == 1);
  CHECK(free.count("encoder.pos_embedding") == 1);
  CHECK(free.count("encoder.layers.encoder_layer_0.ln_1.weight") == 1);
  CHECK(free.count("conv_proj.bias") == 1);
  CHECK(free.count("conv_proj.weight") == 0);
  CHECK(free.count("encoder.layers.encoder_layer_0.mlp.0.weight") == 0);
  CHECK(groups[0].params.size() + groups[1].params.size() == t->parameters().size());
  // A model file without metadata: the arch from the width, the image size from the positions.
  const ModelInfo info = infer_model_info(t->named_parameters(), "t4");
  CHECK(info.arch == "vit_t_4");
  CHECK(info.image_size == 32);
  CHECK(info.num_classes == 10);
}

TEST_CASE("MultiheadAttention equals its definition; an encoder block's gradients") {
  manual_seed(4);
  nn::MultiheadAttention mha(8, 2);
  mha.to(DType::f64);
  const Tensor x = randn({2, 5, 8}, DType::f64);
  const Tensor y = mha(x);
  // By hand: project, split heads, softmax(q·kᵀ/√d)·v, merge, project.
  const auto params = mha.named_parameters();
  std::map<std::string, Tensor> p(params.begin(), params.end());
  const Tensor qkv = F::add(F::matmul(x, p.at("in_proj_weight").t()), p.at("in_proj_bias"));
  auto head = [&](int64_t part, int64_t h) { return qkv.narrow(2, part * 8 + h * 4, 4); };
  std::vector<Tensor> outs;
  for (int64_t h = 0; h < 2; ++h) {
    const Tensor s = F::mul(F::matmul(head(0, h), head(1, h).transpose(-2, -1)), 0.5);
    outs.push_back(F::matmul(F::softmax(s, -1), head(2, h)));
  }
  const Tensor want = F::add(F::matmul(F::cat(outs, 2), p.at("out_proj.weight").t()),
                             p.at("out_proj.bias"));
  KILN_CHECK_OK(compare(y, want, 1e-12, 1e-12));

  nn::EncoderBlock block(2, 8, 16);
  block.to(DType::f64);
  std::vector<Tensor> leaves = {randn({2, 3, 8}, DType::f64).set_requires_grad(true)};
  for (const Tensor& t : block.parameters()) leaves.push_back(t);
  KILN_CHECK_OK(gradcheck([&](auto& in) { return block(in[0]); }, leaves));
}

TEST_CASE("a small ViT learns to tell two kinds of images apart (AdamW, CPU)") {
  manual_seed(1);
  models::ViTOptions o{16, 4, 2, 2, 16, 32, 2};
  models::VisionTransformer vit(o);
  optim::AdamWOptions ao;
  ao.lr = 3e-3;
  optim::AdamW opt(vit.parameters(), ao);
  Generator g(5);
  // Class 1: a bright top half; class 0: a bright bottom half; noise on both.
  auto batch = [&](Tensor& x, Tensor& y) {
    y = randint(0, 2, {16}, DType::i64, &g);
    x = randn({16, 3, 16, 16}, DType::f32, &g) * 0.5;
    const auto labels = y.to_vector<int64_t>();
    NoGradGuard ng;
    for (int64_t i = 0; i < 16; ++i) x.select(0, i).narrow(1, labels[size_t(i)] ? 0 : 8, 8).add_(1.0);
  };
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    Tensor x, y;
    batch(x, y);
    Tensor loss = F::cross_entropy(vit(x), y);
    opt.zero_grad();
    loss.backward();
    opt.step();
    if (step < 5) first += loss.item() / 5;
    if (step >= 55) last += loss.item() / 5;
  }
  MESSAGE("loss ", first, " -> ", last);
  CHECK(last < 0.5 * first);
}
