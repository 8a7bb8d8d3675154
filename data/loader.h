#pragma once
// DataLoader: batches from a TensorDataset (data/dataset.h), shuffled, augmented, normalised,
// prepared by worker threads ahead of the consumer.
//
//   DataLoader loader(TensorDataset(images, labels), opts);
//   for (int64_t e = 0; e < epochs; ++e)
//     for (Batch& b : loader.epoch(e)) train_step(b.x, b.y);   // breaking out early is fine
//
//   auto ep = loader.epoch(e);                                 // or pull batches by hand
//   while (std::optional<Batch> b = ep.next()) ...
//
// Determinism: the sample order of epoch e comes from a Generator seeded with (seed, e); the
// augmentation of batch k of epoch e from a Generator seeded with (seed, e, k), drawn sample by
// sample in batch order. Each batch is built by one thread, so the batches are bit-identical
// for any number of workers (0, 1, 3 ...) and any thread timing.
//
// Per sample, in order (torchvision's RandomCrop(padding) + RandomHorizontalFlip + ToTensor +
// Normalize): pad each side by `crop_padding` and crop back to H x W at a uniformly drawn
// offset; mirror left-right with p = 0.5; x = (pixel / 255 - mean[c]) / stddev[c]. Zero padding
// reads pixel 0 (it comes out as -mean[c] / stddev[c]); reflect padding mirrors the image about
// its edge pixels (torch's 'reflect': padded column -1 is column 1).
// Alternating flip (the CIFAR-10 speedruns' variant of the random flip): sample i is mirrored
// in epoch 0 with p = 0.5 (a hash of seed and its dataset index), and in every later epoch
// exactly when it was not in the epoch before, so each pair of epochs sees both views.
// A fixed transform gives every sample the same crop and flip and draws nothing: the views of
// test-time augmentation (tta_views below) are loaders that differ only in it.
//
// Threads: with workers > 0, an Epoch starts `workers` threads that build batches in order of
// their index into a bounded queue of `prefetch` batches, and the consumer receives them in
// index order. An exception thrown while building batch k reaches the consumer from next()
// (or the range-for) after batches 0..k-1. Destroying an Epoch (end of the loop, `break`, an
// exception in the consumer) stops its workers and joins them; it never waits for more than
// the batches already being built. An Epoch is used by one consumer thread; it holds its own
// references to the data, so it may outlive the DataLoader.
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <vector>

#include "data/dataset.h"
#include "data/prefetch.h"

namespace kiln::data {

struct Batch {
  Tensor x;           // f32 (B, C, H, W), contiguous, CPU
  Tensor y;           // i64 (B)
  int64_t index = 0;  // the batch's number within its epoch
};

// Chooses the samples of each epoch in place of the loader's own order (a rank's shard of a
// DistributedSampler, say). indices(e) must return size() indices in [0, dataset size).
class Sampler {
 public:
  virtual ~Sampler() = default;
  virtual int64_t size() const = 0;
  virtual std::vector<int64_t> indices(int64_t epoch) const = 0;
};

// One sample's augmentation: the crop's top-left corner in padded coordinates, each in
// [0, 2 * crop_padding] (crop_padding, crop_padding is the identity), and the flip.
struct SampleTransform {
  int64_t top = 0;
  int64_t left = 0;
  bool flip = false;
  bool operator==(const SampleTransform&) const = default;
};

enum class Padding { Zero, Reflect };

struct LoaderOptions {
  int64_t batch_size = 64;
  bool shuffle = false;     // must stay false with a sampler (the sampler orders)
  std::shared_ptr<const Sampler> sampler;  // null: all samples, in order or shuffled
  bool drop_last = false;  // drop the last batch when it is smaller than batch_size
  uint64_t seed = 0;       // drives shuffling and augmentation
  int workers = 0;         // 0: each batch is built on the consumer's thread inside next()
  int prefetch = 0;        // batches built ahead; 0: min(2 * workers, kMaxDefaultPrefetch)
  std::vector<float> mean = {0.0f};    // one value, or one per channel
  std::vector<float> stddev = {1.0f};  // one value, or one per channel; all > 0
  int64_t crop_padding = 0;            // random crop with this much padding (0: no crop)
  Padding padding = Padding::Zero;     // Reflect needs crop_padding < H and < W
  bool horizontal_flip = false;        // random horizontal flip, p = 0.5
  bool alternating_flip = false;       // with horizontal_flip: alternating (see above)
  // Every sample gets this crop (top, left in [0, 2 * crop_padding]) and flip; nothing drawn.
  std::optional<SampleTransform> fixed_transform;
  // Called on the building thread with each finished batch (extra transforms, checks); must be
  // thread-safe when workers > 0. What it throws reaches the consumer like any worker error.
  std::function<void(Batch&)> on_batch;
};

// dst (C, H, W) f32 = lut[c][pixel] of the padded, cropped, maybe mirrored src (C, H, W) u8.
// `lut` holds C x 256 values; zero padding reads as pixel 0, reflect padding as the pixel
// mirrored about the edge. Used by the loader; public for tests.
void crop_flip_normalize(const uint8_t* src, int64_t channels, int64_t height, int64_t width,
                         int64_t crop_padding, SampleTransform t, const float* lut, float* dst,
                         Padding padding = Padding::Zero);

// The source row (or column) that padded coordinate `i` (image coordinates, -pad..n-1+pad)
// reads under reflect padding: -1 reads 1, n reads n - 2. Needs pad < n.
inline int64_t reflect_index(int64_t i, int64_t n) { return i < 0 ? -i : (i >= n ? 2 * n - 2 - i : i); }

// Test-time augmentation: the views of a test image and the weight of each view's logits (the
// weights sum to 1), with crop_padding 1 and reflect padding (the CIFAR-10 speedruns' levels).
// Level 0: the image. Level 1: the image and its mirror, 1/2 each. Level 2: those two at 1/4
// each, and the image shifted one pixel up-left and one down-right, each with its mirror, at
// 1/8 each.
struct TtaView {
  SampleTransform transform;
  double weight = 1.0;
};
std::vector<TtaView> tta_views(int level);

// What batch k of an epoch is made of: the dataset index of each sample, in batch order, and
// its augmentation. The CPU batches and DeviceLoader (data/device_loader.h) both build from it,
// so the two paths draw identical batches.
struct BatchPlan {
  std::vector<int64_t> indices;
  std::vector<SampleTransform> transforms;  // one per index
};

class Epoch;

class DataLoader {
 public:
  // Throws kiln::Error for batch_size < 1, workers < 0, prefetch < 0, crop_padding < 0,
  // mean/stddev sizes other than 1 or C, stddev <= 0, shuffle together with a sampler.
  DataLoader(TensorDataset dataset, LoaderOptions opts);

  const TensorDataset& dataset() const { return *dataset_; }
  const LoaderOptions& options() const { return opts_; }
  // Batches per epoch: ceil(N / batch_size), or floor with drop_last; N is the sampler's size
  // when there is one.
  int64_t num_batches() const;
  // Sample indices of epoch e in visiting order (0..N-1 unless shuffle; the sampler's if set).
  std::vector<int64_t> order(int64_t epoch) const;
  // Starts epoch e at batch `first` (workers begin building at once): batches first, first + 1,
  // ... come out, each the same as in a whole epoch (a run resumed in the middle of an epoch).
  // Throws kiln::Error for `first` outside [0, num_batches()].
  Epoch epoch(int64_t e, int64_t first = 0) const;
  // Fills `plan` (its vectors are reused, so a caller can keep one across batches) with batch
  // k of epoch e; `order` is order(e). Throws kiln::Error for k outside [0, num_batches()).
  void batch_plan(int64_t epoch, int64_t k, const std::vector<int64_t>& order,
                  BatchPlan& plan) const;
  // The normalisation table: lut()[c * 256 + v] = (v / 255 - mean[c]) / stddev[c], C x 256.
  const std::vector<float>& lut() const { return *lut_; }

 private:
  friend class Epoch;
  std::shared_ptr<const TensorDataset> dataset_;
  LoaderOptions opts_;
  std::shared_ptr<const std::vector<float>> lut_;  // C x 256 normalised pixel values
};

class Epoch {
 public:
  Epoch(Epoch&&) noexcept;
  Epoch& operator=(Epoch&&) noexcept;
  ~Epoch();

  // The next batch in index order, std::nullopt after the last; rethrows a worker's error.
  std::optional<Batch> next();
  int64_t size() const;  // batches this epoch hands out (from its first)

  class Iterator {
   public:
    Batch& operator*() { return *current_; }
    Batch* operator->() { return &*current_; }
    Iterator& operator++() {
      current_ = epoch_->next();
      return *this;
    }
    bool operator!=(std::default_sentinel_t) const { return current_.has_value(); }
    bool operator==(std::default_sentinel_t) const { return !current_.has_value(); }

   private:
    friend class Epoch;
    explicit Iterator(Epoch* e) : epoch_(e), current_(e->next()) {}
    Epoch* epoch_;
    std::optional<Batch> current_;
  };
  // begin() fetches the first batch; call it once.
  Iterator begin() { return Iterator(this); }
  std::default_sentinel_t end() { return {}; }

 private:
  friend class DataLoader;
  struct State;
  explicit Epoch(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace kiln::data
