// ResNet family: torchvision's parameter counts, names (in order), buffers, v1.5 strides,
// torchvision init, zero_init_residual, resnet_small's size and make_model. No forward passes
// here (see tests/test_model_forward.cpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "models/resnet.h"

using namespace kiln;
using namespace kiln::models;

namespace {

std::vector<std::string> names_of(const std::vector<nn::NamedTensor>& v) {
  std::vector<std::string> out;
  for (const auto& [n, _] : v) out.push_back(n);
  return out;
}

// torchvision's parameter names, rebuilt from its source structure.
std::vector<std::string> torchvision_param_names(bool bottleneck, std::vector<int> layers) {
  std::vector<std::string> n = {"conv1.weight", "bn1.weight", "bn1.bias"};
  auto bn = [&](const std::string& p) {
    n.push_back(p + ".weight");
    n.push_back(p + ".bias");
  };
  for (int s = 0; s < 4; ++s) {
    for (int b = 0; b < layers[size_t(s)]; ++b) {
      std::string blk = "layer" + std::to_string(s + 1) + "." + std::to_string(b) + ".";
      for (int c = 1; c <= (bottleneck ? 3 : 2); ++c) {
        n.push_back(blk + "conv" + std::to_string(c) + ".weight");
        bn(blk + "bn" + std::to_string(c));
      }
      // Every stage's first block downsamples except layer1 of the basic-block nets.
      if (b == 0 && (bottleneck || s > 0)) {
        n.push_back(blk + "downsample.0.weight");
        bn(blk + "downsample.1");
      }
    }
  }
  n.push_back("fc.weight");
  n.push_back("fc.bias");
  return n;
}

const nn::Module* find_module(const nn::Module& root, const std::string& name) {
  for (const auto& [n, m] : root.named_modules())
    if (n == name) return m;
  return nullptr;
}

double sample_std(const std::vector<double>& v) {
  double mean = 0, sq = 0;
  for (double x : v) mean += x;
  mean /= double(v.size());
  for (double x : v) sq += (x - mean) * (x - mean);
  return std::sqrt(sq / double(v.size() - 1));
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (double v : t.to_vector<double>()) m = std::max(m, std::abs(v));
  return m;
}

bool all_equal(const Tensor& t, double value) {
  for (double v : t.to_vector<double>())
    if (v != value) return false;
  return true;
}

// Built once: zero_init_residual changes values only, not structure.
const std::shared_ptr<ResNet>& resnet50_zero_init() {
  static const auto m = resnet50(1000, /*zero_init_residual=*/true);
  return m;
}

}  // namespace

TEST_CASE("resnet50: 25,557,032 parameters in 161 tensors with torchvision's names") {
  const auto& m = resnet50_zero_init();
  auto named = m->named_parameters();
  CHECK(named.size() == 161);
  CHECK(m->num_parameters() == 25557032);
  auto names = names_of(named);
  CHECK(names == torchvision_param_names(true, {3, 4, 6, 3}));
  // A hand-written sample, in order.
  REQUIRE(names.size() == 161);
  CHECK(names[0] == "conv1.weight");
  CHECK(names[1] == "bn1.weight");
  CHECK(names[2] == "bn1.bias");
  CHECK(names[3] == "layer1.0.conv1.weight");
  CHECK(names[4] == "layer1.0.bn1.weight");
  CHECK(names[12] == "layer1.0.downsample.0.weight");
  CHECK(names[13] == "layer1.0.downsample.1.weight");
  CHECK(names[15] == "layer1.1.conv1.weight");
  CHECK(names[158] == "layer4.2.bn3.bias");
  CHECK(names[159] == "fc.weight");
  CHECK(names[160] == "fc.bias");
  CHECK(named[0].second.shape() == Shape{64, 3, 7, 7});
  CHECK(named[12].second.shape() == Shape{256, 64, 1, 1});
  CHECK(named[159].second.shape() == Shape{1000, 2048});

  auto buffers = names_of(m->named_buffers());
  CHECK(buffers.size() == 53 * 3);
  CHECK(buffers[0] == "bn1.running_mean");
  CHECK(buffers[1] == "bn1.running_var");
  CHECK(buffers[2] == "bn1.num_batches_tracked");
  CHECK(buffers[4] == "layer1.0.bn1.running_var");
  CHECK(std::find(buffers.begin(), buffers.end(), "layer1.0.downsample.1.running_mean") !=
        buffers.end());
  CHECK(buffers.back() == "layer4.2.bn3.num_batches_tracked");
  for (const auto& [n, t] : m->named_buffers())
    if (n.ends_with("num_batches_tracked")) CHECK(t.dtype() == DType::i64);

  // v1.5: the stride of a downsampling bottleneck is on its 3x3 conv, and on the shortcut.
  const nn::Module* c1 = find_module(*m, "layer2.0.conv1");
  const nn::Module* c2 = find_module(*m, "layer2.0.conv2");
  const nn::Module* ds = find_module(*m, "layer2.0.downsample.0");
  REQUIRE((c1 && c2 && ds));
  CHECK(c1->describe() == "Conv2d(256, 128, kernel=1, stride=1, padding=0, bias=false)");
  CHECK(c2->describe() == "Conv2d(128, 128, kernel=3, stride=2, padding=1, bias=false)");
  CHECK(ds->describe() == "Conv2d(256, 512, kernel=1, stride=2, padding=0, bias=false)");
  CHECK(find_module(*m, "maxpool")->describe() == "MaxPool2d(kernel=3, stride=2, padding=1)");
  CHECK(find_module(*m, "conv1")->describe() ==
        "Conv2d(3, 64, kernel=7, stride=2, padding=3, bias=false)");
}

TEST_CASE("resnet18/34/101/152 parameter counts and names") {
  auto r18 = resnet18();
  CHECK(r18->num_parameters() == 11689512);
  CHECK(names_of(r18->named_parameters()) == torchvision_param_names(false, {2, 2, 2, 2}));
  CHECK(find_module(*r18, "layer1.0.downsample") == nullptr);
  auto r34 = resnet34();
  CHECK(r34->num_parameters() == 21797672);
  CHECK(names_of(r34->named_parameters()) == torchvision_param_names(false, {3, 4, 6, 3}));
  r34.reset();
  auto r101 = resnet101();
  CHECK(r101->num_parameters() == 44549160);
  CHECK(names_of(r101->named_parameters()) == torchvision_param_names(true, {3, 4, 23, 3}));
  r101.reset();
  auto r152 = resnet152();
  CHECK(r152->num_parameters() == 60192808);
  CHECK(names_of(r152->named_parameters()) == torchvision_param_names(true, {3, 8, 36, 3}));
}

TEST_CASE("torchvision init: kaiming_normal(fan_out) convs, BN 1/0, zero_init_residual") {
  const auto& m = resnet50_zero_init();
  std::map<std::string, Tensor> p;
  for (auto& [n, t] : m->named_parameters()) p[n] = t;
  // (512, 512, 3, 3): fan_out = 512·9
  CHECK(sample_std(p["layer4.0.conv2.weight"].to_vector<double>()) ==
        doctest::Approx(std::sqrt(2.0 / (512 * 9))).epsilon(0.03));
  // (64, 3, 7, 7): fan_out = 64·49
  CHECK(sample_std(p["conv1.weight"].to_vector<double>()) ==
        doctest::Approx(std::sqrt(2.0 / (64 * 49))).epsilon(0.05));
  CHECK(max_abs(p["fc.weight"]) <= 1 / std::sqrt(2048.0));
  CHECK(all_equal(p["bn1.weight"], 1.0));
  CHECK(all_equal(p["layer1.0.bn2.weight"], 1.0));
  CHECK(all_equal(p["layer1.0.downsample.1.weight"], 1.0));
  CHECK(all_equal(p["layer3.5.bn2.bias"], 0.0));
  int zeroed = 0;
  for (const auto& [n, t] : p) {
    if (n.ends_with("bn3.weight")) {
      CHECK(all_equal(t, 0.0));
      ++zeroed;
    }
  }
  CHECK(zeroed == 16);
  auto r18 = resnet18(1000, true);
  for (auto& [n, t] : r18->named_parameters()) {
    if (n.ends_with("bn2.weight")) CHECK(all_equal(t, 0.0));
    if (n.ends_with("bn1.weight")) CHECK(all_equal(t, 1.0));
  }
  // Without the option the last BN starts at 1.
  auto plain = resnet18();
  for (auto& [n, t] : plain->named_parameters())
    if (n == "layer2.1.bn2.weight") CHECK(t.to_vector<double>()[0] == 1.0);
  // Fixed seed: same model twice.
  CHECK(resnet18()->named_parameters()[0].second.to_vector<double>() ==
        plain->named_parameters()[0].second.to_vector<double>());
}

TEST_CASE("zero_init_residual_bns: after construction, as the option does at it") {
  // kiln-train --zero-init-residual: the model is built first, then each block's last BN zeroed.
  auto m = resnet50();
  CHECK(zero_init_residual_bns(*m) == 16);
  const auto& reference = resnet50_zero_init();  // the same seed, the option at construction
  const auto a = m->named_parameters(), b = reference->named_parameters();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CAPTURE(a[i].first);
    CHECK(a[i].first == b[i].first);
    CHECK(a[i].second.to_vector<double>() == b[i].second.to_vector<double>());
  }
  auto r18 = resnet18();
  CHECK(zero_init_residual_bns(*r18) == 8);
  for (auto& [n, t] : r18->named_parameters())
    if (n.ends_with("bn2.weight")) CHECK(all_equal(t, 0.0));
  // No residual blocks: nothing changes.
  nn::Linear fc(4, 2);
  const std::vector<double> before = fc.weight().to_vector<double>();
  CHECK(zero_init_residual_bns(fc) == 0);
  CHECK(fc.weight().to_vector<double>() == before);
}

TEST_CASE("resnet_small: 3x3 stem, no max pool, three BasicBlock stages") {
  auto m = resnet_small();  // 10 classes, width 32, one block per stage, 1 input channel
  const int64_t w = 32;
  auto bn = [](int64_t c) { return 2 * c; };
  int64_t expected = 9 * 1 * w + bn(w);                           // stem
  expected += 2 * (9 * w * w + bn(w));                            // layer1
  expected += 9 * w * 2 * w + 9 * 4 * w * w + 2 * bn(2 * w) + w * 2 * w + bn(2 * w);  // layer2
  expected += 9 * 2 * w * 4 * w + 9 * 16 * w * w + 2 * bn(4 * w) + 2 * w * 4 * w + bn(4 * w);
  expected += 4 * w * 10 + 10;                                    // fc
  CHECK(m->num_parameters() == expected);
  CHECK(m->num_parameters() == 308074);
  CHECK(find_module(*m, "maxpool") == nullptr);
  CHECK(find_module(*m, "layer4") == nullptr);
  CHECK(find_module(*m, "conv1")->describe() ==
        "Conv2d(1, 32, kernel=3, stride=1, padding=1, bias=false)");
  CHECK(find_module(*m, "layer3.0.conv1")->describe() ==
        "Conv2d(64, 128, kernel=3, stride=2, padding=1, bias=false)");
  CHECK(names_of(m->named_parameters()).back() == "fc.bias");
  CHECK(resnet_small(10, 16, 2)->num_parameters() > 0);
}

TEST_CASE("make_model by name; unknown names list the valid ones") {
  CHECK(make_model("resnet18", 10)->num_parameters() == 11689512 - 990 * 512 - 990);
  CHECK(make_model("resnet_small", 10)->num_parameters() == 308074);
  CHECK(model_names().size() == 6);
  try {
    make_model("resnet51", 10);
    FAIL("expected an error");
  } catch (const Error& e) {
    std::string msg = e.what();
    CHECK(msg.find("resnet51") != std::string::npos);
    CHECK(msg.find("resnet50") != std::string::npos);
    CHECK(msg.find("resnet_small") != std::string::npos);
  }
  CHECK_THROWS_AS(ResNet(BlockKind::Basic, {}), Error);
}
