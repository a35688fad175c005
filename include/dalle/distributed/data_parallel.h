#pragma once
// Data parallelism: every rank holds the whole model, trains on its own share of each
// global batch, and averages the gradients before the optimizer steps, so that every
// replica takes the same update. The gradients travel in buckets of a bounded size, each
// one flat all-reduce, so that a model of thousands of tensors makes a few collectives per
// update, not thousands.
//
// Attached parameters (an update step's) are bucketed in the order backward produces their
// gradients, as PyTorch's DDP reducer does: at first in reverse registration order, then,
// after the first reduction, in the order rank 0 saw them arrive. With overlap, a bucket's
// all-reduce starts the moment its last gradient is accumulated (a post-accumulate-grad
// hook), in bucket order, while backward computes the rest; reduce_scaled starts what is
// left and waits. Without overlap the same buckets start only in reduce_scaled: the same
// bytes summed in the same layout, so the two give identical bits. A checkpoint keeps the
// learned order (save_state), so that a resumed run sums in the layout the uninterrupted one
// would: on more than two ranks another layout sums in another order, in the last bits.
#include <cstdint>
#include <memory>
#include <vector>

#include "dalle/distributed/gradient_reducer.h"
#include "dalle/distributed/process_group.h"

namespace dalle::distributed {

// Replaces every tensor of `parts` (one dtype and device, any shapes and views) by its mean
// over the group's ranks, in one flat all-reduce; returns the payload's bytes.
int64_t average_together(ProcessGroup& group, const std::vector<torch::Tensor>& parts);

// What an attached reducer saw during the last backward, in order: a gradient accumulated
// (`index`: the parameter's position in the attached list) or a bucket's all-reduce started.
struct ReducerEvent {
  enum Kind { gradient_ready, bucket_started } kind;
  size_t index;
  bool operator==(const ReducerEvent&) const = default;
};

class DataParallelReducer final : public GradientReducer {
 public:
  // `bucket_bytes`: the most gradient bytes one all-reduce carries (a larger tensor travels
  // alone); `overlap`: start attached buckets during backward.
  DataParallelReducer(std::shared_ptr<ProcessGroup> group, int64_t bucket_bytes, bool overlap = true);
  ~DataParallelReducer() override;

  // Gradients a rank lacks (a parameter its batch did not reach) count as zeros; they stay
  // undefined only where every rank lacks them, so that AdamW treats them alike everywhere.
  // Parameters named to before_backward use their buckets (made then); any others are bucketed
  // in their order and started at once.
  void reduce_scaled(const std::vector<torch::Tensor>& parameters) override;
  void before_backward(const std::vector<torch::Tensor>& parameters) override;
  torch::Tensor agree(const torch::Tensor& flags) override;
  int64_t replicas() const override { return group_->size(); }
  int64_t bytes_across_machines() const override { return bytes_reduced_; }
  // The buckets' order learned from rank 0's first backward, per attached list ...
  void save_state(io::TensorMap& state, const std::string& prefix) override;
  // ... taken up by the lists attached from now on, in the same order (a list of another
  // length learns its own).
  void load_state(const io::TensorMap& state, const std::string& prefix) override;

  // What this rank handed to all-reduce so far: payload bytes and collectives.
  int64_t bytes_reduced() const { return bytes_reduced_; }
  int64_t collectives() const { return collectives_; }
  // The last backward of the parameters attached first, as their hooks saw it.
  std::vector<ReducerEvent> last_backward() const;
  // The attached parameters' buckets, as positions in the attached list, in launch order.
  std::vector<std::vector<size_t>> buckets() const;

  struct Attached;  // one attached list's buckets and hooks (data_parallel.cpp)

 private:
  void reduce_at_once(const std::vector<torch::Tensor>& parameters);
  void finish(Attached& attached);
  Attached* attached_as(const std::vector<torch::Tensor>& parameters);
  Attached* attach(const std::vector<torch::Tensor>& parameters);
  std::vector<size_t> order_of_rank_0(const std::vector<size_t>& arrival, size_t count);

  std::shared_ptr<ProcessGroup> group_;
  int64_t bucket_bytes_;
  bool overlap_;
  int64_t bytes_reduced_ = 0, collectives_ = 0;
  std::vector<std::shared_ptr<Attached>> attached_;
  std::vector<std::vector<size_t>> restored_orders_;  // by attached list, from load_state
};

}  // namespace dalle::distributed
