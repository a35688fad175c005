#pragma once
// Data parallelism: every rank holds the whole model, trains on its own share of each
// global batch, and averages the gradients before the optimizer steps, so that every
// replica takes the same update. The gradients travel in buckets of a bounded size, each
// one flat all-reduce, so that a model of thousands of tensors makes a few collectives per
// update, not thousands.
#include <cstdint>
#include <memory>
#include <vector>

#include "dalle/distributed/gradient_reducer.h"
#include "dalle/distributed/process_group.h"

namespace dalle::distributed {

// Replaces every tensor of `parts` (one dtype and device, any shapes and views) by its mean
// over the group's ranks, in one flat all-reduce; returns the payload's bytes.
int64_t average_together(ProcessGroup& group, const std::vector<torch::Tensor>& parts);

class DataParallelReducer final : public GradientReducer {
 public:
  // `bucket_bytes`: the most gradient bytes one all-reduce carries (a larger tensor travels
  // alone).
  DataParallelReducer(std::shared_ptr<ProcessGroup> group, int64_t bucket_bytes);

  // Gradients a rank lacks (a parameter its batch did not reach) count as zeros; they stay
  // undefined only where every rank lacks them, so that AdamW treats them alike everywhere.
  void reduce(const std::vector<torch::Tensor>& parameters) override;
  torch::Tensor agree(const torch::Tensor& flags) override;
  int64_t replicas() const override { return group_->size(); }
  int64_t bytes_across_machines() const override { return bytes_reduced_; }

  // What this rank handed to all-reduce so far: payload bytes and collectives.
  int64_t bytes_reduced() const { return bytes_reduced_; }
  int64_t collectives() const { return collectives_; }

 private:
  void reduce_bucket(const std::vector<torch::Tensor>& gradients);

  std::shared_ptr<ProcessGroup> group_;
  int64_t bucket_bytes_;
  int64_t bytes_reduced_ = 0, collectives_ = 0;
};

}  // namespace dalle::distributed
