#include "dalle/distributed/sharded_reducer.h"

#include <torch/torch.h>

#include <cmath>

#include "dalle/error.h"
#include "dalle/io/sharded_checkpoint.h"

namespace dalle::distributed {

ShardedReducer::ShardedReducer(std::shared_ptr<ShardedParameters> sharded, std::shared_ptr<ProcessGroup> world,
                               std::shared_ptr<ProcessGroup> within_node, std::shared_ptr<ProcessGroup> across_nodes,
                               int64_t bucket_bytes, std::optional<PowerSgdOptions> powersgd, bool overlap)
    : sharded_(std::move(sharded)),
      within_node_(std::move(within_node)),
      across_group_(std::move(across_nodes)),
      replicated_(std::move(world), bucket_bytes, overlap),
      powersgd_(powersgd) {
  if (!across_group_) return;
  across_nodes_ = std::make_unique<DataParallelReducer>(across_group_, bucket_bytes);
  if (powersgd_) low_rank_ = std::make_unique<LowRankAverager>(across_group_, *powersgd_);
}

bool ShardedReducer::compressing() const { return low_rank_ && updates_ >= powersgd_->start_update; }

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
  if (!across_group_) replicated_.before_backward(replicated(parameters));
}

void ShardedReducer::reduce_scaled(const std::vector<torch::Tensor>& parameters) {
  sharded_->finish_reductions();
  if (!across_group_) replicated_.reduce_scaled(replicated(parameters));
}

void ShardedReducer::reduce_unscaled(const std::vector<torch::Tensor>& parameters) {
  shard_square_.reset();
  if (!across_group_) return;
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
    const int64_t values = sharded_->trains(g) ? shard.numel() : 0;  // a frozen group sends nothing
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
}

void ShardedReducer::compress_shards() {
  torch::NoGradGuard no_grad;
  prepare_low_rank();
  std::vector<torch::Tensor> matrices, whole;
  std::vector<LowRankState*> states;
  for (size_t g = 0; g < sharded_->groups(); ++g) {
    if (!sharded_->trains(g)) continue;
    auto shard = sharded_->shard(g);
    if (!shard.grad().defined()) shard.mutable_grad() = torch::zeros_like(shard);
    const auto gradient = shard.grad();
    int64_t at = 0;
    for (size_t k = 0; k < compressed_rows_[g].size(); ++k) {
      const auto& rows = compressed_rows_[g][k];
      if (rows.offset > at) whole.push_back(gradient.narrow(0, at, rows.offset - at));
      matrices.push_back(gradient.narrow(0, rows.offset, rows.rows * rows.columns).view({rows.rows, rows.columns}));
      states.push_back(&states_[g][k]);
      at = rows.offset + rows.rows * rows.columns;
    }
    if (at < gradient.numel()) whole.push_back(gradient.narrow(0, at, gradient.numel() - at));
  }
  const double compressed = low_rank_->average(matrices, states);
  whole_bytes_ += average_together(*across_group_, whole);
  std::vector<torch::Tensor> squares;
  for (const auto& part : whole) squares.push_back(part.to(torch::kFloat32).square().sum().to(torch::kFloat64));
  shard_square_ = compressed + (squares.empty() ? 0.0 : torch::stack(squares).sum().item<double>());
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
  prepare_low_rank();
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
  prepare_low_rank();
  if (error.numel() != errors_[g].numel()) {
    throw Error("the checkpoint's PowerSGD error feedback does not fit shard " + std::to_string(g));
  }
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
