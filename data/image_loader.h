#pragma once
// ImageLoader: batches of decoded, augmented images from an ImageFolder (data/image_folder.h),
// built by worker threads ahead of the consumer.
//
//   ImageLoader loader(ImageFolder("/data/imagenet/train"), {.batch_size = 256, .workers = 8});
//   for (int64_t e = 0; e < epochs; ++e) {
//     ImageEpoch ep = loader.epoch(e);
//     while (std::optional<ImageBatch> b = ep.next()) ...   // b->images u8 (B, 224, 224, 3)
//   }
// To get normalised tensors on the GPU with the copy overlapping compute, wrap the epoch in a
// DeviceFeeder (data/device_batches.h).
//
// Per sample: read, then decode + transform. JPEGs go through libjpeg-turbo when kiln has it
// (decoder Auto or Turbo; data/jpeg_turbo.h): the crop box is drawn from the JPEG header and only
// the rows and columns it needs are decoded, DCT-scaled when the box is >= 2x the output.
// PNGs (and JPEGs with decoder Stb) are decoded whole by stb_image (data/image.h). Then
// Augment::Train: RandomResizedCrop(image_size)
// and a horizontal flip with p = 0.5; Augment::Eval: Resize(resize_size) + CenterCrop(image_size)
// (data/transforms.h). The output stays u8 NHWC; normalisation happens on the consumer's device.
//
// Order and sharding: epoch e visits a permutation of the N files (seeded by (seed, e) when
// shuffle, else 0..N-1). For distributed training the sequence is padded by wrapping around to
// a multiple of world_size and rank r takes positions r, r + world_size, ... (as PyTorch's
// DistributedSampler), so every rank has ceil(N / world_size) samples per epoch.
//
// Determinism: the sample at position p of epoch e is augmented with a Generator seeded by
// (seed, e, p), so batches are bit-identical for any number of workers and any timing (for a
// given decoder; Stb and Turbo agree on every crop box and flip, their pixels differ by the
// decoders' rounding and Turbo's DCT scaling).
//
// Work sharing: a batch is split into parts of a few samples that all workers fill in parallel
// (data/prefetch.h's PartedPrefetch), so batch k is ready after (its decode work) / workers and
// the workers never idle while one of them finishes a whole batch alone.
//
// Bad files: a file that cannot be read or decoded (truncated, empty, not an image, over the
// size guard) is replaced by the next file of the epoch's sequence that decodes (with that
// file's label), so the replacement is deterministic too. Each bad file is named in a warning
// on stderr once per loader, and counted per epoch; when an epoch has met more than
// max(max_bad_fraction x (samples per epoch), min_bad_files) bad files, the batch that finds the
// next one fails with a kiln::Error listing them (which batch that is depends on worker timing).
// min_bad_files keeps one bad file in a small folder (a 41-image validation set) from stopping
// a run. Files over max_file_bytes are bad files too (refused before they are read).
//
// Memory: batch buffers come from a pool that recycles them when the last tensor viewing
// them is dropped; when kiln is built with CUDA and a device is present (and pin_memory) they
// are page-locked so host->device copies run asynchronously.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "data/image.h"
#include "data/image_folder.h"
#include "data/jpeg_turbo.h"
#include "data/prefetch.h"
#include "data/transforms.h"

namespace kiln::data {

enum class Augment { Train, Eval };

// Which CPU decoder takes JPEG files (PNG always goes to stb_image).
enum class JpegDecoder {
  Auto,   // Turbo when kiln is built with libjpeg-turbo, else Stb
  Stb,    // whole-image decode with stb_image
  Turbo,  // libjpeg-turbo, crop-region + DCT-scaled (kiln::Error when not built with it)
};
// "auto", "stb", "turbo"; kiln::Error naming the accepted values otherwise.
JpegDecoder parse_jpeg_decoder(const std::string& name);
const char* jpeg_decoder_name(JpegDecoder d);

struct ImageLoaderOptions {
  int64_t batch_size = 256;
  int64_t image_size = 224;  // output height = width
  Augment augment = Augment::Train;
  int64_t resize_size = 256;     // Eval: the shorter side before the centre crop
  RandomResizedCropParams crop;  // Train
  bool horizontal_flip = true;   // Train
  bool shuffle = true;
  bool drop_last = false;  // drop the last batch when smaller than batch_size
  uint64_t seed = 0;
  int workers = 0;   // 0: batches are built on the consumer's thread
  int prefetch = 0;  // batches made ahead of the consumer; 0: 4 (workers share each batch)
  JpegDecoder decoder = JpegDecoder::Auto;
  int64_t rank = 0;
  int64_t world_size = 1;
  double max_bad_fraction = 0.01;  // of the epoch's samples; see "Bad files"
  int64_t min_bad_files = 5;       // tolerated in any epoch, whatever its size
  int64_t max_file_bytes = kMaxImageFileBytes;  // larger files are bad files (data/image.h)
  bool pin_memory = true;          // only effective with CUDA and a device
  bool warn = true;                // print the bad-file warnings
  // Deferred decoding (the GPU path, data/gpu_jpeg.h): when set, a JPEG whose header reads and
  // for which defer_jpeg(bytes, size, header) returns true is not decoded on the host: its
  // bytes, crop box and flip go into ImageBatch::encoded and its pixels in `images` are left
  // unwritten. Called on the worker threads (must be thread-safe).
  std::function<bool(const uint8_t*, size_t, const JpegInfo&)> defer_jpeg;
};

// A sample whose decoding was deferred (ImageLoaderOptions::defer_jpeg): resampling `box` of the
// decoded image, taps limited to `limit`, mirrored when `flip`, gives what the host would have
// written (data/transforms.h's resample_box).
struct EncodedSample {
  std::vector<uint8_t> bytes;  // the whole file; empty: the sample was decoded on the host
  JpegInfo info;
  BoxF box;
  CropBox limit;
  bool flip = false;
  int64_t position = 0;  // padded position in the epoch (for ImageEpoch::redo)
  int64_t index = 0;     // dataset index of the file
};

struct ImageBatch {
  Tensor images;      // u8 (B, H, W, 3) contiguous (NHWC), CPU, maybe pinned
  Tensor labels;      // i64 (B), CPU, same buffer as images
  int64_t index = 0;  // the batch's number within its epoch
  bool pinned = false;
  // With defer_jpeg: one entry per sample (bytes empty where the host decoded it); else null.
  std::shared_ptr<std::vector<EncodedSample>> encoded;
};

class ImageEpoch;

class ImageLoader {
 public:
  // Throws kiln::Error for batch_size/image_size/resize_size < 1, workers/prefetch < 0, Turbo
  // without libjpeg-turbo,
  // world_size < 1, rank outside [0, world_size), max_bad_fraction outside [0, 1],
  // min_bad_files < 0, max_file_bytes < 1,
  // Eval with resize_size < image_size.
  ImageLoader(ImageFolder folder, ImageLoaderOptions opts);
  ~ImageLoader();

  const ImageFolder& folder() const;
  const ImageLoaderOptions& options() const { return opts_; }
  int64_t samples_per_epoch() const;  // this rank's: ceil(N / world_size)
  int64_t num_batches() const;
  // The dataset indices this rank visits in epoch e, in order (before bad-file replacement).
  std::vector<int64_t> order(int64_t epoch) const;
  // Starts epoch e at batch `first` (workers begin at once): batches first, first + 1, ..., each
  // the same as in a whole epoch. The epoch keeps the loader's shared state alive. Throws
  // kiln::Error for `first` outside [0, num_batches()].
  ImageEpoch epoch(int64_t e, int64_t first = 0) const;
  // Every file found bad so far (any epoch), as its error message (which names the file), in
  // discovery order.
  std::vector<std::string> bad_files() const;

  struct Shared;  // folder, bad-file log, buffer pool (data/image_loader.cpp)

 private:
  ImageLoaderOptions opts_;
  std::shared_ptr<Shared> shared_;
};

class ImageEpoch {
 public:
  ImageEpoch(ImageEpoch&&) noexcept;
  ImageEpoch& operator=(ImageEpoch&&) noexcept;
  ~ImageEpoch();
  // The next batch in index order, std::nullopt after the last; rethrows a worker's error.
  std::optional<ImageBatch> next();
  int64_t size() const;       // batches in this epoch
  int64_t bad_count() const;  // distinct bad files met so far in this epoch
  // For a deferred sample that failed to decode later (on the GPU and then on the host): records
  // its file as bad with `reason`, then writes the replacement the host path gives for its
  // position (the next file of the sequence that decodes, decoded on the host) to dst
  // (S, S, 3) and returns its label. Thread-safe.
  int64_t redo(const EncodedSample& s, const std::string& reason, uint8_t* dst);

  struct State;

 private:
  friend class ImageLoader;
  explicit ImageEpoch(std::unique_ptr<State> s);
  std::unique_ptr<State> state_;
};

}  // namespace kiln::data
