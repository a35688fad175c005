#include "dalle/dist/sharded_parameters.h"

#include <torch/torch.h>

#include "dalle/error.h"

namespace dalle::dist {

ShardedParameters::ShardedParameters(std::vector<std::vector<torch::Tensor>> groups,
                                     std::shared_ptr<ProcessGroup> group)
    : groups_(std::move(groups)), group_(std::move(group)) {
  if (!group_) throw Error("sharded parameters: no process group");
  torch::NoGradGuard no_grad;
  const int64_t ranks = group_->size();
  for (size_t g = 0; g < groups_.size(); ++g) {
    std::vector<Layout> layouts;
    int64_t total = 0;
    for (const auto& tensor : groups_[g]) {
      layouts.push_back({tensor.sizes().vec(), tensor.numel(), tensor.options()});
      total += tensor.numel();
    }
    layouts_.push_back(std::move(layouts));
    shard_numel_.push_back((total + ranks - 1) / ranks);
    shards_.push_back(shard_of(g, groups_[g]).to(groups_[g].empty() ? torch::kCPU : groups_[g][0].device())
                          .requires_grad_(true));
    shard_impls_.insert(shards_.back().unsafeGetTensorImpl());
    release(g);
  }
}

std::vector<std::vector<int64_t>> ShardedParameters::shapes(size_t g) const {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& layout : layouts_[g]) shapes.push_back(layout.shape);
  return shapes;
}

bool ShardedParameters::holds(const torch::Tensor& tensor) const {
  return shard_impls_.count(tensor.unsafeGetTensorImpl()) > 0;
}

torch::Tensor ShardedParameters::flatten(size_t g, const std::vector<torch::Tensor>& tensors) const {
  const auto device = group_->device();
  std::vector<torch::Tensor> parts{torch::zeros({0}, device)};
  for (const auto& tensor : tensors) parts.push_back(tensor.detach().reshape({-1}).to(device, torch::kFloat32));
  auto flat = torch::cat(parts);
  const int64_t padded = shard_numel_[g] * group_->size();
  if (flat.numel() > padded) throw Error("sharded parameters: more values than group " + std::to_string(g) + " holds");
  return torch::constant_pad_nd(flat, {0, padded - flat.numel()});
}

torch::Tensor ShardedParameters::shard_of(size_t g, const std::vector<torch::Tensor>& full) const {
  return flatten(g, full).narrow(0, group_->rank() * shard_numel_[g], shard_numel_[g]).clone();
}

torch::Tensor ShardedParameters::all_gather(const torch::Tensor& shard) const {
  const auto values = shard.detach().to(group_->device(), torch::kFloat32).contiguous();
  auto gathered = torch::empty({values.numel() * group_->size()}, values.options());
  group_->all_gather(values, gathered);
  bytes_moved_ += gathered.numel() * static_cast<int64_t>(gathered.element_size());
  return gathered;
}

std::vector<torch::Tensor> ShardedParameters::unshard(size_t g, const torch::Tensor& shard_like) const {
  const auto flat = all_gather(shard_like);
  std::vector<torch::Tensor> full;
  int64_t offset = 0;
  for (const auto& layout : layouts_[g]) {
    full.push_back(flat.narrow(0, offset, layout.numel).view(layout.shape));
    offset += layout.numel;
  }
  return full;
}

void ShardedParameters::prefetch(size_t g) {
  if (g >= groups_.size() || prefetched_.count(g)) return;
  Prefetch prefetch;
  prefetch.input = shards_[g].detach().to(group_->device(), torch::kFloat32).contiguous();
  prefetch.output = torch::empty({prefetch.input.numel() * group_->size()}, prefetch.input.options());
  prefetch.pending = group_->start_all_gather(prefetch.input, prefetch.output);
  bytes_moved_ += prefetch.output.numel() * static_cast<int64_t>(prefetch.output.element_size());
  prefetched_.emplace(g, std::move(prefetch));
}

void ShardedParameters::gather(size_t g) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> full;
  if (auto found = prefetched_.find(g); found != prefetched_.end()) {
    found->second.pending->wait();
    int64_t offset = 0;
    for (const auto& layout : layouts_[g]) {
      full.push_back(found->second.output.narrow(0, offset, layout.numel).view(layout.shape));
      offset += layout.numel;
    }
    prefetched_.erase(found);
  } else {
    full = unshard(g, shards_[g]);
  }
  for (size_t i = 0; i < full.size(); ++i) {
    groups_[g][i].set_data(full[i].to(layouts_[g][i].options.device(), layouts_[g][i].options.dtype().toScalarType(),
                                      /*non_blocking=*/false, /*copy=*/true));
  }
}

void ShardedParameters::release(size_t g) {
  for (size_t i = 0; i < groups_[g].size(); ++i) {
    groups_[g][i].set_data(torch::empty({0}, layouts_[g][i].options.requires_grad(false)));
  }
}

void ShardedParameters::reduce_gradients(size_t g) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> gradients;
  for (size_t i = 0; i < groups_[g].size(); ++i) {
    auto& tensor = groups_[g][i];
    gradients.push_back(tensor.grad().defined() ? tensor.grad() : torch::zeros(layouts_[g][i].shape));
    tensor.mutable_grad() = torch::Tensor();
  }
  auto mine = torch::empty({shard_numel_[g]}, torch::TensorOptions().device(group_->device()));
  const auto flat = flatten(g, gradients);
  group_->reduce_scatter(flat, mine, ReduceOp::average);
  bytes_moved_ += flat.numel() * static_cast<int64_t>(flat.element_size());
  auto& shard = shards_[g];
  mine = mine.to(shard.device());
  if (shard.grad().defined()) {
    shard.mutable_grad().add_(mine);
  } else {
    shard.mutable_grad() = mine;
  }
}

ShardedReducer::ShardedReducer(std::shared_ptr<ShardedParameters> sharded, std::shared_ptr<ProcessGroup> world,
                               std::shared_ptr<ProcessGroup> within_node, std::shared_ptr<ProcessGroup> across_nodes,
                               int64_t bucket_bytes)
    : sharded_(std::move(sharded)), within_node_(std::move(within_node)), replicated_(std::move(world), bucket_bytes) {
  if (across_nodes) across_nodes_ = std::make_unique<DataParallelReducer>(std::move(across_nodes), bucket_bytes);
}

void ShardedReducer::reduce(const std::vector<torch::Tensor>& parameters) {
  std::vector<torch::Tensor> replicated, shards;
  for (const auto& parameter : parameters) (sharded_->holds(parameter) ? shards : replicated).push_back(parameter);
  replicated_.reduce(replicated);
  if (across_nodes_) across_nodes_->reduce(shards);
}

double ShardedReducer::gradient_norm(const std::vector<torch::Tensor>& parameters) {
  // Squares: the replicated gradients' once (every rank has them whole), the shards' summed
  // over the machine's ranks (every machine holds the same shards, averaged).
  // Summed where the gradients live, so that a GPU is read once, not once per parameter.
  const auto on = torch::TensorOptions().dtype(torch::kFloat64).device(within_node_->device());
  auto replicated = torch::zeros({1}, on), sharded = torch::zeros({1}, on);
  for (const auto& parameter : parameters) {
    if (!parameter.grad().defined()) continue;
    const auto square = torch::linalg_vector_norm(parameter.grad(), 2).to(on).square();
    (sharded_->holds(parameter) ? sharded : replicated) += square;
  }
  within_node_->all_reduce(sharded, ReduceOp::sum);
  return std::sqrt((replicated + sharded).item<double>());
}

}  // namespace dalle::dist
