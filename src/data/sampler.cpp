#include "dalle/data/sampler.h"

#include <numeric>
#include <string>

#include "dalle/error.h"

namespace dalle::data {

ShardedSampler::ShardedSampler(int64_t dataset_size, SamplerOptions options)
    : dataset_size_(dataset_size), options_(options) {
  if (dataset_size <= 0) throw Error("cannot sample from an empty dataset");
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    throw Error("invalid shard: rank " + std::to_string(options.rank) + " of world size " +
                std::to_string(options.world_size));
  }
}

int64_t ShardedSampler::shard_size() const {
  return (dataset_size_ + options_.world_size - 1) / options_.world_size;
}

std::vector<int64_t> ShardedSampler::indices(int64_t epoch) const {
  std::vector<int64_t> order(static_cast<size_t>(dataset_size_));
  std::iota(order.begin(), order.end(), 0);
  if (options_.shuffle) {
    uint64_t state = mix_seed(options_.seed, static_cast<uint64_t>(epoch));
    for (size_t i = order.size() - 1; i > 0; --i) {
      state = mix_seed(state);
      // The modulo bias is below 2^-40 for any dataset that fits in memory.
      std::swap(order[i], order[state % (i + 1)]);
    }
  }
  std::vector<int64_t> shard;
  shard.reserve(static_cast<size_t>(shard_size()));
  const int64_t padded = shard_size() * options_.world_size;
  for (int64_t position = options_.rank; position < padded; position += options_.world_size) {
    shard.push_back(order[static_cast<size_t>(position % dataset_size_)]);
  }
  return shard;
}

}  // namespace dalle::data
