// kiln-convert: moves weights through kiln's model, for interop checks against PyTorch.
//
//   kiln-convert --in A.safetensors [--out B.safetensors] [--arch NAME] [--num-classes N]
//                [--in-channels C] [--width W] [--eval-input X --eval-output Y]
//
// The model is described by A's metadata when it has kiln's (optim/model_file.h; flags given
// must then agree with it), else by the flags (--arch required), else read off A's weights.
// A loads strictly (every key and shape must match); B is written with save_weights (f32,
// torchvision's state_dict keys) and the model's metadata. With --eval-input, runs the loaded
// model in eval mode on the CPU on the file's one tensor (N, C, H, W) and writes the logits as
// the tensor "logits". Errors print one line and exit 1.
#include <cstdio>
#include <string>

#include "core/autograd.h"
#include "core/error.h"
#include "core/device_query.h"
#include "core/version.h"
#include "optim/checkpoint.h"
#include "optim/model_file.h"
#include "tools/cli/cli.h"

int main(int argc, char** argv) {
  using namespace kiln;
  return cli::run_tool("kiln-convert", [&] {
    std::string arch, in, out, eval_in, eval_out;
    int64_t num_classes = 1000, in_channels = 3, width = 0;
    cli::Parser p("kiln-convert", "--in A.safetensors [--out B.safetensors] [flags]",
                  "Loads weights into kiln's ResNet strictly and writes them back out.");
    p.version(version_line("kiln-convert"));
    p.value("--in", "PATH", &in, "weights to load (strict), e.g. a torchvision state_dict");
    p.value("--out", "PATH", &out, "write the loaded weights back (f32, torchvision keys)");
    p.value("--arch", "NAME", &arch,
            "resnet18|resnet34|resnet50|resnet101|resnet152|resnet_small\n"
            "(default: from the file's metadata, else from its weights)");
    p.value("--num-classes", "N", &num_classes, "classifier width, with --arch", 1, kMaxClasses);
    p.value("--in-channels", "C", &in_channels, "input channels, with --arch (1 for IDX data)", 1,
            kMaxInChannels);
    p.value("--width", "W", &width, "stem width, with --arch (default 64; resnet_small 32)", 1,
            kMaxWidth);
    p.value("--eval-input", "X", &eval_in, "safetensors file with one input tensor (N, C, H, W)");
    p.value("--eval-output", "Y", &eval_out, "where the eval-mode logits go (tensor 'logits')");
    std::string eval_device = "cpu";
    p.value("--eval-device", "DEV", &eval_device, "where --eval-input runs: cpu, cuda, cuda:N (f32)");
    if (!p.parse(argc, argv)) {
      std::fputs(p.info().c_str(), stdout);
      return 0;
    }
    if (in.empty()) cli::usage_error("--in PATH is required (see kiln-convert --help)");
    if (eval_in.empty() != eval_out.empty())
      cli::usage_error("--eval-input and --eval-output go together");
    if (out.empty() && eval_in.empty())
      cli::usage_error("nothing to do (give --out and/or --eval-input)");

    SafetensorsData file;
    ModelInfo info;
    std::string how;
    try {
      file = load_safetensors(in);
      check_finite(file, "--in");
      if (file.metadata.count("format") && file.metadata.at("format") == "kiln-model-1") {
        info = read_model_metadata(file.metadata, in);
        check_metadata_matches_weights(info, infer_model_info(file.tensors, in), in);
        how = "its metadata";
      } else if (!arch.empty()) {
        info.arch = arch;
        info.num_classes = num_classes;
        info.in_channels = in_channels;
        const bool vit = arch == "vit_b_16" || arch == "vit_s_16";
        info.imagenet_stem = arch != "resnet_small";
        info.width = vit ? (arch == "vit_b_16" ? 768 : 384)
                         : width > 0 ? width : (arch == "resnet_small" ? 32 : 64);
        if (in_channels != 3) {
          info.mean.assign(size_t(in_channels), 0.5f);
          info.std.assign(size_t(in_channels), 0.5f);
        }
        how = "the flags";
      } else {
        info = infer_model_info(file.tensors, in);
        how = "its weights";
      }
    } catch (const Error& e) {
      cli::usage_error(cli::without_location(e.what()));
    }
    // Flags given next to a self-describing file must agree with it.
    auto agree = [&](const char* flag, const std::string& given, const std::string& file_value) {
      if (p.given(flag) && given != file_value)
        cli::usage_error(flag, " ", given, " but '", in, "' holds ", file_value, " (", how, ")");
    };
    agree("--arch", arch, info.arch);
    agree("--num-classes", std::to_string(num_classes), std::to_string(info.num_classes));
    agree("--in-channels", std::to_string(in_channels), std::to_string(info.in_channels));
    agree("--width", std::to_string(width), std::to_string(info.width));

    auto model = cli::user_input("--arch: ", [&] { return build_model(info); });
    try {
      load_state(file.tensors, *model, KeyMatch::Strict, in);
    } catch (const Error& e) {
      cli::usage_error(cli::without_location(e.what()));
    }
    std::printf("loaded %s into %s (%zu tensors; %ld classes, %ld input channel(s), from %s)\n",
                in.c_str(), info.arch.c_str(), state_dict(*model).size(), long(info.num_classes),
                long(info.in_channels), how.c_str());
    if (!out.empty()) {
      // An older file's class names are read as they are, but never written when blank,
      // repeated or holding control characters (optim/model_file.h).
      std::map<std::string, std::string> meta = cli::user_input(
          "--in '" + in + "' cannot be written back with its metadata: ",
          [&] { return model_metadata(info); });
      for (const auto& [k, v] : file.metadata) meta.emplace(k, v);
      cli::user_input("--out: ", [&] { save_weights(out, *model, WeightsDType::Float32, meta); });
      std::printf("wrote %s\n", out.c_str());
    }
    if (!eval_in.empty()) {
      SafetensorsData x = cli::user_input("--eval-input: ", [&] { return load_safetensors(eval_in); });
      if (x.tensors.size() != 1)
        cli::usage_error("--eval-input '", eval_in, "' must hold one tensor, has ",
                         x.tensors.size());
      const Tensor& t = x.tensors[0].second;
      if (t.dim() != 4 || t.size(1) != info.in_channels)
        cli::usage_error("--eval-input '", eval_in, "': expected (N, ", info.in_channels,
                         ", H, W), got ", t.shape_str());
      Device dev;
      try {
        dev = Device::parse(eval_device);
      } catch (const Error&) {
        cli::usage_error("--eval-device '", eval_device, "': expected cpu, cuda or cuda:N");
      }
      if (dev.is_cuda() && dev.index >= cuda_device_count())
        cli::usage_error("--eval-device ", eval_device, ": no such CUDA device (",
                         cuda_device_count(), " present)");
      NoGradGuard no_grad;
      model->to(dev);
      model->eval();
      Tensor logits = (*model)(t.to(DType::f32).to(dev)).to(Device::cpu());
      cli::user_input("--eval-output: ",
                      [&] { save_safetensors(eval_out, {{"logits", logits}}); });
      std::printf("wrote %s: logits %s\n", eval_out.c_str(), logits.shape_str().c_str());
    }
    return 0;
  });
}
