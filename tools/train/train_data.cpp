#include "tools/train/train_data.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "core/text.h"
#include "data/device_loader.h"
#include "data/distributed_sampler.h"
#include "data/fashion_mnist.h"
#include "data/folder_tensors.h"
#include "data/gpu_jpeg.h"
#include "data/image_folder.h"
#include "data/image_loader.h"
#include "data/jpeg_turbo.h"
#include "data/loader.h"
#include "data/transforms.h"
#include "ops/ops.h"
#include "optim/model_file.h"
#include "tools/cli/cli.h"

namespace kiln::train {

namespace fs = std::filesystem;

namespace {

// An ImageFolder whose probed images are at most this many pixels a side is a set of small
// photos (CIFAR-10's 32, STL-10's 96 is not; Tiny ImageNet's 64 is), trained as IDX data.
constexpr int64_t kSmallPhotoSide = 64;

// classes.txt beside IDX files: one class name per line, UTF-8 (a leading byte-order mark and
// "\r\n" endings are accepted). Blank lines may end the file; anywhere else, and for a name
// that class_name_problem refuses or that repeats, the error names the file and the line.
std::vector<std::string> read_class_file(const fs::path& path, int64_t num_classes) {
  std::vector<std::string> names;
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return names;
  std::ifstream f(path, std::ios::binary);
  if (!f.good()) cli::usage_error("cannot read '", path.string(), "'");
  const std::string where = "'" + path.string() + "' line ";
  std::map<std::string, size_t> seen;  // name -> its line
  size_t blank_line = 0;               // the first blank line since the last name, or 0
  size_t line_no = 0;
  for (std::string line; std::getline(f, line);) {
    ++line_no;
    if (line_no == 1 && line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) {
      if (blank_line == 0) blank_line = line_no;
      continue;
    }
    if (blank_line != 0)
      cli::usage_error(where, blank_line,
                       " is blank: one class name per line (blank lines may only end the file)");
    const std::string problem = class_name_problem(line);
    if (!problem.empty())
      cli::usage_error(where, line_no, ": class name '", text::printable(line), "' ", problem);
    const auto [it, fresh] = seen.emplace(line, line_no);
    if (!fresh)
      cli::usage_error(where, line_no, ": class name '", text::printable(line), "' repeats line ",
                       it->second);
    names.push_back(line);
  }
  if (f.bad()) cli::usage_error("error reading '", path.string(), "'");
  if (int64_t(names.size()) != num_classes)
    cli::usage_error("'", path.string(), "' names ", names.size(), " classes, but the labels have ",
                     num_classes, " (one name per line)");
  return names;
}

}  // namespace

DataKind detect_data(const std::string& data) {
  if (data == "fashion-mnist") return DataKind::FashionMnist;
  std::error_code ec;
  if (!fs::is_directory(data, ec))
    cli::usage_error("--data '", data,
                     "': no such folder (expected 'fashion-mnist', a folder of MNIST-style IDX "
                     "files, or an ImageFolder root holding train/ and val/ or test/)");
  if (fs::is_directory(fs::path(data) / "train", ec) &&
      (fs::is_directory(fs::path(data) / "val", ec) ||
       fs::is_directory(fs::path(data) / "test", ec)))
    return DataKind::ImageFolder;
  for (const char* n : {"train-images-idx3-ubyte", "train-images-idx3-ubyte.gz",
                        "train-images.idx3-ubyte", "train-images.idx3-ubyte.gz"})
    if (fs::is_regular_file(fs::path(data) / n, ec)) return DataKind::Idx;
  cli::usage_error("--data '", data,
                   "': not a dataset folder: expected MNIST-style IDX files "
                   "(train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-...) or an "
                   "ImageFolder root with train/ and val/ (or test/) sub-folders of class "
                   "folders");
}

std::string eval_folder(const std::string& data) {
  std::error_code ec;
  return (fs::path(data) / (fs::is_directory(fs::path(data) / "val", ec) ? "val" : "test"))
      .string();
}

// --decoder auto: the JPEG decoder under which training runs fastest, measured while training.
// Each training epoch reports its seconds per batch over its second half (steady state, past the
// first epoch's tuning and graph capture: MeasuredStream). The first epoch runs the CPU decoder
// and the second nvJPEG (with the adaptive share, so the CPU workers keep decoding what they
// can); from then on each epoch runs the one that was faster when last measured (a switch needs
// kAutoDecoderMargin), and the CPU decoder after a failover (auto_decoder_picks_gpu).
// Evaluation follows the training epochs' decoder. (The time the step spends in next() would not do: next() also waits for the device,
// through the events that guard the upload buffers, whichever side is behind.)
bool auto_decoder_picks_gpu(double cpu_s, double gpu_s, bool gpu_now, bool failed_over) {
  if (failed_over) return false;
  if (gpu_s < 0) return true;       // nvJPEG not measured yet
  if (cpu_s < 0) return gpu_now;    // nothing to compare with
  const double m = 1 + kAutoDecoderMargin;
  return gpu_now ? gpu_s < cpu_s * m : gpu_s * m < cpu_s;
}

struct DecoderChoice {
  bool announce = false;  // rank 0 prints each switch
  double batch_s[2] = {-1, -1};  // seconds per batch when last measured: [0] CPU, [1] nvJPEG
  bool gpu = false;              // the decoder of the next epoch

  void report(int64_t epoch, bool on_gpu, double seconds_per_batch) {
    batch_s[on_gpu ? 1 : 0] = seconds_per_batch;
    const bool next =
        auto_decoder_picks_gpu(batch_s[0], batch_s[1], on_gpu, data::gpu_jpeg_failed_over());
    if (next != gpu && announce) {
      std::printf("kiln-train: --decoder auto: epoch %ld took %.1f ms per batch with %s", long(epoch + 1),
                  1e3 * seconds_per_batch, on_gpu ? "nvJPEG" : "the CPU decoder");
      if (batch_s[next ? 1 : 0] >= 0)
        std::printf(", %.1f ms with %s when last measured", 1e3 * batch_s[next ? 1 : 0],
                    next ? "nvJPEG" : "the CPU decoder");
      std::printf(" (second halves of epochs); epoch %ld runs %s\n", long(epoch + 2),
                  next ? "nvJPEG" : "the CPU decoder");
      std::fflush(stdout);
    }
    gpu = next;
  }
};

namespace {

// Times the second half of a training epoch and, when the epoch ran to its end, reports its
// seconds per batch to `choice` (--decoder auto).
class MeasuredStream final : public BatchStream {
 public:
  using Clock = std::chrono::steady_clock;
  MeasuredStream(std::unique_ptr<BatchStream> in, bool gpu, int64_t epoch, int64_t batches,
                 std::shared_ptr<DecoderChoice> choice)
      : in_(std::move(in)), gpu_(gpu), epoch_(epoch), from_(batches / 2),
        choice_(std::move(choice)) {}
  ~MeasuredStream() override {
    if (ended_ && k_ > from_)
      choice_->report(epoch_, gpu_,
                      std::chrono::duration<double>(end_ - start_).count() / double(k_ - from_));
  }
  std::optional<data::DeviceBatch> next() override {
    const auto t = Clock::now();
    if (k_ == from_) start_ = t;
    std::optional<data::DeviceBatch> b = in_->next();
    if (b) {
      ++k_;
    } else {
      ended_ = true;
      end_ = t;
    }
    return b;
  }
  int64_t bad_files() const override { return in_->bad_files(); }
  double host_decode_share() const override { return in_->host_decode_share(); }

 private:
  std::unique_ptr<BatchStream> in_;
  bool gpu_;
  int64_t epoch_, from_, k_ = 0;
  std::shared_ptr<DecoderChoice> choice_;
  Clock::time_point start_{}, end_{};
  bool ended_ = false;
};

// CPU batches of an IDX epoch, moved to the device as the model wants them.
class IdxStream final : public BatchStream {
 public:
  IdxStream(data::Epoch ep, Device dev, amp::Precision p)
      : ep_(std::move(ep)), dev_(dev), precision_(p) {}
  std::optional<data::DeviceBatch> next() override {
    std::optional<data::Batch> b = ep_.next();
    if (!b) return std::nullopt;
    return data::DeviceBatch{amp::prepare_input(b->x, dev_, precision_), b->y.to(dev_), b->index};
  }

 private:
  data::Epoch ep_;
  Device dev_;
  amp::Precision precision_;
};

// IDX batches made on the GPU from the device-resident dataset (same plan as IdxStream's).
class DeviceIdxStream final : public BatchStream {
 public:
  explicit DeviceIdxStream(data::DeviceEpoch ep) : ep_(std::move(ep)) {}
  std::optional<data::DeviceBatch> next() override { return ep_.next(); }

 private:
  data::DeviceEpoch ep_;
};

// Decoded u8 batches, uploaded and normalised by a DeviceFeeder (which points at ep_).
class ImageStream final : public BatchStream {
 public:
  ImageStream(data::ImageEpoch ep, Device dev, DType dtype)
      : ep_(std::move(ep)), feed_(ep_, dev, dtype) {}
  std::optional<data::DeviceBatch> next() override { return feed_.next(); }
  int64_t bad_files() const override { return ep_.bad_count(); }

 private:
  data::ImageEpoch ep_;
  data::DeviceFeeder feed_;
};

// Batches decoded and transformed on the GPU (nvJPEG + the fused crop kernel).
class GpuImageStream final : public BatchStream {
 public:
  explicit GpuImageStream(data::GpuJpegEpoch ep) : ep_(std::move(ep)) {}
  std::optional<data::DeviceBatch> next() override { return ep_.next(); }
  int64_t bad_files() const override { return ep_.bad_count(); }
  double host_decode_share() const override {
    const double n = double(ep_.gpu_decoded() + ep_.host_decoded());
    return n > 0 ? double(ep_.host_decoded()) / n : 0.0;
  }

 private:
  data::GpuJpegEpoch ep_;
};

// Synthetic batches: the same device images each step, labels from (seed, epoch, step); from
// batch `first`, the labels of the batches before it drawn and dropped.
class SyntheticStream final : public BatchStream {
 public:
  SyntheticStream(Tensor x, int64_t batches, uint64_t seed, Device dev, int64_t first = 0)
      : x_(std::move(x)), batches_(batches), gen_(seed), dev_(dev) {
    for (; i_ < first; ++i_) (void)randint(0, 1000, {x_.size(0)}, DType::i64, &gen_);
  }
  std::optional<data::DeviceBatch> next() override {
    if (i_ == batches_) return std::nullopt;
    Tensor y = randint(0, 1000, {x_.size(0)}, DType::i64, &gen_).to(dev_);
    return data::DeviceBatch{x_, y, i_++};
  }

 private:
  Tensor x_;
  int64_t batches_, i_ = 0;
  Generator gen_;
  Device dev_;
};

// The pixel mean and std of u8 images (N, H, W), as fractions of 255: data::channel_stats's
// exact integer sums over one channel (no f64 copy of the set, which was 16 times its bytes).
std::pair<float, float> pixel_stats(const Tensor& images) {
  std::vector<float> mean, stddev;
  data::channel_stats(images.reshape({images.size(0), 1, images.size(1), images.size(2)}), &mean,
                      &stddev);
  return {mean[0], stddev[0]};
}

// The dtype decoded images reach the model in: f16 for Mixed16 on a CUDA device, else f32.
DType image_dtype(const DataOptions& o) {
  return o.device.is_cuda() && o.precision == amp::Precision::Mixed16 ? DType::f16 : DType::f32;
}

// One ImageFolder split; a folder without images, or one that cannot be listed, is the user's
// --data to fix.
data::ImageFolder list_image_folder(const std::string& path) {
  return cli::user_input("--data: ", [&] { return data::ImageFolder(path); });
}

// Which decoder takes an ImageFolder's JPEGs (--decoder, issue 15). nvjpeg: the GPU path
// (data/gpu_jpeg.h), an error where it cannot run. auto: DecoderChoice's measured choice where
// kiln has nvJPEG and trains on a CUDA device, else the CPU. Should nvJPEG stall (it hung in some
// trainings before its calls were serialised, docs/lab/input-pipeline.md), the loader fails over
// to the CPU decoder and the run goes on.
enum class JpegPath { Cpu, Gpu, Auto };
JpegPath jpeg_path(const DataOptions& o) {
  if (o.decoder != "auto" && o.decoder != "cpu" && o.decoder != "nvjpeg" && o.decoder != "stb" &&
      o.decoder != "turbo")
    cli::usage_error("--decoder '", o.decoder, "': expected auto, cpu, nvjpeg, stb or turbo");
  if (o.decoder == "nvjpeg") {
    if (!o.device.is_cuda())
      cli::usage_error("--decoder nvjpeg needs a CUDA device; the device is ", o.device.str());
    if (!data::gpu_jpeg_available())
      cli::usage_error("--decoder nvjpeg: this kiln was built without nvJPEG (CUDA builds find "
                       "it in the toolkit); use --decoder cpu");
    return JpegPath::Gpu;
  }
  if (o.decoder == "auto" && o.device.is_cuda() && data::gpu_jpeg_available())
    return JpegPath::Auto;
  return JpegPath::Cpu;
}

// The ImageFolder training loader: this rank's shard, augmented, the last partial batch dropped.
data::ImageLoaderOptions image_train_options(const DataOptions& o, int64_t image_size,
                                             int64_t resize_size) {
  data::ImageLoaderOptions lo;
  lo.batch_size = o.batch_size;
  lo.image_size = image_size;
  lo.resize_size = resize_size;
  lo.drop_last = true;
  lo.seed = o.seed;
  lo.workers = o.workers;
  lo.rank = o.rank;
  lo.world_size = o.world_size;
  if (o.decoder == "stb" || o.decoder == "turbo") lo.decoder = data::parse_jpeg_decoder(o.decoder);
  return lo;
}

// The evaluation loader: as the training one, in order, every image, the evaluation transform.
data::ImageLoaderOptions image_eval_options(data::ImageLoaderOptions eo) {
  eo.augment = data::Augment::Eval;
  eo.shuffle = false;
  eo.drop_last = false;
  return eo;
}

// nvJPEG's stall guard when the CPU decoder cannot take over (the stuck call holds the CUDA
// driver, data/gpu_jpeg.h): unwinding would block on the device, so say why and leave at once
// (the last epoch's checkpoint is already on disk).
void exit_on_stall(const std::string& message) {
  std::fflush(stdout);
  std::fprintf(stderr, "kiln-train: error: %s\n", message.c_str());
  std::fflush(nullptr);
  std::_Exit(kStallExitCode);
}

// One IDX split, Fashion-MNIST's or --data's; a missing or malformed file is the user's to fix.
data::IdxPair load_idx(bool fmnist, const std::string& dir, data::Split s) {
  return cli::user_input(fmnist ? "fashion-mnist: " : "--data: ", [&] {
    return fmnist ? data::load_fashion_mnist(dir, s) : data::load_mnist(dir, s);
  });
}

// An in-memory training loader's base (IDX data, small photos): --batch-size, shuffled with
// --seed, the last partial batch dropped, --workers threads.
data::LoaderOptions tensor_train_options(const DataOptions& o) {
  data::LoaderOptions lo;
  lo.batch_size = o.batch_size;
  lo.shuffle = true;
  lo.drop_last = true;
  lo.seed = o.seed;
  lo.workers = o.workers;
  return lo;
}

// The IDX training loader: tensor_train_options, normalised by the training set's pixel mean and
// std (Fashion-MNIST's are known), crop (padding 4) + flip with --augment.
data::LoaderOptions idx_train_options(const DataOptions& o, bool fmnist, const Tensor& images) {
  data::LoaderOptions lo = tensor_train_options(o);
  if (fmnist) {  // the training set's pixel mean and std
    lo.mean = {0.2860f};
    lo.stddev = {0.3530f};
  } else {
    auto [m, s] = pixel_stats(images);
    lo.mean = {m};
    lo.stddev = {s};
  }
  if (o.augment) {
    lo.crop_padding = 4;
    lo.horizontal_flip = true;
  }
  return lo;
}

// The IDX evaluation loader: as the training one, in order, every image, no augmentation, in
// batches of eval_batch_size.
data::LoaderOptions idx_eval_options(data::LoaderOptions eo, int64_t eval_batch_size) {
  eo.shuffle = false;
  eo.drop_last = false;
  eo.crop_padding = 0;
  eo.horizontal_flip = false;
  eo.batch_size = eval_batch_size;
  return eo;
}

}  // namespace

TrainData::TrainData(const DataOptions& o)
    : opts_(o), kind_(o.dummy ? DataKind::Synthetic : detect_data(o.data)) {
  switch (kind_) {
    case DataKind::Synthetic:
      open_synthetic();
      return;
    case DataKind::ImageFolder:
      open_image_folder();
      return;
    case DataKind::FashionMnist:
    case DataKind::Idx:
      open_idx();
      return;
  }
}

// --dummy: ImageNet's shape and normalisation, one device batch of random images reused by every
// step (labels are drawn per step: SyntheticStream).
void TrainData::open_synthetic() {
  const DataOptions& o = opts_;
  if (o.dummy_images < o.batch_size * o.world_size)
    cli::usage_error("--dummy-images ", o.dummy_images, ": fewer than one batch of ", o.batch_size,
                     " per process");
  num_classes_ = 1000;
  channels_ = 3;
  const int64_t S = o.image_size > 0 ? o.image_size : 224;
  height_ = width_ = resize_size_ = S;
  train_size_ = o.dummy_images;
  test_size_ =
      std::max(o.batch_size * o.world_size, int64_t(std::llround(double(o.dummy_images) / 25.6)));
  mean_.assign(std::begin(data::kImageNetMean), std::end(data::kImageNetMean));
  stddev_.assign(std::begin(data::kImageNetStd), std::end(data::kImageNetStd));
  description_ = "synthetic data (--dummy)";
  Generator g(o.seed);
  dummy_x_ = amp::prepare_input(randn({o.batch_size, 3, S, S}, {}, &g),
                                o.device, o.precision);
}

// ImageFolder: --data/train and --data/val (or test) holding the same class folders. Small photos
// (no --image-size, every probed image at most 64 px a side) are decoded once and trained as IDX
// data (open_small_photos); the rest take ImageNet's recipe: ImageNet's normalisation, decoded
// every epoch by the CPU workers or, with --decoder nvjpeg, on the GPU.
void TrainData::open_image_folder() {
  const DataOptions& o = opts_;
  data::ImageFolder train = list_image_folder(o.data + "/train");
  data::ImageFolder val = list_image_folder(eval_folder(o.data));
  take_folder_classes(train, val);
  if (o.image_size == 0) {
    const int64_t side = cli::user_input(
        "--data: ", [&] { return data::small_image_side(train, kSmallPhotoSide); });
    if (side > 0) return open_small_photos(train, val, side);
  }
  const int64_t S = o.image_size > 0 ? o.image_size : 224;
  mean_.assign(std::begin(data::kImageNetMean), std::end(data::kImageNetMean));
  stddev_.assign(std::begin(data::kImageNetStd), std::end(data::kImageNetStd));
  channels_ = 3;
  height_ = width_ = S;
  resize_size_ = int64_t(std::llround(double(S) * 256.0 / 224.0));
  train_size_ = train.size();
  test_size_ = val.size();
  description_ = "ImageFolder " + o.data;
  const JpegPath path = jpeg_path(o);
  const data::ImageLoaderOptions lo = image_train_options(o, S, resize_size_);
  if (path != JpegPath::Cpu) open_gpu_jpeg_loaders(train, val, lo);
  if (path != JpegPath::Gpu) open_image_loaders(std::move(train), std::move(val), lo);
  if (path == JpegPath::Auto) {
    auto_ = std::make_shared<DecoderChoice>();
    auto_->announce = o.rank == 0;
    description_ = "ImageFolder " + o.data + " (decoder auto: the CPU or nvJPEG " +
                   gpu_train_->backend() + ", whichever trains faster)";
  }
}

// The classes: train/'s class folders, which val/ must match, each a valid class name.
void TrainData::take_folder_classes(const data::ImageFolder& train, const data::ImageFolder& val) {
  const DataOptions& o = opts_;
  if (train.classes() != val.classes())
    cli::usage_error("--data '", o.data, "': train/ has ", train.num_classes(),
                     " class folders and ", fs::path(val.root()).filename().string(), "/ ",
                     val.num_classes(), "; both must hold the same class folders");
  num_classes_ = train.num_classes();
  class_names_ = train.classes();
  try {
    check_class_names(class_names_, "--data '" + o.data + "/train': class folders");
  } catch (const Error& e) {
    cli::usage_error(cli::without_location(e.what()));
  }
}

// ImageFolder decoded by nvJPEG on the GPU (data/gpu_jpeg.h); a stall fails over to the CPU.
void TrainData::open_gpu_jpeg_loaders(data::ImageFolder train, data::ImageFolder val,
                                      const data::ImageLoaderOptions& lo) {
  const DataOptions& o = opts_;
  const DType dt = image_dtype(o);
  gpu_train_ = std::make_unique<data::GpuJpegLoader>(
      std::move(train), lo, o.device, dt, data::NormalizeStats{}, o.host_decode_fraction);
  gpu_test_ =
      std::make_unique<data::GpuJpegLoader>(std::move(val), image_eval_options(lo), o.device, dt,
                                            data::NormalizeStats{}, o.host_decode_fraction);
  gpu_train_->set_stall_handler(exit_on_stall);
  gpu_test_->set_stall_handler(exit_on_stall);
  description_ += std::string(" (nvJPEG ") + gpu_train_->backend() + " decoder)";
  if (gpu_train_->num_batches() == 0)
    cli::usage_error("--data '", o.data, "': ", gpu_train_->host().samples_per_epoch(),
                     " training images per process, fewer than one batch of ", o.batch_size);
}

// ImageFolder decoded by the CPU workers (data/image_loader.h).
void TrainData::open_image_loaders(data::ImageFolder train, data::ImageFolder val,
                                   const data::ImageLoaderOptions& lo) {
  const DataOptions& o = opts_;
  img_train_ = std::make_unique<data::ImageLoader>(std::move(train), lo);
  img_test_ = std::make_unique<data::ImageLoader>(std::move(val), image_eval_options(lo));
  if (img_train_->num_batches() == 0)
    cli::usage_error("--data '", o.data, "': ", img_train_->samples_per_epoch(),
                     " training images per process, fewer than one batch of ", o.batch_size);
}

// IDX: Fashion-MNIST (10 classes, its class names) or a folder of MNIST-style files (as many
// classes as the training labels imply, names from classes.txt beside them when present); the
// model's input is the images' own size, one channel.
void TrainData::open_idx() {
  const DataOptions& o = opts_;
  const bool fmnist = kind_ == DataKind::FashionMnist;
  const std::string dir = fmnist ? data::kFashionMnistDir : o.data;
  const data::IdxPair train = load_idx(fmnist, dir, data::Split::Train);
  const data::IdxPair test = load_idx(fmnist, dir, data::Split::Test);
  // Test labels outside the training labels' classes would be read past the logits: refused
  // here, when the data is opened.
  const std::string what = fmnist ? "fashion-mnist: " : "--data: ";
  // Before the pixel statistics and the labels' checks, which need an image of a pixel or more.
  for (const auto& [split, pair] : {std::pair{"training", &train}, std::pair{"test", &test}})
    if (pair->images.numel() == 0)
      cli::usage_error(what, "'", dir, "': the ", split, " set ", pair->images_path,
                       " holds no images (its shape is ", pair->images.shape_str(),
                       "; at least one image of 1x1 pixels or more is needed)");
  num_classes_ = cli::user_input(what, [&] {
    const int64_t k = fmnist ? 10 : data::infer_num_classes(train);
    data::check_labels(train, k);
    data::check_labels(test, k);
    return k;
  });
  channels_ = 1;
  height_ = train.images.size(1);
  width_ = train.images.size(2);
  resize_size_ = std::min(height_, width_);
  if (fmnist)
    class_names_.assign(data::kFashionMnistClasses.begin(), data::kFashionMnistClasses.end());
  else
    class_names_ = read_class_file(fs::path(dir) / "classes.txt", num_classes_);
  train_size_ = train.images.size(0);
  test_size_ = test.images.size(0);
  description_ = (fmnist ? "Fashion-MNIST " : "IDX ") + dir;
  small_images_ = true;
  const data::LoaderOptions lo = idx_train_options(o, fmnist, train.images);
  mean_ = lo.mean;
  stddev_ = lo.stddev;
  open_tensor_loaders(train.images, train.labels, test.images, test.labels, test.images_path, lo);
  if (o.device.is_cuda()) open_idx_device_loaders();
}

// An ImageFolder of small photos (CIFAR-10): decoded once into memory at `side` x `side` by all
// the machine's cores, normalised by the training set's per-channel statistics, augmented with
// torchvision's RandomCrop(side, padding=4) + RandomHorizontalFlip, evaluated whole and in
// order; the small 3x3 stem. On a CUDA device the pixels live on the GPU (DeviceLoader).
void TrainData::open_small_photos(const data::ImageFolder& train, const data::ImageFolder& val,
                                  int64_t side) {
  const DataOptions& o = opts_;
  data::FolderTensorsOptions fo;
  fo.size = side;
  fo.threads = int(std::clamp<int64_t>(
      std::max<int64_t>(o.workers, int64_t(std::thread::hardware_concurrency())), 1, 64));
  fo.stb = o.decoder == "stb";
  if (o.decoder == "turbo" && !data::jpeg_turbo_available())
    cli::usage_error("--decoder turbo: this kiln was built without libjpeg-turbo");
  // Only rank 0 names unreadable files: every rank decodes the whole set.
  fo.warn = o.rank == 0;
  const data::FolderTensors tr = cli::user_input(
      "--data: ", [&] { return data::decode_image_folder(train, fo); });
  const data::FolderTensors te = cli::user_input(
      "--data: ", [&] { return data::decode_image_folder(val, fo); });
  small_images_ = true;
  channels_ = 3;
  height_ = width_ = resize_size_ = side;
  train_size_ = tr.images.size(0);
  test_size_ = te.images.size(0);
  const size_t skipped = tr.unreadable.size() + te.unreadable.size();
  description_ = "ImageFolder " + o.data + " (" + std::to_string(side) + "x" +
                 std::to_string(side) + " photos, decoded once into memory" +
                 (skipped > 0 ? ", " + std::to_string(skipped) + " unreadable files skipped" : "") +
                 ")";
  data::LoaderOptions lo = tensor_train_options(o);
  data::channel_stats(tr.images, &lo.mean, &lo.stddev);
  lo.crop_padding = 4;
  lo.horizontal_flip = true;
  mean_ = lo.mean;
  stddev_ = lo.stddev;
  open_tensor_loaders(tr.images, tr.labels, te.images, te.labels, val.root(), lo);
  if (o.device.is_cuda()) open_idx_device_loaders();
}

// The in-memory loaders (IDX data, small photos) over this rank's shard (DistributedSampler when
// world_size > 1).
void TrainData::open_tensor_loaders(const Tensor& train_x, const Tensor& train_y,
                                    const Tensor& test_x, const Tensor& test_y,
                                    const std::string& test_name, data::LoaderOptions lo) {
  const DataOptions& o = opts_;
  data::LoaderOptions eo = idx_eval_options(lo, o.eval_batch_size);
  if (o.world_size > 1) {
    lo.shuffle = false;
    lo.sampler = std::make_shared<data::DistributedSampler>(
        train_size_, o.world_size, o.rank, data::DistributedSamplerOptions{true, o.seed, false});
    eo.sampler = std::make_shared<data::DistributedSampler>(
        test_size_, o.world_size, o.rank, data::DistributedSamplerOptions{false, o.seed, false});
  }
  idx_train_ = std::make_unique<data::DataLoader>(data::TensorDataset(train_x, train_y), lo);
  idx_test_ = std::make_unique<data::DataLoader>(data::TensorDataset(test_x, test_y), eo);
  if (test_size_ == 0)
    cli::usage_error("--data '", o.data, "': the test set ", test_name, " holds no images");
  if (idx_train_->num_batches() == 0)
    cli::usage_error("--data '", o.data, "': fewer training images per process than one batch of ",
                     o.batch_size);
}

// On a CUDA device the whole IDX dataset lives on the GPU and batches are made there (issue 19):
// in the form amp::prepare_input gives a CPU batch, f16 channels-last or f32 contiguous.
void TrainData::open_idx_device_loaders() {
  const bool half = opts_.precision == amp::Precision::Mixed16;
  const DType dt = half ? DType::f16 : DType::f32;
  const MemoryFormat fmt = half ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous;
  dev_train_ = std::make_unique<data::DeviceLoader>(*idx_train_, opts_.device, dt, fmt);
  dev_test_ = std::make_unique<data::DeviceLoader>(*idx_test_, opts_.device, dt, fmt);
}

// After an nvJPEG failover the loaders are leaked: freeing their pinned buffers would wait for the
// whole device, the stuck decode stream included (data/gpu_jpeg.h).
TrainData::~TrainData() {
  if (!data::gpu_jpeg_failed_over()) return;
  (void)img_train_.release();
  (void)img_test_.release();
  (void)gpu_train_.release();
  (void)gpu_test_.release();
}

int64_t TrainData::steps_per_epoch() const {
  if (kind_ == DataKind::Synthetic) return train_size_ / (opts_.batch_size * opts_.world_size);
  if (gpu_train_) return gpu_train_->num_batches();
  return idx_train_ ? idx_train_->num_batches() : img_train_->num_batches();
}

int64_t TrainData::test_steps() const {
  if (kind_ == DataKind::Synthetic) return test_size_ / (opts_.batch_size * opts_.world_size);
  if (gpu_test_) return gpu_test_->num_batches();
  return idx_test_ ? idx_test_->num_batches() : img_test_->num_batches();
}

std::unique_ptr<BatchStream> TrainData::train_epoch(int64_t e, int64_t first) const {
  KILN_CHECK(first >= 0 && first <= steps_per_epoch(), "TrainData::train_epoch: first batch ",
             first, " of an epoch of ", steps_per_epoch(), " batches");
  if (kind_ == DataKind::Synthetic)
    return std::make_unique<SyntheticStream>(
        dummy_x_, steps_per_epoch(),
        opts_.seed * 1000003u + uint64_t(e) * 8191u + uint64_t(opts_.rank) + 1, opts_.device,
        first);
  if (auto_) {
    const bool gpu = auto_->gpu;
    std::unique_ptr<BatchStream> s;
    if (gpu)
      s = std::make_unique<GpuImageStream>(gpu_train_->epoch(e, first));
    else
      s = std::make_unique<ImageStream>(img_train_->epoch(e, first), opts_.device,
                                        image_dtype(opts_));
    return std::make_unique<MeasuredStream>(std::move(s), gpu, e, steps_per_epoch() - first, auto_);
  }
  if (gpu_train_) return std::make_unique<GpuImageStream>(gpu_train_->epoch(e, first));
  if (dev_train_) return std::make_unique<DeviceIdxStream>(dev_train_->epoch(e, first));
  if (idx_train_)
    return std::make_unique<IdxStream>(idx_train_->epoch(e, first), opts_.device, opts_.precision);
  return std::make_unique<ImageStream>(img_train_->epoch(e, first), opts_.device,
                                       image_dtype(opts_));
}

std::unique_ptr<BatchStream> TrainData::test_epoch() const {
  if (kind_ == DataKind::Synthetic)
    return std::make_unique<SyntheticStream>(dummy_x_, test_steps(),
                                             ~opts_.seed - uint64_t(opts_.rank), opts_.device);
  if (gpu_test_ && (!auto_ || auto_->gpu))
    return std::make_unique<GpuImageStream>(gpu_test_->epoch(0));
  if (dev_test_) return std::make_unique<DeviceIdxStream>(dev_test_->epoch(0));
  if (idx_test_)
    return std::make_unique<IdxStream>(idx_test_->epoch(0), opts_.device, opts_.precision);
  return std::make_unique<ImageStream>(img_test_->epoch(0), opts_.device, image_dtype(opts_));
}

}  // namespace kiln::train
