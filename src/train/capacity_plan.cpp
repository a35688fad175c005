#include "dalle/train/capacity_plan.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <numeric>
#include <unordered_set>

#include "dalle/distributed/powersgd.h"
#include "dalle/distributed/sharded_parameters.h"
#include "dalle/error.h"
#include "dalle/io/sharded_checkpoint.h"
#include "dalle/models/adapter.h"
#include "dalle/models/prior_flops.h"
#include "dalle/train/trainable.h"
#include "train/capacity_plan_text.h"
#include "train/trainers/prior_weight_decay.h"

namespace dalle::train {
namespace {

using detail::kGiB;
using detail::with_thousands;

constexpr double kFp32 = 4;
// Values per token per unit of width a resblock keeps for its backward when not
// checkpointed (capacity_plan.h): attention's norm, q, k, v and attended; the MLP's norm and
// its 4d hidden before and after GELU.
constexpr double kAttentionInternals = 6, kMlpInternals = 10;
// Logits per token and class in fp32: values, log-softmax and gradient.
constexpr double kLogitBytes = 12;

using Shape = std::vector<int64_t>;

int64_t numel(const Shape& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

// The traffic row of backward's all-gathers, hidden or not by distributed.backward_prefetch.
constexpr const char* kBackwardGathers = "gathered again for backward";

// One resblock as ShardedPrior groups it, once the recipe's adapters are added and
// optimizer.trainable applied: its trained matrices (which AdamW decays: no embeddings live in
// a block), its other trained tensors, its frozen ones, each in the block's parameter order,
// and its adapters, which stay whole.
struct BlockShape {
  bool attention = false;
  std::vector<Shape> groups[3];
  std::vector<Shape> adapters;
  int64_t matrix_weights = 0;  // of its matrix multiplies

  static int64_t values_of(const std::vector<Shape>& shapes) {
    int64_t sum = 0;
    for (const auto& shape : shapes) sum += numel(shape);
    return sum;
  }
  // The base's values: what the block has without adapters.
  int64_t values() const { return values_of(groups[0]) + values_of(groups[1]) + values_of(groups[2]); }
  int64_t trained_values() const { return values_of(groups[0]) + values_of(groups[1]) + adapter_values(); }
  // Its trained matrices, the group precision.weights stores in 16 bits when sharded.
  int64_t matrix_values() const { return values_of(groups[0]); }
  int64_t adapter_values() const { return values_of(adapters); }
  int64_t frozen_matrix_values() const {
    int64_t sum = 0;
    for (const auto& shape : groups[2]) sum += shape.size() >= 2 ? numel(shape) : 0;
    return sum;
  }
  // A rank's shards of the block: every group, or the trained ones, padded to the ranks (the
  // frozen tensors are two groups, the matrices and the rest).
  int64_t shard_values(int64_t ranks) const {
    return trained_shard_values(ranks) + frozen_matrix_shard_values(ranks) +
           io::shard_size(values_of(groups[2]) - frozen_matrix_values(), ranks);
  }
  int64_t frozen_matrix_shard_values(int64_t ranks) const { return io::shard_size(frozen_matrix_values(), ranks); }
  int64_t trained_shard_values(int64_t ranks) const {
    return matrix_shard_values(ranks) + io::shard_size(values_of(groups[1]), ranks);
  }
  int64_t matrix_shard_values(int64_t ranks) const { return io::shard_size(matrix_values(), ranks); }
  // What trains, as shapes: the trained groups' tensors and the adapters.
  std::vector<Shape> trained_shapes() const {
    auto all = groups[0];
    all.insert(all.end(), groups[1].begin(), groups[1].end());
    all.insert(all.end(), adapters.begin(), adapters.end());
    return all;
  }
};

// The parameters' shapes of one layer's two resblocks and of everything outside them.
struct ModelShape {
  std::vector<BlockShape> layer;  // attention, then MLP
  // The embeddings and the head as ShardedPrior groups them (group 0: what AdamW decays).
  BlockShape ends[2];
  std::vector<Shape> outside, outside_trained;  // the base's; what trains, adapters included
  int64_t outside_matrix_weights = 0, outside_adapters = 0;
  bool frozen = false;  // optimizer.trainable or adapters leave part of the model frozen
};

// Built with one layer: every layer's blocks have the same parameters, whatever their mask.
ModelShape measure(const PriorTrainConfig& recipe) {
  auto config = recipe.model;
  config.layers = 1;
  config.attention.clear();
  torch::NoGradGuard no_grad;
  models::Prior prior(config);
  const int64_t base_matrix_weights = models::matrix_weights(*prior);
  models::add_adapters(*prior, recipe.adapter);
  freeze_all_but(*prior, trainable_patterns(recipe.optimizer.trainable, recipe.adapter), "plan");
  ModelShape shape;
  std::unordered_set<const torch::TensorImpl*> in_blocks;
  int64_t block_matrix_weights = 0;
  for (size_t b = 0; b < prior->resblocks().size(); ++b) {
    const auto& block = prior->resblocks()[b];
    BlockShape measured;
    measured.attention = b % 2 == 0;
    measured.matrix_weights = models::matrix_weights(*block);
    block_matrix_weights += measured.matrix_weights;
    for (const auto& item : block->named_parameters()) {
      const auto& parameter = item.value();
      in_blocks.insert(parameter.unsafeGetTensorImpl());
      auto sizes = parameter.sizes().vec();
      if (!parameter.requires_grad()) {
        measured.groups[2].push_back(std::move(sizes));
      } else if (models::is_adapter_tensor(item.key())) {
        measured.adapters.push_back(std::move(sizes));
      } else {
        measured.groups[parameter.dim() == 2 ? 0 : 1].push_back(std::move(sizes));
      }
    }
    shape.layer.push_back(std::move(measured));
  }
  for (const auto& item : prior->named_parameters()) {
    const auto& parameter = item.value();
    shape.frozen = shape.frozen || !parameter.requires_grad();
    if (in_blocks.count(parameter.unsafeGetTensorImpl())) continue;
    if (models::is_adapter_tensor(item.key())) {
      shape.outside_adapters += parameter.numel();
    } else {
      shape.outside.push_back(parameter.sizes().vec());
    }
    if (parameter.requires_grad()) shape.outside_trained.push_back(parameter.sizes().vec());
  }
  shape.outside_matrix_weights = base_matrix_weights - block_matrix_weights;
  for (const auto end : {models::PriorEnd::embeddings, models::PriorEnd::head}) {
    auto& measured = shape.ends[end == models::PriorEnd::head ? 1 : 0];
    for (const auto& [name, parameter] : prior->end_parameters(end)) {
      auto sizes = parameter.sizes().vec();
      if (!parameter.requires_grad()) {
        measured.groups[2].push_back(std::move(sizes));
      } else if (models::is_adapter_tensor(name)) {
        measured.adapters.push_back(std::move(sizes));
      } else {
        measured.groups[prior_training::decayed_by_adamw(name, parameter) ? 0 : 1].push_back(std::move(sizes));
      }
    }
  }
  return shape;
}

double dtype_bytes(const std::string& dtype) { return dtype == "float32" ? 4 : 2; }

// What PowerSGD keeps and sends for a set of gradient matrices (per update, per rank).
struct LowRankCost {
  double compressed_values = 0;  // of the matrices (or blocks of rows) compressed
  double pq_values = 0;          // (rows + columns) x rank of those
  double q_values = 0;           // columns x rank
  double whole_values = 0;       // the values that go uncompressed
  double largest_values = 0;     // of the largest matrix (or block of rows) compressed

  void add_matrix(int64_t rows, int64_t columns, const distributed::PowerSgdOptions& options) {
    const auto rank = static_cast<double>(distributed::effective_rank(rows, columns, options));
    compressed_values += static_cast<double>(rows * columns);
    largest_values = std::max(largest_values, static_cast<double>(rows * columns));
    pq_values += static_cast<double>(rows + columns) * rank;
    q_values += static_cast<double>(columns) * rank;
  }
  LowRankCost& operator+=(const LowRankCost& other) {
    compressed_values += other.compressed_values;
    pq_values += other.pq_values;
    q_values += other.q_values;
    whole_values += other.whole_values;
    largest_values = std::max(largest_values, other.largest_values);
    return *this;
  }
  // The sums scaled (layers, or a mean over ranks); the largest matrix stays what it is.
  LowRankCost times(double factor) const {
    return {compressed_values * factor, pq_values * factor, q_values * factor, whole_values * factor, largest_values};
  }
};

// Flat PowerSGD (PowerSgdReducer): every gradient, as its first dimension by the rest.
LowRankCost flat_low_rank(const ModelShape& shape, int64_t layers, const distributed::PowerSgdOptions& options) {
  const auto cost_of = [&](const Shape& parameter) {
    LowRankCost cost;
    if (distributed::compresses(parameter, options)) {
      cost.add_matrix(parameter[0], numel(parameter) / parameter[0], options);
    } else {
      cost.whole_values += static_cast<double>(numel(parameter));
    }
    return cost;
  };
  LowRankCost total;
  for (const auto& block : shape.layer) {
    for (const auto& parameter : block.trained_shapes()) total += cost_of(parameter).times(static_cast<double>(layers));
  }
  for (const auto& parameter : shape.outside_trained) total += cost_of(parameter);
  return total;
}

// DALL-E's hierarchy (ShardedReducer): local rank `rank`'s shard of every trained group, its
// whole rows of matrices compressed, the rest of the shard (cut rows, vectors, padding) whole.
LowRankCost shard_low_rank(const ModelShape& shape, int64_t layers, int64_t rank, int64_t ranks,
                           const distributed::PowerSgdOptions& options) {
  LowRankCost per_layer;
  for (const auto& block : shape.layer) {
    for (const auto& group : {block.groups[0], block.groups[1]}) {
      int64_t values = 0;
      for (const auto& tensor : group) values += numel(tensor);
      double left = static_cast<double>(io::shard_size(values, ranks));
      for (const auto& rows : distributed::rows_in_shard(group, rank, ranks)) {
        if (!distributed::compresses(rows.rows, rows.columns, options)) continue;
        per_layer.add_matrix(rows.rows, rows.columns, options);
        left -= static_cast<double>(rows.rows * rows.columns);
      }
      per_layer.whole_values += left;
    }
  }
  auto cost = per_layer.times(static_cast<double>(layers));
  // The embeddings and head cross whole (ShardedPrior::uncompressed_groups).
  for (const auto& end : shape.ends) {
    cost.whole_values += static_cast<double>(end.trained_shard_values(ranks));
  }
  return cost;
}

double ring_factor(const std::string& collective, int64_t ranks) {
  const double n = static_cast<double>(ranks);
  return (collective == "all-reduce" ? 2.0 : 1.0) * (n - 1.0) / n;
}

double wire_seconds(const TrafficPart& part, const ClusterShape& cluster) {
  const double wire = ring_factor(part.collective, part.ranks) * part.payload_bytes;
  const double within = cluster.link_within_gbps * 1e9 / 8.0, across = cluster.link_across_gbps * 1e9 / 8.0;
  switch (part.scope) {
    case CollectiveScope::within: return wire / within;
    // Every local rank's group crosses at once through the machine's links.
    case CollectiveScope::across: return wire * static_cast<double>(cluster.gpus_per_node) / across;
    case CollectiveScope::spanning: return std::max(wire / within, wire / across);
  }
  return 0;
}

// The plan's pieces as they are worked out, in order.
class Planner {
 public:
  Planner(const PriorTrainConfig& recipe, const ClusterShape& cluster)
      : recipe_(recipe), cluster_(cluster), shape_(measure(recipe)) {
    plan_.cluster = cluster;
    plan_.model = recipe.model;
    plan_.precision = recipe.precision.mode;
    plan_.adam_moments = recipe.precision.adam_moments;
    plan_.sharding = recipe.distributed.sharding;
    plan_.gradient_reduction = recipe.distributed.gradient_reduction;
    plan_.sharded = recipe.distributed.sharding == "within_node";
    plan_.weights = recipe.precision.weights;
    matrix_bytes_ = dtype_bytes(plan_.weights);
    layers_ = recipe.model.layers;
    resblocks_ = 2 * layers_;
    gpus_ = cluster.gpus_per_node;
    powersgd_ = recipe.distributed.gradient_reduction == "powersgd";
    overlap_ = recipe.distributed.overlap;
    prefetch_before_gradients_ = recipe.distributed.backward_prefetch == "before_gradients";
  }

  CapacityPlan run() {
    batch();
    check_storage();
    count_parameters();
    low_rank_costs();
    state_memory();
    working_memory();
    powersgd_memory();
    decide_fit();
    traffic();
    step_time();
    add_notes();
    return std::move(plan_);
  }

 private:
  void batch() {
    const int64_t ranks = cluster_.ranks();
    plan_.global_batch = recipe_.data.batch_size;
    if (plan_.global_batch % ranks != 0) {
      throw Error("data.batch_size " + std::to_string(plan_.global_batch) + " does not divide between " +
                  std::to_string(ranks) + " ranks (it is the global batch); make it a multiple of the ranks, as " +
                  "--set data.batch_size=" + std::to_string(ranks));
    }
    plan_.batch_per_rank = plan_.global_batch / ranks;
    plan_.tokens_per_rank = plan_.batch_per_rank * recipe_.model.length();
  }

  // The 16-bit storage keys need autocast's 16-bit compute, and precision.weights a sharded
  // run, as the trainer requires.
  void check_storage() const {
    const bool fp32 = recipe_.precision.precision() == Precision::fp32;
    if (recipe_.frozen_weights != "float32" && fp32) {
      throw Error("plan: frozen_weights " + recipe_.frozen_weights + " needs precision.mode bfloat16 or float16");
    }
    check_weights_storage(recipe_.precision, plan_.sharded, "plan");
    recipe_.checkpointed_inputs_type("plan");
  }

  void count_parameters() {
    auto& counts = plan_.parameters;
    int64_t layer_values = 0, layer_shards = 0, layer_trained_shards = 0, layer_matrix_shards = 0, layer_trained = 0,
            layer_adapters = 0, layer_matrix_weights = 0;
    for (const auto& block : shape_.layer) {
      layer_values += block.values();
      layer_shards += block.shard_values(gpus_);
      layer_trained_shards += block.trained_shard_values(gpus_);
      layer_matrix_shards += block.matrix_shard_values(gpus_);
      layer_trained += block.trained_values();
      layer_adapters += block.adapter_values();
      layer_matrix_weights += block.matrix_weights;
    }
    for (const auto& parameter : shape_.outside) counts.outside_resblocks += numel(parameter);
    for (const auto& parameter : shape_.outside_trained) outside_trained_ += numel(parameter);
    counts.in_resblocks = layers_ * layer_values;
    counts.matrix_weights = layers_ * layer_matrix_weights + shape_.outside_matrix_weights;
    counts.adapters = layers_ * layer_adapters + shape_.outside_adapters;
    counts.total = counts.in_resblocks + counts.outside_resblocks + counts.adapters;
    counts.trained = shape_.frozen ? layers_ * layer_trained + outside_trained_ : counts.total;
    for (const auto& end : shape_.ends) {
      end_shard_values_ += end.shard_values(gpus_);
      end_trained_shard_values_ += end.trained_shard_values(gpus_);
    }
    shard_values_ = layers_ * layer_shards + end_shard_values_;
    trained_shard_values_ = layers_ * layer_trained_shards + end_trained_shard_values_;
    matrix_shard_values_ = layers_ * layer_matrix_shards;
    // Sharded, a rank holds its shards of the blocks, embeddings and head, and the adapters whole.
    replicated_trained_ = layers_ * layer_adapters + shape_.outside_adapters;
    counts.per_rank = plan_.sharded ? shard_values_ + counts.adapters : counts.total;
    trained_per_rank_ = plan_.sharded ? trained_shard_values_ + replicated_trained_ : counts.trained;
  }

  void add_memory(std::string name, MemoryPhase phase, double bytes, std::string rule) {
    plan_.memory.push_back({std::move(name), phase, bytes, std::move(rule)});
  }

  bool sixteen_bit_matrices() const { return matrix_bytes_ < kFp32; }

  // What each rank keeps from one update to the next.
  void state_memory() {
    const double held = static_cast<double>(plan_.parameters.per_rank);
    const std::string what =
        plan_.sharded ? share_of_blocks() + ", the embeddings and the head (padded)" : "the whole model";
    const bool frozen = shape_.frozen;
    // frozen_weights: the frozen block matrices in 16 bits, in the model and in the validation
    // model that shares them, or in a sharded run's shards of them.
    double sixteen_bit = 0, sixteen_bit_held = 0;
    if (recipe_.frozen_weights != "float32") {
      for (const auto& block : shape_.layer) {
        sixteen_bit += static_cast<double>(layers_ * block.frozen_matrix_values());
        sixteen_bit_held += static_cast<double>(layers_ * block.frozen_matrix_shard_values(gpus_));
      }
    }
    const double saved = (kFp32 - frozen_matrix_bytes()) * (plan_.sharded ? sixteen_bit_held : sixteen_bit);
    // precision.weights, sharded: the trained matrices' shards and their gradients in 16 bits.
    const double halved = (kFp32 - matrix_bytes_) * static_cast<double>(matrix_shard_values_);
    const std::string frozen_stored = "frozen resblock matrices in " + recipe_.frozen_weights;
    const std::string stored =
        !sixteen_bit_matrices() ? (saved > 0 ? "fp32 but the " + frozen_stored + ", " : "fp32, ")
        : !frozen               ? plan_.weights + " resblock matrices, fp32 rest, "
        : saved > 0             ? plan_.weights + " trained resblock matrices, " + frozen_stored + ", fp32 rest, "
                                : plan_.weights + " trained resblock matrices, fp32 frozen ones and the rest, ";
    add_memory("weights", MemoryPhase::kept, kFp32 * held - saved - halved,
               stored + what + (frozen ? ", frozen and trained" : ""));
    const double trained = static_cast<double>(trained_per_rank_);
    const std::string trains =
        frozen ? "what trains (" + with_thousands(plan_.parameters.trained) + " values" +
                     (plan_.sharded ? ", the blocks' part sharded, adapters whole)" : ")")
               : what;
    // Compressing across machines, the rows PowerSGD compresses have no gradient of their own:
    // they accumulate in its error feedback (ShardedReducer), the rank with the fewest such rows counted.
    const bool in_errors = plan_.sharded && reduces_low_rank();
    const double in_error_feedback = in_errors ? matrix_bytes_ * fewest_compressed_values_ : 0.0;
    add_memory("gradients", MemoryPhase::kept, kFp32 * trained - halved - in_error_feedback,
               stored + trains + (in_errors ? "; the rows PowerSGD compresses accumulate in its error feedback" : ""));
    const double moment = static_cast<double>(c10::elementSize(recipe_.precision.moments_dtype()));
    add_memory("AdamW moments", MemoryPhase::kept, 2 * moment * trained,
               "two, " + recipe_.precision.adam_moments + ", " + trains);
    average_memory(trains);
    validation_memory(sixteen_bit);
    if (recipe_.precision.precision() == Precision::fp16) {
      add_memory("fp16 gradient scales", MemoryPhase::kept, 16.0 * static_cast<double>(resblocks_),
                 "a scale and its last backoff per resblock (host memory, counted anyway)");
    }
  }

  // What a rank holds of the blocks, sharded.
  std::string share_of_blocks() const {
    return gpus_ == 1 ? "shards of one: every resblock" : "1/" + std::to_string(gpus_) + " of every resblock";
  }

  // The fp32 moving average of what trains. The trainer keeps the average of 16-bit matrix
  // shards in host memory (on the GPU, it would take back what their 16 bits save); the rest
  // of the shards' and the replicated parameters' stay on the GPU.
  void average_memory(const std::string& trains) {
    const double trained = kFp32 * static_cast<double>(trained_per_rank_);
    if (!sixteen_bit_matrices()) {
      add_memory("moving average", MemoryPhase::kept, trained, "fp32, " + trains);
      return;
    }
    const double matrices = kFp32 * static_cast<double>(matrix_shard_values_);
    add_memory("moving average", MemoryPhase::kept, trained - matrices,
               "fp32, " + trains + ", but the matrices' shards (in host memory)");
    add_memory("moving average (host)", MemoryPhase::host, matrices,
               "fp32, " + share_of_blocks() + "'s matrices (padded): not on the GPU");
  }

  // The model validation and sample grids run with the moving average in. Sharded, there is
  // none: they run on the sharded model, the average gathered block by block into the
  // gathered block that backward holds (counted there).
  void validation_memory(double sixteen_bit) {
    if (plan_.sharded) {
      add_memory("validation model", MemoryPhase::kept, 0,
                 "none: validation gathers the average block by block, as training gathers the weights");
      return;
    }
    // Frozen weights are shared with the model.
    add_memory("validation model", MemoryPhase::kept,
               shape_.frozen ? kFp32 * static_cast<double>(plan_.parameters.trained)
                             : kFp32 * static_cast<double>(plan_.parameters.total) - 2 * sixteen_bit,
               shape_.frozen ? "fp32, what trains: the frozen weights are the model's own"
                             : std::string("fp32, whole on every rank: the moving average copied in for validation and "
                                           "sample grids") +
                                   (sixteen_bit > 0 ? "; its frozen resblock matrices in " + recipe_.frozen_weights
                                                    : ""));
  }

  bool checkpointed(int64_t block) const {
    if (plan_.sharded) return true;
    const int64_t every = recipe_.checkpoint_activations_every;
    return every > 0 && block % every == 0;
  }

  // What the forward and backward passes hold besides the state.
  void working_memory() {
    const double tokens = static_cast<double>(plan_.tokens_per_rank), width = static_cast<double>(recipe_.model.width);
    const bool sixteen_bits = recipe_.precision.precision() != Precision::fp32;
    const double activation = sixteen_bits ? 2 : 4;
    double internals = 0, recomputed = 0, copied_weights = 0, recomputed_weights = 0;
    int64_t checkpointed_blocks = 0;
    for (int64_t b = 0; b < resblocks_; ++b) {
      const auto& block = shape_.layer[b % 2];
      const double values = (block.attention ? kAttentionInternals : kMlpInternals) * tokens * width;
      if (checkpointed(b)) {
        ++checkpointed_blocks;
        recomputed = std::max(recomputed, values);
        recomputed_weights = std::max(recomputed_weights, cast_values(block));
      } else {
        internals += values;
        copied_weights += cast_values(block);
      }
    }
    plan_.checkpointing = plan_.sharded ? "every resblock (sharding recomputes each block)"
                          : checkpointed_blocks == 0
                              ? "none"
                              : std::to_string(checkpointed_blocks) + " of " + std::to_string(resblocks_) +
                                    " resblocks (checkpoint_activations_every " +
                                    std::to_string(recipe_.checkpoint_activations_every) + ")";
    // A checkpointed block keeps its input in checkpointed_inputs' type; the others in fp32.
    const double kept = static_cast<double>(c10::elementSize(recipe_.checkpointed_inputs_type("plan")));
    const double inputs =
        tokens * width * (static_cast<double>(checkpointed_blocks) * kept +
                          static_cast<double>(resblocks_ - checkpointed_blocks) * kFp32);
    add_memory("activations", MemoryPhase::backward, inputs + (internals + recomputed) * activation,
               "estimate: every resblock's input (" +
                   (kept == kFp32 ? std::string("fp32") : "the checkpointed ones' in " + recipe_.checkpointed_inputs) +
                   "), the internals of those not checkpointed, one recomputed");
    const double classes = static_cast<double>(recipe_.model.text_classes() + recipe_.model.image_vocab_size);
    // Sharded, backward holds the logits and the gathered head first, then one gathered block
    // at a time: two moments, the larger counts.
    const auto at_head = plan_.sharded ? MemoryPhase::backward_head : MemoryPhase::backward;
    const auto at_blocks = plan_.sharded ? MemoryPhase::backward_blocks : MemoryPhase::backward;
    add_memory("logits", at_head, tokens * classes * kLogitBytes,
               "fp32 values, log-softmax and gradient per token and class");
    if (sixteen_bits) {
      add_memory("16-bit weight copies", at_blocks, 2 * (copied_weights + recomputed_weights),
                 std::string("autocast's casts of the blocks whose activations are kept, and of one recomputed") +
                     (matrices_stored_as_cast() ? " (not of the matrices, " + plan_.weights + " already)" : ""));
    }
    if (plan_.sharded) gathered_memory();
  }

  // Whether the trained matrices are stored in the dtype autocast computes in
  // (precision.weights as precision.mode): autocast then uses them as they are, with no copy.
  bool matrices_stored_as_cast() const {
    return sixteen_bit_matrices() && recipe_.precision.weights_dtype() == recipe_.precision.autocast_dtype();
  }

  // The values of a block autocast casts to 16 bits.
  double cast_values(const BlockShape& block) const {
    return static_cast<double>(block.values() - (matrices_stored_as_cast() ? block.matrix_values() : 0));
  }

  // A block all-gathered, whole, as the forward and backward hold it: its trained matrices
  // in precision.weights, its frozen ones in frozen_weights, the rest (and its whole adapters)
  // fp32 ...
  double gathered_bytes(const BlockShape& block) const {
    const auto matrices = static_cast<double>(block.matrix_values());
    const auto frozen = static_cast<double>(block.frozen_matrix_values());
    return matrix_bytes_ * matrices + frozen_matrix_bytes() * frozen +
           kFp32 * (static_cast<double>(block.values() + block.adapter_values()) - matrices - frozen);
  }
  // ... and as the all-gather's output, each group padded to the ranks.
  double gathered_padded_bytes(const BlockShape& block) const {
    const auto matrices = static_cast<double>(gpus_ * block.matrix_shard_values(gpus_));
    const auto frozen = static_cast<double>(gpus_ * block.frozen_matrix_shard_values(gpus_));
    return matrix_bytes_ * matrices + frozen_matrix_bytes() * frozen +
           kFp32 * (static_cast<double>(gpus_ * block.shard_values(gpus_)) - matrices - frozen);
  }
  // The bytes per value of the blocks' frozen matrices (frozen_weights).
  double frozen_matrix_bytes() const { return recipe_.frozen_weights == "float32" ? kFp32 : 2.0; }

  // The embeddings or the head gathered (float32 in every group), as the all-gather's output.
  double gathered_end_bytes(const BlockShape& end) const {
    return kFp32 * static_cast<double>(gpus_ * end.shard_values(gpus_));
  }

  // What a unit's backward holds beyond its values and gradients (`values` each, made whole):
  // its gradients flattened in fp32 for their reduce-scatter, the values freed by then (what
  // 16-bit gradients grow), and the gather of the unit backward reaches next (`next`). That
  // gather (distributed.backward_prefetch) is held before the gradients beside their making
  // and flattening, all of it; after them only beside the flattened gradients still in flight
  // with overlap, what that moment holds beyond the others (without overlap, nothing).
  struct UnitBackward {
    double flattened_beyond = 0, prefetched_before = 0, prefetched_after = 0;
  };
  UnitBackward unit_backward(double values, double flattened, double next) const {
    const double making = 2 * values, flattening = values + std::max(flattened, values);
    return {.flattened_beyond = std::max(0.0, flattened - values),
            .prefetched_before = next,
            .prefetched_after = overlap_ ? std::max(0.0, flattened + next - std::max(making, flattening)) : 0.0};
  }
  double prefetched(const UnitBackward& unit) const {
    return prefetch_before_gradients_ ? unit.prefetched_before : unit.prefetched_after;
  }

  void gathered_memory() {
    const auto& embeddings = shape_.ends[0];
    const auto& head = shape_.ends[1];
    double gathered = 0, prefetched_block = 0, flattened = 0;
    for (const auto& block : shape_.layer) {
      gathered = std::max(gathered, gathered_bytes(block));
      prefetched_block = std::max(prefetched_block, gathered_padded_bytes(block));
      flattened = std::max(flattened, kFp32 * static_cast<double>(gpus_ * block.trained_shard_values(gpus_)));
    }
    const double block_flattened = flattened;
    // The first block prefetches the embeddings; the head's reduce-scatter may still run while
    // the last block recomputes.
    const double head_flattened = kFp32 * static_cast<double>(gpus_ * head.trained_shard_values(gpus_));
    flattened = std::max(flattened, head_flattened);
    const auto block = unit_backward(gathered, flattened, std::max(prefetched_block, gathered_end_bytes(embeddings)));
    blocks_saved_after_gradients_ = block.prefetched_before - block.prefetched_after;
    const std::string stored = sixteen_bit_matrices() ? plan_.weights + " matrices, fp32 rest" : "fp32";
    add_memory("gathered resblock", MemoryPhase::backward_blocks, 2 * gathered,
               (sixteen_bit_matrices() ? stored + ": values" : "fp32 values") +
                   " and gradients of the largest block, whole");
    add_rows(MemoryPhase::backward_blocks, block, "flattened gradients", "prefetched resblock", stored,
             "the next block's");
    const auto head_values = kFp32 * static_cast<double>(head.values() + head.adapter_values());
    add_memory("gathered head", MemoryPhase::backward_head, 2 * head_values,
               "fp32 values and gradients of the head, whole, as backward starts");
    const auto head_unit = unit_backward(head_values, head_flattened, prefetched_block);
    head_saved_after_gradients_ = head_unit.prefetched_before - head_unit.prefetched_after;
    add_rows(MemoryPhase::backward_head, head_unit, "head's reduce-scatter", "last resblock prefetched", stored,
             "the last block's");
    if (embeddings.trained_values() == 0) return;
    const auto embeddings_values = kFp32 * static_cast<double>(embeddings.values() + embeddings.adapter_values());
    add_memory("gathered embeddings", MemoryPhase::backward_embeddings, 2 * embeddings_values,
               "fp32 values and gradients of the embeddings, whole, as backward ends (the blocks' inputs freed)");
    const double embeddings_flattened = kFp32 * static_cast<double>(gpus_ * embeddings.trained_shard_values(gpus_));
    add_rows(MemoryPhase::backward_embeddings, unit_backward(embeddings_values, embeddings_flattened, 0),
             "embeddings' reduce-scatter", "", stored, "");
    // With overlap the first block's reduce-scatter runs on while the embeddings recompute.
    if (const double beside = block_flattened - std::max(embeddings_values, embeddings_flattened);
        overlap_ && beside > 0) {
      add_memory("first block's reduce-scatter", MemoryPhase::backward_embeddings, beside,
                 "fp32, the first block's gradients flattened, in flight while the embeddings recompute: what that "
                 "holds beyond their values and gradients");
    }
  }

  // A unit's rows beyond its values and gradients (unit_backward).
  void add_rows(MemoryPhase phase, const UnitBackward& unit, const std::string& flattened_name,
                const std::string& prefetched_name, const std::string& stored, const std::string& next) {
    if (unit.flattened_beyond > 0) {
      add_memory(flattened_name, phase, unit.flattened_beyond,
                 "fp32, the gradients flattened for their reduce-scatter, the values freed: what they hold beyond "
                 "them");
    }
    if (const double held = prefetched(unit); !prefetched_name.empty() && held > 0) {
      add_memory(prefetched_name, phase, held,
                 stored + ", " + next +
                     (prefetch_before_gradients_ ? " all-gather, in flight while the gradients are made"
                                                 : " all-gather, started once the gradients are handed to their "
                                                   "reduce-scatter: what it holds beyond them"));
    }
  }

  bool reduces_low_rank() const {
    return powersgd_ && (plan_.sharded ? cluster_.nodes > 1 : cluster_.ranks() > 1);
  }

  // PowerSGD's buffers; the per-rank cost of the hierarchy differs by local rank (which
  // rows a shard holds): memory takes the largest, traffic the mean.
  void low_rank_costs() {
    if (!reduces_low_rank()) return;
    const auto options = *powersgd_options(recipe_.distributed, recipe_.run);
    if (!plan_.sharded) {
      low_rank_ = largest_low_rank_ = flat_low_rank(shape_, layers_, options);
      return;
    }
    fewest_compressed_values_ = std::numeric_limits<double>::infinity();
    for (int64_t rank = 0; rank < gpus_; ++rank) {
      const auto cost = shard_low_rank(shape_, layers_, rank, gpus_, options);
      low_rank_ += cost.times(1.0 / static_cast<double>(gpus_));
      largest_low_rank_.largest_values = std::max(largest_low_rank_.largest_values, cost.largest_values);
      fewest_compressed_values_ = std::min(fewest_compressed_values_, cost.compressed_values);
      if (cost.pq_values + cost.compressed_values > largest_low_rank_.pq_values + largest_low_rank_.compressed_values) {
        const double largest_matrix = largest_low_rank_.largest_values;
        largest_low_rank_ = cost;
        largest_low_rank_.largest_values = std::max(largest_matrix, cost.largest_values);
      }
    }
  }

  void powersgd_memory() {
    if (!reduces_low_rank()) return;
    const auto options = *powersgd_options(recipe_.distributed, recipe_.run);
    const double bytes = dtype_bytes(recipe_.distributed.powersgd.dtype);
    const auto& dtype = recipe_.distributed.powersgd.dtype;
    const auto& largest = largest_low_rank_;
    const double error_values = plan_.sharded ? static_cast<double>(trained_shard_values_ - end_trained_shard_values_)
                                              : largest.compressed_values;
    add_memory("PowerSGD error feedback", MemoryPhase::kept, bytes * error_values,
               dtype + (plan_.sharded ? ", the size of the resblocks' shards; the compressed rows' gradients "
                                        "accumulate in it (the embeddings and head cross whole)"
                                      : ", the size of the compressed gradients"));
    const bool fixed_q = distributed::q_dtype(options) != torch::kFloat32;
    add_memory("PowerSGD Q", MemoryPhase::kept, (fixed_q ? bytes : kFp32) * largest.q_values,
               (fixed_q ? dtype + " (fixed Q)" : std::string("fp32")) + ", columns x rank per matrix");
    if (plan_.sharded) {
      // Kept from the reduction until the optimizer takes each group's gradient (P Q^T).
      const double p_values = largest.pq_values - largest.q_values;
      add_memory("PowerSGD P and Q of an update", MemoryPhase::reduction,
                 kFp32 * p_values + 2 * bytes * largest.q_values,
                 "P in fp32 (orthonormal), Q in " + dtype + " and its flat copy for the all-reduce, kept until the "
                 "optimizer takes the gradients");
      double group = 0;
      for (const auto& block : shape_.layer) {
        group = std::max(group, static_cast<double>(block.matrix_shard_values(gpus_)));
      }
      add_memory("PowerSGD fp32 working copies", MemoryPhase::reduction,
                 kFp32 * (2 * largest.largest_values + group),
                 "the largest buffer block read back in fp32 and its decompressed product, and the gradient of one "
                 "group as the optimizer takes it: one at a time");
      return;
    }
    add_memory("PowerSGD P and Q of an update", MemoryPhase::reduction, 2 * bytes * largest.pq_values,
               dtype + ", each and its flat copy for the all-reduce");
    // In 16 bits, LowRankAverager::average reads each buffer back in fp32 where it uses it,
    // one matrix at a time; the last step holds it beside its decompressed product.
    if (dtype != "float32") {
      add_memory("PowerSGD fp32 working copies", MemoryPhase::reduction, 2 * kFp32 * largest.largest_values,
                 "the largest 16-bit buffer read back in fp32, and its decompressed product: one matrix at a time");
    }
  }

  // Sharded, backward holds what all of it holds and the larger of its head's and its blocks'
  // moments, or, as it ends, the embeddings' moment alone.
  void decide_fit() {
    double at_head = 0, at_blocks = 0, at_embeddings = 0;
    for (const auto& part : plan_.memory) {
      bytes_of_phase(part.phase, at_head, at_blocks, at_embeddings) += part.bytes;
    }
    // Backward's peak, given its head's and blocks' moments: what all of it holds and the larger
    // of those, or the embeddings' moment alone.
    const double held_throughout = plan_.backward_bytes;
    const auto backward_with = [&](double head, double blocks) {
      return std::max(held_throughout + std::max(head, blocks), at_embeddings);
    };
    // The same with backward_prefetch after_gradients, for the note: only the head's and the
    // blocks' moments change.
    if (prefetch_before_gradients_) {
      const double after =
          backward_with(at_head - head_saved_after_gradients_, at_blocks - blocks_saved_after_gradients_);
      peak_after_gradients_ = plan_.kept_bytes + std::max(after, plan_.reduction_bytes);
    }
    plan_.backward_bytes = backward_with(at_head, at_blocks);
    auto busiest = at_head >= at_blocks ? MemoryPhase::backward_head : MemoryPhase::backward_blocks;
    if (at_embeddings > held_throughout + std::max(at_head, at_blocks)) busiest = MemoryPhase::backward_embeddings;
    const auto peak_phase =
        plan_.backward_bytes >= plan_.reduction_bytes ? MemoryPhase::backward : MemoryPhase::reduction;
    plan_.peak_bytes = plan_.kept_bytes + std::max(plan_.backward_bytes, plan_.reduction_bytes);
    plan_.capacity_bytes = cluster_.gpu_memory_gib * kGiB;
    plan_.fits = plan_.peak_bytes <= plan_.capacity_bytes;
    const auto held_at_peak = [&](MemoryPhase phase) {
      if (phase == MemoryPhase::kept) return true;
      if (peak_phase == MemoryPhase::reduction) return phase == MemoryPhase::reduction;
      return phase == busiest || (phase == MemoryPhase::backward && busiest != MemoryPhase::backward_embeddings);
    };
    std::vector<const MemoryPart*> at_peak;
    for (const auto& part : plan_.memory) {
      if (held_at_peak(part.phase)) at_peak.push_back(&part);
    }
    std::stable_sort(at_peak.begin(), at_peak.end(), [](auto* a, auto* b) { return a->bytes > b->bytes; });
    double left = plan_.peak_bytes;
    for (const auto* part : at_peak) {
      if (left <= plan_.capacity_bytes) break;
      plan_.too_large.push_back(part->name);
      left -= part->bytes;
    }
    startup_memory();
  }

  // A sharded run builds the prior one block at a time, each drawn (or read from init_from),
  // frozen where the recipe freezes it and cut into its shards before the next, then its
  // embeddings and head; it has no validation copy. An unsharded run builds the whole model
  // in fp32, then the validation copy (of what trains, when the frozen weights are shared),
  // and what is kept holds both anyway.
  void startup_memory() {
    const auto& counts = plan_.parameters;
    plan_.built_sharded = plan_.sharded;
    if (plan_.built_sharded) {
      // The embeddings and head are built whole and cut once the blocks are: beside the
      // shards, they and one block drawn and flattened, or their own largest group flattened.
      double block = 0, ends = 0, largest_end_group = 0;
      for (const auto& layer_block : shape_.layer) block = std::max(block, static_cast<double>(layer_block.values()));
      for (const auto& end : shape_.ends) {
        ends += static_cast<double>(end.values());
        for (const auto& group : end.groups) {
          largest_end_group = std::max(largest_end_group, static_cast<double>(BlockShape::values_of(group)));
        }
      }
      plan_.startup_bytes = part_bytes("weights") + kFp32 * (ends + std::max(2 * block, largest_end_group));
    } else {
      const double validation_copy = static_cast<double>(shape_.frozen ? counts.trained : counts.total);
      plan_.startup_bytes = kFp32 * (static_cast<double>(counts.total) + validation_copy);
    }
    plan_.fits_at_startup = !plan_.sharded || plan_.startup_bytes <= plan_.capacity_bytes;
  }

  double part_bytes(const std::string& name) const {
    for (const auto& part : plan_.memory) {
      if (part.name == name) return part.bytes;
    }
    throw Error("plan: no memory part named " + name);
  }

  // Where a phase's parts are summed: the backward's moments apart.
  double& bytes_of_phase(MemoryPhase phase, double& at_head, double& at_blocks, double& at_embeddings) {
    switch (phase) {
      case MemoryPhase::kept: return plan_.kept_bytes;
      case MemoryPhase::backward: return plan_.backward_bytes;
      case MemoryPhase::backward_head: return at_head;
      case MemoryPhase::backward_blocks: return at_blocks;
      case MemoryPhase::backward_embeddings: return at_embeddings;
      case MemoryPhase::reduction: return plan_.reduction_bytes;
      case MemoryPhase::host: return plan_.host_bytes;
    }
    return plan_.host_bytes;
  }

  void add_traffic(std::string name, std::string collective, CollectiveScope scope, int64_t ranks, double payload,
                   std::string counted_by, bool hidden = false) {
    TrafficPart part{std::move(name), std::move(collective), scope, ranks, payload, std::move(counted_by), 0, hidden};
    part.seconds = wire_seconds(part, cluster_);
    plan_.traffic.push_back(std::move(part));
  }

  void traffic() {
    if (cluster_.ranks() == 1) return;
    plan_.sharded ? sharded_traffic() : data_parallel_traffic();
    for (const auto& part : plan_.traffic) {
      (part.scope == CollectiveScope::within ? plan_.bytes_within : plan_.bytes_across) += part.payload_bytes;
    }
  }

  void data_parallel_traffic() {
    const auto scope = cluster_.nodes > 1 ? CollectiveScope::spanning : CollectiveScope::within;
    const int64_t ranks = cluster_.ranks();
    const double whole = kFp32 * static_cast<double>(plan_.parameters.trained);
    if (cluster_.nodes > 1) plan_.bytes_across_uncompressed = whole;
    if (!powersgd_) {
      add_traffic("gradients", "all-reduce", scope, ranks, whole, "DataParallelReducer::bytes_reduced", overlap_);
      return;
    }
    const double bytes = dtype_bytes(recipe_.distributed.powersgd.dtype);
    add_traffic("gradients' P and Q", "all-reduce", scope, ranks, bytes * low_rank_.pq_values,
                "PowerSgdReducer::bytes_reduced (LowRankAverager)");
    add_traffic("gradients not compressed", "all-reduce", scope, ranks, kFp32 * low_rank_.whole_values,
                "PowerSgdReducer::bytes_reduced (DataParallelReducer)", overlap_);
  }

  // The all-gathers send each group at its storage's size; the gradients are reduce-scattered
  // in fp32, whatever the matrices' storage.
  void sharded_traffic() {
    double blocks = 0;
    for (const auto& block : shape_.layer) blocks += static_cast<double>(layers_) * gathered_padded_bytes(block);
    const auto& embeddings = shape_.ends[0];
    const auto& head = shape_.ends[1];
    // Backward gathers the head again, and the embeddings only when they train.
    const double forward = blocks + gathered_end_bytes(embeddings) + gathered_end_bytes(head);
    const double backward =
        blocks + gathered_end_bytes(head) + (embeddings.trained_values() > 0 ? gathered_end_bytes(embeddings) : 0);
    const double trained_units = kFp32 * static_cast<double>(gpus_ * trained_shard_values_);
    const auto within = CollectiveScope::within, across = CollectiveScope::across;
    const char* moved = "ShardedParameters::bytes_moved";
    add_traffic("the prior gathered for forward", "all-gather", within, gpus_, forward, moved, true);
    // Prefetched after a block's gradients, backward's gathers wait with nothing to hide them.
    add_traffic(kBackwardGathers, "all-gather", within, gpus_, backward, moved, prefetch_before_gradients_);
    if (trained_units > 0) {
      add_traffic("gradients reduce-scattered", "reduce-scatter", within, gpus_, trained_units, moved, overlap_);
    }
    const int64_t outside = replicated_trained_;
    if (outside == 0) {
      sharded_across_machines(0.0);
      return;
    }
    if (cluster_.nodes == 1) {
      add_traffic("replicated gradients (adapters)", "all-reduce", within, gpus_, kFp32 * static_cast<double>(outside),
                  "ShardedReducer::bytes_reduced (DataParallelReducer)", overlap_);
      return;
    }
    const double part = kFp32 * static_cast<double>(io::shard_size(outside, gpus_));
    const double part_whole = part * static_cast<double>(gpus_);
    const int64_t machines = cluster_.nodes;
    add_traffic("replicated gradients reduce-scattered in the machine", "reduce-scatter", within, gpus_, part_whole,
                "");
    add_traffic("replicated gradients' part across machines", "all-reduce", across, machines, part,
                "ShardedReducer::bytes_across_nodes");
    add_traffic("replicated gradients all-gathered in the machine", "all-gather", within, gpus_, part_whole, "");
    sharded_across_machines(part);
  }

  // The shards' gradients averaged with their replicas on the other machines; `replicated`:
  // the replicated gradients' part a rank sends across.
  void sharded_across_machines(double replicated) {
    if (cluster_.nodes == 1) return;
    const auto across = CollectiveScope::across;
    const int64_t machines = cluster_.nodes;
    const double shards = kFp32 * static_cast<double>(trained_shard_values_);
    plan_.bytes_across_uncompressed = replicated + shards;
    if (!powersgd_) {
      add_traffic("shards across machines", "all-reduce", across, machines, shards,
                  "ShardedReducer::bytes_across_nodes (DataParallelReducer)");
      return;
    }
    const double bytes = dtype_bytes(recipe_.distributed.powersgd.dtype);
    add_traffic("shards' P and Q across machines", "all-reduce", across, machines, bytes * low_rank_.pq_values,
                "ShardedReducer::bytes_across_nodes (LowRankAverager)");
    add_traffic("shards' rest and the ends across machines, whole", "all-reduce", across, machines,
                kFp32 * low_rank_.whole_values, "ShardedReducer::bytes_across_nodes");
  }

  // The communication compute does not hide; `gathers_hidden`: whether backward's gathers
  // may be (backward_prefetch before_gradients).
  double exposed_seconds(bool gathers_hidden) const {
    double hidden = 0, exposed = 0;
    for (const auto& part : plan_.traffic) {
      ((part.name == kBackwardGathers ? gathers_hidden : part.hidden) ? hidden : exposed) += part.seconds;
    }
    return exposed + std::max(0.0, hidden - plan_.compute_seconds);
  }

  void step_time() {
    plan_.flops_per_token = models::prior_flops_per_token(static_cast<double>(plan_.parameters.matrix_weights),
                                                          recipe_.model);
    const double sequence = static_cast<double>(recipe_.model.length());
    plan_.flops_per_update = plan_.flops_per_token * static_cast<double>(plan_.global_batch) * sequence;
    plan_.compute_seconds = plan_.flops_per_token * static_cast<double>(plan_.tokens_per_rank) /
                            (cluster_.peak_tflops * 1e12 * cluster_.mfu);
    plan_.exposed_communication_seconds = exposed_seconds(prefetch_before_gradients_);
    plan_.step_seconds = plan_.compute_seconds + plan_.exposed_communication_seconds;
    plan_.tokens_per_second = static_cast<double>(plan_.global_batch) * sequence / plan_.step_seconds;
  }

  void add_notes() {
    auto& notes = plan_.notes;
    if (plan_.sharded && gpus_ == 1) {
      notes.push_back("distributed.sharding within_node on one GPU per machine divides nothing: the model is kept "
                      "as shards of one, gathered a block at a time, for what that layout holds less of (16-bit "
                      "precision.weights, no validation copy)");
    }
    if (!plan_.fits_at_startup) {
      char text[200];
      std::snprintf(text, sizeof text,
                    "at start each rank places the whole model on its GPU in fp32 before sharding (it is loaded "
                    "from init_from or frozen in part): %.1f GiB, more than the GPU holds",
                    plan_.startup_bytes / kGiB);
      notes.push_back(text);
    }
    if (prefetch_before_gradients_ && plan_.sharded && plan_.peak_bytes - peak_after_gradients_ >= 0.005 * kGiB) {
      char text[240];
      std::snprintf(text, sizeof text,
                    "distributed.backward_prefetch after_gradients would peak at %.2f GiB (%.2f less) and step in "
                    "%.3f s (%.3f s now): backward's gathers then not hidden",
                    peak_after_gradients_ / kGiB, (plan_.peak_bytes - peak_after_gradients_) / kGiB,
                    plan_.compute_seconds + exposed_seconds(false), plan_.step_seconds);
      notes.push_back(text);
    }
    if (!powersgd_) return;
    if (plan_.sharded) {
      notes.push_back("distributed.powersgd.rank is each shard's rank: DALL-E's 896 over 8 GPUs per machine is 112");
      if (cluster_.nodes == 1) notes.push_back("on one machine nothing crosses machines and nothing is compressed");
    } else {
      notes.push_back("flat PowerSGD compresses every matrix, embeddings and output layer included");
    }
    if (reduces_low_rank() && recipe_.distributed.powersgd.start_update > 1) {
      notes.push_back("before update " + std::to_string(recipe_.distributed.powersgd.start_update) +
                      " (powersgd.start_update) every gradient goes whole, as bytes_across_uncompressed");
    }
  }

  const PriorTrainConfig& recipe_;
  ClusterShape cluster_;
  ModelShape shape_;
  CapacityPlan plan_;
  int64_t layers_ = 0, resblocks_ = 0, gpus_ = 1;
  int64_t shard_values_ = 0;  // of every sharded group (resblocks, ends) on one rank, padding included
  int64_t trained_shard_values_ = 0;  // of the trained groups only
  int64_t end_shard_values_ = 0, end_trained_shard_values_ = 0;  // of the embeddings' and head's (in the above)
  LowRankCost largest_low_rank_;      // PowerSGD's state of the rank that holds the most
  double fewest_compressed_values_ = 0;  // the compressed rows of the rank that holds the fewest
  int64_t matrix_shard_values_ = 0;   // of the trained matrices' groups (precision.weights' storage)
  int64_t outside_trained_ = 0;       // values that train outside the blocks, adapters included
  int64_t replicated_trained_ = 0;    // values that train whole on every rank (all, or sharded the adapters)
  int64_t trained_per_rank_ = 0;      // the gradients, moments and average a rank keeps
  double matrix_bytes_ = kFp32;  // per value of the sharded trained matrices and their gradients
  bool powersgd_ = false;
  bool overlap_ = true;  // distributed.overlap: buckets and reduce-scatters start during backward
  bool prefetch_before_gradients_ = true;  // distributed.backward_prefetch
  // What the blocks' and the head's backward would hold less with backward_prefetch after_gradients, and
  // the peak it would make.
  double blocks_saved_after_gradients_ = 0, head_saved_after_gradients_ = 0, peak_after_gradients_ = 0;
  LowRankCost low_rank_;  // per rank, the mean over local ranks when sharded
};

void require(bool holds, const std::string& what) {
  if (!holds) throw Error("the cluster: " + what);
}

}  // namespace

void ClusterShape::validate() const {
  require(nodes >= 1, "nodes must be at least 1, not " + std::to_string(nodes));
  require(gpus_per_node >= 1, "gpus per node must be at least 1, not " + std::to_string(gpus_per_node));
  require(gpu_memory_gib > 0, "GPU memory must be more than 0 GiB");
  require(peak_tflops > 0, "peak TFLOP/s must be more than 0");
  require(mfu > 0 && mfu <= 1, "the MFU must be in (0, 1], not " + std::to_string(mfu));
  require(link_within_gbps > 0, "the link within a machine must be faster than 0 Gbit/s");
  require(link_across_gbps > 0, "the link across machines must be faster than 0 Gbit/s");
}

CapacityPlan plan_capacity(const PriorTrainConfig& recipe, const ClusterShape& cluster) {
  cluster.validate();
  recipe.model.validate();
  return Planner(recipe, cluster).run();
}

}  // namespace dalle::train
