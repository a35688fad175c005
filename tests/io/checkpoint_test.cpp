#include "dalle/io/checkpoint.h"

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
