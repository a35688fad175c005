#include "dalle/train/sharded_prior.h"

#include <torch/torch.h>

#include <algorithm>
#include <unordered_set>

#include "dalle/error.h"
#include "dalle/train/activation_checkpoint.h"

namespace dalle::train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Unit u's groups: its trained matrices, the rest of what trains, its frozen matrices, the rest
// of what is frozen.
std::vector<size_t> groups_of(size_t u, size_t units) {
  return {2 * u, 2 * u + 1, 2 * (units + u), 2 * (units + u) + 1};
}

// What a sharded unit's backward needs, carried through the autograd context.
struct ShardedRun : torch::CustomClassHolder {
  std::function<torch::Tensor(const torch::Tensor&)> fn;
  std::shared_ptr<distributed::ShardedParameters> sharded;
  // The unit's groups (its trained ones, then its frozen ones), and those of the unit that
  // runs next: the following one in forward, the one before in backward (none at the ends).
  std::vector<size_t> groups, next_in_forward, next_in_backward;
  bool prefetch_before_gradients = true;
  ForwardState state;
  torch::ScalarType kept_as = torch::kFloat32, input_type = torch::kFloat32;

  void gather() const {
    for (const size_t g : groups) sharded->gather(g);
  }
  void prefetch(const std::vector<size_t>& next) const {
    for (const size_t g : next) sharded->prefetch(g);
  }
  // Backward: this unit gathered (the previous one's reduce-scatters running on, with overlap)
  // and recomputed; then those reduce-scatters complete, and (prefetching before gradients)
  // the next unit's gather starts before this unit's gradients are made. A reduce-scatter's
  // buffer (its flattened input) so never meets this unit's gradients.
  torch::Tensor recomputed_for_backward(const torch::Tensor& input) {
    gather();
    auto output = state.rerun(fn, input);
    sharded->finish_reductions();
    if (prefetch_before_gradients) prefetch(next_in_backward);
    return output;
  }
  // ... and once they are made: the values released, the gradients handed to their reduce-
  // scatter, then (prefetching after gradients) the next unit's gather started.
  void after_gradients() const {
    release();
    reduce_gradients();
    if (!prefetch_before_gradients) prefetch(next_in_backward);
  }
  void reduce_gradients() const {
    for (const size_t g : groups) {
      if (sharded->trains(g)) sharded->reduce_gradients(g);
    }
  }
  void release() const {
    for (const size_t g : groups) sharded->release(g);
  }
  // fn(x) on the gathered unit, released after; `prefetching`: the next unit's gather is
  // started first (a forward whose backward follows).
  torch::Tensor gathered_run(const torch::Tensor& x, bool prefetching = false) const {
    gather();
    if (prefetching) prefetch(next_in_forward);
    auto y = fn(x);
    release();
    return y;
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
    return run->gathered_run(x, /*prefetching=*/true);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto run = c10::static_intrusive_pointer_cast<ShardedRun>(ctx->saved_data["run"].toCapsule());
    const auto input = recomputation_input(ctx->get_saved_variables()[0], run->input_type);
    torch::autograd::backward({run->recomputed_for_backward(input)}, {grads[0]});
    run->after_gradients();
    return {input.grad(), torch::Tensor()};
  }
};

// The embeddings, sharded: their input (the tokens) takes no gradient, so an empty `anchor`
// that requires one makes autograd run this backward, which recomputes the embeddings on the
// gathered tables (with the forward's random and autocast state, as a block's) and
// reduce-scatters their gradients.
class ShardedEmbeddings : public torch::autograd::Function<ShardedEmbeddings> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& /*anchor*/, const torch::Tensor& tokens,
                               c10::intrusive_ptr<ShardedRun> run) {
    run->state = ForwardState(tokens);
    ctx->save_for_backward({tokens});
    ctx->saved_data["run"] = c10::IValue::make_capsule(run);
    torch::NoGradGuard no_grad;
    return run->gathered_run(tokens, /*prefetching=*/true);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto run = c10::static_intrusive_pointer_cast<ShardedRun>(ctx->saved_data["run"].toCapsule());
    const auto tokens = ctx->get_saved_variables()[0];
    torch::autograd::backward({run->recomputed_for_backward(tokens)}, {grads[0]});
    run->after_gradients();
    return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

ShardedPrior::ShardedPrior(models::PriorImpl& prior, const DecayRule& decayed,
                           std::shared_ptr<distributed::ProcessGroup> group, ShardedCollectives collectives,
                           const KeepWhole& keep_whole, torch::ScalarType matrices, torch::ScalarType frozen_matrices)
    : ShardedPrior(prior.resblocks().size(), decayed, std::move(group), collectives, keep_whole, matrices,
                   frozen_matrices) {
  for (size_t b = 0; b < blocks_; ++b) add_block(b, *prior.resblocks()[b]);
  add_ends(prior);
}

ShardedPrior::ShardedPrior(size_t blocks, const DecayRule& decayed, std::shared_ptr<distributed::ProcessGroup> group,
                           ShardedCollectives collectives, const KeepWhole& keep_whole, torch::ScalarType matrices,
                           torch::ScalarType frozen_matrices)
    : blocks_(blocks),
      prefetch_before_gradients_(collectives.prefetch_before_gradients),
      decayed_(decayed),
      keep_whole_(keep_whole),
      matrices_(matrices),
      frozen_matrices_(frozen_matrices),
      sharded_(std::make_shared<distributed::ShardedParameters>(4 * units(), std::move(group), collectives.overlap)),
      names_(4 * units()),
      kept_whole_(units()) {}

void ShardedPrior::add_block(size_t b, models::ResblockImpl& block) {
  if (b >= blocks_ || block_index_.count(&block)) {
    throw Error("sharded prior: block " + std::to_string(b) + " added twice, or beyond the " +
                std::to_string(blocks_) + " blocks");
  }
  block_index_.emplace(&block, b);
  std::vector<std::pair<std::string, torch::Tensor>> parameters;
  const std::string prefix = "resblocks." + std::to_string(b) + ".";
  for (const auto& item : block.named_parameters()) parameters.emplace_back(prefix + item.key(), item.value());
  cut(b, parameters, matrices_, frozen_matrices_);
}

void ShardedPrior::add_ends(models::PriorImpl& prior) {
  if (ends_added_) throw Error("sharded prior: the ends were added twice");
  ends_added_ = true;
  for (size_t b = 0; b < blocks_; ++b) keep_added_whole(b, *prior.resblocks()[b]);
  cut(blocks_, prior.end_parameters(models::PriorEnd::embeddings), torch::kFloat32, torch::kFloat32);
  cut(blocks_ + 1, prior.end_parameters(models::PriorEnd::head), torch::kFloat32, torch::kFloat32);
  prior.set_end_runner(end_runner());
}

void ShardedPrior::keep_added_whole(size_t b, models::ResblockImpl& block) {
  std::unordered_set<std::string> known;
  for (const size_t g : groups_of(b, units())) known.insert(names_[g].begin(), names_[g].end());
  std::unordered_set<const torch::TensorImpl*> kept;
  for (const auto& tensor : kept_whole_[b]) kept.insert(tensor.unsafeGetTensorImpl());
  const std::string prefix = "resblocks." + std::to_string(b) + ".";
  for (const auto& item : block.named_parameters()) {
    const auto name = prefix + item.key();
    if (known.count(name) || kept.count(item.value().unsafeGetTensorImpl())) continue;
    if (!keep_whole_ || !keep_whole_(name) || !item.value().requires_grad()) {
      throw Error("sharded prior: " + name + " was added after its block was cut, and only trained tensors that "
                  "stay whole (adapters) may be");
    }
    kept_whole_[b].push_back(item.value());
  }
}

// Group 2u: the unit's trained matrices (AdamW decays them), in `matrices`; 2u + 1: the rest
// of what trains; 2 (units + u): its frozen matrices, in `frozen_matrices`; 2 (units + u) + 1:
// the rest of what is frozen (a norm reads its fp32 input with its own gains' type).
void ShardedPrior::cut(size_t u, const std::vector<std::pair<std::string, torch::Tensor>>& parameters,
                       torch::ScalarType matrices, torch::ScalarType frozen_matrices) {
  std::vector<torch::Tensor> decayed, rest, frozen[2];
  const size_t first_frozen = 2 * (units() + u);
  for (const auto& [name, parameter] : parameters) {
    if (!parameter.requires_grad()) {
      const size_t vector = parameter.dim() < 2 ? 1 : 0;
      frozen[vector].push_back(parameter);
      names_[first_frozen + vector].push_back(name);
    } else if (keep_whole_ && keep_whole_(name)) {
      kept_whole_[u].push_back(parameter);
    } else {
      const bool is_decayed = decayed_(name, parameter);
      (is_decayed ? decayed : rest).push_back(parameter);
      names_[is_decayed ? 2 * u : 2 * u + 1].push_back(name);
    }
  }
  sharded_->set_group(2 * u, std::move(decayed), matrices);
  sharded_->set_group(2 * u + 1, std::move(rest));
  sharded_->set_group(first_frozen, std::move(frozen[0]), frozen_matrices);
  sharded_->set_group(first_frozen + 1, std::move(frozen[1]));
}

bool ShardedPrior::trains(size_t u) const {
  return !kept_whole_[u].empty() || sharded_->shard(2 * u).numel() + sharded_->shard(2 * u + 1).numel() > 0;
}

void ShardedPrior::gather_averages(const std::vector<torch::Tensor>& averages) const {
  if (averages.empty()) return sharded_->gather_from({});
  if (averages.size() != trained_groups()) throw Error("sharded prior: an average per trained group");
  auto sources = averages;
  for (size_t g = trained_groups(); g < sharded_->groups(); ++g) sources.push_back(sharded_->shard(g));
  sharded_->gather_from(std::move(sources));
}

std::vector<torch::Tensor> ShardedPrior::decayed_shards() const {
  std::vector<torch::Tensor> shards;
  for (size_t u = 0; u < units(); ++u) shards.push_back(sharded_->shard(2 * u));
  return shards;
}

std::vector<torch::Tensor> ShardedPrior::undecayed_shards() const {
  std::vector<torch::Tensor> shards;
  for (size_t u = 0; u < units(); ++u) shards.push_back(sharded_->shard(2 * u + 1));
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

std::vector<size_t> ShardedPrior::uncompressed_groups() const {
  return {2 * blocks_, 2 * blocks_ + 1, 2 * blocks_ + 2, 2 * blocks_ + 3};
}

// Units run as embeddings, blocks 0 .. n - 1, head in forward, and in reverse in backward:
// each prefetches the next one's groups.
models::ResblockRunner ShardedPrior::runner(models::ResblockRunner inner, torch::ScalarType kept_as) const {
  std::vector<bool> trained;
  for (size_t b = 0; b < blocks_; ++b) trained.push_back(trains(b));
  const size_t units = this->units(), head = blocks_ + 1;
  // Frozen embeddings have no backward to take a prefetch.
  const auto before_first = trains(blocks_) ? groups_of(blocks_, units) : std::vector<size_t>{};
  return [inner = std::move(inner), sharded = sharded_, index = block_index_, trained = std::move(trained), kept_as,
          units, head, before_first, before_gradients = prefetch_before_gradients_](
             models::ResblockImpl& block, const torch::Tensor& x, const models::ResblockContext& context) {
    const size_t b = index.at(&block);
    auto run = c10::make_intrusive<ShardedRun>();
    run->fn = [inner, &block, context](const torch::Tensor& input) { return inner(block, input, context); };
    run->sharded = sharded;
    run->groups = groups_of(b, units);
    run->next_in_forward = groups_of(b + 1 < index.size() ? b + 1 : head, units);
    run->next_in_backward = b > 0 ? groups_of(b - 1, units) : before_first;
    run->kept_as = kept_as;
    run->prefetch_before_gradients = before_gradients;
    if (!torch::GradMode::is_enabled() || (!x.requires_grad() && !trained.at(b))) return run->gathered_run(x);
    // A block that trains behind frozen layers (adapters after frozen embeddings) gets an
    // input that requires a gradient, without which its backward would never run.
    return ShardedBlock::apply(x.requires_grad() ? x : x.detach().requires_grad_(true), run);
  };
}

models::EndRunner ShardedPrior::end_runner() const {
  const size_t units = this->units(), embeddings = blocks_, head = blocks_ + 1;
  const bool embeddings_train = trains(embeddings), head_trains = trains(head);
  const size_t first = 0, last = blocks_ - 1;
  return [sharded = sharded_, units, embeddings, head, embeddings_train, head_trains, first, last,
          before_gradients = prefetch_before_gradients_](models::PriorEnd end, const models::EndPart& part,
                                                         const torch::Tensor& input) {
    auto run = c10::make_intrusive<ShardedRun>();
    run->fn = part;
    run->sharded = sharded;
    run->prefetch_before_gradients = before_gradients;
    const bool is_head = end == models::PriorEnd::head;
    run->groups = groups_of(is_head ? head : embeddings, units);
    if (is_head) {
      run->next_in_backward = groups_of(last, units);
    } else {
      run->next_in_forward = groups_of(first, units);
    }
    if (!torch::GradMode::is_enabled()) return run->gathered_run(input);
    if (!is_head) {
      if (!embeddings_train) return run->gathered_run(input);
      const auto anchor = torch::empty({0}, input.options().dtype(torch::kFloat32).requires_grad(true));
      return ShardedEmbeddings::apply(anchor, input, run);
    }
    if (!input.requires_grad() && !head_trains) return run->gathered_run(input);
    return ShardedBlock::apply(input.requires_grad() ? input : input.detach().requires_grad_(true), run);
  };
}

void ShardedPrior::each_frozen_group(const std::function<void(const io::TensorMap& group)>& take) const {
  for (size_t g = trained_groups(); g < sharded_->groups(); ++g) {
    const auto full = sharded_->unshard(g, sharded_->shard(g));
    io::TensorMap group;
    for (size_t i = 0; i < full.size(); ++i) group.emplace(names_[g][i], full[i]);
    take(group);
  }
}

std::vector<io::TensorSpec> ShardedPrior::frozen_specs() const {
  std::vector<io::TensorSpec> specs;
  for (size_t g = trained_groups(); g < sharded_->groups(); ++g) {
    const auto shapes = sharded_->shapes(g);
    const auto stored = sharded_->shard(g).scalar_type();
    for (size_t i = 0; i < shapes.size(); ++i) specs.push_back({names_[g][i], stored, shapes[i]});
  }
  return specs;
}

void ShardedPrior::restore_frozen(io::TensorMap& weights, const io::ShardedWeights& unread) const {
  torch::NoGradGuard no_grad;
  for (size_t g = trained_groups(); g < sharded_->groups(); ++g) {
    const auto& names = names_[g];
    auto joined = unread.read([&](const std::string& name) {
      return !weights.count(name) && std::find(names.begin(), names.end(), name) != names.end();
    });
    std::vector<torch::Tensor> full;
    for (const auto& name : names) {
      const auto whole = weights.find(name);
      const auto read = joined.find(name);
      if (whole == weights.end() && read == joined.end()) {
        throw Error("the checkpoint and its base lack the frozen weight " + name);
      }
      full.push_back(whole != weights.end() ? whole->second : read->second);
    }
    sharded_->shard(g).detach().copy_(sharded_->shard_of(g, full));
    for (const auto& name : names_[g]) weights.erase(name);
  }
}

}  // namespace dalle::train
