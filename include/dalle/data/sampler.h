#pragma once
// The order in which a rank visits a dataset: a permutation fixed by (seed, epoch), cut into
// one shard per rank. Implemented here rather than with std::shuffle, whose algorithm is
// left to the standard library, so that an order is the same on every machine.
#include <cstdint>
#include <vector>

#include "dalle/seed.h"

namespace dalle::data {

struct SamplerOptions {
  uint64_t seed = 0;
  bool shuffle = true;
  int64_t rank = 0;
  int64_t world_size = 1;
};

class ShardedSampler {
 public:
  ShardedSampler(int64_t dataset_size, SamplerOptions options);

  // This rank's dataset indices for `epoch`. Every rank gets the same count: the
  // permutation is padded by wrapping around when the size does not divide evenly.
  std::vector<int64_t> indices(int64_t epoch) const;
  int64_t shard_size() const;
  const SamplerOptions& options() const { return options_; }

 private:
  int64_t dataset_size_;
  SamplerOptions options_;
};

}  // namespace dalle::data
