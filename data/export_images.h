#pragma once
// Writes an in-memory image dataset out as an ImageFolder of PNG files (data/image_folder.h):
//   out/<class folder>/<sample index>.png
// Class folders are named "<index>_<name>" with the index zero-padded to the width of the
// largest one, so their sorted order is the class order and ImageFolder(out) gives back the
// original labels. Characters other than [A-Za-z0-9._-] in names become '_' ("T-shirt/top" ->
// "0_T-shirt_top"). Used by tools/kiln-export-images.
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace kiln::data {

struct ExportOptions {
  int64_t limit = -1;  // the first `limit` samples; -1: all
  bool rgb = false;    // write 1-channel sources as 3-channel PNGs (gray replicated)
  bool force = false;  // allow a non-empty `out` (existing files of the same name are replaced)
};

std::string class_folder_name(int64_t index, const std::string& name, int64_t num_classes);

// images u8 (N, H, W) or (N, C, H, W) with C = 1 or 3, CPU; labels (N) integer in
// [0, class_names.size()). Creates `out` (and parents) when missing; refuses (kiln::Error) a
// non-empty `out` unless opts.force. Every class gets its folder, even one left without samples
// by `limit`. Returns the number of files written.
int64_t export_image_folder(const Tensor& images, const Tensor& labels,
                            const std::vector<std::string>& class_names, const std::string& out,
                            const ExportOptions& opts = {});

}  // namespace kiln::data
