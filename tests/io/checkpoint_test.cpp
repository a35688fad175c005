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
