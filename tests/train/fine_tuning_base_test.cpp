#include "train/fine_tuning_base.h"

#include <torch/torch.h>

#include <filesystem>
#include <set>

#include "dalle/io/checkpoint.h"
#include "dalle/io/sharded_checkpoint.h"
#include "test_support.h"

namespace dalle::train {
namespace {

using testing::ScratchDir;

const std::vector<std::string> kFrozen = {"resblocks.0.attn.weight", "resblocks.0.norm.bias",
                                          "resblocks.1.attn.weight", "to_logits.weight"};

io::TensorMap values() {
  return {{"resblocks.0.attn.weight", torch::arange(6.0f).view({2, 3})},
          {"resblocks.0.norm.bias", torch::arange(2.0f)},
          {"resblocks.1.attn.weight", -torch::arange(6.0f).view({3, 2})},
          {"to_logits.weight", torch::ones({2, 2})}};
}

// A model that holds its ends whole and its blocks no longer (cut into shards): empty tensors.
NamedTensors sharded_model() {
  NamedTensors ours;
  for (const auto& [name, tensor] : values()) {
    ours.insert(name, name.rfind("resblocks.", 0) == 0 ? torch::empty({0}) : tensor);
  }
  return ours;
}

// The blocks' values as read, each call's picks recorded; `changed` given a different value.
struct Reader {
  std::vector<std::set<std::string>> calls;
  std::string changed;
  io::TensorMap operator()(const std::function<bool(const std::string&)>& wanted) {
    io::TensorMap picked;
    calls.emplace_back();
    for (const auto& [name, tensor] : values()) {
      if (!wanted(name) || name.rfind("resblocks.", 0) != 0) continue;
      calls.back().insert(name);
      picked.emplace(name, name == changed ? tensor + 1 : tensor);
    }
    return picked;
  }
};

std::string block_of(const std::string& name) { return name.substr(0, name.find('.', 10) + 1); }

TEST(FineTuningBase, FrozenValuesAsReadAreComparedWithTheBaseOneBlockAtATime) {
  ScratchDir dir;
  io::save_checkpoint(dir / "whole", {"model: {}\n", values(), {}, {}});
  // The same values in a sharded checkpoint: the blocks in its shards, the head whole.
  const io::ShardLayout layout{
      .ranks = 2,
      .groups = {{{"resblocks.0.attn.weight", {2, 3}}, {"resblocks.0.norm.bias", {2}}},
                 {{"resblocks.1.attn.weight", {3, 2}}}},
      .kinds = {{"weights", {.into_weights = true}}}};
  const auto staging = dir / "sharded";
  std::filesystem::create_directories(staging);
  io::write_checkpoint_files(staging, {"model: {}\n", {{"to_logits.weight", torch::ones({2, 2})}}, {}, {}}, layout);
  const auto first = torch::cat({torch::arange(6.0f), torch::arange(2.0f)});
  const auto second = -torch::arange(6.0f).view({3, 2}).reshape({-1});
  for (int64_t rank = 0; rank < 2; ++rank) {
    io::write_checkpoint_shard(staging, rank, 2,
                               {{"weights.0", first.slice(0, 4 * rank, 4 * rank + 4)},
                                {"weights.1", second.slice(0, 3 * rank, 3 * rank + 3)}});
  }
  for (const auto& base : {dir / "whole", staging}) {
    Reader reader;
    const auto as_read = [&reader](const std::function<bool(const std::string&)>& wanted) { return reader(wanted); };
    EXPECT_TRUE(holds_as_they_are(base, sharded_model(), kFrozen, as_read)) << base;
    std::set<std::string> asked;
    for (const auto& call : reader.calls) {
      std::set<std::string> blocks;
      for (const auto& name : call) blocks.insert(block_of(name));
      EXPECT_LE(blocks.size(), 1u) << base << ": one block's values at a time";
      asked.insert(call.begin(), call.end());
    }
    EXPECT_EQ(asked.size(), 3u) << base << ": every block's frozen values compared";

    reader = {};
    reader.changed = "resblocks.1.attn.weight";
    EXPECT_FALSE(holds_as_they_are(base, sharded_model(), kFrozen, as_read)) << base;
  }
  // Without the values as read, the model's own (empty) blocks are not the base's.
  EXPECT_FALSE(holds_as_they_are(dir / "whole", sharded_model(), kFrozen));
  NamedTensors whole;
  for (const auto& [name, tensor] : values()) whole.insert(name, tensor);
  EXPECT_TRUE(holds_as_they_are(dir / "whole", whole, kFrozen));
  whole.insert("resblocks.2.attn.weight", torch::zeros({2}));
  EXPECT_FALSE(holds_as_they_are(dir / "whole", whole, {"resblocks.2.attn.weight"})) << "a name the base lacks";
}

}  // namespace
}  // namespace dalle::train
