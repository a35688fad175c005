#pragma once
// DALL-E's reducer for a model whose resblocks are sharded within the machine
// (distributed/sharded_parameters.h): behind GradientReducer, as DataParallelReducer
// (distributed/data_parallel.h) and PowerSgdReducer (distributed/powersgd.h) are.
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "dalle/distributed/data_parallel.h"
#include "dalle/distributed/gradient_reducer.h"
#include "dalle/distributed/powersgd.h"
#include "dalle/distributed/process_group.h"
#include "dalle/distributed/sharded_parameters.h"

namespace dalle::distributed {

// The reducer of a model whose sharded groups' gradients are already reduce-scattered
// within the machine (by ShardedParameters::reduce_gradients, in backward): it averages the
// shards with their replicas on the other machines (hybrid sharding: DALL-E's layout), the
// replicated parameters over the whole job (on several machines, reduce-scattered within
// the machine, averaged across, all-gathered within), and measures the norm over every
// shard. With PowerSGD options, the shards' whole rows of matrices cross the machines
// compressed (DALL-E's hierarchy: reduce-scatter within the machine, PowerSGD across
// machines on each shard; the all-gather within the machine is the next forward's), the
// rest of each shard whole in one all-reduce. Q stays fixed (DALL-E) or, with warm_start,
// each block's last Q starts its next power iteration.
//
// Compressing, it keeps one buffer per shard where there would be two (DALL-E): from
// before_backward the shard's gradient IS its error feedback, so that backward's
// reduce-scatters add this update's gradient to what earlier ones dropped (the update step
// brings the buffer to the backward's fp16 scale first); P and Q are made from it, and the
// decompressed gradient only when the optimizer takes it, group by group, as the buffer
// keeps what P Q^T dropped. A skipped update drops the buffers' contents.
class ShardedReducer final : public GradientReducer {
 public:
  // `within_node`: the group the parameters are sharded over; `across_nodes`: the replicas
  // of this rank's shards (null on one machine); `world`: every rank. `uncompressed`: groups
  // PowerSGD sends whole (the prior's embeddings and head, as DALL-E did): they keep no error
  // feedback buffer.
  ShardedReducer(std::shared_ptr<ShardedParameters> sharded, std::shared_ptr<ProcessGroup> world,
                 std::shared_ptr<ProcessGroup> within_node, std::shared_ptr<ProcessGroup> across_nodes,
                 int64_t bucket_bytes, std::optional<PowerSgdOptions> powersgd = std::nullopt, bool overlap = true,
                 std::vector<size_t> uncompressed = {});
  // Before unscaling: the blocks' reduce-scatters (started in backward) waited for, and on
  // one machine the replicated parameters' buckets (overlapped with backward when attached).
  // After it: what crosses machines (the replicated parameters' hierarchy, the shards'
  // averages, PowerSGD's), not overlapped.
  void reduce_scaled(const std::vector<torch::Tensor>& parameters) override;
  void reduce_unscaled(const std::vector<torch::Tensor>& parameters) override;
  void before_backward(const std::vector<torch::Tensor>& parameters) override;
  torch::Tensor agree(const torch::Tensor& flags) override { return replicated_.agree(flags); }
  int64_t replicas() const override { return replicated_.replicas(); }
  double gradient_norm(const std::vector<torch::Tensor>& parameters) override;
  bool keeps_gradients() const override;
  torch::Tensor take_gradient(const torch::Tensor& parameter, double factor) override;
  // PowerSGD's update count; the error feedback travels in the checkpoint's shards (below).
  void save_state(io::TensorMap& state, const std::string& prefix) override;
  void load_state(const io::TensorMap& state, const std::string& prefix) override;

  // PowerSGD's error feedback of this rank's shard of group g (shard-shaped, zero where
  // nothing is compressed, as in a group sent whole; empty for a frozen group) as its mean
  // over the shard's replicas on the other machines (what enters their next averages), and
  // the same set back from a checkpoint; undefined without PowerSGD across machines. Every
  // rank calls it for every group.
  torch::Tensor shard_error(size_t g);
  void set_shard_error(size_t g, const torch::Tensor& error);
  // Q of each compressed block of rows of this rank's shard of group g (the same on every
  // machine), what warm_start carries into the next update, and the same set back from a
  // checkpoint written by as many ranks per machine; empty without PowerSGD across machines.
  std::vector<torch::Tensor> shard_q(size_t g);
  void set_shard_q(size_t g, const std::vector<torch::Tensor>& qs);

  // The all-reduce payload so far: the replicated parameters' on one machine, and what
  // crossed machines on several.
  int64_t bytes_reduced() const { return replicated_.bytes_reduced() + bytes_across_nodes(); }
  // What this rank sent across machines: its part of the replicated gradients, and of its
  // shards P and Q and what went whole.
  int64_t bytes_across_nodes() const;
  int64_t bytes_across_machines() const override { return bytes_across_nodes(); }

 private:
  bool compressing() const;
  // The values of group g's error feedback: its shard's, or none (frozen, or sent whole).
  int64_t error_values(size_t g) const;
  std::vector<torch::Tensor> replicated(const std::vector<torch::Tensor>& parameters) const;
  void average_replicated_hierarchically(const std::vector<torch::Tensor>& parameters);
  void prepare_low_rank();
  void compress_shards();
  // Group g's gradient joins its error feedback (unless it is that buffer already) and leaves.
  void accumulate_into_error(size_t g);
  void drop_errors();

  std::shared_ptr<ShardedParameters> sharded_;
  std::shared_ptr<ProcessGroup> within_node_, across_group_;
  DataParallelReducer replicated_;
  std::unique_ptr<DataParallelReducer> across_nodes_;
  std::optional<PowerSgdOptions> powersgd_;
  std::unique_ptr<LowRankAverager> low_rank_;
  std::unordered_set<size_t> uncompressed_;
  // PowerSGD's state, made at its first update: per group, the error feedback of the shard
  // (flat), and each compressed block of rows with its Q and its view of that buffer.
  std::vector<torch::Tensor> errors_;
  std::vector<std::vector<ShardRows>> compressed_rows_;
  std::vector<std::vector<LowRankState>> states_;
  // After a compressed reduction, per group, until the optimizer takes its gradient: each
  // compressed block's average, and the rest of the shard averaged whole (float32); `kept_`
  // says which groups' are still there.
  std::vector<std::vector<LowRankAverage>> averages_;
  std::vector<std::vector<torch::Tensor>> whole_parts_;
  std::vector<bool> kept_;
  bool backward_unreduced_ = false;  // from reduce_scaled to reduce_unscaled: a skip leaves it set
  int64_t updates_ = 0, whole_bytes_ = 0, replicated_across_bytes_ = 0;
  std::optional<double> shard_square_;  // the shards' squared norm, from Q, after a compressed update
};
}  // namespace dalle::distributed
