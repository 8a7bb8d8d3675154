#pragma once
// IDX files: the format of MNIST and Fashion-MNIST (http://yann.lecun.com/exdb/mnist/).
//
//   magic   4 bytes, big-endian: 0x00 0x00 <type> <ndim>; type 0x08 = unsigned byte
//   dims    ndim x 4 bytes, big-endian u32
//   data    prod(dims) elements, row-major
//
// Images are magic 0x00000803 (N, H, W), labels 0x00000801 (N). Files may be gzipped; gzip
// is recognised by its magic bytes (1f 8b), not by the file name, so a raw file named .gz
// and a gzipped file without the suffix both load.
//
// Every failure throws kiln::Error with the file's path in the message: a missing or
// unreadable file, a wrong magic number (found and expected), a header whose dims do not fit
// the file (raw files: checked against the file size before allocating; gzipped files: capped
// by deflate's maximum ratio and kIdxMaxGzipBytes), a truncated file (expected vs got bytes),
// trailing bytes after the data, corrupt gzip data.
#include <cstdint>
#include <string>

#include "core/tensor.h"

namespace kiln::data {

inline constexpr uint32_t kIdxMagicU8Images = 0x00000803;  // u8, 3 dims
inline constexpr uint32_t kIdxMagicU8Labels = 0x00000801;  // u8, 1 dim
// Upper bound on the decompressed data of a gzipped IDX file (4 GiB).
inline constexpr uint64_t kIdxMaxGzipBytes = uint64_t(1) << 32;

// Reads a u8 IDX file of any rank (type byte 0x08). Returns a contiguous CPU u8 tensor whose
// shape is the header's dims. If `expected_magic` is nonzero the magic must equal it.
Tensor read_idx(const std::string& path, uint32_t expected_magic = 0);

// u8 (N, H, W); magic 0x00000803.
Tensor read_idx_images(const std::string& path);
// u8 (N); magic 0x00000801.
Tensor read_idx_labels(const std::string& path);

struct IdxPair {
  Tensor images;  // u8 (N, H, W)
  Tensor labels;  // u8 (N)
  std::string images_path, labels_path;  // for messages
};
// Both files; their counts N must agree (the error names both files and both counts).
IdxPair read_idx_pair(const std::string& images_path, const std::string& labels_path);

// Every label < num_classes, else kiln::Error naming the labels file, the index and the value.
void check_labels(const IdxPair& pair, int64_t num_classes);

// The class count training labels imply: max label + 1, at least min_classes. Labels are
// classes 0..K-1, so when the largest label is >= min_classes every label below it must occur;
// otherwise (a stray 255 among 0..9) kiln::Error names the file, the index and the value.
int64_t infer_num_classes(const IdxPair& train, int64_t min_classes = 10);

}  // namespace kiln::data
