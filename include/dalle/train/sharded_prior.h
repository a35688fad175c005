#pragma once
// ZeRO-3 for a prior, applied from outside the model as the training runner is
// (train/resblock_runner.h), DALL-E's layout within a machine: "every parameter array" is
// sharded among the ranks of a machine. The prior is cut into units: each resblock, the
// embeddings and the head. A unit's trained parameters are two sharded groups
// (distributed/sharded_parameters.h), its matrices, which AdamW decays, and the rest; its
// frozen ones (fine-tuning) a third, gathered as the others but never reduced, stepped or
// checkpointed; and those kept whole (the small low-rank adapters that train on a sharded
// base) stay replicated, reduced with any other replicated parameter. A unit is gathered
// before its forward, which keeps no activations, and released after it; its backward
// gathers it again, reruns the forward with the random and autocast state of the first run
// (activation checkpointing: DALL-E checkpointed every resblock), backpropagates,
// reduce-scatters the unit's gradients into its shards and releases it. The next unit's
// gather is prefetched: embeddings, resblocks, head in forward, the reverse in backward.
// The ends stay float32 in every group (DALL-E kept embeddings and unembeddings in fp32 with
// fp32 gradients and moments), and PowerSGD sends them whole (uncompressed_groups()).
#include <torch/types.h>

#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dalle/distributed/process_group.h"
#include "dalle/distributed/sharded_parameters.h"
#include "dalle/io/safetensors.h"
#include "dalle/io/sharded_checkpoint.h"
#include "dalle/models/prior.h"
#include "dalle/train/resblock_runner.h"

namespace dalle::train {

// How a sharded prior's collectives meet its backward.
struct ShardedCollectives {
  bool overlap = true;  // a block's reduce-scatter runs while backward goes on (ShardedParameters)
  // Whether a block's backward starts gathering the block it reaches next before making its
  // gradients (hidden behind them, held beside them) or after (distributed.backward_prefetch).
  bool prefetch_before_gradients = true;
};

class ShardedPrior {
 public:
  // Whether AdamW decays a parameter, by its name in the prior's state dict.
  using DecayRule = std::function<bool(const std::string& name, const torch::Tensor& parameter)>;
  // Whether a block's trained parameter stays whole on every rank, by its name.
  using KeepWhole = std::function<bool(const std::string& name)>;
  // Shards the blocks' and the ends' current values (the same on every rank of `group`), named
  // as in `prior`'s state dict, and installs the prior's end runner (add_ends); a parameter
  // that requires no gradient is frozen.
  // `matrices`: the storage of the trained groups AdamW decays (precision.weights);
  // `frozen_matrices`: that of the blocks' frozen matrices (frozen_weights); the rest is
  // float32.
  ShardedPrior(models::PriorImpl& prior, const DecayRule& decayed, std::shared_ptr<distributed::ProcessGroup> group,
               ShardedCollectives collectives = {}, const KeepWhole& keep_whole = nullptr,
               torch::ScalarType matrices = torch::kFloat32, torch::ScalarType frozen_matrices = torch::kFloat32);
  // The same for a prior of `blocks` resblocks not built yet, each then cut by add_block as it
  // is built (models::ResblockBuilt): no rank holds more than one block whole; add_ends once
  // the prior exists.
  ShardedPrior(size_t blocks, const DecayRule& decayed, std::shared_ptr<distributed::ProcessGroup> group,
               ShardedCollectives collectives = {}, const KeepWhole& keep_whole = nullptr,
               torch::ScalarType matrices = torch::kFloat32, torch::ScalarType frozen_matrices = torch::kFloat32);
  // Cuts resblock b (named "resblocks.<b>." as in the prior's state dict) into its shards and
  // empties its tensors. Once per block, in any order, before anything is gathered.
  void add_block(size_t b, models::ResblockImpl& block);
  // Cuts the prior's embeddings and head (float32) into their shards, empties their tensors
  // and installs the end runner that gathers them around each use (in forward, backward,
  // validation and sampling alike). Once, after the blocks are added. What the blocks gained
  // since they were cut, their adapters (added to the built prior, as to a whole one), is
  // kept whole.
  void add_ends(models::PriorImpl& prior);

  const std::shared_ptr<distributed::ShardedParameters>& parameters() const { return sharded_; }
  // Units 0 .. blocks - 1 are the resblocks, then the embeddings and the head. The groups
  // that train come first, two per unit (2u: its matrices, 2u + 1: the rest, either possibly
  // empty); the frozen groups follow, two per unit too (trained_groups() + 2u: its frozen
  // matrices, in a block the frozen_matrices storage; + 2u + 1: the rest).
  size_t units() const { return blocks_ + 2; }
  size_t trained_groups() const { return 2 * units(); }
  // The shards AdamW decays (the matrices) and those it does not.
  std::vector<torch::Tensor> decayed_shards() const;
  std::vector<torch::Tensor> undecayed_shards() const;
  // One fp16 scale group per resblock: its two trained shards and its trained parameters
  // kept whole. The ends compute in float32 and have none.
  std::vector<std::vector<torch::Tensor>> scale_groups() const;
  // The ends' trained groups: PowerSGD sends them whole (DALL-E compressed the resblocks).
  std::vector<size_t> uncompressed_groups() const;

  // A runner that runs `inner` (x + branch, in the training precision) on gathered blocks,
  // as above, each block's input kept for its backward as `kept_as` (kept_input). Without
  // grad mode it gathers, runs and releases.
  models::ResblockRunner runner(models::ResblockRunner inner, torch::ScalarType kept_as = torch::kFloat32) const;

  // The names of group g's tensors.
  const std::vector<std::string>& names(size_t group) const { return names_[group]; }

  // Gathers take the trained groups' values from `averages` (one per trained group, as the
  // shards) until called with none: validation on the moving average, block by block.
  void gather_averages(const std::vector<torch::Tensor>& averages) const;

  // The frozen groups' values by name, one group at a time (every rank of the group calls
  // it), handed to `take` in the order of frozen_specs() and freed before the next is
  // gathered (views of the gathered buffer, valid during the call) ...
  void each_frozen_group(const std::function<void(const io::TensorMap& group)>& take) const;
  // ... their names, stored dtypes and shapes, group by group.
  std::vector<io::TensorSpec> frozen_specs() const;
  // ... and this rank's shards of them from whole values by name (a checkpoint's base),
  // each taken out of `weights` once used; those `weights` lacks from `unread` (a sharded
  // base's shards), one group at a time.
  void restore_frozen(io::TensorMap& weights, const io::ShardedWeights& unread = {}) const;

 private:
  // Cuts unit u's parameters, named as in the state dict, into its groups.
  void cut(size_t u, const std::vector<std::pair<std::string, torch::Tensor>>& parameters,
           torch::ScalarType matrices, torch::ScalarType frozen_matrices);
  // Keeps whole the trained tensors block b gained since it was cut (keep_whole's, or throws).
  void keep_added_whole(size_t b, models::ResblockImpl& block);
  // Whether unit u has anything that trains (in its shards or kept whole).
  bool trains(size_t u) const;
  models::EndRunner end_runner() const;

  size_t blocks_ = 0;
  bool ends_added_ = false;
  bool prefetch_before_gradients_ = true;
  DecayRule decayed_;
  KeepWhole keep_whole_;
  torch::ScalarType matrices_ = torch::kFloat32, frozen_matrices_ = torch::kFloat32;
  std::shared_ptr<distributed::ShardedParameters> sharded_;
  std::vector<std::vector<std::string>> names_;  // of each group's tensors
  std::vector<std::vector<torch::Tensor>> kept_whole_;  // of each unit
  std::unordered_map<const models::ResblockImpl*, size_t> block_index_;
};

}  // namespace dalle::train
