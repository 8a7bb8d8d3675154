#include "data/export_images.h"

#include <filesystem>

#include "core/error.h"
#include "data/image.h"

namespace kiln::data {

namespace fs = std::filesystem;

std::string class_folder_name(int64_t index, const std::string& name, int64_t num_classes) {
  std::string idx = std::to_string(index);
  const size_t width = std::to_string(std::max<int64_t>(num_classes - 1, 0)).size();
  if (idx.size() < width) idx.insert(0, width - idx.size(), '0');
  std::string safe;
  for (char c : name) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    safe += ok ? c : '_';
  }
  return safe.empty() ? idx : idx + "_" + safe;
}

int64_t export_image_folder(const Tensor& images, const Tensor& labels,
                            const std::vector<std::string>& class_names, const std::string& out,
                            const ExportOptions& opts) {
  KILN_CHECK(images.defined() && images.dtype() == DType::u8 && images.is_cpu() &&
                 (images.dim() == 3 || images.dim() == 4),
             "export_image_folder: images must be u8 (N, H, W) or (N, C, H, W) on the CPU, got ",
             images.defined() ? images.desc() : "undefined");
  Tensor x = images.dim() == 3 ? images.unsqueeze(1).contiguous() : images.contiguous();
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  KILN_CHECK(C == 1 || C == 3, "export_image_folder: 1 or 3 channels, got ", C);
  KILN_CHECK(labels.defined() && labels.dim() == 1 && labels.size(0) == N && labels.is_cpu(),
             "export_image_folder: labels must be (", N, ") on the CPU, got ",
             labels.defined() ? labels.desc() : "undefined");
  KILN_CHECK(!class_names.empty(), "export_image_folder: no class names");
  const Tensor y = labels.to(DType::i64).contiguous();
  const auto K = int64_t(class_names.size());
  const int64_t n = opts.limit < 0 ? N : std::min(opts.limit, N);

  std::error_code ec;
  if (fs::exists(out, ec)) {
    KILN_CHECK(fs::is_directory(out, ec), "export_image_folder: '", out, "' is not a folder");
    KILN_CHECK(opts.force || fs::is_empty(out, ec), "export_image_folder: '", out,
               "' is not empty (use --force / ExportOptions::force to write into it anyway)");
  }
  std::vector<fs::path> dirs;
  for (int64_t c = 0; c < K; ++c) {
    dirs.push_back(fs::path(out) / class_folder_name(c, class_names[size_t(c)], K));
    fs::create_directories(dirs.back(), ec);
    KILN_CHECK(!ec, "export_image_folder: cannot create '", dirs.back().string(),
               "': ", ec.message());
  }
  const size_t width = std::to_string(std::max<int64_t>(N - 1, 0)).size();
  const uint8_t* px = x.data<uint8_t>();
  const int64_t* lab = y.data<int64_t>();
  const int64_t out_c = (C == 1 && opts.rgb) ? 3 : C;
  for (int64_t i = 0; i < n; ++i) {
    KILN_CHECK(lab[i] >= 0 && lab[i] < K, "export_image_folder: label ", lab[i], " of sample ", i,
               " outside [0, ", K, ")");
    Image im;
    im.height = H;
    im.width = W;
    im.channels = out_c;
    im.pixels.resize(size_t(H * W * out_c));
    const uint8_t* s = px + i * C * H * W;  // (C, H, W) -> (H, W, out_c)
    for (int64_t p = 0; p < H * W; ++p)
      for (int64_t c = 0; c < out_c; ++c)
        im.pixels[size_t(p * out_c + c)] = s[(C == 1 ? 0 : c) * H * W + p];
    std::string name = std::to_string(i);
    if (name.size() < width) name.insert(0, width - name.size(), '0');
    write_png((dirs[size_t(lab[i])] / (name + ".png")).string(), im);
  }
  return n;
}

}  // namespace kiln::data
