#include "dalle/distributed/sharded_reducer.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "dalle/error.h"
#include "dalle/io/sharded_checkpoint.h"

namespace dalle::distributed {

ShardedReducer::ShardedReducer(std::shared_ptr<ShardedParameters> sharded, std::shared_ptr<ProcessGroup> world,
                               std::shared_ptr<ProcessGroup> within_node, std::shared_ptr<ProcessGroup> across_nodes,
                               int64_t bucket_bytes, std::optional<PowerSgdOptions> powersgd, bool overlap,
                               std::vector<size_t> uncompressed)
    : sharded_(std::move(sharded)),
      within_node_(std::move(within_node)),
      across_group_(std::move(across_nodes)),
      replicated_(std::move(world), bucket_bytes, overlap),
      powersgd_(powersgd),
      uncompressed_(uncompressed.begin(), uncompressed.end()) {
  if (!across_group_) return;
  across_nodes_ = std::make_unique<DataParallelReducer>(across_group_, bucket_bytes);
  if (powersgd_) low_rank_ = std::make_unique<LowRankAverager>(across_group_, *powersgd_);
}

bool ShardedReducer::compressing() const { return low_rank_ && updates_ >= powersgd_->start_update; }

int64_t ShardedReducer::error_values(size_t g) const {
  return sharded_->trains(g) && !uncompressed_.count(g) ? sharded_->shard(g).numel() : 0;
}

int64_t ShardedReducer::bytes_across_nodes() const {
  return (across_nodes_ ? across_nodes_->bytes_reduced() : 0) + (low_rank_ ? low_rank_->bytes_reduced() : 0) +
         whole_bytes_ + replicated_across_bytes_;
}

// The mean over every rank of the replicated parameters' gradients in DALL-E's hierarchy:
// reduce-scattered within the machine, each rank's part averaged across machines, then
// all-gathered within the machine, so that a rank sends 1/L of them across machines, not
// all. (A gradient no rank has counts as zeros here.)
void ShardedReducer::average_replicated_hierarchically(const std::vector<torch::Tensor>& parameters) {
  torch::NoGradGuard no_grad;
  if (parameters.empty()) return;
  std::vector<torch::Tensor> gradients, flat;
  for (auto parameter : parameters) {
    if (!parameter.grad().defined()) parameter.mutable_grad() = torch::zeros_like(parameter);
    gradients.push_back(parameter.grad());
    flat.push_back(parameter.grad().reshape({-1}).to(within_node_->device(), torch::kFloat32));
  }
  const int64_t ranks = within_node_->size();
  auto whole = torch::cat(flat);
  const int64_t part = io::shard_size(whole.numel(), ranks);
  whole = torch::constant_pad_nd(whole, {0, part * ranks - whole.numel()});
  auto mine = torch::empty({part}, whole.options());
  within_node_->reduce_scatter(whole, mine, ReduceOp::average);
  across_group_->all_reduce(mine, ReduceOp::average);
  replicated_across_bytes_ += part * static_cast<int64_t>(mine.element_size());
  within_node_->all_gather(mine, whole);
  int64_t offset = 0;
  for (auto& gradient : gradients) {
    gradient.copy_(whole.narrow(0, offset, gradient.numel()).view(gradient.sizes()));
    offset += gradient.numel();
  }
}

std::vector<torch::Tensor> ShardedReducer::replicated(const std::vector<torch::Tensor>& parameters) const {
  std::vector<torch::Tensor> replicated;
  for (const auto& parameter : parameters) {
    if (!sharded_->holds(parameter)) replicated.push_back(parameter);
  }
  return replicated;
}

void ShardedReducer::before_backward(const std::vector<torch::Tensor>& parameters) {
  if (!across_group_) {
    replicated_.before_backward(replicated(parameters));
    return;
  }
  // A skipped update (or one whose optimizer took no gradient) left its gradients, at that
  // backward's scales, in the buffers.
  if (backward_unreduced_ || keeps_gradients()) drop_errors();
  if (!low_rank_ || updates_ + 1 < powersgd_->start_update) return;
  prepare_low_rank();
  for (size_t g = 0; g < sharded_->groups(); ++g) {
    if (!compressed_rows_[g].empty()) sharded_->shard(g).mutable_grad() = errors_[g];
  }
}

void ShardedReducer::reduce_scaled(const std::vector<torch::Tensor>& parameters) {
  sharded_->finish_reductions();
  if (!across_group_) {
    replicated_.reduce_scaled(replicated(parameters));
    return;
  }
  backward_unreduced_ = true;
}

void ShardedReducer::reduce_unscaled(const std::vector<torch::Tensor>& parameters) {
  shard_square_.reset();
  if (!across_group_) return;
  backward_unreduced_ = false;
  average_replicated_hierarchically(replicated(parameters));
  std::vector<torch::Tensor> shards;
  for (const auto& parameter : parameters) {
    if (sharded_->holds(parameter)) shards.push_back(parameter);
  }
  ++updates_;
  if (compressing()) {
    compress_shards();
  } else {
    across_nodes_->reduce(shards);
  }
}

// The error buffers and Q of every compressed block of rows: the same blocks at every update,
// and a Q seeded by the tensor, so that a matrix's blocks on every machine start alike.
void ShardedReducer::prepare_low_rank() {
  if (!errors_.empty()) return;
  int64_t slot = 0;
  for (size_t g = 0; g < sharded_->groups(); ++g) {
    const auto& shard = sharded_->shard(g);
    const int64_t values = error_values(g);
    errors_.push_back(torch::zeros({values}, torch::TensorOptions().dtype(powersgd_->dtype).device(shard.device())));
    std::vector<ShardRows> compressed;
    std::vector<LowRankState> states;
    for (const auto& rows : values == 0 ? std::vector<ShardRows>{} : sharded_->rows_in_shard(g)) {
      if (!compresses(rows.rows, rows.columns, *powersgd_)) continue;
      compressed.push_back(rows);
      states.push_back({initial_q(*powersgd_, slot + static_cast<int64_t>(rows.tensor), rows.rows, rows.columns, shard.device()),
                        errors_[g].narrow(0, rows.offset, rows.rows * rows.columns).view({rows.rows, rows.columns})});
    }
    compressed_rows_.push_back(std::move(compressed));
    states_.push_back(std::move(states));
    slot += static_cast<int64_t>(sharded_->shapes(g).size());
  }
  averages_.resize(errors_.size());
  whole_parts_.resize(errors_.size());
  kept_.assign(errors_.size(), false);
}

void ShardedReducer::accumulate_into_error(size_t g) {
  auto shard = sharded_->shard(g);
  const auto gradient = shard.grad();
  shard.mutable_grad() = torch::Tensor();
  auto& error = errors_[g];
  if (!gradient.defined() || gradient.is_same(error)) return;
  // A gradient reduced without before_backward (a caller of reduce() alone): two buffers, as
  // PowerSGD has them elsewhere; one that holds non-finite values starts again from zero.
  if (!torch::isfinite(error).all().item<bool>()) error.zero_();
  error.add_(gradient);
}

void ShardedReducer::drop_errors() {
  torch::NoGradGuard no_grad;
  for (auto& error : errors_) error.zero_();
  for (size_t g = 0; g < kept_.size(); ++g) {
    kept_[g] = false;
    averages_[g].clear();
    whole_parts_[g].clear();
  }
}

bool ShardedReducer::keeps_gradients() const {
  return std::any_of(kept_.begin(), kept_.end(), [](bool kept) { return kept; });
}

// P Q^T of each compressed block and the rest as averaged, in float32; the buffer keeps what
// P Q^T dropped. One group at a time: no rank holds every decompressed gradient.
torch::Tensor ShardedReducer::take_gradient(const torch::Tensor& parameter, double factor) {
  size_t g = 0;
  while (g < kept_.size() && !(kept_[g] && sharded_->shard(g).is_same(parameter))) ++g;
  if (g == kept_.size()) return {};
  torch::NoGradGuard no_grad;
  auto gradient = torch::empty({errors_[g].numel()}, errors_[g].options().dtype(torch::kFloat32));
  int64_t at = 0;
  size_t part = 0;
  const auto fill_whole = [&](int64_t end) {
    if (end > at) gradient.narrow(0, at, end - at).copy_(whole_parts_[g][part++]);
  };
  for (size_t k = 0; k < compressed_rows_[g].size(); ++k) {
    const auto& rows = compressed_rows_[g][k];
    fill_whole(rows.offset);
    const auto decompressed = averages_[g][k].decompressed();
    low_rank_->drop_from_error(states_[g][k], decompressed);
    gradient.narrow(0, rows.offset, rows.rows * rows.columns).view({rows.rows, rows.columns}).copy_(decompressed);
    at = rows.offset + rows.rows * rows.columns;
  }
  fill_whole(gradient.numel());
  kept_[g] = false;
  averages_[g].clear();
  whole_parts_[g].clear();
  if (factor != 1.0) gradient.mul_(factor);
  return gradient;
}

void ShardedReducer::compress_shards() {
  torch::NoGradGuard no_grad;
  prepare_low_rank();
  std::vector<LowRankState*> states;
  std::vector<torch::Tensor> whole;  // averaged in place
  std::vector<size_t> compressed_groups;
  for (size_t g = 0; g < sharded_->groups(); ++g) {
    if (!sharded_->trains(g)) continue;
    auto shard = sharded_->shard(g);
    if (compressed_rows_[g].empty()) {
      // Nothing of it compressed: its gradient is averaged whole where it is, and stays.
      if (!shard.grad().defined()) shard.mutable_grad() = torch::zeros_like(shard);
      whole.push_back(shard.grad());
      continue;
    }
    accumulate_into_error(g);
    // What lies between the compressed blocks leaves the buffer, to be averaged whole.
    auto& error = errors_[g];
    int64_t at = 0;
    const auto keep_whole = [&](int64_t end) {
      if (end <= at) return;
      auto part = error.narrow(0, at, end - at);
      whole_parts_[g].push_back(part.to(torch::kFloat32, false, true));
      part.zero_();
      whole.push_back(whole_parts_[g].back());
    };
    for (size_t k = 0; k < compressed_rows_[g].size(); ++k) {
      const auto& rows = compressed_rows_[g][k];
      keep_whole(rows.offset);
      states.push_back(&states_[g][k]);
      at = rows.offset + rows.rows * rows.columns;
    }
    keep_whole(error.numel());
    compressed_groups.push_back(g);
  }
  double square = 0;
  auto averages = low_rank_->compress(states, square);
  auto next = averages.begin();
  for (const size_t g : compressed_groups) {
    const auto blocks = static_cast<std::ptrdiff_t>(compressed_rows_[g].size());
    averages_[g].assign(std::make_move_iterator(next), std::make_move_iterator(next + blocks));
    next += blocks;
    kept_[g] = true;
  }
  whole_bytes_ += average_together(*across_group_, whole);
  std::vector<torch::Tensor> squares;
  for (const auto& part : whole) squares.push_back(part.to(torch::kFloat32).square().sum().to(torch::kFloat64));
  shard_square_ = square + (squares.empty() ? 0.0 : torch::stack(squares).sum().item<double>());
}

void ShardedReducer::save_state(io::TensorMap& state, const std::string& prefix) {
  if (low_rank_) state[prefix + "updates"] = torch::tensor(updates_, torch::kInt64);
  replicated_.save_state(state, prefix + "replicated.");
}

void ShardedReducer::load_state(const io::TensorMap& state, const std::string& prefix) {
  replicated_.load_state(state, prefix + "replicated.");
  const auto updates = state.find(prefix + "updates");
  if (low_rank_ && updates != state.end()) updates_ = updates->second.item<int64_t>();
}

torch::Tensor ShardedReducer::shard_error(size_t g) {
  if (!low_rank_) return {};
  // Before compression (the buffers not yet made), or a group sent whole: zeros.
  if (errors_.empty() || uncompressed_.count(g)) {
    const int64_t values = sharded_->trains(g) ? sharded_->shard(g).numel() : 0;
    return torch::zeros({values}, torch::TensorOptions().device(across_group_->device()));
  }
  auto error = errors_[g].to(across_group_->device(), torch::kFloat32).contiguous();
  if (error.numel() > 0) across_group_->all_reduce(error, ReduceOp::average);
  return error;
}

std::vector<torch::Tensor> ShardedReducer::shard_q(size_t g) {
  if (!low_rank_) return {};
  prepare_low_rank();
  std::vector<torch::Tensor> qs;
  for (const auto& state : states_[g]) qs.push_back(state.q);
  return qs;
}

void ShardedReducer::set_shard_q(size_t g, const std::vector<torch::Tensor>& qs) {
  if (!low_rank_) return;
  prepare_low_rank();
  if (qs.size() != states_[g].size()) {
    throw Error("the checkpoint's PowerSGD Q holds " + std::to_string(qs.size()) + " blocks of rows for shard " +
                std::to_string(g) + ", which has " + std::to_string(states_[g].size()));
  }
  for (size_t k = 0; k < qs.size(); ++k) {
    if (qs[k].sizes() != states_[g][k].q.sizes()) {
      throw Error("the checkpoint's PowerSGD Q does not fit block " + std::to_string(k) + " of shard " +
                  std::to_string(g) + " (powersgd.rank changed?)");
    }
    states_[g][k].q.copy_(qs[k]);
  }
}

void ShardedReducer::set_shard_error(size_t g, const torch::Tensor& error) {
  if (!low_rank_) return;
  if (error.numel() != (sharded_->trains(g) ? sharded_->shard(g).numel() : 0)) {
    throw Error("the checkpoint's PowerSGD error feedback does not fit shard " + std::to_string(g));
  }
  // Zeros (a checkpoint written before compression) make no buffers before they are needed; a
  // group sent whole has none.
  if (uncompressed_.count(g) || (errors_.empty() && (error.numel() == 0 || !error.ne(0).any().item<bool>()))) {
    return;
  }
  prepare_low_rank();
  errors_[g].copy_(error.reshape({-1}));
}

double ShardedReducer::gradient_norm(const std::vector<torch::Tensor>& parameters) {
  // Squares: the replicated gradients' once (every rank has them whole), the shards' summed
  // over the machine's ranks (every machine holds the same shards, averaged).
  // Summed where the gradients live, so that a GPU is read once, not once per parameter.
  const auto on = torch::TensorOptions().dtype(torch::kFloat64).device(within_node_->device());
  auto replicated = torch::zeros({1}, on), sharded = torch::zeros({1}, on);
  for (const auto& parameter : parameters) {
    if (!parameter.grad().defined()) continue;
    const bool held = sharded_->holds(parameter);
    if (held && shard_square_) continue;  // measured from Q
    // In float32 whatever the gradient's storage: a 16-bit norm would round the sum.
    const auto square =
        torch::linalg_vector_norm(parameter.grad(), 2, std::nullopt, false, torch::kFloat32).to(on).square();
    (held ? sharded : replicated) += square;
  }
  if (shard_square_) sharded += *shard_square_;
  within_node_->all_reduce(sharded, ReduceOp::sum);
  return std::sqrt((replicated + sharded).item<double>());
}

}  // namespace dalle::distributed
