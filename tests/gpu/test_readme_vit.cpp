// The README's vision-transformer example, as written there, on a GPU: a ViT trained with mixed
// precision, AdamW, label smoothing and clipping, the whole step one CUDA graph. The task is
// learnable (each class shifts each colour channel by its own amount), so the loss must fall.
#include <doctest/doctest.h>

#include <kiln/kiln.h>

#include "cuda/graph.h"

using namespace kiln;

TEST_CASE("README: a ViT trained on the GPU, whole step in a CUDA graph") {
  manual_seed(0);
  const Device gpu = Device::cuda(0);
  models::ViTOptions o;
  o.image_size = 32;
  o.patch_size = 4;
  o.num_layers = 6;
  o.num_heads = 8;
  o.hidden_dim = 256;
  o.mlp_dim = 512;
  o.num_classes = 10;
  o.dropout = 0.1;
  auto vit = std::make_shared<models::VisionTransformer>(o);
  amp::prepare_model(*vit, gpu);
  optim::ParamGroup g;
  g.lr = 1e-3;
  g.weight_decay = 0.05;
  optim::FusedAdamW opt(optim::split_weight_decay(*vit, g));
  optim::DynamicLossScaler scaler(gpu);
  optim::ClassifierStep step(*vit, opt, scaler, 0.1, 1.0);
  Tensor x = amp::prepare_input(randn({128, 3, 32, 32}), gpu);
  Tensor y = randint(0, 10, {128}, TensorOptions(DType::i64).with_device(gpu));
  cuda::GraphStep graph([&] { step.run(x, y); });
  Generator data(3);
  const Tensor means = randn({10, 3, 1, 1}, DType::f32, &data);  // each class shifts each channel
  auto next_batch = [&] {
    const Tensor labels = randint(0, 10, {128}, DType::i64, &data);
    Tensor img = randn({128, 3, 32, 32}, DType::f32, &data);
    const auto l = labels.to_vector<int64_t>();
    NoGradGuard ng;
    for (int64_t i = 0; i < 128; ++i) img.select(0, i).add_(means.select(0, l[size_t(i)]));
    x.copy_(amp::prepare_input(img, gpu));
    y.copy_(labels.to(gpu));
  };
  double first = 0, last = 0;
  for (int i = 0; i < 100; ++i) {
    next_batch();
    step.reset_metrics();
    opt.stage_lr();
    graph.run();
    const double loss = step.loss_sum().item() / 128.0;
    if (i < 5) first += loss / 5;
    if (i >= 95) last += loss / 5;
  }
  MESSAGE("loss ", first, " -> ", last);
  CHECK(graph.stats().captures == 1);
  CHECK(last < 0.5 * first);
}
