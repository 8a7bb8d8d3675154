#include "data/loader.h"

#include <algorithm>

#include "core/generator.h"
#include "data/prefetch.h"

namespace kiln::data {
namespace {

uint64_t shuffle_seed(uint64_t seed, int64_t epoch) { return derive_seed(seed, uint64_t(epoch), 0); }
uint64_t batch_seed(uint64_t seed, int64_t epoch, int64_t k) {
  return derive_seed(seed, uint64_t(epoch), uint64_t(k) + 1);
}

// The one place a batch's samples and augmentation are drawn (see the header's determinism
// note): generator draws go sample by sample, crop before flip.
void plan_batch(const LoaderOptions& opts, int64_t epoch, int64_t k,
                const std::vector<int64_t>& order, BatchPlan& plan) {
  const int64_t begin = k * opts.batch_size;
  const int64_t end = std::min<int64_t>(begin + opts.batch_size, int64_t(order.size()));
  const int64_t pad = opts.crop_padding;
  plan.indices.assign(order.begin() + begin, order.begin() + end);
  if (opts.fixed_transform) {
    plan.transforms.assign(size_t(end - begin), *opts.fixed_transform);
    return;
  }
  plan.transforms.assign(size_t(end - begin), SampleTransform{pad, pad, false});
  if (pad == 0 && !opts.horizontal_flip) return;
  Generator gen(batch_seed(opts.seed, epoch, k));
  const bool alternate = opts.horizontal_flip && opts.alternating_flip;
  for (size_t i = 0; i < plan.transforms.size(); ++i) {
    SampleTransform& t = plan.transforms[i];
    if (pad > 0) {
      t.top = int64_t(gen.below(uint64_t(2 * pad + 1)));
      t.left = int64_t(gen.below(uint64_t(2 * pad + 1)));
    }
    if (alternate)  // epoch 0's coin for this sample, inverted every other epoch
      t.flip = ((derive_seed(opts.seed, ~uint64_t(0), uint64_t(plan.indices[i])) >> 63) != 0) !=
               (epoch % 2 == 1);
    else if (opts.horizontal_flip)
      t.flip = gen.uniform() < 0.5;
  }
}

}  // namespace

void crop_flip_normalize(const uint8_t* src, int64_t channels, int64_t height, int64_t width,
                         int64_t pad, SampleTransform t, const float* lut, float* dst,
                         Padding padding) {
  const int64_t dy = t.top - pad, dx = t.left - pad;  // output (h, w) reads src (h+dy, w'+dx)
  const bool reflect = padding == Padding::Reflect;
  for (int64_t c = 0; c < channels; ++c) {
    const float* lc = lut + c * 256;
    const uint8_t* sc = src + c * height * width;
    for (int64_t h = 0; h < height; ++h) {
      float* row = dst + (c * height + h) * width;
      int64_t sh = h + dy;
      if (reflect) {
        sh = reflect_index(sh, height);
      } else if (sh < 0 || sh >= height) {
        std::fill(row, row + width, lc[0]);
        continue;
      }
      const uint8_t* srow = sc + sh * width;
      for (int64_t w = 0; w < width; ++w) {
        int64_t sw = (t.flip ? width - 1 - w : w) + dx;
        if (reflect) sw = reflect_index(sw, width);
        row[w] = (sw >= 0 && sw < width) ? lc[srow[sw]] : lc[0];
      }
    }
  }
}

std::vector<TtaView> tta_views(int level) {
  KILN_CHECK(level >= 0 && level <= 2, "tta_views: level must be 0, 1 or 2, got ", level);
  if (level == 0) return {{{1, 1, false}, 1.0}};
  if (level == 1) return {{{1, 1, false}, 0.5}, {{1, 1, true}, 0.5}};
  return {{{1, 1, false}, 0.25}, {{1, 1, true}, 0.25},  {{0, 0, false}, 0.125},
          {{0, 0, true}, 0.125}, {{2, 2, false}, 0.125}, {{2, 2, true}, 0.125}};
}

// ---------------------------------------------------------------------------------------------
// Epoch state: everything the workers touch, owned by the Epoch through a unique_ptr so the
// Epoch handle can move while the threads keep a stable pointer.
struct Epoch::State {
  std::shared_ptr<const TensorDataset> data;
  LoaderOptions opts;
  std::shared_ptr<const std::vector<float>> lut;
  int64_t epoch = 0;
  std::vector<int64_t> order;
  int64_t num_batches = 0;

    // Batches built ahead by the workers and handed out in order (data/prefetch.h); created by
  // DataLoader::epoch once the fields above are set, destroyed (workers joined) by shutdown().
  std::unique_ptr<OrderedPrefetch<Batch>> prefetch;

  Batch build(int64_t k) const {
    const TensorDataset& ds = *data;
    BatchPlan plan;
    plan_batch(opts, epoch, k, order, plan);
    const auto b_count = int64_t(plan.indices.size());
    const int64_t C = ds.channels(), H = ds.height(), W = ds.width();
    Batch b;
    b.index = k;
    b.x = empty({b_count, C, H, W}, DType::f32);
    b.y = empty({b_count}, DType::i64);
    float* x = b.x.data<float>();
    int64_t* y = b.y.data<int64_t>();
    for (int64_t i = 0; i < b_count; ++i) {
      const int64_t idx = plan.indices[size_t(i)];
      crop_flip_normalize(ds.image(idx), C, H, W, opts.crop_padding, plan.transforms[size_t(i)],
                          lut->data(), x + i * C * H * W, opts.padding);
      y[i] = ds.label(idx);
    }
    if (opts.on_batch) opts.on_batch(b);
    return b;
  }

  void shutdown() { prefetch.reset(); }
};

Epoch::Epoch(std::unique_ptr<State> state) : state_(std::move(state)) {}
Epoch::Epoch(Epoch&&) noexcept = default;
Epoch& Epoch::operator=(Epoch&& o) noexcept {
  if (this != &o) {
    if (state_) state_->shutdown();
    state_ = std::move(o.state_);
  }
  return *this;
}
Epoch::~Epoch() {
  if (state_) state_->shutdown();
}

int64_t Epoch::size() const { return state_ ? state_->num_batches : 0; }

std::optional<Batch> Epoch::next() {
  KILN_CHECK(state_ && state_->prefetch, "Epoch::next on a moved-from Epoch");
  return state_->prefetch->next();
}

// ---------------------------------------------------------------------------------------------

DataLoader::DataLoader(TensorDataset dataset, LoaderOptions opts)
    : dataset_(std::make_shared<const TensorDataset>(std::move(dataset))), opts_(std::move(opts)) {
  const int64_t C = dataset_->channels();
  KILN_CHECK(opts_.batch_size >= 1, "DataLoader: batch_size must be >= 1, got ", opts_.batch_size);
  KILN_CHECK(opts_.workers >= 0, "DataLoader: workers must be >= 0, got ", opts_.workers);
  KILN_CHECK(opts_.prefetch >= 0, "DataLoader: prefetch must be >= 0, got ", opts_.prefetch);
  KILN_CHECK(opts_.crop_padding >= 0, "DataLoader: crop_padding must be >= 0, got ",
             opts_.crop_padding);
  KILN_CHECK(opts_.padding == Padding::Zero ||
                 (opts_.crop_padding < dataset_->height() && opts_.crop_padding < dataset_->width()),
             "DataLoader: reflect padding of ", opts_.crop_padding, " needs images larger than it, got ",
             dataset_->height(), "x", dataset_->width());
  if (const auto& f = opts_.fixed_transform) {
    const int64_t hi = 2 * opts_.crop_padding;
    KILN_CHECK(f->top >= 0 && f->top <= hi && f->left >= 0 && f->left <= hi,
               "DataLoader: fixed_transform's crop (", f->top, ", ", f->left, ") must lie in [0, ",
               hi, "] (2 x crop_padding)");
  }
  auto per_channel = [&](const std::vector<float>& v, const char* name) {
    KILN_CHECK(v.size() == 1 || int64_t(v.size()) == C, "DataLoader: ", name, " has ", v.size(),
               " values; the images have ", C, " channels (give 1 or ", C, ")");
    std::vector<float> out(static_cast<size_t>(C));
    for (int64_t c = 0; c < C; ++c) out[size_t(c)] = v[v.size() == 1 ? 0 : size_t(c)];
    return out;
  };
  KILN_CHECK(!(opts_.shuffle && opts_.sampler),
             "DataLoader: shuffle must be false with a sampler (the sampler sets the order)");
  const std::vector<float> mean = per_channel(opts_.mean, "mean");
  const std::vector<float> sd = per_channel(opts_.stddev, "stddev");
  auto lut = std::make_shared<std::vector<float>>(size_t(C * 256));
  for (int64_t c = 0; c < C; ++c) {
    KILN_CHECK(sd[size_t(c)] > 0.0f, "DataLoader: stddev[", c, "] must be > 0, got ",
               sd[size_t(c)]);
    for (int v = 0; v < 256; ++v)
      (*lut)[size_t(c * 256 + v)] = (float(v) / 255.0f - mean[size_t(c)]) / sd[size_t(c)];
  }
  lut_ = std::move(lut);
}

int64_t DataLoader::num_batches() const {
  const int64_t n = opts_.sampler ? opts_.sampler->size() : dataset_->size();
  const int64_t bs = opts_.batch_size;
  return opts_.drop_last ? n / bs : (n + bs - 1) / bs;
}

std::vector<int64_t> DataLoader::order(int64_t epoch) const {
  if (opts_.sampler) {
    std::vector<int64_t> idx = opts_.sampler->indices(epoch);
    KILN_CHECK(int64_t(idx.size()) == opts_.sampler->size(), "DataLoader: the sampler returned ",
               idx.size(), " indices for epoch ", epoch, " but its size() is ",
               opts_.sampler->size());
    for (int64_t i : idx)
      KILN_CHECK(i >= 0 && i < dataset_->size(), "DataLoader: sampler index ", i,
                 " is out of range for a dataset of ", dataset_->size(), " samples");
    return idx;
  }
  std::vector<int64_t> order(size_t(dataset_->size()));
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  if (opts_.shuffle) {
    Generator gen(shuffle_seed(opts_.seed, epoch));
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[gen.below(i)]);
  }
  return order;
}

void DataLoader::batch_plan(int64_t epoch, int64_t k, const std::vector<int64_t>& order,
                            BatchPlan& plan) const {
  const int64_t n = num_batches();
  KILN_CHECK(k >= 0 && k < n, "DataLoader::batch_plan: batch ", k, " of an epoch of ", n,
             " batches");
  const int64_t want = opts_.sampler ? opts_.sampler->size() : dataset_->size();
  KILN_CHECK(int64_t(order.size()) == want, "DataLoader::batch_plan: the order holds ",
             order.size(), " indices, the epoch ", want, " (pass order(epoch))");
  plan_batch(opts_, epoch, k, order, plan);
}

Epoch DataLoader::epoch(int64_t e, int64_t first) const {
  KILN_CHECK(first >= 0 && first <= num_batches(), "DataLoader::epoch: first batch ", first,
             " of an epoch of ", num_batches(), " batches");
  auto s = std::make_unique<Epoch::State>();
  s->data = dataset_;
  s->opts = opts_;
  s->lut = lut_;
  s->epoch = e;
  s->order = order(e);
  s->num_batches = num_batches() - first;
  const int64_t capacity = std::max<int64_t>(
      1, opts_.prefetch > 0 ? opts_.prefetch
                            : std::min<int64_t>(2 * opts_.workers, kMaxDefaultPrefetch));
  const Epoch::State* st = s.get();  // stable: the Epoch moves its unique_ptr, not the State
  s->prefetch = std::make_unique<OrderedPrefetch<Batch>>(
      s->num_batches, opts_.workers, capacity,
      [st, first](int64_t k) { return st->build(first + k); });
  return Epoch(std::move(s));
}

}  // namespace kiln::data
