#pragma once
// ZeRO-3 for a prior's resblocks, applied from outside the model as the training runner is
// (train/resblock_runner.h), DALL-E's layout within a machine: each resblock's trained
// parameters are two sharded groups (distributed/sharded_parameters.h), its matrices, which
// AdamW decays, and the rest; its frozen ones (fine-tuning) a third, gathered as the others
// but never reduced, stepped or checkpointed; and those kept whole (the small low-rank
// adapters that train on a sharded base) stay replicated, reduced with the parameters outside
// the blocks. A block is gathered before its forward, which keeps no activations, and
// released after it; its backward gathers it again, reruns the forward with the random and
// autocast state of the first run (activation checkpointing: DALL-E checkpointed every
// resblock), backpropagates, reduce-scatters the block's gradients into its shards and
// releases it. Embeddings and the final layers stay whole on every rank.
#include <torch/types.h>

#include <functional>
#include <memory>
#include <unordered_map>
#include <string>
#include <vector>

#include "dalle/distributed/process_group.h"
#include "dalle/distributed/sharded_parameters.h"
#include "dalle/io/safetensors.h"
#include "dalle/models/prior.h"
#include "dalle/train/resblock_runner.h"

namespace dalle::train {

class ShardedPrior {
 public:
  // Whether AdamW decays a parameter, by its name in the prior's state dict.
  using DecayRule = std::function<bool(const std::string& name, const torch::Tensor& parameter)>;
  // Whether a block's trained parameter stays whole on every rank, by its name.
  using KeepWhole = std::function<bool(const std::string& name)>;
  // Shards the blocks' current values (the same on every rank of `group`), named as in
  // `prior`'s state dict; a parameter that requires no gradient is frozen.
  // `overlap`: a block's reduce-scatter runs while backward goes on (ShardedParameters).
  // `matrices`: the storage of the trained groups AdamW decays (precision.weights); the
  // rest is float32.
  ShardedPrior(models::PriorImpl& prior, const DecayRule& decayed,
                   std::shared_ptr<distributed::ProcessGroup> group, bool overlap = true,
                   const KeepWhole& keep_whole = nullptr, torch::ScalarType matrices = torch::kFloat32);
  // The same for a prior of `blocks` resblocks not built yet, each then cut by add_block as it
  // is built (models::ResblockBuilt): no rank holds more than one block whole.
  ShardedPrior(size_t blocks, const DecayRule& decayed, std::shared_ptr<distributed::ProcessGroup> group,
                   bool overlap = true, const KeepWhole& keep_whole = nullptr,
                   torch::ScalarType matrices = torch::kFloat32);
  // Cuts resblock b (named "resblocks.<b>." as in the prior's state dict) into its shards and
  // empties its tensors. Once per block, in any order, before anything is gathered.
  void add_block(size_t b, models::ResblockImpl& block);

  const std::shared_ptr<distributed::ShardedParameters>& parameters() const { return sharded_; }
  // The groups that train come first, two per block (2b: its matrices, 2b + 1: the rest,
  // either possibly empty); the frozen groups follow (trained_groups() + b).
  size_t trained_groups() const { return 2 * blocks_; }
  // The shards AdamW decays (the blocks' matrices) and those it does not.
  std::vector<torch::Tensor> decayed_shards() const;
  std::vector<torch::Tensor> undecayed_shards() const;
  // One fp16 scale group per resblock: its two trained shards and its trained parameters
  // kept whole.
  std::vector<std::vector<torch::Tensor>> scale_groups() const;

  // A runner that runs `inner` (x + branch, in the training precision) on gathered blocks,
  // as above, each block's input kept for its backward as `kept_as` (kept_input). Without
  // grad mode it gathers, runs and releases.
  models::ResblockRunner runner(models::ResblockRunner inner, torch::ScalarType kept_as = torch::kFloat32) const;

  // The names of group g's tensors.
  const std::vector<std::string>& names(size_t group) const { return names_[group]; }

  // Gathers take the trained groups' values from `averages` (one per trained group, as the
  // shards) until called with none: validation on the moving average, block by block.
  void gather_averages(const std::vector<torch::Tensor>& averages) const;

  // The frozen groups' values, whole, by name (every rank of the group calls it) ...
  io::TensorMap frozen_weights() const;
  // ... and this rank's shards of them from whole values by name (a checkpoint's base),
  // each taken out of `weights` once used.
  void restore_frozen(io::TensorMap& weights) const;

 private:
  size_t blocks_ = 0;
  DecayRule decayed_;
  KeepWhole keep_whole_;
  torch::ScalarType matrices_ = torch::kFloat32;
  std::shared_ptr<distributed::ShardedParameters> sharded_;
  std::vector<std::vector<std::string>> names_;  // of each group's tensors
  std::vector<std::vector<torch::Tensor>> kept_whole_;  // of each block
  std::unordered_map<const models::ResblockImpl*, size_t> block_index_;
};

}  // namespace dalle::train
