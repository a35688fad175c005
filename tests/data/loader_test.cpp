#include "dalle/data/loader.h"

#include <set>

#include "test_support.h"

namespace dalle::data {
namespace {

// Examples are their own index plus a draw from their random stream; indices divisible by
// `unreadable_every` cannot be read.
struct CountingDataset {
  using Example = std::pair<int64_t, uint64_t>;
  size_t count;
  int64_t unreadable_every = 0;
  size_t size() const { return count; }
  std::optional<Example> get(size_t index, std::mt19937_64& rng) const {
    if (unreadable_every > 0 && index % unreadable_every == 0) return std::nullopt;
    return Example{static_cast<int64_t>(index), rng()};
  }
};

std::vector<std::vector<CountingDataset::Example>> take(DataLoader<CountingDataset>& loader, int batches) {
  std::vector<std::vector<CountingDataset::Example>> out;
  for (int i = 0; i < batches; ++i) out.push_back(loader.next().examples);
  return out;
}

std::shared_ptr<const CountingDataset> dataset(size_t count, int64_t unreadable_every = 0) {
  return std::make_shared<const CountingDataset>(CountingDataset{count, unreadable_every});
}

TEST(Sampler, ShuffleIsAPermutationFixedBySeedAndEpoch) {
  ShardedSampler sampler(100, {.seed = 3});
  const auto epoch0 = sampler.indices(0);
  EXPECT_EQ(std::set<int64_t>(epoch0.begin(), epoch0.end()).size(), 100u);
  EXPECT_EQ(epoch0, ShardedSampler(100, {.seed = 3}).indices(0));
  EXPECT_NE(epoch0, sampler.indices(1));
  EXPECT_NE(epoch0, ShardedSampler(100, {.seed = 4}).indices(0));
  EXPECT_EQ(ShardedSampler(5, {.shuffle = false}).indices(0), (std::vector<int64_t>{0, 1, 2, 3, 4}));
}

TEST(Sampler, ShardsCoverTheDatasetWithEqualCounts) {
  std::multiset<int64_t> seen;
  for (int64_t rank = 0; rank < 3; ++rank) {
    const auto shard = ShardedSampler(10, {.seed = 1, .rank = rank, .world_size = 3}).indices(2);
    EXPECT_EQ(shard.size(), 4u);
    seen.insert(shard.begin(), shard.end());
  }
  for (int64_t i = 0; i < 10; ++i) EXPECT_GE(seen.count(i), 1u) << i;
  EXPECT_EQ(seen.size(), 12u) << "two indices repeat to even out the shards";
  EXPECT_THROW(ShardedSampler(10, {.rank = 3, .world_size = 3}), Error);
  EXPECT_THROW(ShardedSampler(0, {}), Error);
}

TEST(Loader, BatchesDoNotDependOnTheNumberOfWorkers) {
  DataLoader<CountingDataset> serial(dataset(50), {.batch_size = 4, .workers = 0});
  DataLoader<CountingDataset> parallel(dataset(50), {.batch_size = 4, .workers = 3, .prefetch_batches = 2});
  EXPECT_EQ(take(serial, 30), take(parallel, 30));  // crosses an epoch boundary (12 batches an epoch)
}

TEST(Loader, ResumesExactlyFromASavedPosition) {
  LoaderOptions options{.batch_size = 3, .workers = 2, .sampler = {.seed = 9}};
  DataLoader<CountingDataset> uninterrupted(dataset(20), options);
  const auto all = take(uninterrupted, 15);

  DataLoader<CountingDataset> first(dataset(20), options);
  take(first, 8);
  const LoaderPosition saved = first.position();
  EXPECT_EQ(saved, (LoaderPosition{1, 2}));  // 6 batches an epoch
  DataLoader<CountingDataset> resumed(dataset(20), options);
  resumed.seek(saved);
  const auto rest = take(resumed, 7);
  EXPECT_EQ(rest, std::vector(all.begin() + 8, all.end()));
}

TEST(Loader, EpochsVisitEveryExampleOnceAndDropThePartialBatch) {
  DataLoader<CountingDataset> loader(dataset(10), {.batch_size = 3, .workers = 2, .sampler = {.seed = 2}});
  EXPECT_EQ(loader.batches_per_epoch(), 3);
  std::set<int64_t> seen;
  for (const auto& batch : take(loader, 3)) {
    EXPECT_EQ(batch.size(), 3u);
    for (const auto& example : batch) seen.insert(example.first);
  }
  EXPECT_EQ(seen.size(), 9u);
  EXPECT_EQ(loader.position(), (LoaderPosition{1, 0}));
  DataLoader<CountingDataset> keep_last(dataset(10), {.batch_size = 3, .workers = 1, .drop_last = false});
  EXPECT_EQ(keep_last.batches_per_epoch(), 4);
}

TEST(Loader, UnreadableExamplesAreCountedNotFatal) {
  DataLoader<CountingDataset> loader(dataset(12, 4), {.batch_size = 12, .workers = 2, .sampler = {.shuffle = false}});
  const auto batch = loader.next();
  EXPECT_EQ(batch.examples.size(), 9u);
  EXPECT_EQ(batch.skipped, 3);
}

TEST(Loader, WorkerExceptionsReachTheCaller) {
  struct Throwing {
    using Example = int;
    size_t size() const { return 8; }
    std::optional<int> get(size_t, std::mt19937_64&) const { throw Error("disk on fire"); }
  };
  DataLoader<Throwing> loader(std::make_shared<const Throwing>(), {.batch_size = 2, .workers = 2});
  EXPECT_THROW_WITH(loader.next(), Error, "disk on fire");
}

TEST(Loader, RefusesBatchesLargerThanTheShard) {
  EXPECT_THROW_WITH(DataLoader<CountingDataset>(dataset(4), {.batch_size = 8}), Error, "holds no full batch");
  DataLoader<CountingDataset> loader(dataset(8), {.batch_size = 2});
  EXPECT_THROW(loader.seek({0, 5}), Error);
  EXPECT_EQ(loader.next().examples.size(), 2u) << "a refused seek leaves the loader working";
  EXPECT_THROW_WITH(DataLoader<CountingDataset>(dataset(8), {.batch_size = 2, .prefetch_batches = 0}), Error,
                    "prefetch at least one batch");
}

}  // namespace
}  // namespace dalle::data
