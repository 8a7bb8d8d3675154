#pragma once
// safetensors files: an 8-byte little-endian header length, a JSON header
// {"__metadata__": {...}, "name": {"dtype": "F32", "shape": [...], "data_offsets": [b, e]}, ...}
// and the raw little-endian tensor bytes. PyTorch reads them with safetensors.torch.load_file.
//
// Writes are atomic: the bytes go to a temporary file in the same folder, which is fsynced and
// renamed over the target, so a crash mid-save leaves any previous file intact.
#include <cstdint>
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
// The bytes save_safetensors writes (device tensors are copied to the host now), for a caller
// that writes them later or elsewhere. `path` names errors.
std::string safetensors_bytes(const std::string& path, const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata = {});

// safetensors_bytes in two steps, for a background writer: safetensors_host copies every tensor
// to host memory of its own now (on the caller's thread, so the file holds this moment's values;
// CPU tensors are copied too, so later in-place updates do not reach it), and join() lays out the
// bytes later, on any thread, touching no device. join() == safetensors_bytes(...) byte for byte.
struct SafetensorsHost {
  std::string header;           // length prefix and JSON header, padded to 8 bytes
  NamedTensors tensors;         // contiguous host copies, in file order
  std::string join() const;
};
SafetensorsHost safetensors_host(const std::string& path, const NamedTensors& tensors,
                                 const std::map<std::string, std::string>& metadata = {});

struct SafetensorsData {
  NamedTensors tensors;  // CPU tensors in file order
  std::map<std::string, std::string> metadata;
  // The tensor called `name`, or an error naming the file and the missing key.
  const Tensor& at(const std::string& name) const;
  bool contains(const std::string& name) const;
  std::string path;
};

// The largest JSON header load_safetensors accepts (the reference implementation's limit).
inline constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;

// Reads and validates the whole file, with the safetensors rules: a regular file (a FIFO or
// folder is refused without blocking), a header of at most kMaxSafetensorsHeader bytes starting
// with '{', no duplicate keys, known dtypes, shapes and data_offsets of non-negative integer
// literals, sizes computed without overflow, and a data section covered exactly by the tensors
// (no holes, no overlaps, no trailing bytes). Every error names the file, and the tensor where
// there is one. Tensor bytes are read straight into their storage (no whole-file buffer).
SafetensorsData load_safetensors(const std::string& path);

// The name of the first floating-point tensor holding a NaN or an infinity, "" when all are
// finite (device tensors are copied to the host; one pass over each tensor's bits).
std::string first_non_finite(const NamedTensors& tensors);
// Throws kiln::Error (no source location: the message is about the user's file) when `file`
// holds a non-finite tensor: "<what> '<path>': tensor '<name>' holds NaN or infinite values...".
// `what` names the flag or role, e.g. "--weights".
void check_finite(const SafetensorsData& file, const std::string& what);

// Writes `bytes` to `path` atomically (temp file, fsync, rename, fsync of the folder).
void write_file_atomic(const std::string& path, const std::string& bytes);

}  // namespace kiln
