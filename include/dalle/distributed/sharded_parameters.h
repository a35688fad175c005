#pragma once
// ZeRO-3 storage of parameter groups (DALL-E's layout: one group per resblock, sharded
// across the GPUs of a machine). Each group is one flat fp32 vector, padded to a multiple of
// the ranks, of which every rank keeps a 1/N shard: a leaf the optimizer steps (or, for a
// group of frozen tensors, a constant). The group's
// own tensors stay the module's parameters, but hold values only between gather() and
// release(); their gradients become the shard's by a reduce-scatter.
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <unordered_set>
#include <memory>
#include <vector>

#include "dalle/distributed/data_parallel.h"
#include "dalle/distributed/gradient_reducer.h"
#include "dalle/distributed/powersgd.h"
#include "dalle/distributed/process_group.h"

namespace dalle::distributed {

// A block of whole rows of one matrix (a tensor of two or more dimensions, seen as its first
// dimension by the rest) in one rank's shard of a group: which tensor of the group, where the
// rows start in the shard, how many and how long.
struct ShardRows {
  size_t tensor;
  int64_t offset, rows, columns;
};
// The blocks of whole rows in rank `rank`'s shard of a group of tensors of `shapes`,
// flattened one after another, padded to a multiple of `ranks` and cut into `ranks` equal
// shards. A shard's gradient is these blocks, the parts of rows cut at the shard's ends, the
// vectors, and padding.
std::vector<ShardRows> rows_in_shard(const std::vector<std::vector<int64_t>>& shapes, int64_t rank, int64_t ranks);

class ShardedParameters {
 public:
  // Takes this rank's shard of each group's current values (the same on every rank) and
  // empties the tensors. `overlap`: reduce_gradients only starts the reduce-scatter.
  ShardedParameters(std::vector<std::vector<torch::Tensor>> groups, std::shared_ptr<ProcessGroup> group,
                    bool overlap = true);

  size_t groups() const { return groups_.size(); }
  const torch::Tensor& shard(size_t g) const { return shards_[g]; }
  std::vector<torch::Tensor> shards() const { return shards_; }
  bool holds(const torch::Tensor& tensor) const;
  // Whether group g trains: a group of tensors none of which requires gradients (frozen) is
  // gathered for forward and backward, but its shard requires none, and nothing reduces it.
  bool trains(size_t g) const { return shards_[g].requires_grad(); }

  // Starts all-gathering group g, so that its gather() finds the values there (issued a
  // block ahead, the gather overlaps the computation). Call it only for a gather() that
  // follows before the shards change.
  void prefetch(size_t g);
  // Group g's tensors hold their full values (all-gathered from the shards) ...
  void gather(size_t g);
  // ... and then none again.
  void release(size_t g);
  // The mean over the ranks of group g's tensors' gradients, this rank's part of it added to
  // its shard's gradient; the tensors' gradients are dropped. With overlap the reduce-scatter
  // is only started (backward goes on with the next block) ...
  void reduce_gradients(size_t g);
  // ... and the shards' gradients are complete after this.
  void finish_reductions();

  // This rank's part of full values shaped as group g's tensors (the moments or moving
  // average of a model that was not sharded yet)...
  torch::Tensor shard_of(size_t g, const std::vector<torch::Tensor>& full) const;
  // ... and the full values again, from every rank's `shard_like` (a shard-shaped tensor).
  std::vector<torch::Tensor> unshard(size_t g, const torch::Tensor& shard_like) const;

  // The shapes of group g's tensors, whole.
  std::vector<std::vector<int64_t>> shapes(size_t g) const;
  // rows_in_shard(shapes(g), this rank, the ranks).
  std::vector<ShardRows> rows_in_shard(size_t g) const;

  // The bytes of whole groups gathered and reduce-scattered so far (the collectives' payload).
  int64_t bytes_moved() const { return bytes_moved_; }

 private:
  torch::Tensor flatten(size_t g, const std::vector<torch::Tensor>& tensors) const;
  torch::Tensor all_gather(const torch::Tensor& shard) const;

  // What each tensor of each group is when whole.
  struct Layout {
    std::vector<int64_t> shape;
    int64_t numel;
    torch::TensorOptions options;
  };

  std::vector<std::vector<torch::Tensor>> groups_;
  std::vector<std::vector<Layout>> layouts_;
  std::vector<torch::Tensor> shards_;
  std::unordered_set<const torch::TensorImpl*> shard_impls_;  // which tensors are shards, for holds()
  std::vector<int64_t> shard_numel_;
  // Prefetched groups: the all-gather under way, its input and its output.
  struct Prefetch {
    std::unique_ptr<PendingCollective> pending;
    torch::Tensor input, output;
  };
  std::map<size_t, Prefetch> prefetched_;
  // Reduce-scatters under way: the group, the collective, its input and this rank's part.
  struct Reduction {
    size_t g;
    std::unique_ptr<PendingCollective> pending;
    torch::Tensor input, output;
  };
  std::vector<Reduction> reductions_;
  bool overlap_;
  std::shared_ptr<ProcessGroup> group_;
  mutable int64_t bytes_moved_ = 0;
};

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
class ShardedReducer final : public GradientReducer {
 public:
  // `within_node`: the group the parameters are sharded over; `across_nodes`: the replicas
  // of this rank's shards (null on one machine); `world`: every rank.
  ShardedReducer(std::shared_ptr<ShardedParameters> sharded, std::shared_ptr<ProcessGroup> world,
                 std::shared_ptr<ProcessGroup> within_node, std::shared_ptr<ProcessGroup> across_nodes,
                 int64_t bucket_bytes, std::optional<PowerSgdOptions> powersgd = std::nullopt, bool overlap = true);
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
  // PowerSGD's update count; the error feedback travels in the checkpoint's shards (below).
  void save_state(io::TensorMap& state, const std::string& prefix) override;
  void load_state(const io::TensorMap& state, const std::string& prefix) override;

  // PowerSGD's error feedback of this rank's shard of group g (shard-shaped, zero where
  // nothing is compressed) as its mean over the shard's replicas on the other machines (what
  // enters their next averages), and the same set back from a checkpoint; undefined without
  // PowerSGD across machines. Every rank calls it for every group.
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
  std::vector<torch::Tensor> replicated(const std::vector<torch::Tensor>& parameters) const;
  void average_replicated_hierarchically(const std::vector<torch::Tensor>& parameters);
  void prepare_low_rank();
  void compress_shards();

  std::shared_ptr<ShardedParameters> sharded_;
  std::shared_ptr<ProcessGroup> within_node_, across_group_;
  DataParallelReducer replicated_;
  std::unique_ptr<DataParallelReducer> across_nodes_;
  std::optional<PowerSgdOptions> powersgd_;
  std::unique_ptr<LowRankAverager> low_rank_;
  // PowerSGD's state, made at its first update: per group, the error feedback of the shard
  // (flat), and each compressed block of rows with its Q and its view of that buffer.
  std::vector<torch::Tensor> errors_;
  std::vector<std::vector<ShardRows>> compressed_rows_;
  std::vector<std::vector<LowRankState>> states_;
  int64_t updates_ = 0, whole_bytes_ = 0, replicated_across_bytes_ = 0;
  std::optional<double> shard_square_;  // the shards' squared norm, from Q, after a compressed update
};
}  // namespace dalle::distributed
