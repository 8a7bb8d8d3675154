#include "tools/predict/predict.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>

#include "core/autograd.h"
#include "core/text.h"
#include "data/image_folder.h"
#include "data/transforms.h"
#include "optim/amp.h"
#include "tools/cli/cli.h"
#include "tools/train/train_parts.h"

namespace kiln::predict {

namespace fs = std::filesystem;

namespace {

// Appends the image files under `dir` (not following links to folders) to `found`; a folder
// that cannot be listed adds a message to `errors`.
void list_folder(const fs::path& dir, std::vector<std::string>& found,
                 std::vector<std::string>& errors) {
  std::vector<fs::path> pending = {dir};
  while (!pending.empty()) {
    const fs::path d = std::move(pending.back());
    pending.pop_back();
    std::error_code ec;
    fs::directory_iterator it(d, ec);
    for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
      std::error_code ec2;
      if (it->symlink_status(ec2).type() == fs::file_type::directory)
        pending.push_back(it->path());
      else if (it->is_regular_file(ec2) && data::has_image_extension(it->path().string()))
        found.push_back(it->path().string());
    }
    if (ec)
      errors.push_back("cannot list folder '" + d.string() + "': " + ec.message() +
                       " (its images are not predicted)");
  }
}

}  // namespace

Inputs collect_images(const std::vector<std::string>& paths) {
  Inputs in;
  for (const std::string& p : paths) {
    std::error_code ec;
    const fs::file_status st = fs::status(p, ec);
    if (st.type() == fs::file_type::not_found) {
      in.errors.push_back("no such image or folder: '" + p + "'");
    } else if (ec) {
      in.errors.push_back("cannot access '" + p + "': " + ec.message());
    } else if (fs::is_directory(st)) {
      std::vector<std::string> found;
      const size_t errors_before = in.errors.size();
      list_folder(p, found, in.errors);
      if (found.empty() && in.errors.size() == errors_before)
        in.errors.push_back("folder '" + p + "' holds no .jpg, .jpeg or .png file");
      std::sort(found.begin(), found.end());
      in.images.insert(in.images.end(), found.begin(), found.end());
    } else {
      in.images.push_back(p);
    }
  }
  return in;
}

Tensor preprocess(const data::Image& rgb, const ModelInfo& info) {
  const int64_t C = info.in_channels, S = info.image_size;
  KILN_CHECK(C == 1 || C == 3, "kiln-predict: models with ", C,
             " input channels take no images (1 or 3 only)");
  KILN_CHECK(rgb.channels == 3, "preprocess: expected an RGB image");
  std::vector<uint8_t> src;
  const uint8_t* pixels = rgb.pixels.data();
  if (C == 1) {  // PIL's "L" conversion
    src.resize(size_t(rgb.height * rgb.width));
    for (size_t i = 0; i < src.size(); ++i) {
      const uint8_t* p = pixels + 3 * i;
      src[i] = uint8_t(std::lround(0.299 * p[0] + 0.587 * p[1] + 0.114 * p[2]));
    }
    pixels = src.data();
  }
  std::vector<uint8_t> crop(size_t(S * S * C));
  data::resize_center_crop(pixels, rgb.height, rgb.width, C, std::max(info.resize_size, S), S,
                           crop.data());
  Tensor x = empty({C, S, S}, DType::f32);
  float* d = x.data<float>();
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < S * S; ++i)
      d[c * S * S + i] =
          (float(crop[size_t(i * C + c)]) / 255.0f - info.mean[size_t(c)]) / info.std[size_t(c)];
  return x;
}

std::string class_name(const ModelInfo& info, int64_t k) {
  return k < int64_t(info.class_names.size()) ? info.class_names[size_t(k)]
                                              : "class " + std::to_string(k);
}

Prediction predict_image(const LoadedModel& m, const std::string& path, Device device,
                         int64_t top) {
  NoGradGuard no_grad;
  Prediction p;
  p.path = path;
  Tensor x;
  try {
    x = preprocess(data::read_image(path), m.info);
  } catch (const Error& e) {
    p.error = cli::without_location(e.what());
    return p;
  }
  Tensor logits = (*m.model)(x.reshape({1, x.size(0), x.size(1), x.size(2)}).to(device));
  Tensor l = logits.to(Device::cpu()).to(DType::f64).contiguous();
  const double* v = l.data<double>();
  const int64_t n = l.size(1);
  const double mx = *std::max_element(v, v + n);
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += std::exp(v[j] - mx);
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return v[a] > v[b]; });
  for (int64_t j = 0; j < std::min(top, n); ++j) {
    p.classes.push_back(order[size_t(j)]);
    p.probabilities.push_back(std::exp(v[order[size_t(j)]] - mx) / sum);
  }
  return p;
}

std::vector<Prediction> predict(const LoadedModel& m, const std::vector<std::string>& images,
                                Device device, int64_t top) {
  std::vector<Prediction> out;
  for (const std::string& path : images) out.push_back(predict_image(m, path, device, top));
  return out;
}

int main(const std::vector<std::string>& args) {
  return cli::run_tool("kiln-predict", [&] {
    std::string weights, device = "auto";
    int64_t top = 5;
    std::vector<std::string> inputs;
    cli::Parser p("kiln-predict", "--weights MODEL.safetensors IMAGE|FOLDER... [flags]",
                  "Prints the classes a trained model sees in JPEG/PNG images, most likely first.");
    p.positional("IMAGE|FOLDER", &inputs, "images, or folders searched for .jpg/.jpeg/.png", 1);
    p.value("--weights", "PATH", &weights,
            "model file (kiln-train's model.safetensors; its metadata gives\n"
            "the preprocessing and class names)");
    p.value("--top", "K", &top, "classes per image", 1);
    p.value("--device", "DEV", &device, "auto (cuda if present, else cpu), cpu, cuda, cuda:N");
    if (!p.parse(args)) {
      std::fputs(p.info().c_str(), stdout);
      return 0;
    }
    if (weights.empty()) cli::usage_error("--weights PATH is required (see kiln-predict --help)");
    if (::fcntl(STDOUT_FILENO, F_GETFD) < 0)
      cli::usage_error("standard output is closed: nowhere to print the predictions");
    auto error_line = [](const std::string& what) {
      std::fflush(stdout);
      std::fprintf(stderr, "kiln-predict: error: %s\n", text::printable(what).c_str());
    };
    const Inputs in = collect_images(inputs);
    for (const std::string& e : in.errors) error_line(e);
    if (in.images.empty()) return 1;  // nothing to predict; each input's error is above
    const Device dev = train::pick_device(device, DistEnv{});
    LoadedModel m;
    try {
      m = load_model_file(weights);
    } catch (const Error& e) {
      cli::usage_error("--weights: ", cli::without_location(e.what()));
    }
    if (m.info.in_channels != 1 && m.info.in_channels != 3)
      cli::usage_error("--weights '", weights, "': the model takes ", m.info.in_channels,
                       " input channels; images give 1 (grey) or 3 (RGB)");
    if (!m.notes.empty())
      std::fprintf(stderr, "kiln-predict: note: %s\n", text::printable(m.notes).c_str());
    amp::prepare_model(*m.model, dev, amp::Precision::FP32);
    m.model->eval();
    size_t predicted = 0;
    for (const std::string& path : in.images) {
      const Prediction r = predict_image(m, path, dev, top);
      if (!r.error.empty()) {
        error_line(r.error);
        continue;
      }
      std::printf("%s\n", text::printable(r.path).c_str());
      for (size_t j = 0; j < r.classes.size(); ++j)
        std::printf("  %6.2f%%  %s\n", 100.0 * r.probabilities[j],
                    text::printable(class_name(m.info, r.classes[j])).c_str());
      if (std::ferror(stdout)) cli::check_stdout();  // stop at the first lost line
      ++predicted;
    }
    cli::check_stdout();
    const size_t failed = in.errors.size() + (in.images.size() - predicted);
    if (failed > 0)
      std::fprintf(stderr, "kiln-predict: %zu error(s) above; %zu of %zu image(s) predicted\n",
                   failed, predicted, in.images.size());
    return failed > 0 ? 1 : 0;
  });
}

}  // namespace kiln::predict
