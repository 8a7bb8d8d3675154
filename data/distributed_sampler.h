#pragma once
// DistributedSampler: each rank's shard of an epoch, as PyTorch's
// torch.utils.data.DistributedSampler does it.
//
//   auto sampler = std::make_shared<DistributedSampler>(dataset.size(), world, rank,
//                                                       DistributedSamplerOptions{.seed = 7});
//   LoaderOptions opts; opts.sampler = sampler;   // and shuffle = false
//
// Epoch e: the permutation of 0..N-1 drawn from a Generator seeded with (seed, e) (or 0..N-1
// without shuffle), the same on every rank; then
//  * drop_last = false: padded by repeating its head (cyclically when N is small) to
//    total_size() = num_replicas * ceil(N / num_replicas);
//  * drop_last = true: truncated to total_size() = num_replicas * floor(N / num_replicas);
// and rank r takes positions r, r + R, r + 2R, ... (R = num_replicas). So the shards are
// disjoint (up to the padded repeats), equal-sized, together cover every sample (without
// drop_last), and depend only on (N, R, r, seed, e, shuffle, drop_last).
#include <cstdint>
#include <vector>

#include "data/loader.h"

namespace kiln::data {

struct DistributedSamplerOptions {
  bool shuffle = true;
  uint64_t seed = 0;  // must be the same on every rank
  bool drop_last = false;
};

class DistributedSampler final : public Sampler {
 public:
  // Throws kiln::Error for dataset_size < 0, num_replicas < 1, rank outside [0, num_replicas),
  // or drop_last with fewer samples than replicas (every shard would be empty).
  DistributedSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank,
                     DistributedSamplerOptions opts = {});

  int64_t size() const override { return num_samples_; }  // samples per rank
  int64_t total_size() const { return num_samples_ * num_replicas_; }
  int64_t num_replicas() const { return num_replicas_; }
  int64_t rank() const { return rank_; }
  // This rank's sample indices for epoch e, in visiting order.
  std::vector<int64_t> indices(int64_t epoch) const override;
  // The whole epoch before sharding (padded or truncated to total_size()), for tests.
  std::vector<int64_t> global_indices(int64_t epoch) const;

 private:
  int64_t dataset_size_;
  int64_t num_replicas_;
  int64_t rank_;
  DistributedSamplerOptions opts_;
  int64_t num_samples_;
};

}  // namespace kiln::data
