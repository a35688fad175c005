#include "dalle/train/sharded_prior.h"

#include <torch/torch.h>

#include "dalle/error.h"
#include "dalle/train/activation_checkpoint.h"

namespace dalle::train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What a sharded block's backward needs, carried through the autograd context.
struct ShardedRun : torch::CustomClassHolder {
  std::function<torch::Tensor(const torch::Tensor&)> fn;
  std::shared_ptr<distributed::ShardedParameters> sharded;
  size_t block = 0, blocks = 0;
  std::vector<size_t> groups;  // of the block: its trained ones, then its frozen one
  ForwardState state;
  torch::ScalarType kept_as = torch::kFloat32, input_type = torch::kFloat32;

  std::vector<size_t> groups_of(size_t b) const { return {2 * b, 2 * b + 1, 2 * blocks + b}; }
  void gather() const {
    for (const size_t g : groups) sharded->gather(g);
  }
  // The groups of the block that runs next: the following one in forward, the one before
  // in backward.
  void prefetch(size_t next_block) const {
    if (next_block >= blocks) return;
    for (const size_t g : groups_of(next_block)) sharded->prefetch(g);
  }
  void reduce_gradients() const {
    for (const size_t g : groups) {
      if (sharded->trains(g)) sharded->reduce_gradients(g);
    }
  }
  void release() const {
    for (const size_t g : groups) sharded->release(g);
  }
};

class ShardedBlock : public torch::autograd::Function<ShardedBlock> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, c10::intrusive_ptr<ShardedRun> run) {
    run->state = ForwardState(x);
    run->input_type = x.scalar_type();
    ctx->save_for_backward({kept_input(x, run->kept_as)});
    ctx->saved_data["run"] = c10::IValue::make_capsule(run);
    torch::NoGradGuard no_grad;
    run->gather();
    run->prefetch(run->block + 1);
    auto y = run->fn(x);
    run->release();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto run = c10::static_intrusive_pointer_cast<ShardedRun>(ctx->saved_data["run"].toCapsule());
    const auto input = recomputation_input(ctx->get_saved_variables()[0], run->input_type);
    run->gather();
    if (run->block > 0) run->prefetch(run->block - 1);
    torch::autograd::backward({run->state.rerun(run->fn, input)}, {grads[0]});
    run->reduce_gradients();
    run->release();
    return {input.grad(), torch::Tensor()};
  }
};

}  // namespace

ShardedPrior::ShardedPrior(models::PriorImpl& prior, const DecayRule& decayed,
                                   std::shared_ptr<distributed::ProcessGroup> group, bool overlap,
                                   const KeepWhole& keep_whole, torch::ScalarType matrices)
    : ShardedPrior(prior.resblocks().size(), decayed, std::move(group), overlap, keep_whole, matrices) {
  for (size_t b = 0; b < blocks_; ++b) add_block(b, *prior.resblocks()[b]);
}

ShardedPrior::ShardedPrior(size_t blocks, const DecayRule& decayed,
                                   std::shared_ptr<distributed::ProcessGroup> group, bool overlap,
                                   const KeepWhole& keep_whole, torch::ScalarType matrices)
    : blocks_(blocks),
      decayed_(decayed),
      keep_whole_(keep_whole),
      matrices_(matrices),
      sharded_(std::make_shared<distributed::ShardedParameters>(3 * blocks, std::move(group), overlap)),
      names_(3 * blocks),
      kept_whole_(blocks) {}

// Group 2b: the block's trained matrices (AdamW decays them), in `matrices_`; 2b + 1: the rest
// of what trains; 2 blocks + b: what is frozen.
void ShardedPrior::add_block(size_t b, models::ResblockImpl& block) {
  if (b >= blocks_ || block_index_.count(&block)) {
    throw Error("sharded resblocks: block " + std::to_string(b) + " added twice, or beyond the " +
                std::to_string(blocks_) + " blocks");
  }
  block_index_.emplace(&block, b);
  std::vector<torch::Tensor> matrices, rest, frozen;
  const std::string prefix = "resblocks." + std::to_string(b) + ".";
  for (const auto& item : block.named_parameters()) {
    const auto name = prefix + item.key();
    const auto& parameter = item.value();
    if (!parameter.requires_grad()) {
      frozen.push_back(parameter);
      names_[2 * blocks_ + b].push_back(name);
    } else if (keep_whole_ && keep_whole_(name)) {
      kept_whole_[b].push_back(parameter);
    } else {
      const bool decayed = decayed_(name, parameter);
      (decayed ? matrices : rest).push_back(parameter);
      names_[decayed ? 2 * b : 2 * b + 1].push_back(name);
    }
  }
  sharded_->set_group(2 * b, std::move(matrices), matrices_);
  sharded_->set_group(2 * b + 1, std::move(rest));
  sharded_->set_group(2 * blocks_ + b, std::move(frozen));
}

void ShardedPrior::gather_averages(const std::vector<torch::Tensor>& averages) const {
  if (averages.empty()) return sharded_->gather_from({});
  if (averages.size() != trained_groups()) throw Error("sharded resblocks: an average per trained group");
  auto sources = averages;
  for (size_t g = trained_groups(); g < sharded_->groups(); ++g) sources.push_back(sharded_->shard(g));
  sharded_->gather_from(std::move(sources));
}

std::vector<torch::Tensor> ShardedPrior::decayed_shards() const {
  std::vector<torch::Tensor> shards;
  for (size_t b = 0; b < blocks_; ++b) shards.push_back(sharded_->shard(2 * b));
  return shards;
}

std::vector<torch::Tensor> ShardedPrior::undecayed_shards() const {
  std::vector<torch::Tensor> shards;
  for (size_t b = 0; b < blocks_; ++b) shards.push_back(sharded_->shard(2 * b + 1));
  return shards;
}

std::vector<std::vector<torch::Tensor>> ShardedPrior::scale_groups() const {
  std::vector<std::vector<torch::Tensor>> groups;
  for (size_t b = 0; b < blocks_; ++b) {
    groups.push_back({sharded_->shard(2 * b), sharded_->shard(2 * b + 1)});
    groups.back().insert(groups.back().end(), kept_whole_[b].begin(), kept_whole_[b].end());
  }
  return groups;
}

models::ResblockRunner ShardedPrior::runner(models::ResblockRunner inner, torch::ScalarType kept_as) const {
  std::vector<bool> trains;
  for (size_t b = 0; b < blocks_; ++b) {
    const int64_t in_shards = sharded_->shard(2 * b).numel() + sharded_->shard(2 * b + 1).numel();
    trains.push_back(!kept_whole_[b].empty() || in_shards > 0);
  }
  return [inner = std::move(inner), sharded = sharded_, index = block_index_, trains = std::move(trains), kept_as](
             models::ResblockImpl& block, const torch::Tensor& x, const models::ResblockContext& context) {
    const size_t b = index.at(&block);
    auto run = c10::make_intrusive<ShardedRun>();
    run->fn = [inner, &block, context](const torch::Tensor& input) { return inner(block, input, context); };
    run->sharded = sharded;
    run->block = b;
    run->blocks = index.size();
    run->groups = run->groups_of(b);
    run->kept_as = kept_as;
    if (!torch::GradMode::is_enabled() || (!x.requires_grad() && !trains.at(b))) {
      run->gather();
      auto y = run->fn(x);
      run->release();
      return y;
    }
    // A block that trains behind frozen layers (adapters after frozen embeddings) gets an
    // input that requires a gradient, without which its backward would never run.
    return ShardedBlock::apply(x.requires_grad() ? x : x.detach().requires_grad_(true), run);
  };
}

io::TensorMap ShardedPrior::frozen_weights() const {
  io::TensorMap named;
  for (size_t g = trained_groups(); g < sharded_->groups(); ++g) {
    const auto full = sharded_->unshard(g, sharded_->shard(g));
    for (size_t i = 0; i < full.size(); ++i) named.emplace(names_[g][i], full[i].clone());
  }
  return named;
}

void ShardedPrior::restore_frozen(io::TensorMap& weights) const {
  torch::NoGradGuard no_grad;
  for (size_t g = trained_groups(); g < sharded_->groups(); ++g) {
    std::vector<torch::Tensor> full;
    for (const auto& name : names_[g]) {
      const auto found = weights.find(name);
      if (found == weights.end()) throw Error("the checkpoint and its base lack the frozen weight " + name);
      full.push_back(found->second);
    }
    sharded_->shard(g).detach().copy_(sharded_->shard_of(g, full));
    for (const auto& name : names_[g]) weights.erase(name);
  }
}

}  // namespace dalle::train
