#include "data/distributed_sampler.h"

#include <utility>

#include "core/generator.h"

namespace kiln::data {

DistributedSampler::DistributedSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank,
                                       DistributedSamplerOptions opts)
    : dataset_size_(dataset_size), num_replicas_(num_replicas), rank_(rank), opts_(opts) {
  KILN_CHECK(dataset_size >= 0, "DistributedSampler: dataset_size must be >= 0, got ",
             dataset_size);
  KILN_CHECK(num_replicas >= 1, "DistributedSampler: num_replicas must be >= 1, got ",
             num_replicas);
  KILN_CHECK(rank >= 0 && rank < num_replicas, "DistributedSampler: rank ", rank,
             " is out of range [0, ", num_replicas, ")");
  KILN_CHECK(!opts.drop_last || dataset_size >= num_replicas, "DistributedSampler: drop_last with ",
             dataset_size, " samples and ", num_replicas, " replicas leaves every shard empty");
  num_samples_ = opts.drop_last ? dataset_size / num_replicas
                                : (dataset_size + num_replicas - 1) / num_replicas;
}

std::vector<int64_t> DistributedSampler::global_indices(int64_t epoch) const {
  std::vector<int64_t> order(static_cast<size_t>(dataset_size_));
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  if (opts_.shuffle) {
    // Mixing (rather than seed + epoch) keeps (seed, e) and (seed + 1, e - 1) apart.
    Generator gen(splitmix64(opts_.seed ^ splitmix64(uint64_t(epoch))));
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[gen.below(i)]);
  }
  const size_t total = size_t(total_size());
  if (order.size() > total) {
    order.resize(total);
  } else if (!order.empty()) {
    for (size_t i = 0, n = order.size(); order.size() < total; ++i) order.push_back(order[i % n]);
  }
  return order;
}

std::vector<int64_t> DistributedSampler::indices(int64_t epoch) const {
  const std::vector<int64_t> all = global_indices(epoch);
  std::vector<int64_t> mine;
  mine.reserve(size_t(num_samples_));
  for (size_t i = size_t(rank_); i < all.size(); i += size_t(num_replicas_)) mine.push_back(all[i]);
  return mine;
}

}  // namespace kiln::data
