#include "dalle/train/sharded_resblocks.h"

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
  std::vector<size_t> groups;
  ForwardState state;

  void gather() const {
    for (const size_t g : groups) sharded->gather(g);
  }
  // The groups of the block that runs next: the following one in forward, the one before
  // in backward.
  void prefetch(size_t next_block) const {
    if (next_block >= blocks) return;
    sharded->prefetch(2 * next_block);
    sharded->prefetch(2 * next_block + 1);
  }
  void release() const {
    for (const size_t g : groups) sharded->release(g);
  }
};

class ShardedBlock : public torch::autograd::Function<ShardedBlock> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, c10::intrusive_ptr<ShardedRun> run) {
    run->state = ForwardState(x);
    ctx->save_for_backward({x});
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
    const auto input = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    run->gather();
    if (run->block > 0) run->prefetch(run->block - 1);
    torch::autograd::backward({run->state.rerun(run->fn, input)}, {grads[0]});
    for (const size_t g : run->groups) run->sharded->reduce_gradients(g);
    run->release();
    return {input.grad(), torch::Tensor()};
  }
};

}  // namespace

ShardedResblocks::ShardedResblocks(models::PriorImpl& prior, const DecayRule& decayed,
                                   std::shared_ptr<distributed::ProcessGroup> group, bool overlap) {
  std::unordered_map<const torch::TensorImpl*, std::string> name_of;
  for (const auto& item : prior.named_parameters()) name_of.emplace(item.value().unsafeGetTensorImpl(), item.key());
  std::vector<std::vector<torch::Tensor>> groups;
  for (size_t b = 0; b < prior.resblocks().size(); ++b) {
    block_index_.emplace(prior.resblocks()[b].get(), b);
    std::vector<torch::Tensor> matrices, rest;
    std::vector<std::string> matrix_names, rest_names;
    for (const auto& parameter : prior.resblocks()[b]->parameters()) {
      const auto& name = name_of.at(parameter.unsafeGetTensorImpl());
      const bool decay = decayed(name, parameter);
      (decay ? matrices : rest).push_back(parameter);
      (decay ? matrix_names : rest_names).push_back(name);
    }
    groups.push_back(std::move(matrices));
    groups.push_back(std::move(rest));
    names_.push_back(std::move(matrix_names));
    names_.push_back(std::move(rest_names));
  }
  sharded_ = std::make_shared<distributed::ShardedParameters>(std::move(groups), std::move(group), overlap);
}

std::vector<torch::Tensor> ShardedResblocks::decayed_shards() const {
  std::vector<torch::Tensor> shards;
  for (size_t g = 0; g < sharded_->groups(); g += 2) shards.push_back(sharded_->shard(g));
  return shards;
}

std::vector<torch::Tensor> ShardedResblocks::undecayed_shards() const {
  std::vector<torch::Tensor> shards;
  for (size_t g = 1; g < sharded_->groups(); g += 2) shards.push_back(sharded_->shard(g));
  return shards;
}

std::vector<std::vector<torch::Tensor>> ShardedResblocks::scale_groups() const {
  std::vector<std::vector<torch::Tensor>> groups;
  for (size_t g = 0; g < sharded_->groups(); g += 2) groups.push_back({sharded_->shard(g), sharded_->shard(g + 1)});
  return groups;
}

models::ResblockRunner ShardedResblocks::runner(models::ResblockRunner inner) const {
  return [inner = std::move(inner), sharded = sharded_, index = block_index_](
             models::ResblockImpl& block, const torch::Tensor& x, const models::ResblockContext& context) {
    const size_t b = index.at(&block);
    auto run = c10::make_intrusive<ShardedRun>();
    run->fn = [inner, &block, context](const torch::Tensor& input) { return inner(block, input, context); };
    run->sharded = sharded;
    run->block = b;
    run->blocks = index.size();
    run->groups = {2 * b, 2 * b + 1};
    if (!torch::GradMode::is_enabled() || !x.requires_grad()) {
      run->gather();
      auto y = run->fn(x);
      run->release();
      return y;
    }
    return ShardedBlock::apply(x, run);
  };
}

io::TensorMap ShardedResblocks::whole(const std::vector<torch::Tensor>& shard_like, const std::string& suffix) const {
  io::TensorMap named;
  for (size_t g = 0; g < sharded_->groups(); ++g) {
    const auto full = sharded_->unshard(g, shard_like.at(g));
    for (size_t i = 0; i < full.size(); ++i) named.emplace(names_[g][i] + suffix, full[i]);
  }
  return named;
}

}  // namespace dalle::train
