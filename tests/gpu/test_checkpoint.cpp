// Checkpoints of CUDA models: saving f16 device weights (as f32 or as stored), loading a CPU file
// into a device model (device, dtype and memory format kept), and an optimizer whose state lives
// on the device surviving a training-checkpoint round trip bit for bit.
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>

#include "core/autograd.h"
#include "optim/checkpoint.h"
#include "models/resnet.h"
#include "optim/sgd.h"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

const Device kGpu = Device::cuda(0);

struct TempDir {
  fs::path dir = fs::temp_directory_path() / ("kiln_gpu_ckpt_" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(dir); }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

std::string temp_path(const std::string& name) {
  static TempDir tmp;
  return (tmp.dir / name).string();
}

std::string host_bytes(const Tensor& t) {
  Tensor c = t.detach().to(Device::cpu()).contiguous();
  return std::string(static_cast<const char*>(c.raw_data()), c.nbytes());
}

bool same_tensor(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && host_bytes(a) == host_bytes(b);
}

class LayoutNet : public nn::Module {
 public:
  LayoutNet() {
    auto nhwc = TensorOptions().with_device(kGpu).with_memory_format(MemoryFormat::ChannelsLast);
    w_ = register_parameter("w", zeros({8, 3, 3, 3}, nhwc.with_dtype(DType::f16)));
    n_ = register_buffer("n", zeros({}, TensorOptions(DType::i64).with_device(kGpu)));
  }
  Tensor forward(const Tensor& x) override { return x; }
  std::string type_name() const override { return "LayoutNet"; }
  Tensor w_, n_;
};

}  // namespace

TEST_CASE("save_weights from an f16 CUDA model: f32 by default, f16 as stored") {
  auto m = models::resnet_small(10, 8);
  m->to(kGpu);
  m->to(DType::f16);
  std::string path = temp_path("gpu16.safetensors");
  save_weights(path, *m);
  SafetensorsData f = load_safetensors(path);
  NamedTensors live = state_dict(*m);
  REQUIRE(f.tensors.size() == live.size());
  int wrong = 0;
  for (size_t i = 0; i < live.size(); ++i) {
    const Tensor& t = live[i].second;
    CHECK(t.is_cuda());
    DType want = is_floating(t.dtype()) ? DType::f32 : t.dtype();
    wrong += !same_tensor(f.tensors[i].second, t.to(Device::cpu()).to(want));
  }
  CHECK(wrong == 0);
  save_weights(path, *m, WeightsDType::AsStored);
  f = load_safetensors(path);
  wrong = 0;
  for (size_t i = 0; i < live.size(); ++i) wrong += !same_tensor(f.tensors[i].second, live[i].second);
  CHECK(wrong == 0);
}

TEST_CASE("load_weights into a CUDA f16 model keeps device, dtype and channels-last layout") {
  std::string path = temp_path("cpu32.safetensors");
  Generator g(3);
  Tensor w = randn({8, 3, 3, 3}, {}, &g);
  save_safetensors(path, {{"w", w}, {"n", full({}, 77, DType::i64)}});
  LayoutNet net;
  load_weights(path, net);
  CHECK(net.w_.is_cuda());
  CHECK(net.w_.dtype() == DType::f16);
  CHECK(net.w_.is_contiguous(MemoryFormat::ChannelsLast));
  CHECK(same_tensor(net.w_, w.to(DType::f16)));  // same round-to-nearest-even on both sides
  CHECK(net.n_.is_cuda());
  CHECK(net.n_.item() == 77);
}

TEST_CASE("training checkpoint of a CUDA model and SGD state round-trips bit for bit") {
  auto model = models::resnet_small(10, 8);
  model->to(kGpu);
  optim::SGDOptions o;
  o.lr = 0.1;
  o.momentum = 0.9;
  optim::SGD opt(model->parameters(), o);
  Generator g(5);
  for (int step = 0; step < 2; ++step) {
    for (const Tensor& p : model->parameters())
      p.set_grad(randn(p.shape(), TensorOptions().with_device(kGpu), &g));
    opt.step();
  }
  TrainingState st;
  st.model = model.get();
  st.optimizer = &opt;
  st.scaler = {{"scale", full({}, 1024.0, TensorOptions().with_device(kGpu))}};
  st.step = 2;
  std::string path = temp_path("gpu.ckpt");
  save_checkpoint(path, st);

  auto fresh = models::resnet_small(10, 8);
  fresh->to(kGpu);
  optim::SGD fresh_opt(fresh->parameters(), o);
  TrainingState in;
  in.model = fresh.get();
  in.optimizer = &fresh_opt;
  load_checkpoint(path, in);
  NamedTensors a = state_dict(*model), b = state_dict(*fresh);
  int wrong = 0;
  for (size_t i = 0; i < a.size(); ++i)
    wrong += !(b[i].second.is_cuda() && same_tensor(a[i].second, b[i].second));
  CHECK(wrong == 0);
  auto sa = opt.state_dict(), sb = fresh_opt.state_dict();
  REQUIRE(sa.size() == sb.size());
  for (auto& [k, t] : sa) {
    CAPTURE(k);
    CHECK(same_tensor(t, sb.at(k)));
    if (k.find("momentum_buffer") != std::string::npos) CHECK(sb.at(k).is_cuda());
  }
  CHECK(in.scaler.at("scale").item() == 1024.0);
}
