#pragma once
// kiln-train's data sources (tools/train/trainer.h): which kind --data names, and each epoch's
// batches already on the training device in the model's input form (amp::prepare_input's).
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/device_batches.h"
#include "optim/amp.h"

namespace kiln::data {
class DataLoader;
class DeviceLoader;
class ImageFolder;
class ImageLoader;
class GpuJpegLoader;
struct IdxPair;
struct ImageLoaderOptions;
struct LoaderOptions;
}  // namespace kiln::data

namespace kiln::train {

enum class DataKind { FashionMnist, Idx, ImageFolder, Synthetic };

// "fashion-mnist", a folder with train-images-idx3-ubyte[.gz] (IDX), or a folder with train/
// and val/ (or test/, CIFAR-10's ImageFolder layout) sub-folders (ImageFolder). Anything else
// throws kiln::Error saying what was expected.
DataKind detect_data(const std::string& data);
// An ImageFolder's evaluation folder: DATA/val, else DATA/test.
std::string eval_folder(const std::string& data);

// One epoch's batches: x as the model takes it (on the device, f16 channels-last for Mixed16),
// y i64 on the device.
class BatchStream {
 public:
  virtual ~BatchStream() = default;
  virtual std::optional<data::DeviceBatch> next() = 0;
  // Distinct unreadable files skipped (and replaced) so far in this epoch; each is named in a
  // warning on stderr when first met. Always 0 for IDX and synthetic data.
  virtual int64_t bad_files() const { return 0; }
  // The GPU JPEG path: the share of this epoch's samples decoded on the CPU so far (the rest by
  // nvJPEG). NaN for other sources.
  virtual double host_decode_share() const { return std::numeric_limits<double>::quiet_NaN(); }
};

struct DataOptions {
  std::string data = "fashion-mnist";
  // Synthetic data (kiln-train --dummy, main.py's FakeData): random 3 x image_size² images and
  // labels of 1000 classes, made on the device; `dummy_images` per epoch, 1/25.6 of that (at
  // least one batch) for evaluation. `data` is ignored.
  bool dummy = false;
  int64_t dummy_images = 1281167;
  int64_t batch_size = 128;
  int64_t eval_batch_size = 1000;  // IDX; ImageFolder evaluates with batch_size
  // ImageFolder: the crop size; 0 (auto): 224, or for small photos (data/folder_tensors.h's
  // small_image_side: at most 64 px a side) their own size, decoded once, trained as IDX data.
  // --dummy: 224 when 0.
  int64_t image_size = 0;
  bool augment = false;  // IDX: crop (padding 4) + flip; ImageFolder and small photos always
  uint64_t seed = 0;
  int workers = 2;
  // ImageFolder decoding (issue 15): auto (whichever of the CPU and nvJPEG trains faster,
  // measured: DecoderChoice in train_data.cpp; the CPU alone without nvJPEG or a CUDA device), cpu (libjpeg-turbo, or stb without it), nvjpeg (data/gpu_jpeg.h; kiln::Error
  // when it cannot run; should it stall, the CPU takes over: GpuJpegLoader's failover), stb or
  // turbo (CPU, forced).
  std::string decoder = "auto";
  // nvjpeg: share of JPEGs decoded on the CPU instead; -1 (GpuJpegLoader::kAdaptiveHostShare):
  // steered while training
  double host_decode_fraction = -1.0;
  int64_t rank = 0, world_size = 1;  // shards (DistributedSampler's scheme) when world_size > 1
  Device device;
  amp::Precision precision = amp::Precision::FP32;
};

// kiln-train's exit status when nvJPEG's stall guard fires and the CPU decoder cannot take over
// (the stuck call holds the CUDA driver: GpuJpegLoader::set_failover): EX_TEMPFAIL, since
// rerunning (with --decoder cpu, --resume) works.
constexpr int kStallExitCode = 75;

struct DecoderChoice;
// --decoder auto's rule (DecoderChoice in train_data.cpp): whether the next epoch runs nvJPEG,
// from the seconds per batch last measured with the CPU decoder and with nvJPEG (negative: not
// measured yet), whether the epoch now ending ran nvJPEG, and whether nvJPEG failed over.
// Untried nvJPEG gets an epoch; then the faster side wins, by more than kAutoDecoderMargin to
// switch.
constexpr double kAutoDecoderMargin = 0.01;  // relative
bool auto_decoder_picks_gpu(double cpu_s, double gpu_s, bool gpu_now, bool failed_over);

class TrainData {
 public:
  explicit TrainData(const DataOptions& opts);
  ~TrainData();

  DataKind kind() const { return kind_; }
  // Small images that take the small 3x3 stem: IDX data, and an ImageFolder of small photos.
  bool small_images() const { return small_images_; }
  const std::string& description() const { return description_; }
  int64_t num_classes() const { return num_classes_; }
  int64_t channels() const { return channels_; }
  int64_t height() const { return height_; }  // training input size
  int64_t width() const { return width_; }
  int64_t train_size() const { return train_size_; }  // whole dataset (all ranks)
  int64_t test_size() const { return test_size_; }
  int64_t steps_per_epoch() const;  // this rank's (the last partial batch is dropped)
  int64_t test_steps() const;       // this rank's evaluation batches
  // What a prediction needs to treat an image as the model was trained: class names (ImageFolder
  // folder names, Fashion-MNIST's, or classes.txt beside IDX files, one per line; else empty),
  // per-channel mean/std of the normalisation (0..1 scale) and the evaluation resize.
  const std::vector<std::string>& class_names() const { return class_names_; }
  const std::vector<float>& mean() const { return mean_; }
  const std::vector<float>& stddev() const { return stddev_; }
  int64_t resize_size() const { return resize_size_; }

  // Epoch `epoch`'s batches from batch `first` on (a run resumed in the middle of an epoch): the
  // same batches, in the same order, as batches first, first + 1, ... of the whole epoch.
  std::unique_ptr<BatchStream> train_epoch(int64_t epoch, int64_t first = 0) const;
  std::unique_ptr<BatchStream> test_epoch() const;  // this rank's shard, in order

 private:
  // The constructor's steps, by kind of data (train_data.cpp says what each one sets).
  void open_synthetic();
  void open_image_folder();
  void open_small_photos(const data::ImageFolder& train, const data::ImageFolder& val,
                         int64_t side);
  void take_folder_classes(const data::ImageFolder& train, const data::ImageFolder& val);
  void open_gpu_jpeg_loaders(data::ImageFolder train, data::ImageFolder val,
                             const data::ImageLoaderOptions& lo);
  void open_image_loaders(data::ImageFolder train, data::ImageFolder val,
                          const data::ImageLoaderOptions& lo);
  void open_idx();
  void open_tensor_loaders(const Tensor& train_x, const Tensor& train_y, const Tensor& test_x,
                           const Tensor& test_y, const std::string& test_name,
                           data::LoaderOptions lo);
  void open_idx_device_loaders();

  DataOptions opts_;
  DataKind kind_;
  bool small_images_ = false;
  std::string description_;
  int64_t num_classes_ = 0, channels_ = 0, height_ = 0, width_ = 0;
  int64_t train_size_ = 0, test_size_ = 0, resize_size_ = 0;
  std::vector<std::string> class_names_;
  std::vector<float> mean_, stddev_;
  Tensor dummy_x_;  // Synthetic: one device batch reused by every step
  // IDX data and small photos: in memory, batches made by a DataLoader, or by a DeviceLoader
  // from a copy on the GPU when training on a CUDA device.
  std::unique_ptr<data::DataLoader> idx_train_, idx_test_;
  std::unique_ptr<data::DeviceLoader> dev_train_, dev_test_;
  std::unique_ptr<data::ImageLoader> img_train_, img_test_;
  std::unique_ptr<data::GpuJpegLoader> gpu_train_, gpu_test_;  // --decoder nvjpeg (or auto)
  // --decoder auto with nvJPEG present: both loader pairs are open, and this picks per epoch.
  std::shared_ptr<DecoderChoice> auto_;
};

}  // namespace kiln::train
