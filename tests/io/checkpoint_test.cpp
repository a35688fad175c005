#include "dalle/io/checkpoint.h"
#include "dalle/io/sharded_checkpoint.h"

#include <torch/torch.h>

#include "test_support.h"

namespace dalle::io {
namespace {

using testing::ScratchDir;
namespace fs = std::filesystem;

Checkpoint make_checkpoint(float value) {
  return {"model: {layers: 2}\n",
          {{"layer.weight", torch::full({2, 2}, value)}},
          {{"adam.exp_avg", torch::full({2, 2}, value / 2)}, {"rng", torch::arange(4, torch::kUInt8)}},
          {{"step", std::to_string(static_cast<int>(value))}}};
}

TEST(Checkpoint, RoundTripsConfigWeightsAndState) {
  ScratchDir dir;
  save_checkpoint(dir / "ckpt", make_checkpoint(3));
  const auto loaded = load_checkpoint(dir / "ckpt");
  EXPECT_EQ(loaded.config_yaml, "model: {layers: 2}\n");
  EXPECT_TRUE(torch::equal(loaded.weights.at("layer.weight"), torch::full({2, 2}, 3.0f)));
  EXPECT_TRUE(torch::equal(loaded.state.at("adam.exp_avg"), torch::full({2, 2}, 1.5f)));
  EXPECT_EQ(loaded.state_metadata.at("step"), "3");
}

TEST(Checkpoint, OverwritingReplacesTheWholeDirectory) {
  ScratchDir dir;
  save_checkpoint(dir / "ckpt", make_checkpoint(1));
  save_checkpoint(dir / "ckpt", make_checkpoint(2));
  EXPECT_TRUE(torch::equal(load_checkpoint(dir / "ckpt").weights.at("layer.weight"), torch::full({2, 2}, 2.0f)));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), {}), 1) << "no staging directory left";
}

TEST(Checkpoint, IncompleteDirectoryIsRefused) {
  ScratchDir dir;
  save_checkpoint(dir / "ckpt", make_checkpoint(1));
  fs::remove(dir / "ckpt/state.safetensors");
  EXPECT_THROW_WITH(load_checkpoint(dir / "ckpt"), Error, "incomplete checkpoint", "state.safetensors");
  EXPECT_THROW_WITH(load_checkpoint(dir / "nothing"), Error, "no checkpoint directory");
}

// A fine-tuning checkpoint that refers to its base: loaded, the base's inference weights (its
// moving average over its weights) fill the names it lacks; its own weights win; a base that
// changed or is gone is refused by name.
TEST(Checkpoint, ACheckpointThatRefersToItsBaseIsFilledFromItAndRefusesAChangedBase) {
  ScratchDir dir;
  Checkpoint base{.config_yaml = "model: {}\n",
                  .weights = {{"frozen", torch::full({2, 3}, 1.0)}, {"trained", torch::zeros({2})}},
                  .state = {{"ema.frozen", torch::full({2, 3}, 2.0)}}};
  save_checkpoint(dir / "base", base);
  Checkpoint tuned{.config_yaml = "model: {}\n", .weights = {{"trained", torch::ones({2})}}};
  refer_to_base(tuned, dir / "base");
  save_checkpoint(dir / "tuned", tuned);
  const auto loaded = load_checkpoint(dir / "tuned");
  EXPECT_EQ(base_of(loaded), fs::absolute(dir / "base").lexically_normal().string());
  EXPECT_TRUE(torch::equal(loaded.weights.at("frozen"), torch::full({2, 3}, 2.0))) << "the base's moving average";
  EXPECT_TRUE(torch::equal(loaded.weights.at("trained"), torch::ones({2}))) << "its own weights win";
  EXPECT_EQ(read_safetensors(dir / "tuned/model.safetensors").tensors.size(), 1u) << "only what trained is written";

  base.weights.at("frozen").fill_(5.0);
  base.state.at("ema.frozen").fill_(5.0);
  save_checkpoint(dir / "base", base);
  EXPECT_THROW_WITH(load_checkpoint(dir / "tuned"), Error, "base checkpoint's weights changed");
  fs::remove_all(dir / "base");
  EXPECT_THROW_WITH(load_checkpoint(dir / "tuned"), Error, "its base checkpoint is gone", "/base");
}

// Two ranks' shards of one group (a 2x2 matrix and a vector of 3: 7 values, 4 per rank with
// one of padding), published from the staging folder, come back whole under their names.
TEST(CheckpointStore, AShardedCheckpointIsStagedPublishedAndReadWhole) {
  ScratchDir dir;
  CheckpointStore store(dir / "checkpoints");
  store.stage(5);
  const auto staging = store.staging_for(5);
  const ShardLayout layout{.ranks = 2,
                           .groups = {{{"block.weight", {2, 2}}, {"block.bias", {3}}}},
                           .kinds = {{"weights", {.into_weights = true}}, {"ema", {.prefix = "ema."}}}};
  write_checkpoint_files(staging, make_checkpoint(3), layout);
  const auto values = torch::arange(8.0f);
  write_checkpoint_shard(staging, 0, 2, {{"weights.0", values.slice(0, 0, 4)}, {"ema.0", -values.slice(0, 0, 4)}});
  EXPECT_FALSE(store.latest()) << "nothing is published before every rank has written";
  EXPECT_THROW_WITH(load_checkpoint(staging), Error, "shard-00001-of-00002.safetensors is missing");
  write_checkpoint_shard(staging, 1, 2, {{"weights.0", values.slice(0, 4, 8)}, {"ema.0", -values.slice(0, 4, 8)}});
  EXPECT_EQ(store.publish(5), dir / "checkpoints/step-000000005");
  EXPECT_FALSE(fs::exists(staging));

  const auto loaded = load_checkpoint(*store.latest());
  EXPECT_TRUE(torch::equal(loaded.weights.at("layer.weight"), torch::full({2, 2}, 3.0f))) << "rank 0's own";
  EXPECT_TRUE(torch::equal(loaded.weights.at("block.weight"), torch::arange(4.0f).view({2, 2})));
  EXPECT_TRUE(torch::equal(loaded.weights.at("block.bias"), torch::arange(4.0f, 7.0f)));
  EXPECT_TRUE(torch::equal(loaded.state.at("ema.block.bias"), -torch::arange(4.0f, 7.0f)));
  EXPECT_EQ(loaded.state_metadata.count("shard_layout"), 0u);

  // A job killed while staging leaves a folder the next staging removes.
  store.stage(6);
  store.stage(7);
  EXPECT_FALSE(fs::exists(store.staging_for(6)));
  EXPECT_EQ(store.steps(), std::vector<int64_t>{5});
}

// One group of 10 values (a 2x4 matrix and a vector of 2) and the kinds a sharded job keeps.
ShardLayout block_layout(int64_t ranks) {
  return {.ranks = ranks,
          .groups = {{{"block.weight", {2, 4}}, {"block.bias", {2}}}},
          .kinds = {{"weights", {.into_weights = true}},
                    {"ema", {.prefix = "ema."}},
                    {"exp_avg", {.prefix = "adamw.", .suffix = ".exp_avg"}}}};
}

// A checkpoint written by 4 ranks (3 values each, 2 of padding): weights 0..9, average -0..-9.
std::string four_rank_checkpoint(const ScratchDir& dir) {
  const auto staging = dir / "ckpt";
  fs::create_directories(staging);
  auto layout = block_layout(4);
  layout.kinds.erase("exp_avg");  // written before the first update
  write_checkpoint_files(staging, make_checkpoint(3), layout);
  const auto values = torch::constant_pad_nd(torch::arange(10.0f), {0, 2});
  for (int64_t rank = 0; rank < 4; ++rank) {
    write_checkpoint_shard(staging, rank, 4,
                           {{"weights.0", values.slice(0, 3 * rank, 3 * rank + 3)},
                            {"ema.0", -values.slice(0, 3 * rank, 3 * rank + 3)}});
  }
  return staging;
}

// On the world size it was written with, a rank reads its own shard file and no byte of
// another's; on another, the slices of the files that hold its part; a kind the checkpoint
// lacks has no slices; the replicated part comes whole, without the group's parameters.
TEST(Checkpoint, ARankReadsOnlyTheSlicesItWillHold) {
  ScratchDir dir;
  const auto directory = four_rank_checkpoint(dir);
  const auto padded = torch::constant_pad_nd(torch::arange(10.0f), {0, 2});
  for (int64_t rank = 0; rank < 4; ++rank) {
    const auto read = load_checkpoint_for_rank(directory, block_layout(4), rank, 4);
    const int64_t values = std::min<int64_t>(3, 10 - 3 * rank);  // the padding is not read
    EXPECT_EQ(read.shard_bytes_read, (std::map<int64_t, int64_t>{{rank, 2 * values * 4}})) << "rank " << rank;
    EXPECT_TRUE(torch::equal(read.slices.at("weights.0"), padded.slice(0, 3 * rank, 3 * rank + 3)));
    EXPECT_TRUE(torch::equal(read.slices.at("ema.0"), -padded.slice(0, 3 * rank, 3 * rank + 3)));
    EXPECT_EQ(read.slices.count("exp_avg.0"), 0u);
    EXPECT_TRUE(torch::equal(read.replicated.weights.at("layer.weight"), torch::full({2, 2}, 3.0f)));
    EXPECT_EQ(read.replicated.weights.count("block.weight"), 0u);
    EXPECT_EQ(read.replicated.state_metadata.count("shard_layout"), 0u);
  }
  // 2 ranks of 5 values: rank 0 takes 3 from writer 0 and 2 from writer 1; rank 1 the rest.
  const auto first = load_checkpoint_for_rank(directory, block_layout(2), 0, 2);
  EXPECT_EQ(first.shard_bytes_read, (std::map<int64_t, int64_t>{{0, 2 * 3 * 4}, {1, 2 * 2 * 4}}));
  EXPECT_TRUE(torch::equal(first.slices.at("weights.0"), torch::arange(5.0f)));
  const auto second = load_checkpoint_for_rank(directory, block_layout(2), 1, 2);
  EXPECT_EQ(second.shard_bytes_read, (std::map<int64_t, int64_t>{{1, 2 * 1 * 4}, {2, 2 * 3 * 4}, {3, 2 * 1 * 4}}));
  EXPECT_TRUE(torch::equal(second.slices.at("ema.0"), -torch::arange(5.0f, 10.0f)));
  // 3 ranks of 4 values: the last is padded with zeros.
  EXPECT_TRUE(torch::equal(load_checkpoint_for_rank(directory, block_layout(3), 2, 3).slices.at("weights.0"),
                           torch::tensor({8.0f, 9.0f, 0.0f, 0.0f})));
}

// A model that shards more than the checkpoint's writer did (the prior's embeddings and head,
// whole before): the groups the shards hold come from the shard files, the later ones from
// the checkpoint's whole tensors; a checkpoint with more groups than the model is refused.
TEST(Checkpoint, GroupsBeyondTheWrittenShardsAreCutFromTheWholeTensors) {
  ScratchDir dir;
  const auto directory = four_rank_checkpoint(dir);
  auto wanted = block_layout(2);
  wanted.groups.push_back({{"layer.weight", {2, 2}}});
  const auto read = load_checkpoint_for_rank(directory, wanted, 1, 2);
  EXPECT_TRUE(torch::equal(read.slices.at("weights.0"), torch::arange(5.0f, 10.0f)));
  EXPECT_TRUE(torch::equal(read.slices.at("weights.1"), torch::full({2}, 3.0f))) << "rank 1's half of 2x2";
  EXPECT_EQ(read.slices.count("ema.1"), 0u) << "a kind the whole tensors lack";
  EXPECT_EQ(read.replicated.weights.count("layer.weight"), 0u);
  auto fewer = block_layout(4);
  fewer.groups.clear();
  EXPECT_THROW_WITH(load_checkpoint_for_rank(directory, fewer, 0, 4), Error, "hold 1 groups where the model has 0");
}

// What inference reads of a sharded checkpoint is its average's shards alone: shards that hold
// no moments (which the layout names) load as a model, while the whole checkpoint does not.
TEST(Checkpoint, AnInferenceCheckpointJoinsOnlyTheAveragesShards) {
  ScratchDir dir;
  const auto staging = dir / "ckpt";
  fs::create_directories(staging);
  write_checkpoint_files(staging, make_checkpoint(3), block_layout(4));
  const auto values = torch::constant_pad_nd(torch::arange(10.0f), {0, 2});
  for (int64_t rank = 0; rank < 4; ++rank) {
    write_checkpoint_shard(staging, rank, 4,
                           {{"weights.0", values.slice(0, 3 * rank, 3 * rank + 3)},
                            {"ema.0", -values.slice(0, 3 * rank, 3 * rank + 3)}});
  }
  EXPECT_THROW_WITH(load_checkpoint(staging), Error, "a shard lacks 'exp_avg.0'");
  const auto checkpoint = load_inference_checkpoint(staging);
  EXPECT_EQ(checkpoint.state.count("adamw.block.weight.exp_avg"), 0u);
  EXPECT_EQ(checkpoint.weights.count("block.weight"), 0u) << "the average replaces the weights: they are not joined";
  EXPECT_EQ(checkpoint.state.count("adam.exp_avg"), 1u) << "what is not sharded is read as it is";
  const auto weights = inference_weights(checkpoint);
  EXPECT_EQ(weights.size(), 3u);
  EXPECT_TRUE(torch::equal(weights.at("block.weight"), -torch::arange(8.0f).view({2, 4})));
  EXPECT_TRUE(torch::equal(weights.at("block.bias"), -torch::tensor({8.0f, 9.0f})));
  EXPECT_TRUE(torch::equal(weights.at("layer.weight"), torch::full({2, 2}, 3.0f)));
}

// A sharded checkpoint opened with its shards left unread (a sharded trainer's init_from):
// each group is joined only when one of its parameters is read, and reads as the joined
// checkpoint does.
TEST(Checkpoint, UnreadShardsJoinOneGroupWhenItIsRead) {
  ScratchDir dir;
  const auto staging = dir / "ckpt";
  fs::create_directories(staging);
  const ShardLayout layout{.ranks = 2,
                           .groups = {{{"a.weight", {2, 4}}, {"a.bias", {2}}}, {{"b.weight", {3}}}},
                           .kinds = {{"weights", {.into_weights = true}}, {"ema", {.prefix = "ema."}}}};
  write_checkpoint_files(staging, make_checkpoint(3), layout);
  const auto a = torch::arange(10.0f), b = torch::constant_pad_nd(torch::arange(10.0f, 13.0f), {0, 1});
  for (int64_t rank = 0; rank < 2; ++rank) {
    write_checkpoint_shard(staging, rank, 2,
                           {{"weights.0", a.slice(0, 5 * rank, 5 * rank + 5)},
                            {"ema.0", -a.slice(0, 5 * rank, 5 * rank + 5)},
                            {"weights.1", b.slice(0, 2 * rank, 2 * rank + 2)},
                            {"ema.1", -b.slice(0, 2 * rank, 2 * rank + 2)}});
  }
  ShardedWeights unread;
  const auto opened = load_inference_checkpoint(staging, unread);
  ASSERT_FALSE(unread.empty());
  EXPECT_EQ(unread.names(), (std::vector<std::string>{"a.weight", "a.bias", "b.weight"}));
  const auto read_whole = inference_weights(opened);
  EXPECT_EQ(read_whole.count("a.weight") + read_whole.count("b.weight"), 0u) << "left in the shards";
  EXPECT_EQ(opened.state_metadata.count("shard_layout"), 0u);
  const auto only_b = unread.read([](const std::string& name) { return name == "b.weight"; });
  ASSERT_EQ(only_b.size(), 1u);
  EXPECT_TRUE(torch::equal(only_b.at("b.weight"), -torch::arange(10.0f, 13.0f))) << "the average, as inference reads";
  const auto joined = inference_weights(load_inference_checkpoint(staging));
  for (const auto& [name, tensor] : unread.read([](const std::string&) { return true; })) {
    EXPECT_TRUE(torch::equal(tensor, joined.at(name))) << name;
  }
  // Group 0's average missing from one shard: reading group 1 never touches it, reading
  // group 0 finds it missing.
  const auto broken = dir / "broken";
  fs::create_directories(broken);
  write_checkpoint_files(broken, make_checkpoint(3), layout);
  for (int64_t rank = 0; rank < 2; ++rank) {
    TensorMap shard{{"weights.0", a.slice(0, 5 * rank, 5 * rank + 5)},
                    {"weights.1", b.slice(0, 2 * rank, 2 * rank + 2)},
                    {"ema.1", -b.slice(0, 2 * rank, 2 * rank + 2)}};
    if (rank == 0) shard.emplace("ema.0", -a.slice(0, 0, 5));
    write_checkpoint_shard(broken, rank, 2, shard);
  }
  ShardedWeights partly;
  load_inference_checkpoint(broken, partly);
  EXPECT_EQ(partly.read([](const std::string& name) { return name == "b.weight"; }).size(), 1u);
  EXPECT_THROW_WITH(partly.read([](const std::string& name) { return name == "a.bias"; }), Error,
                    "a shard lacks 'ema.0'");
  save_checkpoint(dir / "whole", make_checkpoint(1));
  ShardedWeights none;
  load_inference_checkpoint(dir / "whole", none);
  EXPECT_TRUE(none.empty()) << "a checkpoint that was not sharded has no shards to leave unread";
}

TEST(Checkpoint, ARankTakesItsSlicesOfACheckpointThatWasNotSharded) {
  ScratchDir dir;
  auto whole = make_checkpoint(3);
  whole.weights.emplace("block.weight", torch::arange(8.0f).view({2, 4}));
  whole.weights.emplace("block.bias", torch::tensor({8.0f, 9.0f}));
  whole.state.emplace("ema.block.weight", -torch::arange(8.0f).view({2, 4}));
  whole.state.emplace("ema.block.bias", -torch::tensor({8.0f, 9.0f}));
  whole.state.emplace("adamw.block.weight.exp_avg", torch::ones({2, 4}));
  save_checkpoint(dir / "ckpt", whole);
  auto without_moments = block_layout(3);
  without_moments.kinds.erase("exp_avg");
  const auto read = load_checkpoint_for_rank(dir / "ckpt", without_moments, 1, 3);
  EXPECT_TRUE(torch::equal(read.slices.at("weights.0"), torch::arange(4.0f, 8.0f)));
  EXPECT_TRUE(torch::equal(read.slices.at("ema.0"), -torch::arange(4.0f, 8.0f)));
  EXPECT_TRUE(read.shard_bytes_read.empty());
  EXPECT_EQ(read.replicated.weights.count("block.bias"), 0u);
  EXPECT_EQ(read.replicated.state.count("ema.block.weight"), 0u);
  EXPECT_TRUE(read.replicated.weights.count("layer.weight"));
  EXPECT_THROW_WITH(load_checkpoint_for_rank(dir / "ckpt", block_layout(3), 0, 3), Error,
                    "'exp_avg' for some of group 0's parameters only");
}

TEST(CheckpointStore, TracksLatestAndPrunesOldSteps) {
  ScratchDir dir;
  CheckpointStore store(dir / "checkpoints", /*keep=*/2);
  EXPECT_FALSE(store.latest().has_value());
  for (int step : {100, 200, 300}) store.save(step, make_checkpoint(static_cast<float>(step)));
  EXPECT_EQ(store.steps(), (std::vector<int64_t>{200, 300}));
  ASSERT_TRUE(store.latest().has_value());
  EXPECT_EQ(load_checkpoint(*store.latest()).state_metadata.at("step"), "300");
}

TEST(CheckpointStore, IgnoresTheDebrisOfAnInterruptedSave) {
  ScratchDir dir;
  CheckpointStore store(dir / "checkpoints");
  store.save(5, make_checkpoint(5));
  // A save killed half-way leaves a staging directory behind and `latest` untouched.
  fs::create_directories(dir / "checkpoints/step-000000010.tmp-123-0");
  EXPECT_EQ(load_checkpoint(*store.latest()).state_metadata.at("step"), "5");
  EXPECT_EQ(store.steps(), (std::vector<int64_t>{5}));
}

TEST(CheckpointStore, FallsBackToNewestStepWhenLatestIsStale) {
  ScratchDir dir;
  CheckpointStore store(dir / "checkpoints", 0);
  store.save(1, make_checkpoint(1));
  store.save(2, make_checkpoint(2));
  for (const char* pointer : {"step-000000099\n", "\n", "../..\n"}) {
    testing::write_text(dir / "checkpoints/latest", pointer);
    EXPECT_EQ(load_checkpoint(*store.latest()).state_metadata.at("step"), "2") << pointer;
  }
}

}  // namespace
}  // namespace dalle::io
