// kiln-convert: moves weights through kiln's model, for interop checks against PyTorch.
//
//   kiln-convert --arch resnet50 --in A.safetensors --out B.safetensors
//                [--num-classes 1000] [--eval-input x.safetensors --eval-output y.safetensors]
//
// Builds the named model, loads A with load_weights (strict: every key and shape must match),
// and writes B with save_weights (f32, torchvision's state_dict keys). With --eval-input, runs
// the loaded model in eval mode on the CPU on the file's one tensor (N, C, H, W) and writes the
// logits as the tensor "logits". Errors print one line and exit 1.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/autograd.h"
#include "optim/checkpoint.h"
#include "core/error.h"
#include "core/version.h"
#include "models/resnet.h"

namespace {

void usage() {
  std::printf(
      "usage: kiln-convert --arch NAME --in A.safetensors [--out B.safetensors]\n"
      "                    [--num-classes N] [--eval-input X --eval-output Y]\n"
      "  --arch NAME        resnet18|resnet34|resnet50|resnet101|resnet152|resnet_small\n"
      "  --in PATH          weights to load (strict), e.g. a torchvision state_dict\n"
      "  --out PATH         write the loaded weights back (f32, torchvision keys)\n"
      "  --num-classes N    classifier width (default 1000)\n"
      "  --version          kiln's version and build\n"
      "  --eval-input X     safetensors file with one input tensor (N, C, H, W)\n"
      "  --eval-output Y    where the eval-mode logits go (tensor 'logits')\n");
}

struct Args {
  std::string arch, in, out, eval_in, eval_out;
  int64_t num_classes = 1000;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      usage();
      std::exit(0);
    }
    if (flag == "--version") {
      std::printf("%s\n", kiln::version_line("kiln-convert").c_str());
      std::exit(0);
    }
    KILN_CHECK(i + 1 < argc, "kiln-convert: ", flag, " needs a value");
    std::string v = argv[++i];
    if (flag == "--arch") a.arch = v;
    else if (flag == "--in") a.in = v;
    else if (flag == "--out") a.out = v;
    else if (flag == "--eval-input") a.eval_in = v;
    else if (flag == "--eval-output") a.eval_out = v;
    else if (flag == "--num-classes") a.num_classes = std::stoll(v);
    else KILN_FAIL("kiln-convert: unknown flag ", flag, " (try --help)");
  }
  KILN_CHECK(!a.arch.empty() && !a.in.empty(), "kiln-convert: --arch and --in are required");
  KILN_CHECK(a.eval_in.empty() == a.eval_out.empty(),
             "kiln-convert: --eval-input and --eval-output go together");
  KILN_CHECK(!a.out.empty() || !a.eval_in.empty(),
             "kiln-convert: nothing to do (give --out and/or --eval-input)");
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kiln;
  try {
    Args a = parse(argc, argv);
    auto model = models::make_model(a.arch, a.num_classes);
    load_weights(a.in, *model);
    std::printf("loaded %s into %s (%zu tensors)\n", a.in.c_str(), a.arch.c_str(),
                state_dict(*model).size());
    if (!a.out.empty()) {
      save_weights(a.out, *model);
      std::printf("wrote %s\n", a.out.c_str());
    }
    if (!a.eval_in.empty()) {
      SafetensorsData x = load_safetensors(a.eval_in);
      KILN_CHECK(x.tensors.size() == 1, "kiln-convert: '", a.eval_in, "' must hold one tensor, has ",
                 x.tensors.size());
      NoGradGuard no_grad;
      model->eval();
      Tensor logits = (*model)(x.tensors[0].second.to(DType::f32));
      save_safetensors(a.eval_out, {{"logits", logits}});
      std::printf("wrote %s: logits %s\n", a.eval_out.c_str(), logits.shape_str().c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln-convert: %s\n", e.what());
    return 1;
  }
}
