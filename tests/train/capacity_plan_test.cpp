#include "dalle/train/capacity_plan.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "dalle/distributed/data_parallel.h"
#include "dalle/distributed/sharded_parameters.h"
#include "dalle/distributed/sharded_reducer.h"
#include "dalle/models/adapter.h"
#include "dalle/models/prior_flops.h"
#include "dalle/train/precision.h"
#include "dalle/train/sharded_prior.h"
#include "dalle/train/trainable.h"
#include "distributed/on_ranks.h"
#include "test_support.h"

namespace dalle::train {
namespace {

using distributed::LaunchEnvironment;

models::PriorConfig tiny_model() {
  return {.text_length = 6, .text_vocab_size = 20, .grid_size = 5, .image_vocab_size = 12, .layers = 5, .width = 32,
          .heads = 4, .conv_kernel = 3};
}

PriorTrainConfig recipe_of(models::PriorConfig model, int64_t batch) {
  PriorTrainConfig recipe;
  recipe.model = std::move(model);
  recipe.data.batch_size = batch;
  return recipe;
}

// DALL-E's 12B recipe as shipped, with the overrides dalle-plan's --set would give.
PriorTrainConfig twelve_billion(const std::vector<std::string>& overrides) {
  auto source = ConfigSource::from_file(std::string(DALLE_SOURCE_DIR) + "/configs/prior/dalle-12b.yaml");
  source.set_all(overrides);
  return load_config<PriorTrainConfig>(source);
}

const MemoryPart& part_named(const CapacityPlan& plan, const std::string& name) {
  for (const auto& part : plan.memory) {
    if (part.name == name) return part;
  }
  throw Error("no memory part " + name);
}

double payload_counted_by(const CapacityPlan& plan, const std::string& counter) {
  double bytes = 0;
  for (const auto& part : plan.traffic) {
    if (part.counted_by.starts_with(counter)) bytes += part.payload_bytes;
  }
  return bytes;
}

// What plan_capacity says when it refuses `recipe` on `cluster` ("no error" if it plans).
std::string refusal_of(const PriorTrainConfig& recipe, const ClusterShape& cluster) {
  try {
    plan_capacity(recipe, cluster);
  } catch (const Error& error) {
    return error.what();
  }
  return "no error";
}

int64_t numel_of(const std::vector<torch::Tensor>& tensors) {
  int64_t count = 0;
  for (const auto& tensor : tensors) count += tensor.numel();
  return count;
}

TEST(CapacityPlan, CountsTheParametersOfTheBuiltModel) {
  auto sandwich = tiny_model();
  sandwich.sandwich_norm = sandwich.head_norm = true;
  sandwich.layer_pattern = "rudalle";
  for (const auto& model : {tiny_model(), sandwich}) {
    const models::Prior prior(model);
    int64_t in_blocks = 0;
    for (const auto& block : prior->resblocks()) in_blocks += numel_of(block->parameters());
    const auto plan = plan_capacity(recipe_of(model, 4), {.nodes = 1, .gpus_per_node = 1});
    EXPECT_EQ(plan.parameters.total, numel_of(prior->parameters()));
    EXPECT_EQ(plan.parameters.in_resblocks, in_blocks);
    EXPECT_EQ(plan.parameters.outside_resblocks, plan.parameters.total - in_blocks);
    EXPECT_EQ(plan.parameters.matrix_weights, models::matrix_weights(*prior));
    EXPECT_DOUBLE_EQ(plan.flops_per_token, models::prior_flops_per_token(models::matrix_weights(*prior), model));
    EXPECT_DOUBLE_EQ(part_named(plan, "weights").bytes, 4.0 * static_cast<double>(plan.parameters.total));
    EXPECT_TRUE(plan.traffic.empty()) << "one rank reduces nothing";
  }
}

// The prior's units as ShardedPrior cuts them (each resblock, the embeddings, the head), each
// with the values AdamW decays (the matrices but the embeddings) and the rest.
struct UnitValues {
  int64_t matrices = 0, rest = 0;
  bool is_block = true;
  int64_t values() const { return matrices + rest; }
  int64_t shard_values(int64_t ranks) const { return (matrices + ranks - 1) / ranks + (rest + ranks - 1) / ranks; }
};

// AdamW's rule in the trainer: what ShardedPrior puts in a unit's first group.
bool decayed(const std::string& name, const torch::Tensor& parameter) {
  return parameter.dim() == 2 && name.find("embedding") == std::string::npos;
}

std::vector<UnitValues> units_of(const models::Prior& prior) {
  const auto count = [](const auto& named, bool is_block) {
    UnitValues unit{.is_block = is_block};
    for (const auto& [name, parameter] : named) (decayed(name, parameter) ? unit.matrices : unit.rest) += parameter.numel();
    return unit;
  };
  std::vector<UnitValues> units;
  for (const auto& block : prior->resblocks()) {
    std::vector<std::pair<std::string, torch::Tensor>> named;
    for (const auto& item : block->named_parameters()) named.emplace_back(item.key(), item.value());
    units.push_back(count(named, true));
  }
  for (const auto end : {models::PriorEnd::embeddings, models::PriorEnd::head}) {
    units.push_back(count(prior->end_parameters(end), false));
  }
  return units;
}

TEST(CapacityPlan, ShardedStateIsAShareOfEveryResblockTheEmbeddingsAndTheHead) {
  const int64_t gpus = 4;
  const models::Prior prior(tiny_model());
  // As ShardedPrior groups a unit: its matrices, then the rest, each padded to the ranks.
  int64_t shards = 0, in_blocks = 0, largest_block = 0, ends = 0, largest_end_group = 0;
  for (const auto& unit : units_of(prior)) {
    shards += unit.shard_values(gpus);
    if (unit.is_block) {
      in_blocks += unit.values();
      largest_block = std::max(largest_block, unit.values());
    } else {
      ends += unit.values();
      largest_end_group = std::max({largest_end_group, unit.matrices, unit.rest});
    }
  }
  const int64_t rest = numel_of(prior->parameters()) - in_blocks;
  ASSERT_EQ(rest, ends);
  auto recipe = recipe_of(tiny_model(), 8);
  recipe.distributed.sharding = "within_node";
  const auto sharded = plan_capacity(recipe, {.nodes = 2, .gpus_per_node = gpus});
  EXPECT_TRUE(sharded.sharded);
  EXPECT_EQ(sharded.parameters.per_rank, shards);
  for (const char* name : {"weights", "gradients", "moving average"}) {
    EXPECT_DOUBLE_EQ(part_named(sharded, name).bytes, 4.0 * static_cast<double>(shards)) << name;
  }
  EXPECT_DOUBLE_EQ(part_named(sharded, "AdamW moments").bytes, 8.0 * static_cast<double>(shards));
  // Validation gathers the average block by block: no whole copy; fp32 weights keep their
  // average on the GPU. At start, built one block at a time: the weights, the embeddings and
  // head whole (cut last), and the largest block whole in fp32 twice (drawn, and flattened
  // to be cut), as started from init_from, read block by block, and as a run that freezes
  // part of the model (optimizer.trainable, adapters), each block frozen before it is cut.
  EXPECT_DOUBLE_EQ(part_named(sharded, "validation model").bytes, 0.0);
  EXPECT_DOUBLE_EQ(sharded.host_bytes, 0.0);
  EXPECT_TRUE(sharded.built_sharded);
  EXPECT_DOUBLE_EQ(sharded.startup_bytes,
                   4.0 * static_cast<double>(shards + ends + std::max(2 * largest_block, largest_end_group)));
  recipe.init_from = "runs/base";
  const auto loaded = plan_capacity(recipe, {.nodes = 2, .gpus_per_node = gpus});
  EXPECT_TRUE(loaded.built_sharded);
  EXPECT_DOUBLE_EQ(loaded.startup_bytes, sharded.startup_bytes);
  recipe.optimizer.trainable = {"resblocks.*"};
  const auto frozen = plan_capacity(recipe, {.nodes = 2, .gpus_per_node = gpus});
  EXPECT_TRUE(frozen.built_sharded);
  EXPECT_DOUBLE_EQ(frozen.startup_bytes,
                   part_named(frozen, "weights").bytes +
                       4.0 * static_cast<double>(ends + std::max(2 * largest_block, largest_end_group)));
  recipe.optimizer.trainable.clear();
  recipe.init_from.clear();
  EXPECT_THAT(sharded.checkpointing, ::testing::HasSubstr("every resblock"));

  recipe.distributed.sharding = "none";
  const auto whole = plan_capacity(recipe, {.nodes = 2, .gpus_per_node = gpus});
  EXPECT_EQ(whole.parameters.per_rank, rest + in_blocks);
  EXPECT_DOUBLE_EQ(part_named(whole, "validation model").bytes, 4.0 * static_cast<double>(rest + in_blocks));
  EXPECT_EQ(whole.checkpointing, "none");
}

// precision.weights bfloat16, sharded: each block's trained matrices (its first group) are
// stored in their shards in 2 bytes, and so are their gradients; gains, biases and the
// replicated rest stay 4. The matrix shards' moving average is fp32 in host memory, outside
// the GPU's peak; the rest's stays on the GPU. The all-gathers move the matrices in 2 bytes,
// the reduce-scatters the gradients in 4.
TEST(CapacityPlan, SixteenBitWeightsHalveTheShardedMatricesAndTheirGradients) {
  const int64_t gpus = 4;
  const models::Prior prior(tiny_model());
  int64_t matrix_shards = 0, rest_shards = 0, end_shards = 0;
  // Bytes: the largest block whole, and padded (an all-gather's output); every unit padded.
  double largest = 0, largest_padded = 0, gathered = 0, largest_rest = 0, largest_block = 0, ends = 0,
         largest_end_group = 0;
  const auto units = units_of(prior);
  for (const auto& unit : units) {
    const int64_t matrix_shard = (unit.matrices + gpus - 1) / gpus, rest_shard = (unit.rest + gpus - 1) / gpus;
    if (!unit.is_block) {  // float32 throughout
      end_shards += matrix_shard + rest_shard;
      gathered += 4.0 * static_cast<double>(gpus * (matrix_shard + rest_shard));
      ends += static_cast<double>(unit.values());
      largest_end_group = std::max({largest_end_group, static_cast<double>(unit.matrices),
                                    static_cast<double>(unit.rest)});
      continue;
    }
    largest_block = std::max(largest_block, static_cast<double>(unit.values()));
    matrix_shards += matrix_shard;
    rest_shards += rest_shard;
    const double padded = static_cast<double>(gpus) * (2.0 * matrix_shard + 4.0 * rest_shard);
    largest = std::max(largest, 2.0 * unit.matrices + 4.0 * unit.rest);
    largest_padded = std::max(largest_padded, padded);
    gathered += padded;
    largest_rest = std::max(largest_rest, static_cast<double>(unit.rest));
  }
  const auto shards = static_cast<double>(matrix_shards + rest_shards + end_shards);
  auto recipe = recipe_of(tiny_model(), 8);
  recipe.distributed.sharding = "within_node";
  recipe.precision.mode = "bfloat16";
  recipe.precision.weights = "bfloat16";
  const auto plan = plan_capacity(recipe, {.nodes = 1, .gpus_per_node = gpus});
  EXPECT_EQ(plan.weights, "bfloat16");
  const double stored = 2.0 * static_cast<double>(matrix_shards) + 4.0 * static_cast<double>(rest_shards + end_shards);
  EXPECT_DOUBLE_EQ(part_named(plan, "weights").bytes, stored);
  EXPECT_DOUBLE_EQ(part_named(plan, "gradients").bytes, stored);
  EXPECT_DOUBLE_EQ(part_named(plan, "AdamW moments").bytes, 8.0 * shards) << "precision.adam_moments'";
  EXPECT_DOUBLE_EQ(part_named(plan, "moving average").bytes, 4.0 * static_cast<double>(rest_shards + end_shards));
  EXPECT_EQ(part_named(plan, "moving average (host)").phase, MemoryPhase::host);
  EXPECT_DOUBLE_EQ(plan.host_bytes, 4.0 * static_cast<double>(matrix_shards));
  EXPECT_DOUBLE_EQ(part_named(plan, "validation model").bytes, 0.0);
  const auto& embeddings = units[units.size() - 2];
  EXPECT_DOUBLE_EQ(part_named(plan, "gathered resblock").bytes, 2 * largest) << "values and gradients";
  EXPECT_DOUBLE_EQ(part_named(plan, "gathered embeddings").bytes, 2 * 4.0 * static_cast<double>(embeddings.values()));
  EXPECT_DOUBLE_EQ(part_named(plan, "prefetched resblock").bytes,
                   std::max(largest_padded, 4.0 * static_cast<double>(gpus * embeddings.shard_values(gpus))));
  EXPECT_DOUBLE_EQ(part_named(plan, "16-bit weight copies").bytes, 2 * largest_rest)
      << "autocast uses bf16 matrices as they are";
  EXPECT_DOUBLE_EQ(part_named(plan, "gathered head").bytes, 2 * 4.0 * static_cast<double>(units.back().values()));
  std::map<MemoryPhase, double> in_phase;
  for (const auto& part : plan.memory) in_phase[part.phase] += part.bytes;
  const double kept = in_phase[MemoryPhase::kept];
  EXPECT_DOUBLE_EQ(plan.kept_bytes, kept) << "host memory is not the GPU's";
  EXPECT_DOUBLE_EQ(plan.backward_bytes,
                   std::max(in_phase[MemoryPhase::backward] +
                                std::max(in_phase[MemoryPhase::backward_head], in_phase[MemoryPhase::backward_blocks]),
                            in_phase[MemoryPhase::backward_embeddings]))
      << "the head, then the blocks, then the embeddings alone";
  EXPECT_EQ(part_named(plan, "logits").phase, MemoryPhase::backward_head);
  EXPECT_DOUBLE_EQ(plan.peak_bytes, kept + std::max(plan.backward_bytes, plan.reduction_bytes));
  // Forward gathers every unit, backward every unit again (the embeddings train); the
  // gradients are reduce-scattered in fp32.
  EXPECT_DOUBLE_EQ(payload_counted_by(plan, "ShardedParameters::bytes_moved"),
                   2 * gathered + 4.0 * static_cast<double>(gpus) * shards);
  EXPECT_DOUBLE_EQ(plan.startup_bytes, stored + 4.0 * (ends + std::max(2 * largest_block, largest_end_group)))
      << "built one block at a time";
  const auto table = capacity_plan_table(plan);
  EXPECT_THAT(table, ::testing::HasSubstr("bfloat16 resblock matrices, fp32 rest, 1/4 of every resblock, the "
                                          "embeddings and the head (padded)"));
  EXPECT_THAT(table, ::testing::HasSubstr("weights bfloat16, sharding within_node"));
}

// With overlap a unit's reduce-scatter runs on only while the next block gathers and
// recomputes, completed before that block's gradients and the following gather are made:
// beside those it holds nothing, and the plan's memory is the same with overlap and without
// (no row of a reduce-scatter in flight in the blocks' phase nor in the head's; the
// embeddings' recompute beside the first block's: TwelveBillionFitsOnV100sWithAGibFree).
TEST(CapacityPlan, AReduceScatterInFlightNeverMeetsTheNextBlocksGradientsOrGather) {
  auto recipe = recipe_of(tiny_model(), 8);
  recipe.distributed.sharding = "within_node";
  const auto overlapped = plan_capacity(recipe, {.nodes = 1, .gpus_per_node = 4});
  recipe.distributed.overlap = false;
  const auto plan = plan_capacity(recipe, {.nodes = 1, .gpus_per_node = 4});
  for (const auto* each : {&overlapped, &plan}) {
    EXPECT_THROW(part_named(*each, "reduce-scatter in flight"), Error);
  }
  const auto in_phase = [](const CapacityPlan& plan, MemoryPhase phase) {
    double bytes = 0;
    for (const auto& part : plan.memory) bytes += part.phase == phase ? part.bytes : 0;
    return bytes;
  };
  for (const auto phase : {MemoryPhase::backward_head, MemoryPhase::backward_blocks}) {
    EXPECT_DOUBLE_EQ(in_phase(plan, phase), in_phase(overlapped, phase));
  }
  EXPECT_DOUBLE_EQ(plan.kept_bytes, overlapped.kept_bytes);
  EXPECT_DOUBLE_EQ(plan.backward_bytes, overlapped.backward_bytes);
  EXPECT_DOUBLE_EQ(plan.peak_bytes, overlapped.peak_bytes);
}

// distributed.backward_prefetch: prefetched before a block's gradients, the next block's gather
// is held beside their making and their flattening; after them, only beside the flattened
// gradients still in flight (none without overlap), and backward's gathers are not hidden.
TEST(CapacityPlan, PrefetchingAfterGradientsHoldsTheNextGatherOnlyBesideTheReduceScatter) {
  // A batch whose compute outlasts every collective: what is hidden is then free.
  auto recipe = recipe_of(tiny_model(), 4096);
  recipe.distributed.sharding = "within_node";
  recipe.precision.mode = "bfloat16";
  recipe.precision.weights = "bfloat16";
  const ClusterShape machine{.nodes = 1, .gpus_per_node = 4};
  const auto before = plan_capacity(recipe, machine);
  recipe.distributed.backward_prefetch = "after_gradients";
  const auto after = plan_capacity(recipe, machine);
  recipe.distributed.overlap = false;
  const auto after_alone = plan_capacity(recipe, machine);
  const double values_and_gradients = part_named(before, "gathered resblock").bytes;
  const double gradients = values_and_gradients / 2;
  const double flattened = gradients + part_named(before, "flattened gradients").bytes;
  const double prefetched = part_named(before, "prefetched resblock").bytes;
  EXPECT_GT(flattened, gradients) << "16-bit gradients flattened in fp32";
  const auto blocks = [](const CapacityPlan& plan) {  // the block's parameters, gathered or not
    double bytes = 0;
    for (const auto& part : plan.memory) {
      if (part.phase == MemoryPhase::backward_blocks && part.name != "16-bit weight copies") bytes += part.bytes;
    }
    return bytes;
  };
  EXPECT_DOUBLE_EQ(blocks(before), values_and_gradients + (flattened - gradients) + prefetched);
  EXPECT_DOUBLE_EQ(blocks(after), std::max({values_and_gradients, gradients + flattened, flattened + prefetched}));
  EXPECT_DOUBLE_EQ(blocks(after_alone), std::max(values_and_gradients, gradients + flattened));
  EXPECT_LT(blocks(after), blocks(before));
  const auto backward_gathers = [](const CapacityPlan& plan) {
    for (const auto& part : plan.traffic) {
      if (part.name == "gathered again for backward") return part;
    }
    throw Error("no backward gathers");
  };
  EXPECT_TRUE(backward_gathers(before).hidden);
  EXPECT_FALSE(backward_gathers(after).hidden);
  EXPECT_DOUBLE_EQ(after.exposed_communication_seconds,
                   before.exposed_communication_seconds + backward_gathers(after).seconds);
}

// precision.weights needs 16-bit compute and shards to store, as the trainer does.
TEST(CapacityPlan, SixteenBitWeightsNeedSixteenBitComputeAndSharding) {
  auto recipe = recipe_of(tiny_model(), 8);
  recipe.distributed.sharding = "within_node";
  recipe.precision.weights = "bfloat16";
  const auto refusal = [&](const ClusterShape& cluster) { return refusal_of(recipe, cluster); };
  const std::string needs_shards = "precision.weights bfloat16 stores the shards of the resblocks";
  EXPECT_THAT(refusal({.nodes = 1, .gpus_per_node = 4}),
              ::testing::HasSubstr("precision.weights bfloat16 needs precision.mode bfloat16 or float16"));
  recipe.precision.mode = "bfloat16";
  EXPECT_TRUE(plan_capacity(recipe, {.nodes = 2, .gpus_per_node = 1}).sharded) << "one GPU a machine: shards of one";
  recipe.distributed.sharding = "none";
  EXPECT_THAT(refusal({.nodes = 1, .gpus_per_node = 4}), ::testing::HasSubstr(needs_shards));
}

// checkpointed_inputs: a checkpointed resblock's input in 16 bits, 2 bytes a value instead
// of 4 (every block when sharded, every k-th otherwise); refused in a float32 run.
TEST(CapacityPlan, SixteenBitCheckpointedInputsHalveTheKeptInputs) {
  auto recipe = recipe_of(tiny_model(), 8);
  recipe.precision.mode = "bfloat16";
  recipe.distributed.sharding = "within_node";
  const ClusterShape machine{.nodes = 1, .gpus_per_node = 4};
  const auto exact = plan_capacity(recipe, machine);
  recipe.checkpointed_inputs = "bfloat16";
  const auto halved = plan_capacity(recipe, machine);
  const double resblocks = 2.0 * static_cast<double>(recipe.model.layers);
  const double inputs = resblocks * static_cast<double>(halved.tokens_per_rank * recipe.model.width);
  EXPECT_DOUBLE_EQ(part_named(exact, "activations").bytes - part_named(halved, "activations").bytes, 2 * inputs);
  EXPECT_THAT(part_named(halved, "activations").rule, ::testing::HasSubstr("the checkpointed ones' in bfloat16"));
  recipe.distributed.sharding = "none";
  recipe.checkpoint_activations_every = 2;
  const auto every_other = plan_capacity(recipe, machine);
  recipe.checkpointed_inputs = "float32";
  EXPECT_DOUBLE_EQ(part_named(plan_capacity(recipe, machine), "activations").bytes -
                       part_named(every_other, "activations").bytes,
                   inputs) << "half the blocks are checkpointed";
  recipe.precision.mode = "float32";
  recipe.checkpointed_inputs = "float16";
  EXPECT_THAT(refusal_of(recipe, machine),
              ::testing::HasSubstr("plan: checkpointed_inputs float16 needs precision.mode bfloat16 or float16"));
}

// PowerSGD in 16 bits reads each error buffer back in fp32 where it uses it, one matrix at a
// time (LowRankAverager::average): the reduction holds the largest compressed matrix in fp32
// and its decompressed product, whatever the number of matrices. Flat, the matrices are the
// whole gradients, embeddings and output layer included; sharded, the blocks of whole rows in
// each rank's shard of every resblock's matrices, and beside them one group's gradient as
// the optimizer takes it (decompressed, in fp32, whatever the buffers' type). Flat in fp32
// the buffers are used as they are.
TEST(CapacityPlan, PowerSgdWorkingCopiesAreTheLargestMatrixAndItsProduct) {
  const distributed::PowerSgdOptions options{.rank = 2};
  const models::Prior prior(tiny_model());
  double flat = 0;
  for (const auto& parameter : prior->parameters()) {
    if (distributed::compresses(parameter.sizes().vec(), options)) {
      flat = std::max(flat, static_cast<double>(parameter.numel()));
    }
  }
  const int64_t gpus = 4;
  double sharded = 0, group = 0;
  for (const auto& block : prior->resblocks()) {
    std::vector<std::vector<int64_t>> matrices;
    int64_t values = 0;
    for (const auto& parameter : block->parameters()) {
      if (parameter.dim() == 2) matrices.push_back(parameter.sizes().vec());
      if (parameter.dim() == 2) values += parameter.numel();
    }
    group = std::max(group, static_cast<double>((values + gpus - 1) / gpus));
    for (int64_t rank = 0; rank < gpus; ++rank) {
      for (const auto& rows : distributed::rows_in_shard(matrices, rank, gpus)) {
        if (distributed::compresses(rows.rows, rows.columns, options)) {
          sharded = std::max(sharded, static_cast<double>(rows.rows * rows.columns));
        }
      }
    }
  }
  ASSERT_GT(sharded, 0.0);
  ASSERT_LT(sharded, flat) << "a quarter of an MLP's matrices is half of fc_in";
  auto recipe = recipe_of(tiny_model(), 8);
  recipe.distributed.gradient_reduction = "powersgd";
  recipe.distributed.powersgd.rank = 2;
  recipe.distributed.powersgd.dtype = "bfloat16";
  const auto whole = plan_capacity(recipe, {.nodes = 2, .gpus_per_node = 1});
  EXPECT_DOUBLE_EQ(part_named(whole, "PowerSGD fp32 working copies").bytes, 2 * 4.0 * flat);
  recipe.distributed.sharding = "within_node";
  const auto shards = plan_capacity(recipe, {.nodes = 2, .gpus_per_node = gpus});
  const auto& copies = part_named(shards, "PowerSGD fp32 working copies");
  EXPECT_DOUBLE_EQ(copies.bytes, 4.0 * (2 * sharded + group));
  EXPECT_EQ(copies.phase, MemoryPhase::reduction);
  EXPECT_THAT(copies.rule, ::testing::HasSubstr("one group as the optimizer takes it"));
  recipe.distributed.sharding = "none";
  recipe.distributed.powersgd.dtype = "float32";
  const auto fp32 = plan_capacity(recipe, {.nodes = 2, .gpus_per_node = 1});
  EXPECT_THROW(part_named(fp32, "PowerSGD fp32 working copies"), Error) << "flat fp32 buffers are not copied";
}

// Two ranks train the tiny prior data-parallel: the reducer counts what the plan says.
TEST(CapacityPlan, DataParallelBytesAreWhatTheReducerCounts) {
  auto recipe = recipe_of(tiny_model(), 4);
  const auto plan = plan_capacity(recipe, {.nodes = 1, .gpus_per_node = 2});
  ASSERT_EQ(plan.traffic.size(), 1u);
  EXPECT_EQ(plan.traffic[0].collective, "all-reduce");
  EXPECT_DOUBLE_EQ(plan.bytes_within, 4.0 * static_cast<double>(plan.parameters.total)) << "the fp32 gradients";
  EXPECT_DOUBLE_EQ(plan.bytes_across, 0.0);
  testing::on_ranks(2, [&](const LaunchEnvironment& place) {
    models::Prior prior(recipe.model);
    distributed::DataParallelReducer reducer(testing::group_at(place), 25 << 20);
    const auto tokens = torch::randint(0, 12, {2, recipe.model.length()});
    models::prior_loss(prior->forward(tokens), tokens, recipe.model).total.backward();
    reducer.reduce(prior->parameters());
    EXPECT_DOUBLE_EQ(static_cast<double>(reducer.bytes_reduced()), payload_counted_by(plan, "DataParallelReducer"));
  });
}

// Four ranks as 2 machines x 2 GPUs train the tiny prior sharded, with PowerSGD across the
// machines: the shards and the reducer count what the plan says, per update.
TEST(CapacityPlan, ShardedBytesAreWhatTheShardsAndTheReducerCount) {
  auto recipe = recipe_of(tiny_model(), 4);
  recipe.distributed.sharding = "within_node";
  recipe.distributed.gradient_reduction = "powersgd";
  recipe.distributed.powersgd.rank = 2;
  recipe.distributed.powersgd.start_update = 1;
  const auto plan = plan_capacity(recipe, {.nodes = 2, .gpus_per_node = 2});
  std::mutex mutex;
  double across = 0;
  testing::on_ranks(4, [&](const LaunchEnvironment& place) {
    const int64_t node = place.rank / 2, local = place.rank % 2;
    auto world = testing::group_at(place);
    auto within = testing::subgroup_at(place, "node" + std::to_string(node), local, 2);
    auto across_nodes = testing::subgroup_at(place, "local" + std::to_string(local), node, 2);
    models::Prior prior(recipe.model);
    ShardedPrior shards(*prior, decayed, within);
    const auto learned = shards.parameters()->shards();
    prior->set_resblock_runner(shards.runner(
        [](models::ResblockImpl& block, const torch::Tensor& x, const models::ResblockContext& context) {
          return x + block.branch(x, context);
        }));
    const distributed::PowerSgdOptions options{.rank = 2, .start_update = 1};
    distributed::ShardedReducer reducer(shards.parameters(), world, within, across_nodes, 25 << 20, options, true,
                                        shards.uncompressed_groups());
    const auto tokens = torch::randint(0, 12, {1, recipe.model.length()});
    models::prior_loss(prior->forward(tokens), tokens, recipe.model).total.backward();
    reducer.reduce(learned);
    EXPECT_DOUBLE_EQ(static_cast<double>(shards.parameters()->bytes_moved()),
                     payload_counted_by(plan, "ShardedParameters::bytes_moved"));
    std::lock_guard lock(mutex);
    across += static_cast<double>(reducer.bytes_across_nodes()) / 4;
  });
  EXPECT_NEAR(across, plan.bytes_across, 1e-9 * plan.bytes_across) << "the mean over the ranks";
  EXPECT_DOUBLE_EQ(payload_counted_by(plan, "ShardedReducer::bytes_across_nodes"), plan.bytes_across);
  EXPECT_LT(plan.bytes_across, plan.bytes_across_uncompressed);
}

// Two ranks train the tiny prior sharded with bf16 matrices (precision.weights), as the
// trainer does: the shards and their gradients hold, and the all-gathers and reduce-scatters
// move, what the plan counts.
TEST(CapacityPlan, SixteenBitShardsHoldAndMoveWhatThePlanCounts) {
  auto recipe = recipe_of(tiny_model(), 4);
  recipe.distributed.sharding = "within_node";
  recipe.precision.mode = "bfloat16";
  recipe.precision.weights = "bfloat16";
  const auto plan = plan_capacity(recipe, {.nodes = 1, .gpus_per_node = 2});
  testing::on_ranks(2, [&](const LaunchEnvironment& place) {
    models::Prior prior(recipe.model);
    ShardedPrior shards(*prior, decayed, testing::group_at(place), {}, nullptr, torch::kBFloat16);
    const auto bytes_of = [](const torch::Tensor& tensor) {
      return static_cast<double>(tensor.numel()) * static_cast<double>(tensor.element_size());
    };
    EXPECT_EQ(numel_of(prior->parameters()), 0) << "every tensor of the prior holds only its shard";
    double weights = 0;
    for (const auto& shard : shards.parameters()->shards()) weights += bytes_of(shard);
    EXPECT_DOUBLE_EQ(weights, part_named(plan, "weights").bytes);
    prior->set_resblock_runner(shards.runner(
        [](models::ResblockImpl& block, const torch::Tensor& x, const models::ResblockContext& context) {
          AutocastGuard autocast(x.device().type(), torch::kBFloat16);
          return x + block.branch(x, context).to(x.scalar_type());
        }));
    const auto tokens = torch::randint(0, 12, {2, recipe.model.length()});
    models::prior_loss(prior->forward(tokens), tokens, recipe.model).total.backward();
    shards.parameters()->finish_reductions();
    double gradients = 0;
    for (const auto& shard : shards.parameters()->shards()) gradients += bytes_of(shard.grad());
    EXPECT_DOUBLE_EQ(gradients, part_named(plan, "gradients").bytes);
    EXPECT_DOUBLE_EQ(static_cast<double>(shards.parameters()->bytes_moved()),
                     payload_counted_by(plan, "ShardedParameters::bytes_moved"));
  });
}

// DALL-E's recipe as shipped on its cluster: 128 machines of 8 V100s (16 GB, 125 TFLOP/s in
// fp16), fp16 with 16-bit weights, moments and checkpointed inputs, sharded within the
// machine, PowerSGD at 896 (112 per shard) in bfloat16, fits with more than 1 GiB free; with
// fp32 weights and inputs it does not.
TEST(CapacityPlan, TwelveBillionFitsOnV100sWithAGibFree) {
  const ClusterShape v100s{.nodes = 128, .gpus_per_node = 8, .gpu_memory_gib = 16, .peak_tflops = 125};
  const std::vector<std::string> fp32_state = {"precision.weights=float32", "checkpointed_inputs=float32"};
  const auto shipped = plan_capacity(twelve_billion({}), v100s);
  const auto sharded = plan_capacity(twelve_billion(fp32_state), v100s);
  EXPECT_EQ(shipped.global_batch, 1024);
  EXPECT_EQ(shipped.precision, "float16");
  EXPECT_EQ(shipped.gradient_reduction, "powersgd");
  EXPECT_EQ(sharded.parameters.total, 12'293'849'088);
  EXPECT_EQ(sharded.parameters.per_rank, 12'293'849'088 / 8) << "1/8 of every parameter array (none padded)";
  EXPECT_TRUE(shipped.fits);
  EXPECT_GE(shipped.capacity_bytes - shipped.peak_bytes, 1.0 * (1 << 30)) << "at least 1 GiB free";
  EXPECT_TRUE(shipped.too_large.empty());
  // fp32 weights, gradients and average and bf16 moments of 1.5 B values are 23 GiB alone
  // (validation gathers the average block by block: no whole copy). DALL-E kept 16-bit weights.
  EXPECT_FALSE(sharded.fits);
  EXPECT_DOUBLE_EQ(part_named(sharded, "validation model").bytes, 0.0);
  EXPECT_EQ(sharded.too_large, (std::vector<std::string>{"weights", "AdamW moments"}));
  // Built one block at a time, it fits at start: the weights' shards, the embeddings and head
  // whole until cut (198,369,280 values), and one MLP block (8 d^2 and its 7 d gains and
  // biases) whole twice; from init_from too, read block by block, and frozen in part
  // (optimizer.trainable), each block frozen before it is cut.
  const double d = 3968;
  EXPECT_TRUE(shipped.fits_at_startup);
  EXPECT_DOUBLE_EQ(shipped.startup_bytes,
                   part_named(shipped, "weights").bytes + 4 * (198'369'280 + 2 * (8 * d * d + 7 * d)));
  EXPECT_TRUE(plan_capacity(twelve_billion({"init_from=runs/base"}), v100s).fits_at_startup);
  const auto frozen = plan_capacity(twelve_billion({"optimizer.trainable=[\"resblocks.*\"]"}), v100s);
  EXPECT_TRUE(frozen.fits_at_startup);
  EXPECT_DOUBLE_EQ(frozen.startup_bytes,
                   part_named(frozen, "weights").bytes + 4 * (198'369'280 + 2 * (8 * d * d + 7 * d)));
  // Backward's peak is as it starts: every block's input, the logits and the head gathered in
  // fp32 (values and gradients; flattened, the values freed, they hold no more) beside the last
  // block's gather (an MLP's 8 d^2 matrices in bf16, its 7 d gains and biases in fp32).
  const double classes = 16384 + 256 + 8192;       // caption ids, a padding id per position, image codes
  const double head = classes * d + classes + 2 * d;  // to_logits, its bias, the final LayerNorm
  const double last_block = 2 * 8 * d * d + 4 * 7 * d;
  EXPECT_DOUBLE_EQ(part_named(shipped, "gathered head").bytes, 2 * 4 * head);
  EXPECT_THROW(part_named(shipped, "head's reduce-scatter"), Error) << "its flattened gradients replace its values";
  EXPECT_DOUBLE_EQ(part_named(shipped, "last resblock prefetched").bytes, last_block);
  // As backward ends, the embeddings recompute beside the first block's reduce-scatter, its
  // gradients flattened in fp32: what they hold beyond the embeddings' values and gradients.
  EXPECT_DOUBLE_EQ(part_named(shipped, "first block's reduce-scatter").bytes,
                   4 * (8 * d * d + 7 * d) - part_named(shipped, "gathered embeddings").bytes / 2);
  // Prefetched after the gradients (distributed.backward_prefetch), the head's and the blocks'
  // moments hold less and backward's gathers are not hidden: the shipped plan's note says so.
  const auto after = plan_capacity(twelve_billion({"distributed.backward_prefetch=after_gradients"}), v100s);
  EXPECT_LT(after.peak_bytes, shipped.peak_bytes);
  EXPECT_GT(after.step_seconds, shipped.step_seconds);
  char said[160];
  std::snprintf(said, sizeof said, "after_gradients would peak at %.2f GiB (%.2f less) and step in %.3f s (%.3f s now)",
                after.peak_bytes / (1 << 30), (shipped.peak_bytes - after.peak_bytes) / (1 << 30), after.step_seconds,
                shipped.step_seconds);
  EXPECT_THAT(shipped.notes, ::testing::Contains(::testing::HasSubstr(said)));
  EXPECT_THAT(after.notes, ::testing::Not(::testing::Contains(::testing::HasSubstr("backward_prefetch"))));
  EXPECT_DOUBLE_EQ(shipped.backward_bytes, part_named(shipped, "activations").bytes +
                                               part_named(shipped, "logits").bytes + 2 * 4 * head + last_block);
  // PowerSGD reads its bf16 buffers back in fp32 one matrix at a time: the largest is a rank's
  // 1/8 of an MLP's matrices (8 d^2: d whole rows of fc_in, or d / 4 of fc_out), d^2 values,
  // held with its decompressed product, beside the gradient of one MLP group's shard (d^2)
  // as AdamW takes it.
  EXPECT_DOUBLE_EQ(part_named(sharded, "PowerSGD fp32 working copies").bytes, 3 * 4 * d * d);
  EXPECT_GT(sharded.backward_bytes, sharded.reduction_bytes) << "backward is the peak's phase";
  // DALL-E's 16-bit weights: each rank's 1/8 of the resblock matrices (4 d^2 in attention, 8 d^2
  // in the MLP per layer, none padded on 8 ranks) and its gradients take 2 bytes a value less,
  // and their fp32 average moves to host memory; the 128 resblocks' inputs (1,280 tokens) take
  // 2 bytes a value less too. Their gradients are PowerSGD's error feedback in both (every
  // row compresses: 8 ranks cut no row), so the gradients are the rest's alone. The bf16
  // moments are then what does not fit.
  const double matrix_shards = 64 * 12 * d * d / 8;
  EXPECT_DOUBLE_EQ(sharded.kept_bytes - shipped.kept_bytes, (2 + 4) * matrix_shards);
  EXPECT_DOUBLE_EQ(part_named(shipped, "gradients").bytes, part_named(sharded, "gradients").bytes);
  EXPECT_DOUBLE_EQ(part_named(shipped, "gradients").bytes,
                   4 * static_cast<double>(shipped.parameters.per_rank) - 4 * matrix_shards);
  EXPECT_DOUBLE_EQ(shipped.host_bytes, 4 * matrix_shards);
  EXPECT_DOUBLE_EQ(part_named(sharded, "activations").bytes - part_named(shipped, "activations").bytes,
                   2 * 128 * 1280 * d);
  // Q, fixed as DALL-E kept it, is stored in powersgd.dtype; warm-started, in fp32.
  const auto warm = plan_capacity(twelve_billion({"distributed.powersgd.warm_start=true"}), v100s);
  EXPECT_DOUBLE_EQ(part_named(warm, "PowerSGD Q").bytes, 2 * part_named(shipped, "PowerSGD Q").bytes);
  // PowerSGD: P and Q in bf16 against whole fp32 gradients across machines.
  EXPECT_GT(1.0 - sharded.bytes_across / sharded.bytes_across_uncompressed, 0.85);
  // An H200's memory holds it, with fp32 weights too.
  auto h200 = v100s;
  h200.gpu_memory_gib = 130;
  EXPECT_TRUE(plan_capacity(twelve_billion(fp32_state), h200).fits);

  auto unsharded = fp32_state;
  unsharded.push_back("distributed.sharding=none");
  const auto whole = plan_capacity(twelve_billion(unsharded), v100s);
  EXPECT_FALSE(whole.fits);
  EXPECT_EQ(whole.parameters.per_rank, whole.parameters.total);
  EXPECT_THAT(whole.too_large, ::testing::Contains("weights"));
  EXPECT_THAT(whole.too_large, ::testing::Contains("AdamW moments"));
  EXPECT_GT(part_named(whole, "weights").bytes, v100s.gpu_memory_gib * 1024 * 1024 * 1024) << "alone";
}

// The shipped adapter recipe at ruDALL-E XL's layout (bf16, every resblock checkpointed) on
// one 16 GiB GPU: the frozen 1.3B weights are held once (their resblock matrices in fp16, the
// rest fp32); gradients, moments, the average and the validation copy only for the adapters'
// values, which are counted exactly.
TEST(CapacityPlan, AdaptersAtTheXlLayoutHoldStateOnlyForWhatTrains) {
  auto source = ConfigSource::from_file(std::string(DALLE_SOURCE_DIR) + "/configs/prior/rudalle-xl-adapters.yaml");
  const auto recipe = load_config<PriorTrainConfig>(source);
  const ClusterShape one_gpu{.nodes = 1, .gpus_per_node = 1, .gpu_memory_gib = 16};
  const auto plan = plan_capacity(recipe, one_gpu);
  // Rank 8 on qkv (2048 -> 6144), out (2048 -> 2048), fc_in (2048 -> 8192), fc_out (8192 -> 2048).
  const int64_t adapters = 24 * 8 * ((2048 + 6144) + (2048 + 2048) + (2048 + 8192) + (8192 + 2048));
  EXPECT_EQ(plan.parameters.adapters, adapters);
  EXPECT_EQ(plan.parameters.trained, adapters);
  const auto full = plan_capacity(load_config<PriorTrainConfig>(ConfigSource::from_file(
                                      std::string(DALLE_SOURCE_DIR) + "/configs/prior/rudalle-xl.yaml")),
                                  one_gpu);
  EXPECT_EQ(plan.parameters.total, full.parameters.total + adapters);
  // The recipe keeps the frozen resblock matrices (every matrix of the 48 blocks) in fp16.
  const double matrices = 24 * (2048.0 * 6144 + 2048.0 * 2048 + 2048.0 * 8192 + 8192.0 * 2048);
  EXPECT_DOUBLE_EQ(part_named(plan, "weights").bytes, 4.0 * static_cast<double>(plan.parameters.total) - 2 * matrices);
  auto fp32_base = recipe;
  fp32_base.frozen_weights = "float32";
  const auto whole_base = plan_capacity(fp32_base, one_gpu);
  EXPECT_DOUBLE_EQ(part_named(whole_base, "weights").bytes, 4.0 * static_cast<double>(plan.parameters.total));
  EXPECT_GT(whole_base.peak_bytes - plan.peak_bytes, 2.2 * (1 << 30));
  EXPECT_DOUBLE_EQ(part_named(plan, "gradients").bytes, 4.0 * static_cast<double>(adapters));
  EXPECT_DOUBLE_EQ(part_named(plan, "AdamW moments").bytes, 8.0 * static_cast<double>(adapters));
  EXPECT_DOUBLE_EQ(part_named(plan, "validation model").bytes, 4.0 * static_cast<double>(adapters));
  EXPECT_TRUE(plan.fits) << capacity_plan_table(plan);
  EXPECT_FALSE(full.fits) << "full training at batch 8 needs more than 16 GiB";

  // Sharded on 8 GPUs: each holds 1/8 of the frozen base, the adapters and their state whole.
  auto sharded = recipe;
  sharded.distributed.sharding = "within_node";
  const auto eight = plan_capacity(sharded, {.gpus_per_node = 8, .gpu_memory_gib = 16});
  EXPECT_LT(eight.parameters.per_rank, plan.parameters.total / 4);
  EXPECT_DOUBLE_EQ(part_named(eight, "gradients").bytes, 4.0 * static_cast<double>(adapters));
  // Its shards of the frozen matrices in fp16, as the whole model keeps them (none padded).
  EXPECT_DOUBLE_EQ(part_named(eight, "weights").bytes,
                   4.0 * static_cast<double>(eight.parameters.per_rank) - 2 * matrices / 8);
}

// Two ranks fine-tune the tiny prior sharded, with adapters on every linear layer and the
// blocks' norms training too (in shards): the shards, their gradients and what the
// collectives move are what the plan counts.
TEST(CapacityPlan, ShardedFineTuningIsWhatTheShardsAndTheReducerCount) {
  auto recipe = recipe_of(tiny_model(), 4);
  recipe.distributed.sharding = "within_node";
  recipe.adapter = {.rank = 2, .alpha = 4};
  recipe.optimizer.trainable = {"resblocks.*norm*"};
  const auto plan = plan_capacity(recipe, {.nodes = 1, .gpus_per_node = 2});
  EXPECT_LT(plan.parameters.trained, plan.parameters.total / 4);
  testing::on_ranks(2, [&](const LaunchEnvironment& place) {
    auto group = testing::group_at(place);
    models::Prior prior(recipe.model);
    models::add_adapters(*prior, recipe.adapter);
    freeze_all_but(*prior, trainable_patterns(recipe.optimizer.trainable, recipe.adapter), "test");
    // The adapters stay whole (the head's too); the rest is sharded, the frozen ends as well.
    int64_t held = 0, trained = 0;
    std::vector<torch::Tensor> learned;
    for (const auto& item : prior->named_parameters()) {
      if (!models::is_adapter_tensor(item.key())) continue;
      held += item.value().numel();
      learned.push_back(item.value());
    }
    ShardedPrior shards(*prior, decayed, group, {}, models::is_adapter_tensor);
    for (size_t g = 0; g < shards.parameters()->groups(); ++g) {
      held += shards.parameters()->shard(g).numel();
      if (shards.parameters()->trains(g)) learned.push_back(shards.parameters()->shard(g));
    }
    for (const auto& tensor : learned) trained += tensor.numel();
    EXPECT_EQ(held, plan.parameters.per_rank);
    EXPECT_DOUBLE_EQ(4.0 * static_cast<double>(trained), part_named(plan, "gradients").bytes);
    prior->set_resblock_runner(shards.runner(
        [](models::ResblockImpl& block, const torch::Tensor& x, const models::ResblockContext& context) {
          return x + block.branch(x, context);
        }));
    distributed::ShardedReducer reducer(shards.parameters(), group, group, nullptr, 25 << 20);
    const auto tokens = torch::randint(0, 12, {2, recipe.model.length()});
    models::prior_loss(prior->forward(tokens), tokens, recipe.model).total.backward();
    reducer.reduce_scaled(learned);
    EXPECT_DOUBLE_EQ(static_cast<double>(shards.parameters()->bytes_moved()),
                     payload_counted_by(plan, "ShardedParameters::bytes_moved"));
    EXPECT_DOUBLE_EQ(static_cast<double>(reducer.bytes_reduced()),
                     payload_counted_by(plan, "ShardedReducer::bytes_reduced (DataParallelReducer)"));
  });
}

TEST(CapacityPlan, JsonHoldsThePlan) {
  auto recipe = recipe_of(tiny_model(), 8);
  recipe.distributed.sharding = "within_node";
  recipe.precision.mode = "bfloat16";
  recipe.precision.weights = "bfloat16";
  const auto plan = plan_capacity(recipe, {.nodes = 2, .gpus_per_node = 4, .gpu_memory_gib = 1});
  const auto json = nlohmann::json::parse(capacity_plan_json(plan));
  EXPECT_EQ(json["parameters"]["total"].get<int64_t>(), plan.parameters.total);
  EXPECT_EQ(json["training"]["weights"].get<std::string>(), "bfloat16");
  EXPECT_EQ(json["memory"]["fits"].get<bool>(), plan.fits);
  EXPECT_GT(plan.host_bytes, 0.0);
  EXPECT_DOUBLE_EQ(json["memory"]["host_bytes"].get<double>(), plan.host_bytes);
  EXPECT_EQ(json["memory"]["parts"].size(), plan.memory.size());
  EXPECT_EQ(json["traffic"]["parts"].size(), plan.traffic.size());
  EXPECT_DOUBLE_EQ(json["traffic"]["bytes_across"].get<double>(), plan.bytes_across);
  EXPECT_DOUBLE_EQ(json["compute"]["step_seconds"].get<double>(), plan.step_seconds);
  EXPECT_GT(plan.step_seconds, plan.compute_seconds);
  const auto table = capacity_plan_table(plan);
  EXPECT_THAT(table, ::testing::HasSubstr("validation model"));
  EXPECT_THAT(table, ::testing::HasSubstr("moving average (host)"));
  EXPECT_THAT(table, ::testing::HasSubstr("ShardedParameters::bytes_moved"));
}

TEST(CapacityPlan, ABadClusterOrBatchIsRefusedByName) {
  const auto recipe = recipe_of(tiny_model(), 8);
  const auto refusal = [&](const ClusterShape& cluster) { return refusal_of(recipe, cluster); };
  EXPECT_THAT(refusal({.nodes = 0}), ::testing::HasSubstr("nodes must be at least 1, not 0"));
  EXPECT_THAT(refusal({.gpus_per_node = 0}), ::testing::HasSubstr("gpus per node"));
  EXPECT_THAT(refusal({.mfu = 1.5}), ::testing::HasSubstr("MFU"));
  EXPECT_THAT(refusal({.gpu_memory_gib = 0}), ::testing::HasSubstr("GPU memory"));
  EXPECT_THAT(refusal({.nodes = 3, .gpus_per_node = 1}), ::testing::HasSubstr("data.batch_size 8 does not divide"));
}

}  // namespace
}  // namespace dalle::train
