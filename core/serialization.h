#pragma once
// safetensors files: an 8-byte little-endian header length, a JSON header
// {"__metadata__": {...}, "name": {"dtype": "F32", "shape": [...], "data_offsets": [b, e]}, ...}
// and the raw little-endian tensor bytes. PyTorch reads them with safetensors.torch.load_file.
//
// Writes are atomic: the bytes go to a temporary file in the same folder, which is fsynced and
// renamed over the target, so a crash mid-save leaves any previous file intact.
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace kiln {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Tensors may live on any device and have any strides; they are written contiguous, in order.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

struct SafetensorsData {
  NamedTensors tensors;  // CPU tensors in file order
  std::map<std::string, std::string> metadata;
  // The tensor called `name`, or an error naming the file and the missing key.
  const Tensor& at(const std::string& name) const;
  bool contains(const std::string& name) const;
  std::string path;
};

// Reads and validates the whole file (header bounds, dtypes, offsets). Errors name the file.
SafetensorsData load_safetensors(const std::string& path);

// Writes `bytes` to `path` atomically (temp file, fsync, rename, fsync of the folder).
void write_file_atomic(const std::string& path, const std::string& bytes);

}  // namespace kiln
