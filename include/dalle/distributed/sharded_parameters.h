#pragma once
// ZeRO-3 storage of parameter groups (DALL-E's layout: one group per resblock, sharded
// across the GPUs of a machine). Each group is one flat vector, padded to a multiple of the
// ranks, of which every rank keeps a 1/N shard: a leaf the optimizer steps (or, for a group
// of frozen tensors, a constant), float32 or, as the group's storage type says, 16 bits. The
// group's own tensors stay the module's parameters, but hold values only between gather() and
// release() (in the storage type: a 16-bit group is gathered in 16 bits, and its tensors'
// gradients are 16-bit); their gradients become the shard's by a float32 reduce-scatter.
// ShardedReducer (distributed/sharded_reducer.h) completes them in the update step.
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <unordered_set>
#include <memory>
#include <vector>

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
  // `storage`: each group's type (float32, bfloat16 or float16); empty: float32 for all.
  ShardedParameters(std::vector<std::vector<torch::Tensor>> groups, std::shared_ptr<ProcessGroup> group,
                    bool overlap = true, std::vector<torch::ScalarType> storage = {});
  // `groups` groups yet empty, each then given its tensors by set_group (a model built one block
  // at a time, each cut before the next exists).
  ShardedParameters(size_t groups, std::shared_ptr<ProcessGroup> group, bool overlap = true);
  // Takes this rank's shard of `tensors`' current values as group g, stored as `storage`, and
  // empties the tensors. Once per group, before anything is gathered.
  void set_group(size_t g, std::vector<torch::Tensor> tensors, torch::ScalarType storage = torch::kFloat32);

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
  // From now on, gathers take group g's values from `shards[g]` (shard-shaped, any type and
  // device; cast to the storage type as the shards are) instead of the shards: the moving
  // average swapped in for validation. No values: the shards again.
  void gather_from(std::vector<torch::Tensor> shards);
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
  torch::Tensor flatten(size_t g, std::vector<torch::Tensor> tensors) const;
  // Completes the reductions under way but the `newest` (they run on).
  void finish_reductions_but(size_t newest);
  // Reduce-scatters left running while backward goes on: the latest block's two trained
  // groups (its matrices and the rest).
  static constexpr size_t kReductionsInFlight = 2;
  // Group g's tensors, whole, as views of its flat values (gathered).
  std::vector<torch::Tensor> unflatten(size_t g, const torch::Tensor& flat) const;
  torch::Tensor all_gather(const torch::Tensor& shard) const;
  // What group g's gather sends: its shard (or what gather_from names), in its storage type.
  torch::Tensor gather_source(size_t g) const;

  // What each tensor of each group is when whole.
  struct Layout {
    std::vector<int64_t> shape;
    int64_t numel;
    torch::TensorOptions options;
  };

  std::vector<std::vector<torch::Tensor>> groups_;
  std::vector<std::vector<Layout>> layouts_;
  std::vector<torch::Tensor> shards_;
  std::vector<torch::Tensor> gather_from_;  // empty: the shards
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

}  // namespace dalle::distributed
