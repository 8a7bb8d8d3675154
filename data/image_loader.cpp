#include "data/image_loader.h"

#include <cstdio>
#include <numeric>
#include <set>
#include <unordered_map>

#include "core/error.h"
#include "core/generator.h"
#include "data/jpeg_turbo.h"
#ifdef KILN_WITH_CUDA
#include "cuda/runtime.h"
#endif

namespace kiln::data {
namespace {

// Samples per work item: small enough that 16 workers share a batch of 64, large enough that
// claiming a part costs nothing next to decoding it.
constexpr int64_t kSamplesPerPart = 4;

uint64_t shuffle_seed(uint64_t seed, int64_t e) { return derive_seed(seed, uint64_t(e), 0); }
uint64_t sample_seed(uint64_t seed, int64_t e, int64_t p) {
  return derive_seed(seed, uint64_t(e), uint64_t(p) + 1);
}

// kiln::Error texts end in " [file:line, check failed: ...]": drop that for user warnings.
std::string reason_of(const std::exception& e) { return strip_location(e.what()); }

// Batch buffers recycled by size. Pinned buffers are costly to allocate (and cudaHostAlloc
// synchronises the device), so they are kept for reuse rather than freed after each batch. Once
// a stream of the process is stuck (cuda::stream_stuck: a GPU JPEG failover), new buffers are
// pageable and pinned ones are never freed, since both calls would wait for that stream.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  explicit BufferPool(bool pinned) : pinned_(pinned) {}
  ~BufferPool() {
    for (const Buffer& b : free_) release(b);
  }
  bool pinned() const { return pinned_; }

  // A CPU storage of `n` bytes that returns to the pool when its last tensor is dropped.
  std::shared_ptr<Storage> storage(size_t n) {
    const Buffer b = take(n);
    auto self = shared_from_this();
    return std::shared_ptr<Storage>(new Storage(b.p, n, Device::cpu()), [self, b](Storage* s) {
      delete s;
      self->give(b);
    });
  }

 private:
  struct Buffer {
    size_t n = 0;
    void* p = nullptr;
    bool pinned = false;
  };
  static constexpr size_t kMaxFree = 64;
  Buffer take(size_t n) {
    {
      std::lock_guard lk(mu_);
      for (size_t i = 0; i < free_.size(); ++i)
        if (free_[i].n == n) {
          const Buffer b = free_[i];
          free_.erase(free_.begin() + std::ptrdiff_t(i));
          return b;
        }
    }
#ifdef KILN_WITH_CUDA
    if (pinned_ && !cuda::stream_stuck()) return {n, cuda::alloc_pinned(n), true};
#endif
    return {n, cpu_allocator()->allocate(n), false};
  }
  void give(const Buffer& b) {
    std::unique_lock lk(mu_);
    if (free_.size() < kMaxFree) {
      free_.push_back(b);
      return;
    }
    lk.unlock();
    release(b);
  }
  // Runs in storage deleters and destructors, which must not throw: a failing cudaFreeHost
  // (the driver already shut down at exit) leaks the buffer instead.
  static void release(const Buffer& b) noexcept {
#ifdef KILN_WITH_CUDA
    if (b.pinned) {
      try {  // free_pinned leaks it after a stuck stream
        cuda::free_pinned(b.p);
      } catch (const std::exception&) {
      }
      return;
    }
#endif
    cpu_allocator()->deallocate(b.p, b.n);
  }

  const bool pinned_;
  std::mutex mu_;
  std::vector<Buffer> free_;
};

}  // namespace

struct ImageLoader::Shared {
  Shared(ImageFolder f, std::shared_ptr<BufferPool> b)
      : folder(std::move(f)), buffers(std::move(b)) {}
  ImageFolder folder;
  std::shared_ptr<BufferPool> buffers;
  std::mutex mu;  // guards the bad-file log
  std::unordered_map<int64_t, std::string> bad;
  std::vector<std::string> bad_log;

  bool known_bad(int64_t idx) {
    std::lock_guard lk(mu);
    return bad.count(idx) > 0;
  }
  void record_bad(int64_t idx, const std::string& reason, bool warn) {
    std::lock_guard lk(mu);
    if (!bad.emplace(idx, reason).second) return;
    bad_log.push_back(reason);
    // `reason` names the file (every read/decode error does). A folder of thousands of broken
    // files gets ten lines, not thousands: the rest are counted (bad_files(), the epoch's log).
    constexpr size_t kNamedWarnings = 10;
    if (warn && bad_log.size() <= kNamedWarnings)
      std::fprintf(stderr, "kiln: warning: skipping unreadable sample: %s%s\n", reason.c_str(),
                   bad_log.size() == kNamedWarnings
                       ? " (further unreadable samples are skipped and counted without a warning)"
                       : "");
  }
};

struct ImageEpoch::State {
  std::shared_ptr<ImageLoader::Shared> shared;
  ImageLoaderOptions opts;
  int64_t epoch = 0;
  std::vector<int64_t> global;  // the epoch's permutation of all N files
  int64_t samples = 0;          // this rank's
  std::mutex mu;
  std::set<int64_t> bad;                                 // distinct bad files met in this epoch
  JpegDecoder decoder = JpegDecoder::Stb;                // resolved: Stb or Turbo
  std::unique_ptr<PartedPrefetch<ImageBatch>> batches;  // last: its threads stop first

  void note_bad(int64_t idx) {
    std::lock_guard lk(mu);
    bad.insert(idx);
    const double limit =
        std::max(opts.max_bad_fraction * double(samples), double(opts.min_bad_files));
    if (double(bad.size()) <= limit) return;
    std::string list;
    int shown = 0;
    for (int64_t i : bad) {
      if (shown++ == 8) {
        list += ", ...";
        break;
      }
      list += (list.empty() ? "'" : ", '") + shared->folder[i].path + "'";
    }
    // The data's fault, not kiln's: an IoError (no source location), naming the files.
    KILN_IO_FAIL("ImageLoader: ", bad.size(), " unreadable images in epoch ", epoch, " of '",
              shared->folder.root(), "', more than max(max_bad_fraction = ", opts.max_bad_fraction,
              " of its ", samples, " samples, min_bad_files = ", opts.min_bad_files, "): ", list);
  }

  // Decodes dataset item idx and writes its transformed pixels (S, S, 3) to dst, with a
  // Generator seeded by `seed`; kiln::Error naming the file when it cannot be read or decoded.
  // `enc`: where a deferred sample goes (null: never defer). Returns whether it was deferred.
  bool transform_one(int64_t idx, uint64_t seed, uint8_t* dst, EncodedSample* enc) const {
    thread_local std::vector<uint8_t> bytes;  // per worker, reused: no allocation per file
    const std::string& path = shared->folder[idx].path;
    read_file_into(path, bytes, opts.max_file_bytes);
    Generator gen(seed);
    const int64_t S = opts.image_size;
    const bool train = opts.augment == Augment::Train;
    if (enc && looks_like_jpeg(bytes.data(), bytes.size())) {
      const JpegInfo info = read_jpeg_info(bytes.data(), bytes.size(), path);
      if (opts.defer_jpeg(bytes.data(), bytes.size(), info)) {
        enc->info = info;
        enc->limit = CropBox{0, 0, info.height, info.width};
        if (train) {
          const CropBox b = random_resized_crop_box(info.height, info.width, gen, opts.crop);
          enc->flip = opts.horizontal_flip && gen.uniform() < 0.5;
          enc->box = BoxF{double(b.top), double(b.left), double(b.height), double(b.width)};
          enc->limit = b;
        } else {
          enc->box = center_crop_source_box(info.height, info.width, opts.resize_size, S);
          enc->flip = false;
        }
        enc->index = idx;
        enc->bytes.assign(bytes.begin(), bytes.end());
        return true;
      }
    }
    if (decoder == JpegDecoder::Turbo && looks_like_jpeg(bytes.data(), bytes.size())) {
      // The box comes from the header alone, drawn exactly as the Stb path draws it.
      const JpegInfo info = read_jpeg_info(bytes.data(), bytes.size(), path);
      const CropBox whole{0, 0, info.height, info.width};
      if (train) {
        const CropBox b = random_resized_crop_box(info.height, info.width, gen, opts.crop);
        const bool mirror = opts.horizontal_flip && gen.uniform() < 0.5;
        const BoxF bf{double(b.top), double(b.left), double(b.height), double(b.width)};
        decode_jpeg_resampled(bytes.data(), bytes.size(), path, bf, b, S, S, mirror, dst);
      } else {
        const BoxF bf = center_crop_source_box(info.height, info.width, opts.resize_size, S);
        decode_jpeg_resampled(bytes.data(), bytes.size(), path, bf, whole, S, S, false, dst);
      }
      return false;
    }
    // PNGs, and JPEGs when stb was asked for (or is all there is).
    const Image im = decoder == JpegDecoder::Stb ? decode_image_stb(bytes.data(), bytes.size(), path)
                                                 : decode_image(bytes.data(), bytes.size(), path);
    if (train)
      random_resized_crop_flip(im.pixels.data(), im.height, im.width, 3, S, gen,
                               opts.horizontal_flip, dst, opts.crop);
    else
      resize_center_crop(im.pixels.data(), im.height, im.width, 3, opts.resize_size, S, dst);
    return false;
  }

  // The sample at padded position p into dst, or the next one of the epoch's sequence that
  // decodes; returns its label. A deferred sample lands in *enc (with its position) instead.
  int64_t load(int64_t p, uint8_t* dst, EncodedSample* enc) {
    const auto n = int64_t(global.size());
    const uint64_t seed = sample_seed(opts.seed, epoch, p);
    for (int64_t a = 0; a < n; ++a) {
      const int64_t idx = global[size_t((p + a) % n)];
      if (!shared->known_bad(idx)) {
        try {
          if (transform_one(idx, seed, dst, enc)) enc->position = p;
          return shared->folder[idx].label;
        } catch (const Error& e) {
          shared->record_bad(idx, reason_of(e), opts.warn);
        }
      }
      note_bad(idx);
    }
    KILN_FAIL("ImageLoader: no image under '", shared->folder.root(), "' could be decoded");
  }

  int64_t batch_count(int64_t k) const {
    return std::min(opts.batch_size, samples - k * opts.batch_size);
  }
  int64_t parts(int64_t k) const { return (batch_count(k) + kSamplesPerPart - 1) / kSamplesPerPart; }

  // An empty batch k: tensors over one pooled buffer (pixels, then labels 64-byte aligned).
  ImageBatch make(int64_t k) {
    const int64_t S = opts.image_size, b_count = batch_count(k);
    const size_t img_bytes = size_t(b_count * S * S * 3);
    const size_t label_off = (img_bytes + 63) / 64 * 64;
    auto storage = shared->buffers->storage(label_off + size_t(b_count) * sizeof(int64_t));
    ImageBatch b;
    b.index = k;
    b.pinned = shared->buffers->pinned();
    b.images = make_tensor(storage, 0, {b_count, S, S, 3}, contiguous_strides({b_count, S, S, 3}),
                           DType::u8);
    b.labels =
        make_tensor(storage, int64_t(label_off / sizeof(int64_t)), {b_count}, {1}, DType::i64);
    if (opts.defer_jpeg) b.encoded = std::make_shared<std::vector<EncodedSample>>(size_t(b_count));
    return b;
  }

  // Samples [part * kSamplesPerPart, ...) of batch k.
  void fill(ImageBatch& b, int64_t k, int64_t part) {
    const int64_t S = opts.image_size, bs = opts.batch_size;
    uint8_t* px = b.images.data<uint8_t>();
    int64_t* y = b.labels.data<int64_t>();
    const int64_t i1 = std::min(batch_count(k), (part + 1) * kSamplesPerPart);
    for (int64_t i = part * kSamplesPerPart; i < i1; ++i) {
      const int64_t p = (k * bs + i) * opts.world_size + opts.rank;
      y[i] = load(p, px + i * S * S * 3, b.encoded ? &(*b.encoded)[size_t(i)] : nullptr);
    }
  }
};

JpegDecoder parse_jpeg_decoder(const std::string& name) {
  if (name == "auto") return JpegDecoder::Auto;
  if (name == "stb") return JpegDecoder::Stb;
  if (name == "turbo") return JpegDecoder::Turbo;
  KILN_FAIL("unknown JPEG decoder '", name, "' (expected auto, stb or turbo)");
}

const char* jpeg_decoder_name(JpegDecoder d) {
  switch (d) {
    case JpegDecoder::Auto: return "auto";
    case JpegDecoder::Stb: return "stb";
    case JpegDecoder::Turbo: return "turbo";
  }
  return "?";
}

ImageLoader::ImageLoader(ImageFolder folder, ImageLoaderOptions opts) : opts_(std::move(opts)) {
  const auto& o = opts_;
  KILN_CHECK(o.batch_size >= 1, "ImageLoader: batch_size must be >= 1, got ", o.batch_size);
  KILN_CHECK(o.image_size >= 1 && o.resize_size >= 1, "ImageLoader: image_size (", o.image_size,
             ") and resize_size (", o.resize_size, ") must be >= 1");
  KILN_CHECK(o.augment == Augment::Train || o.resize_size >= o.image_size,
             "ImageLoader: Eval needs resize_size (", o.resize_size, ") >= image_size (",
             o.image_size, ")");
  KILN_CHECK(o.workers >= 0 && o.prefetch >= 0, "ImageLoader: workers (", o.workers,
             ") and prefetch (", o.prefetch, ") must be >= 0");
  KILN_CHECK(o.world_size >= 1 && o.rank >= 0 && o.rank < o.world_size, "ImageLoader: rank ",
             o.rank, " outside [0, world_size = ", o.world_size, ")");
  KILN_CHECK(o.decoder != JpegDecoder::Turbo || jpeg_turbo_available(),
             "ImageLoader: decoder 'turbo' requested, but kiln was built without libjpeg-turbo");
  KILN_CHECK(o.max_bad_fraction >= 0.0 && o.max_bad_fraction <= 1.0,
             "ImageLoader: max_bad_fraction must be in [0, 1], got ", o.max_bad_fraction);
  KILN_CHECK(o.min_bad_files >= 0 && o.max_file_bytes >= 1, "ImageLoader: min_bad_files (",
             o.min_bad_files, ") must be >= 0 and max_file_bytes (", o.max_file_bytes, ") >= 1");
  bool pinned = false;
#ifdef KILN_WITH_CUDA
  pinned = o.pin_memory && cuda::is_available();
#endif
  shared_ = std::make_shared<Shared>(std::move(folder), std::make_shared<BufferPool>(pinned));
}

ImageLoader::~ImageLoader() = default;

const ImageFolder& ImageLoader::folder() const { return shared_->folder; }

int64_t ImageLoader::samples_per_epoch() const {
  return (shared_->folder.size() + opts_.world_size - 1) / opts_.world_size;
}

int64_t ImageLoader::num_batches() const {
  const int64_t n = samples_per_epoch(), bs = opts_.batch_size;
  return opts_.drop_last ? n / bs : (n + bs - 1) / bs;
}

namespace {
std::vector<int64_t> permutation(int64_t n, bool shuffle, uint64_t seed, int64_t e) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t(0));
  if (shuffle) {
    Generator gen(shuffle_seed(seed, e));
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[gen.below(i)]);
  }
  return order;
}
}  // namespace

std::vector<int64_t> ImageLoader::order(int64_t e) const {
  const std::vector<int64_t> g = permutation(shared_->folder.size(), opts_.shuffle, opts_.seed, e);
  std::vector<int64_t> mine(static_cast<size_t>(samples_per_epoch()));
  for (size_t i = 0; i < mine.size(); ++i)
    mine[i] = g[size_t((int64_t(i) * opts_.world_size + opts_.rank) % int64_t(g.size()))];
  return mine;
}

ImageEpoch ImageLoader::epoch(int64_t e, int64_t first) const {
  KILN_CHECK(first >= 0 && first <= num_batches(), "ImageLoader::epoch: first batch ", first,
             " of an epoch of ", num_batches(), " batches");
  auto s = std::make_unique<ImageEpoch::State>();
  s->shared = shared_;
  s->opts = opts_;
  s->epoch = e;
  s->global = permutation(shared_->folder.size(), opts_.shuffle, opts_.seed, e);
  s->samples = samples_per_epoch();
  s->decoder = opts_.decoder == JpegDecoder::Auto
                   ? (jpeg_turbo_available() ? JpegDecoder::Turbo : JpegDecoder::Stb)
                   : opts_.decoder;
  // Workers share each batch (PartedPrefetch), so a few batches ahead keep them all busy.
  const int64_t capacity = opts_.prefetch > 0 ? opts_.prefetch : 4;
  ImageEpoch::State* st = s.get();
  s->batches = std::make_unique<PartedPrefetch<ImageBatch>>(
      num_batches() - first, opts_.workers, capacity,
      [st, first](int64_t k) { return st->parts(first + k); },
      [st, first](int64_t k) { return st->make(first + k); },
      [st, first](ImageBatch& b, int64_t k, int64_t part) { st->fill(b, first + k, part); });
  return ImageEpoch(std::move(s));
}

std::vector<std::string> ImageLoader::bad_files() const {
  std::lock_guard lk(shared_->mu);
  return shared_->bad_log;
}

ImageEpoch::ImageEpoch(std::unique_ptr<State> s) : state_(std::move(s)) {}
ImageEpoch::ImageEpoch(ImageEpoch&&) noexcept = default;
ImageEpoch& ImageEpoch::operator=(ImageEpoch&&) noexcept = default;
ImageEpoch::~ImageEpoch() = default;

std::optional<ImageBatch> ImageEpoch::next() {
  KILN_CHECK(state_, "ImageEpoch::next on a moved-from epoch");
  return state_->batches->next();
}
int64_t ImageEpoch::redo(const EncodedSample& s, const std::string& reason, uint8_t* dst) {
  KILN_CHECK(state_, "ImageEpoch::redo on a moved-from epoch");
  State& st = *state_;
  st.shared->record_bad(s.index, reason, st.opts.warn);
  st.note_bad(s.index);
  return st.load(s.position, dst, nullptr);
}

int64_t ImageEpoch::size() const { return state_ ? state_->batches->size() : 0; }
int64_t ImageEpoch::bad_count() const {
  if (!state_) return 0;
  std::lock_guard lk(state_->mu);
  return int64_t(state_->bad.size());
}

}  // namespace kiln::data
