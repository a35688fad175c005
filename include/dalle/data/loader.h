#pragma once
// A multi-threaded batch loader over any dataset with
//   using Example = ...;  size_t size() const;
//   std::optional<Example> get(size_t index, std::mt19937_64& rng) const;
// Worker threads load batches ahead of the consumer; batches come out in sampler order.
// Each example's random stream is seeded from (seed, epoch, index), so the batches of an
// epoch are the same whatever the number of workers, and a run resumed at a saved
// Position continues with exactly the batches it would have seen.
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "dalle/data/sampler.h"
#include "dalle/error.h"

namespace dalle::data {

struct LoaderOptions {
  int64_t batch_size = 32;
  int64_t workers = 2;
  int64_t prefetch_batches = 4;
  bool drop_last = true;  // drop a final partial batch
  SamplerOptions sampler;
};

// Where a loader stands: the next batch it will return. Saved in checkpoints.
struct LoaderPosition {
  int64_t epoch = 0;
  int64_t batch = 0;
  bool operator==(const LoaderPosition&) const = default;
};

template <class Example>
struct Batch {
  std::vector<Example> examples;  // unreadable examples are left out...
  int64_t skipped = 0;            // ...and counted here
  LoaderPosition position;        // the position this batch was taken from
};

template <class Dataset>
class DataLoader {
 public:
  using Example = typename Dataset::Example;

  DataLoader(std::shared_ptr<const Dataset> dataset, LoaderOptions options)
      : dataset_(std::move(dataset)),
        options_(options),
        sampler_(static_cast<int64_t>(dataset_->size()), options.sampler) {
    if (options_.batch_size < 1) throw Error("the batch size must be at least 1");
    if (options_.workers < 0) throw Error("the number of loader workers cannot be negative");
    if (options_.prefetch_batches < 1) throw Error("the loader must prefetch at least one batch");
    if (batches_per_epoch() == 0) {
      throw Error("a rank's shard of " + std::to_string(sampler_.shard_size()) +
                  " examples holds no full batch of " + std::to_string(options_.batch_size));
    }
    seek({0, 0});
  }
  ~DataLoader() { stop_workers(); }
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  int64_t batches_per_epoch() const {
    const int64_t shard = sampler_.shard_size();
    return options_.drop_last ? shard / options_.batch_size
                              : (shard + options_.batch_size - 1) / options_.batch_size;
  }

  LoaderPosition position() const { return position_; }

  // Continues from `position` (as saved by position()).
  void seek(LoaderPosition position) {
    if (position.batch < 0 || position.batch > batches_per_epoch() || position.epoch < 0) {
      throw Error("invalid loader position: epoch " + std::to_string(position.epoch) + ", batch " +
                  std::to_string(position.batch));
    }
    stop_workers();
    if (position.batch == batches_per_epoch()) position = {position.epoch + 1, 0};
    position_ = position;
    order_ = sampler_.indices(position_.epoch);
    start_workers();
  }

  // The next batch; epochs follow one another without end.
  Batch<Example> next() {
    Batch<Example> batch;
    if (options_.workers == 0) {
      batch = load(position_.batch);
    } else {
      std::unique_lock lock(mutex_);
      // A failure in a batch loaded ahead surfaces only if the wanted batch is not ready.
      ready_.wait(lock, [&] { return error_ || done_.count(position_.batch); });
      if (!done_.count(position_.batch)) std::rethrow_exception(error_);
      batch = std::move(done_.at(position_.batch));
      done_.erase(position_.batch);
      consumed_ = position_.batch + 1;
      lock.unlock();
      space_.notify_all();
    }
    if (++position_.batch == batches_per_epoch()) seek({position_.epoch + 1, 0});
    return batch;
  }

 private:
  Batch<Example> load(int64_t batch_index) const {
    Batch<Example> batch;
    batch.position = {position_.epoch, batch_index};
    const auto begin = static_cast<size_t>(batch_index * options_.batch_size);
    const auto end = std::min(order_.size(), begin + static_cast<size_t>(options_.batch_size));
    for (size_t i = begin; i < end; ++i) {
      const auto index = static_cast<uint64_t>(order_[i]);
      std::mt19937_64 rng(mix_seed(options_.sampler.seed, static_cast<uint64_t>(position_.epoch), index));
      if (auto example = dataset_->get(index, rng)) batch.examples.push_back(std::move(*example));
      else ++batch.skipped;
    }
    return batch;
  }

  void start_workers() {
    if (options_.workers == 0) return;
    next_to_claim_ = consumed_ = position_.batch;
    stopping_ = false;
    error_ = nullptr;
    for (int64_t i = 0; i < options_.workers; ++i) workers_.emplace_back([this] { work(); });
  }

  void work() {
    while (true) {
      int64_t batch_index;
      {
        std::unique_lock lock(mutex_);
        space_.wait(lock, [&] {
          return stopping_ || next_to_claim_ >= batches_per_epoch() ||
                 next_to_claim_ < consumed_ + options_.prefetch_batches;
        });
        if (stopping_ || next_to_claim_ >= batches_per_epoch()) return;
        batch_index = next_to_claim_++;
      }
      try {
        auto batch = load(batch_index);
        std::lock_guard lock(mutex_);
        done_.emplace(batch_index, std::move(batch));
      } catch (...) {
        std::lock_guard lock(mutex_);
        error_ = std::current_exception();
      }
      ready_.notify_all();
    }
  }

  void stop_workers() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    space_.notify_all();
    for (auto& worker : workers_) worker.join();
    workers_.clear();
    done_.clear();
  }

  std::shared_ptr<const Dataset> dataset_;
  LoaderOptions options_;
  ShardedSampler sampler_;
  LoaderPosition position_;
  std::vector<int64_t> order_;

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable ready_, space_;
  std::map<int64_t, Batch<Example>> done_;
  int64_t next_to_claim_ = 0, consumed_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
};

}  // namespace dalle::data
