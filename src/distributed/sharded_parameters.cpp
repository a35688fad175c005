#include "dalle/distributed/sharded_parameters.h"

#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <numeric>

#include "dalle/error.h"
#include "dalle/io/sharded_checkpoint.h"

namespace dalle::distributed {

namespace {

void check_storage(torch::ScalarType type) {
  if (type != torch::kFloat32 && type != torch::kBFloat16 && type != torch::kFloat16) {
    throw Error("sharded parameters are stored in float32, bfloat16 or float16");
  }
}

}  // namespace

ShardedParameters::ShardedParameters(std::vector<std::vector<torch::Tensor>> groups,
                                     std::shared_ptr<ProcessGroup> group, bool overlap,
                                     std::vector<torch::ScalarType> storage)
    : ShardedParameters(groups.size(), std::move(group), overlap) {
  if (!storage.empty() && storage.size() != groups.size()) {
    throw Error("sharded parameters: a storage type per group, or none");
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    set_group(g, std::move(groups[g]), storage.empty() ? torch::kFloat32 : storage[g]);
  }
}

ShardedParameters::ShardedParameters(size_t groups, std::shared_ptr<ProcessGroup> group, bool overlap)
    : groups_(groups), layouts_(groups), shards_(groups), shard_numel_(groups, 0), overlap_(overlap),
      group_(std::move(group)) {
  if (!group_) throw Error("sharded parameters: no process group");
  for (auto& shard : shards_) shard = torch::zeros({0});
}

void ShardedParameters::set_group(size_t g, std::vector<torch::Tensor> tensors, torch::ScalarType type) {
  check_storage(type);
  if (g >= groups_.size()) throw Error("sharded parameters: no group " + std::to_string(g));
  torch::NoGradGuard no_grad;
  groups_[g] = std::move(tensors);
  std::vector<Layout> layouts;
  int64_t total = 0;
  for (const auto& tensor : groups_[g]) {
    // A 16-bit group's tensors are gathered in its type; a float32 group's as they were.
    const auto options = type == torch::kFloat32 ? tensor.options() : tensor.options().dtype(type);
    layouts.push_back({tensor.sizes().vec(), tensor.numel(), options});
    total += tensor.numel();
  }
  layouts_[g] = std::move(layouts);
  shard_numel_[g] = io::shard_size(total, group_->size());
  // A group of frozen tensors is gathered and never trained; an empty one trains nothing.
  const bool trains = groups_[g].empty() || std::any_of(groups_[g].begin(), groups_[g].end(),
                                                        [](const torch::Tensor& t) { return t.requires_grad(); });
  shard_impls_.erase(shards_[g].unsafeGetTensorImpl());
  shards_[g] = shard_of(g, groups_[g])
                   .to(groups_[g].empty() ? torch::kCPU : groups_[g][0].device(), type)
                   .requires_grad_(trains);
  shard_impls_.insert(shards_[g].unsafeGetTensorImpl());
  release(g);
}

std::vector<std::vector<int64_t>> ShardedParameters::shapes(size_t g) const {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& layout : layouts_[g]) shapes.push_back(layout.shape);
  return shapes;
}

std::vector<ShardRows> rows_in_shard(const std::vector<std::vector<int64_t>>& shapes, int64_t rank, int64_t ranks) {
  std::vector<int64_t> sizes;
  int64_t total = 0;
  for (const auto& shape : shapes) {
    sizes.push_back(std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>()));
    total += sizes.back();
  }
  const int64_t shard = io::shard_size(total, ranks), low = rank * shard, high = low + shard;
  std::vector<ShardRows> found;
  int64_t start = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const int64_t end = start + sizes[i];
    if (shapes[i].size() >= 2 && sizes[i] > 0 && start < high && low < end) {
      const int64_t columns = sizes[i] / shapes[i][0];
      const int64_t first = (std::max(low, start) - start + columns - 1) / columns;
      const int64_t last = (std::min(high, end) - start) / columns;
      if (last > first) found.push_back({i, start + first * columns - low, last - first, columns});
    }
    start = end;
  }
  return found;
}

std::vector<ShardRows> ShardedParameters::rows_in_shard(size_t g) const {
  return distributed::rows_in_shard(shapes(g), group_->rank(), group_->size());
}

bool ShardedParameters::holds(const torch::Tensor& tensor) const {
  return shard_impls_.count(tensor.unsafeGetTensorImpl()) > 0;
}

// Each tensor is copied into its place in one float32 buffer, padding included, and dropped
// as soon as it is, so that the group is never held twice over (a concatenation and then its
// padded copy held it three times, gradients included). An undefined tensor is zeros.
torch::Tensor ShardedParameters::flatten(size_t g, std::vector<torch::Tensor> tensors) const {
  const int64_t padded = shard_numel_[g] * group_->size();
  auto flat = torch::empty({padded}, torch::TensorOptions().device(group_->device()));
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t numel = layouts_[g][i].numel;
    auto place = flat.narrow(0, offset, numel);
    if (tensors[i].defined()) {
      place.copy_(tensors[i].detach().reshape({-1}));
    } else {
      place.zero_();
    }
    tensors[i] = torch::Tensor();
    offset += numel;
  }
  flat.narrow(0, offset, padded - offset).zero_();
  return flat;
}

// Only this rank's range of the group's values is read, never the whole group flattened: a
// base mapped from its file (a fine-tuning run's frozen blocks, on resume) is touched there alone.
torch::Tensor ShardedParameters::shard_of(size_t g, const std::vector<torch::Tensor>& full) const {
  const int64_t begin = group_->rank() * shard_numel_[g], end = begin + shard_numel_[g];
  auto shard = torch::zeros({shard_numel_[g]}, torch::TensorOptions().device(group_->device()));
  int64_t offset = 0;
  for (const auto& tensor : full) {
    const int64_t low = std::max(begin, offset), high = std::min(end, offset + tensor.numel());
    if (low < high) {
      shard.narrow(0, low - begin, high - low).copy_(tensor.detach().reshape({-1}).narrow(0, low - offset, high - low));
    }
    offset += tensor.numel();
  }
  if (offset > shard_numel_[g] * group_->size()) {
    throw Error("sharded parameters: more values than group " + std::to_string(g) + " holds");
  }
  return shard;
}

namespace {

// An all-gather moves bits: 16-bit values travel as float16, which every backend carries.
torch::Tensor as_sent(const torch::Tensor& values) {
  return values.scalar_type() == torch::kBFloat16 ? values.view(torch::kFloat16) : values;
}

}  // namespace

torch::Tensor ShardedParameters::all_gather(const torch::Tensor& shard) const {
  const auto values = shard.detach().to(group_->device()).contiguous();
  if (values.numel() == 0) return values;  // an empty group: nothing to send
  auto gathered = torch::empty({values.numel() * group_->size()}, values.options());
  auto received = as_sent(gathered);
  group_->all_gather(as_sent(values), received);
  bytes_moved_ += gathered.numel() * static_cast<int64_t>(gathered.element_size());
  return gathered;
}

torch::Tensor ShardedParameters::gather_source(size_t g) const {
  const auto& source = gather_from_.empty() ? shards_[g] : gather_from_[g];
  return source.detach().to(group_->device(), shards_[g].scalar_type()).contiguous();
}

void ShardedParameters::gather_from(std::vector<torch::Tensor> shards) {
  if (!shards.empty() && shards.size() != shards_.size()) {
    throw Error("sharded parameters: gather_from needs values for every group, or none");
  }
  for (size_t g = 0; g < shards.size(); ++g) {
    if (shards[g].numel() != shards_[g].numel()) {
      throw Error("sharded parameters: gather_from's values for group " + std::to_string(g) + " are not shard-shaped");
    }
  }
  if (!prefetched_.empty()) throw Error("sharded parameters: gather_from while a gather is prefetched");
  gather_from_ = std::move(shards);
}

std::vector<torch::Tensor> ShardedParameters::unflatten(size_t g, const torch::Tensor& flat) const {
  std::vector<torch::Tensor> full;
  int64_t offset = 0;
  for (const auto& layout : layouts_[g]) {
    full.push_back(flat.narrow(0, offset, layout.numel).view(layout.shape));
    offset += layout.numel;
  }
  return full;
}

std::vector<torch::Tensor> ShardedParameters::unshard(size_t g, const torch::Tensor& shard_like) const {
  return unflatten(g, all_gather(shard_like));
}

void ShardedParameters::prefetch(size_t g) {
  if (g >= groups_.size() || prefetched_.count(g) || shard_numel_[g] == 0) return;
  Prefetch prefetch;
  prefetch.input = gather_source(g);
  prefetch.output = torch::empty({prefetch.input.numel() * group_->size()}, prefetch.input.options());
  auto received = as_sent(prefetch.output);
  prefetch.pending = group_->start_all_gather(as_sent(prefetch.input), received);
  bytes_moved_ += prefetch.output.numel() * static_cast<int64_t>(prefetch.output.element_size());
  prefetched_.emplace(g, std::move(prefetch));
}

void ShardedParameters::gather(size_t g) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> full;
  if (auto found = prefetched_.find(g); found != prefetched_.end()) {
    found->second.pending->wait();
    full = unflatten(g, found->second.output);
    prefetched_.erase(found);
  } else {
    full = unflatten(g, all_gather(gather_source(g)));
  }
  // The tensors are views of the gathered buffer where its type and device are theirs (a copy
  // would hold the group twice while it is made), converted copies where they are not.
  for (size_t i = 0; i < full.size(); ++i) {
    groups_[g][i].set_data(
        full[i].to(layouts_[g][i].options.device(), layouts_[g][i].options.dtype().toScalarType()));
  }
}

void ShardedParameters::release(size_t g) {
  for (size_t i = 0; i < groups_[g].size(); ++i) {
    groups_[g][i].set_data(torch::empty({0}, layouts_[g][i].options.requires_grad(false)));
  }
}

void ShardedParameters::reduce_gradients(size_t g) {
  torch::NoGradGuard no_grad;
  if (shard_numel_[g] == 0) {
    // An empty group (a block whose matrices are all frozen): its empty gradient, so that
    // the optimizer treats it as any other shard.
    if (!shards_[g].grad().defined()) shards_[g].mutable_grad() = torch::zeros_like(shards_[g]);
    return;
  }
  // Each reduction holds its group's whole gradient (flattened, float32) until it is done: the
  // older ones are completed before this group's is made, the newest run on (at most a unit's
  // two groups). ShardedPrior's backward completes them sooner, before the next unit makes
  // its gradients (finish_reductions); this bound holds for any caller.
  finish_reductions_but(overlap_ ? kReductionsInFlight - 1 : 0);
  std::vector<torch::Tensor> gradients;
  for (size_t i = 0; i < groups_[g].size(); ++i) {
    auto& tensor = groups_[g][i];
    gradients.push_back(tensor.grad());  // undefined: no gradient reached it, zeros
    tensor.mutable_grad() = torch::Tensor();
  }
  Reduction reduction{g, nullptr, flatten(g, std::move(gradients)),
                      torch::empty({shard_numel_[g]}, torch::TensorOptions().device(group_->device()))};
  reduction.pending = group_->start_reduce_scatter(reduction.input, reduction.output, ReduceOp::average);
  bytes_moved_ += reduction.input.numel() * static_cast<int64_t>(reduction.input.element_size());
  reductions_.push_back(std::move(reduction));
  if (!overlap_) finish_reductions();
}

void ShardedParameters::finish_reductions() { finish_reductions_but(0); }

void ShardedParameters::finish_reductions_but(size_t newest) {
  torch::NoGradGuard no_grad;
  const size_t done = reductions_.size() > newest ? reductions_.size() - newest : 0;
  for (size_t i = 0; i < done; ++i) {
    auto& reduction = reductions_[i];
    reduction.pending->wait();
    auto& shard = shards_[reduction.g];
    auto mine = reduction.output.to(shard.device());
    // Added in float32 and rounded once to the gradient's type (PowerSGD's 16-bit error
    // feedback may be the gradient: sharded_reducer.h).
    if (shard.grad().defined()) {
      shard.mutable_grad().add_(mine);
    } else {
      shard.mutable_grad() = mine.to(shard.scalar_type());
    }
  }
  reductions_.erase(reductions_.begin(), reductions_.begin() + static_cast<std::ptrdiff_t>(done));
}

}  // namespace dalle::distributed
