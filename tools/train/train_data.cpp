#include "tools/train/train_data.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include "core/text.h"
#include "data/device_loader.h"
#include "data/distributed_sampler.h"
#include "data/fashion_mnist.h"
#include "data/gpu_jpeg.h"
#include "data/image_folder.h"
#include "data/image_loader.h"
#include "data/loader.h"
#include "data/transforms.h"
#include "ops/ops.h"
#include "optim/model_file.h"
#include "tools/cli/cli.h"

namespace kiln::train {

namespace fs = std::filesystem;

namespace {

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
                     "files, or an ImageFolder root holding train/ and val/)");
  if (fs::is_directory(fs::path(data) / "train", ec) &&
      fs::is_directory(fs::path(data) / "val", ec))
    return DataKind::ImageFolder;
  for (const char* n : {"train-images-idx3-ubyte", "train-images-idx3-ubyte.gz",
                        "train-images.idx3-ubyte", "train-images.idx3-ubyte.gz"})
    if (fs::is_regular_file(fs::path(data) / n, ec)) return DataKind::Idx;
  cli::usage_error("--data '", data,
                   "': not a dataset folder: expected MNIST-style IDX files "
                   "(train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-...) or an "
                   "ImageFolder root with train/ and val/ sub-folders of class folders");
}

namespace {

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

// Synthetic batches: the same device images each step, labels from (seed, epoch, step).
class SyntheticStream final : public BatchStream {
 public:
  SyntheticStream(Tensor x, int64_t batches, uint64_t seed, Device dev)
      : x_(std::move(x)), batches_(batches), gen_(seed), dev_(dev) {}
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

// Per-channel statistics of u8 images (N, H, W), as fractions of 255.
std::pair<float, float> pixel_stats(const Tensor& images) {
  Tensor x = images.to(DType::f64);
  const double mean = F::mean(x).item() / 255.0;
  const double sq = F::mean(F::mul(x, x)).item() / (255.0 * 255.0);
  return {float(mean), float(std::sqrt(std::max(sq - mean * mean, 1e-12)))};
}

}  // namespace

TrainData::TrainData(const DataOptions& o)
    : opts_(o), kind_(o.dummy ? DataKind::Synthetic : detect_data(o.data)) {
  if (kind_ == DataKind::Synthetic) {
    if (o.dummy_images < o.batch_size * o.world_size)
      cli::usage_error("--dummy-images ", o.dummy_images, ": fewer than one batch of ",
                       o.batch_size, " per process");
    num_classes_ = 1000;
    channels_ = 3;
    height_ = width_ = resize_size_ = o.image_size;
    train_size_ = o.dummy_images;
    test_size_ =
        std::max(o.batch_size * o.world_size, int64_t(std::llround(double(o.dummy_images) / 25.6)));
    mean_.assign(std::begin(data::kImageNetMean), std::end(data::kImageNetMean));
    stddev_.assign(std::begin(data::kImageNetStd), std::end(data::kImageNetStd));
    description_ = "synthetic data (--dummy)";
    Generator g(o.seed);
    dummy_x_ = amp::prepare_input(randn({o.batch_size, 3, o.image_size, o.image_size}, {}, &g),
                                  o.device, o.precision);
    return;
  }
  if (kind_ == DataKind::ImageFolder) {
    // A folder without images, or one that cannot be listed: the user's --data to fix.
    const data::ImageFolder train =
        cli::user_input("--data: ", [&] { return data::ImageFolder(o.data + "/train"); });
    const data::ImageFolder val =
        cli::user_input("--data: ", [&] { return data::ImageFolder(o.data + "/val"); });
    if (train.classes() != val.classes())
      cli::usage_error("--data '", o.data, "': train/ has ", train.num_classes(),
                       " class folders and val/ ", val.num_classes(),
                       "; both must hold the same class folders");
    num_classes_ = train.num_classes();
    class_names_ = train.classes();
    try {
      check_class_names(class_names_, "--data '" + o.data + "/train': class folders");
    } catch (const Error& e) {
      cli::usage_error(cli::without_location(e.what()));
    }
    mean_.assign(std::begin(data::kImageNetMean), std::end(data::kImageNetMean));
    stddev_.assign(std::begin(data::kImageNetStd), std::end(data::kImageNetStd));
    channels_ = 3;
    height_ = width_ = o.image_size;
    train_size_ = train.size();
    test_size_ = val.size();
    description_ = "ImageFolder " + o.data;
    data::ImageLoaderOptions lo;
    lo.batch_size = o.batch_size;
    lo.image_size = o.image_size;
    lo.resize_size = resize_size_ = int64_t(std::llround(double(o.image_size) * 256.0 / 224.0));
    lo.drop_last = true;
    lo.seed = o.seed;
    lo.workers = o.workers;
    lo.rank = o.rank;
    lo.world_size = o.world_size;
    // --decoder (issue 15): the GPU path only when asked. auto means the CPU path: nvJPEG's
    // batched decode hung now and then under a running step (docs/lab/input-pipeline.md,
    // 2026-12-01: 5 of 16 trainings that called nvJPEG), and a default must not hang.
    if (o.decoder != "auto" && o.decoder != "cpu" && o.decoder != "nvjpeg" && o.decoder != "stb" &&
        o.decoder != "turbo")
      cli::usage_error("--decoder '", o.decoder, "': expected auto, cpu, nvjpeg, stb or turbo");
    const bool gpu = o.decoder == "nvjpeg";
    if (gpu && !o.device.is_cuda())
      cli::usage_error("--decoder nvjpeg needs a CUDA device; the device is ", o.device.str());
    if (o.decoder == "stb" || o.decoder == "turbo") lo.decoder = data::parse_jpeg_decoder(o.decoder);
    const DType dt = o.device.is_cuda() && o.precision == amp::Precision::Mixed16 ? DType::f16
                                                                                : DType::f32;
    data::ImageLoaderOptions eo = lo;
    eo.augment = data::Augment::Eval;
    eo.shuffle = false;
    eo.drop_last = false;
    if (gpu) {
      gpu_train_ = std::make_unique<data::GpuJpegLoader>(std::move(train), lo, o.device, dt,
                                                         data::NormalizeStats{},
                                                         o.host_decode_fraction);
      gpu_test_ = std::make_unique<data::GpuJpegLoader>(std::move(val), eo, o.device, dt,
                                                        data::NormalizeStats{},
                                                        o.host_decode_fraction);
      // A hung nvJPEG call can leave the device's queues stuck, and unwinding would then block
      // on them: say why and leave at once (the last epoch's checkpoint is already on disk).
      const auto on_stall = [](const std::string& message) {
        std::fflush(stdout);
        std::fprintf(stderr, "kiln-train: error: %s\n", message.c_str());
        std::fflush(nullptr);
        std::_Exit(kStallExitCode);
      };
      gpu_train_->set_stall_handler(on_stall);
      gpu_test_->set_stall_handler(on_stall);
      description_ += std::string(" (nvJPEG ") + gpu_train_->backend() + " decoder)";
      if (gpu_train_->num_batches() == 0)
        cli::usage_error("--data '", o.data, "': ", gpu_train_->host().samples_per_epoch(),
                         " training images per process, fewer than one batch of ", o.batch_size);
      return;
    }
    img_train_ = std::make_unique<data::ImageLoader>(std::move(train), lo);
    img_test_ = std::make_unique<data::ImageLoader>(std::move(val), eo);
    if (img_train_->num_batches() == 0)
      cli::usage_error("--data '", o.data, "': ", img_train_->samples_per_epoch(),
                       " training images per process, fewer than one "
                       "batch of ",
                       o.batch_size);
    return;
  }
  const bool fmnist = kind_ == DataKind::FashionMnist;
  const std::string dir = fmnist ? data::kFashionMnistDir : o.data;
  auto load = [&](data::Split s) {  // a missing or malformed IDX file: the user's to fix
    return cli::user_input(fmnist ? "fashion-mnist: " : "--data: ", [&] {
      return fmnist ? data::load_fashion_mnist(dir, s) : data::load_mnist(dir, s);
    });
  };
  data::IdxPair train = load(data::Split::Train), test = load(data::Split::Test);
  // Fashion-MNIST has 10 classes; other IDX data as many as its training labels imply. Test
  // labels outside them would be read past the logits: refused here, when the data is opened.
  num_classes_ = fmnist ? 10 : data::infer_num_classes(train);
  data::check_labels(train, num_classes_);
  data::check_labels(test, num_classes_);
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

  data::LoaderOptions lo;
  lo.batch_size = o.batch_size;
  lo.shuffle = true;
  lo.drop_last = true;
  lo.seed = o.seed;
  lo.workers = o.workers;
  if (fmnist) {  // the training set's pixel mean and std
    lo.mean = {0.2860f};
    lo.stddev = {0.3530f};
  } else {
    auto [m, s] = pixel_stats(train.images);
    lo.mean = {m};
    lo.stddev = {s};
  }
  if (o.augment) {
    lo.crop_padding = 4;
    lo.horizontal_flip = true;
  }
  mean_ = lo.mean;
  stddev_ = lo.stddev;
  data::LoaderOptions eo = lo;
  eo.shuffle = false;
  eo.drop_last = false;
  eo.crop_padding = 0;
  eo.horizontal_flip = false;
  eo.batch_size = o.eval_batch_size;
  if (o.world_size > 1) {
    lo.shuffle = false;
    lo.sampler = std::make_shared<data::DistributedSampler>(
        train_size_, o.world_size, o.rank, data::DistributedSamplerOptions{true, o.seed, false});
    eo.sampler = std::make_shared<data::DistributedSampler>(
        test_size_, o.world_size, o.rank, data::DistributedSamplerOptions{false, o.seed, false});
  }
  idx_train_ =
      std::make_unique<data::DataLoader>(data::TensorDataset(train.images, train.labels), lo);
  idx_test_ = std::make_unique<data::DataLoader>(data::TensorDataset(test.images, test.labels), eo);
  if (test_size_ == 0)
    cli::usage_error("--data '", o.data, "': the test set ", test.images_path, " holds no images");
  if (idx_train_->num_batches() == 0)
    cli::usage_error("--data '", o.data,
                     "': fewer training images per "
                     "process than one batch of ",
                     o.batch_size);
  if (o.device.is_cuda()) {
    // The whole dataset lives on the GPU and batches are made there (issue 19): in the form
    // amp::prepare_input gives a CPU batch, f16 channels-last or f32 contiguous.
    const bool half = o.precision == amp::Precision::Mixed16;
    const DType dt = half ? DType::f16 : DType::f32;
    const MemoryFormat fmt = half ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous;
    dev_train_ = std::make_unique<data::DeviceLoader>(*idx_train_, o.device, dt, fmt);
    dev_test_ = std::make_unique<data::DeviceLoader>(*idx_test_, o.device, dt, fmt);
  }
}

TrainData::~TrainData() = default;

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

std::unique_ptr<BatchStream> TrainData::train_epoch(int64_t e) const {
  if (kind_ == DataKind::Synthetic)
    return std::make_unique<SyntheticStream>(
        dummy_x_, steps_per_epoch(),
        opts_.seed * 1000003u + uint64_t(e) * 8191u + uint64_t(opts_.rank) + 1, opts_.device);
  if (gpu_train_) return std::make_unique<GpuImageStream>(gpu_train_->epoch(e));
  if (dev_train_) return std::make_unique<DeviceIdxStream>(dev_train_->epoch(e));
  if (idx_train_)
    return std::make_unique<IdxStream>(idx_train_->epoch(e), opts_.device, opts_.precision);
  const DType dt = opts_.device.is_cuda() && opts_.precision == amp::Precision::Mixed16
                       ? DType::f16
                       : DType::f32;
  return std::make_unique<ImageStream>(img_train_->epoch(e), opts_.device, dt);
}

std::unique_ptr<BatchStream> TrainData::test_epoch() const {
  if (kind_ == DataKind::Synthetic)
    return std::make_unique<SyntheticStream>(dummy_x_, test_steps(),
                                             ~opts_.seed - uint64_t(opts_.rank), opts_.device);
  if (gpu_test_) return std::make_unique<GpuImageStream>(gpu_test_->epoch(0));
  if (dev_test_) return std::make_unique<DeviceIdxStream>(dev_test_->epoch(0));
  if (idx_test_)
    return std::make_unique<IdxStream>(idx_test_->epoch(0), opts_.device, opts_.precision);
  const DType dt = opts_.device.is_cuda() && opts_.precision == amp::Precision::Mixed16
                       ? DType::f16
                       : DType::f32;
  return std::make_unique<ImageStream>(img_test_->epoch(0), opts_.device, dt);
}

}  // namespace kiln::train
