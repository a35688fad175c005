#include "dalle/models/export_weights.h"

#include <torch/torch.h>

#include <limits>
#include <optional>

#include "dalle/error.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/safetensors.h"
#include "dalle/io/sharded_checkpoint.h"
#include "dalle/io/state_dict.h"
#include "dalle/models/adapter.h"
#include "dalle/models/clip.h"
#include "dalle/models/prior.h"
#include "dalle/models/trained.h"
#include "test_support.h"

namespace dalle::models {
namespace {

namespace fs = std::filesystem;

const char* const kClipYaml =
    "kind: clip\nmodel:\n  embed_dim: 8\n  image_size: 16\n  patch_size: 8\n  vision_width: 16\n"
    "  vision_layers: 1\n  vision_heads: 2\n  context_length: 8\n  vocab_size: 16\n  text_width: 16\n"
    "  text_layers: 1\n  text_heads: 2\n  eos_id: 3\n";

// A freshly initialised tiny CLIP's weights: each seed a different point to average.
io::TensorMap clip_weights(uint64_t seed) {
  torch::manual_seed(seed);
  Clip clip(ClipConfig{.embed_dim = 8, .image_size = 16, .patch_size = 8, .vision_width = 16, .vision_layers = 1,
                       .vision_heads = 2, .context_length = 8, .vocab_size = 16, .text_width = 16, .text_layers = 1,
                       .text_heads = 2, .eos_id = 3});
  return io::state_dict(*clip);
}

// A run whose checkpoints at updates 100, 200, 300 hold the weights of seeds 1, 2, 3, and
// with `ema` a moving average (seeds 11, 12, 13) in their state, as a trainer writes it.
std::string make_run(const testing::ScratchDir& dir, bool ema) {
  io::CheckpointStore store(dir / "run/checkpoints", 0);
  for (uint64_t i = 1; i <= 3; ++i) {
    io::TensorMap state;
    if (ema) {
      for (auto& [name, tensor] : clip_weights(10 + i)) state.emplace("ema." + name, tensor);
    }
    store.save(static_cast<int64_t>(100 * i), {kClipYaml, clip_weights(i), state, {}});
  }
  return dir / "run";
}

torch::Tensor mean_of(const std::vector<uint64_t>& seeds, const std::string& name) {
  auto sum = torch::zeros_like(clip_weights(seeds[0]).at(name), torch::kFloat64);
  for (auto seed : seeds) sum += clip_weights(seed).at(name).to(torch::kFloat64);
  return (sum / static_cast<double>(seeds.size())).to(torch::kFloat32);
}

TEST(ExportWeights, AveragesTheNewestCheckpointsOfARun) {
  testing::ScratchDir dir;
  const auto run = make_run(dir, /*ema=*/false);
  const auto exported = export_weights(run, dir / "two", {}, 2);
  ASSERT_EQ(exported.averaged.size(), 2u);
  EXPECT_EQ(exported.checkpoint, exported.averaged.back());
  EXPECT_THAT(exported.averaged.front(), ::testing::HasSubstr("step-000000200"));
  EXPECT_THAT(exported.checkpoint, ::testing::HasSubstr("step-000000300"));
  const auto two = io::read_safetensors(dir / "two/model.safetensors").tensors;
  for (const char* name : {"visual.conv1.weight", "token_embedding.weight", "logit_scale"}) {
    EXPECT_TRUE(torch::allclose(two.at(name), mean_of({2, 3}, name), 1e-6, 1e-7)) << name;
  }
  EXPECT_FALSE(torch::equal(two.at("visual.conv1.weight"), clip_weights(3).at("visual.conv1.weight")));
  export_weights(run, dir / "three", {}, 3);
  EXPECT_TRUE(torch::allclose(io::read_safetensors(dir / "three/model.safetensors").tensors.at("visual.proj"),
                              mean_of({1, 2, 3}, "visual.proj"), 1e-6, 1e-7));
  // One checkpoint "averaged" is the plain export of the newest.
  export_weights(run, dir / "one", {}, 1);
  EXPECT_TRUE(torch::equal(io::read_safetensors(dir / "one/model.safetensors").tensors.at("visual.proj"),
                           clip_weights(3).at("visual.proj")));
  // The average loads as the model it is.
  EXPECT_NO_THROW(load_trained_clip(dir / "three"));
}

TEST(ExportWeights, AveragesTheMovingAveragesWhenTheRunKeepsThem) {
  testing::ScratchDir dir;
  const auto exported = export_weights(make_run(dir, /*ema=*/true), dir / "out", {}, 2);
  EXPECT_TRUE(exported.moving_average);
  EXPECT_TRUE(torch::allclose(io::read_safetensors(dir / "out/model.safetensors").tensors.at("visual.proj"),
                              mean_of({12, 13}, "visual.proj"), 1e-6, 1e-7));
}

TEST(ExportWeights, AveragingRefusesTooFewOrMismatchedCheckpointsAndWritesNothing) {
  testing::ScratchDir dir;
  const auto run = make_run(dir, /*ema=*/false);
  EXPECT_THROW_WITH(export_weights(run, dir / "out", {}, 4), Error, "has 3 checkpoints, fewer than the 4");
  EXPECT_THROW_WITH(export_weights(run + "/checkpoints/step-000000300", dir / "out", {}, 2), Error,
                    "needs the run directory, not one checkpoint");
  EXPECT_THROW_WITH(export_weights(run, dir / "out", {}, 0), Error, "at least 1");
  EXPECT_THROW_WITH(export_weights(run, run + "/checkpoints/step-000000200", {}, 2), Error,
                    "is a checkpoint being exported");
  // A moving average is not blended with another checkpoint's raw weights.
  io::TensorMap ema;
  for (auto& [name, tensor] : clip_weights(5)) ema.emplace("ema." + name, tensor);
  io::CheckpointStore(dir / "run/checkpoints", 0).save(400, {kClipYaml, clip_weights(5), ema, {}});
  EXPECT_THROW_WITH(export_weights(run, dir / "out", {}, 2), Error, "step-000000300",
                    "keeps no moving average of the weights, unlike the newest");
  fs::remove_all(dir / "run/checkpoints/step-000000400");
  // A checkpoint of another model among the newest is refused by name.
  auto other = clip_weights(4);
  other["visual.proj"] = torch::zeros({16, 4});
  io::CheckpointStore(dir / "run/checkpoints", 0).save(250, {kClipYaml, other, {}, {}});
  EXPECT_THROW_WITH(export_weights(run, dir / "out", {}, 2), Error, "step-000000250",
                    "tensor visual.proj is missing or has another shape");
  EXPECT_FALSE(fs::exists(dir / "out"));
}

const char* const kPriorYaml =
    "model:\n  text_length: 6\n  text_vocab_size: 20\n  grid_size: 4\n  image_vocab_size: 12\n  layers: 2\n"
    "  width: 32\n  heads: 4\n  conv_kernel: 3\n";

// A checkpoint as 2 ranks of a sharded run write it: each resblock a group cut in two shards
// (of the weights, the checkpoint keeping no average), the embeddings, the head and adapters
// whole in rank 0's files, in `directory`; `poison` NaN in the first value of that group's
// second shard; `base`: the checkpoint it refers to for what it lacks.
std::string write_sharded_prior(const std::string& directory, const io::TensorMap& weights,
                                std::optional<size_t> poison = std::nullopt, const std::string& yaml = kPriorYaml,
                                const std::string& base = "") {
  const int64_t ranks = 2;
  io::ShardLayout layout{.ranks = ranks, .kinds = {{"weights", {.into_weights = true}}}};
  io::TensorMap ends;
  std::vector<io::TensorMap> shards(ranks);
  for (size_t b = 0; b < 4; ++b) {
    const auto prefix = "resblocks." + std::to_string(b) + ".";
    std::vector<torch::Tensor> values;
    layout.groups.emplace_back();
    for (const auto& [name, tensor] : weights) {
      if (!name.starts_with(prefix) || is_adapter_tensor(name)) continue;
      layout.groups.back().push_back({name, tensor.sizes().vec()});
      values.push_back(tensor.reshape({-1}));
    }
    auto flat = torch::cat(values);
    const auto share = io::shard_size(flat.numel(), ranks);
    flat = torch::constant_pad_nd(flat, {0, share * ranks - flat.numel()});
    if (poison == b) flat[share] = std::numeric_limits<float>::quiet_NaN();
    for (int64_t rank = 0; rank < ranks; ++rank) {
      shards[rank].emplace("weights." + std::to_string(b), flat.narrow(0, rank * share, share).clone());
    }
  }
  for (const auto& [name, tensor] : weights) {
    if (!name.starts_with("resblocks.") || is_adapter_tensor(name)) ends.emplace(name, tensor);
  }
  std::filesystem::create_directories(directory);
  io::Checkpoint checkpoint{yaml, ends, {}, {}};
  if (!base.empty()) io::refer_to_base(checkpoint, base);
  io::write_checkpoint_files(directory, checkpoint, layout);
  for (int64_t rank = 0; rank < ranks; ++rank) io::write_checkpoint_shard(directory, rank, ranks, shards[rank]);
  return directory;
}

io::TensorMap tiny_prior_weights(uint64_t seed = 7) {
  torch::manual_seed(seed);
  Prior prior(PriorConfig{.text_length = 6, .text_vocab_size = 20, .grid_size = 4, .image_vocab_size = 12,
                          .layers = 2, .width = 32, .heads = 4, .conv_kernel = 3});
  return io::state_dict(*prior);
}

// A sharded run's prior is exported one resblock at a time (read from the shards, checked by
// loading it into its block, written, freed): the file holds the joined checkpoint's weights,
// bit for bit, in the order they were read, and loads as a prior; the generator loads the
// sharded checkpoint block by block to the same model.
TEST(ExportWeights, AShardedPriorIsWrittenBlockByBlockAsTheJoinedCheckpointHoldsIt) {
  testing::ScratchDir dir;
  const auto weights = tiny_prior_weights();
  const auto sharded = write_sharded_prior(dir / "sharded", weights);
  const auto exported = export_weights(sharded, dir / "out");
  EXPECT_TRUE(exported.streamed);
  EXPECT_FALSE(exported.moving_average);
  EXPECT_EQ(exported.tensors, static_cast<int64_t>(weights.size()));
  const auto file = io::read_safetensors(dir / "out/model.safetensors");
  ASSERT_EQ(file.tensors.size(), weights.size());
  for (const auto& [name, tensor] : weights) EXPECT_TRUE(torch::equal(file.tensors.at(name), tensor)) << name;
  // Block 0's first, the ends last: the bytes follow the reading, not the names.
  const auto offset = [&](const std::string& name) { return file.tensors.at(name).data_ptr<float>(); };
  EXPECT_LT(offset("resblocks.0.qkv.weight"), offset("resblocks.1.fc_in.weight"));
  EXPECT_LT(offset("resblocks.3.fc_out.weight"), offset("image_embedding.weight"));
  const auto loaded = io::state_dict(*load_trained_prior(dir / "out").model);
  const auto from_shards = io::state_dict(*load_trained_prior(sharded).model);
  for (const auto& [name, tensor] : weights) {
    EXPECT_TRUE(torch::equal(loaded.at(name), tensor)) << name;
    EXPECT_TRUE(torch::equal(from_shards.at(name), tensor)) << name;
  }
  // A second export replaces the first.
  EXPECT_NO_THROW(export_weights(sharded, dir / "out"));
}

// The check still reads every value: a NaN in a block's shard is refused by name, after the
// blocks before it were written, and nothing appears at the output.
TEST(ExportWeights, AShardedPriorWithANonFiniteBlockIsRefusedAndWritesNothing) {
  testing::ScratchDir dir;
  const auto sharded = write_sharded_prior(dir / "sharded", tiny_prior_weights(), /*poison=*/2);
  EXPECT_THROW_WITH(export_weights(sharded, dir / "out"), Error, "resblocks.2.", "NaN or infinite");
  EXPECT_FALSE(fs::exists(dir / "out"));
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    EXPECT_EQ(entry.path().filename().string().find("out."), std::string::npos) << entry.path() << " was left";
  }
}

// Averaging a sharded run's newest checkpoints reads them one block at a time as well: the
// file holds, bit for bit, what averaging the same weights written whole gives; an older
// checkpoint of another model is refused by name, and nothing is written.
TEST(ExportWeights, AShardedRunsNewestCheckpointsAreAveragedBlockByBlock) {
  testing::ScratchDir dir;
  const io::CheckpointStore sharded(dir / "run/checkpoints", 0);
  io::CheckpointStore whole(dir / "whole/checkpoints", 0);
  for (uint64_t seed : {7, 8, 9}) {
    write_sharded_prior(sharded.directory_for(100 * static_cast<int64_t>(seed)), tiny_prior_weights(seed));
    whole.save(100 * static_cast<int64_t>(seed), {kPriorYaml, tiny_prior_weights(seed), {}, {}});
  }
  const auto exported = export_weights(dir / "run", dir / "out", {}, 2);
  EXPECT_TRUE(exported.streamed);
  ASSERT_EQ(exported.averaged.size(), 2u);
  EXPECT_THAT(exported.averaged.front(), ::testing::HasSubstr("step-000000800"));
  EXPECT_FALSE(export_weights(dir / "whole", dir / "whole-out", {}, 2).streamed);
  const auto streamed = io::read_safetensors(dir / "out/model.safetensors").tensors;
  const auto joined = io::read_safetensors(dir / "whole-out/model.safetensors").tensors;
  ASSERT_EQ(streamed.size(), joined.size());
  for (const auto& [name, tensor] : joined) EXPECT_TRUE(torch::equal(streamed.at(name), tensor)) << name;
  // Truly the mean, not the newest alone.
  const auto& weight = joined.at("resblocks.3.fc_in.weight");
  const auto expected = tiny_prior_weights(8).at("resblocks.3.fc_in.weight").to(torch::kFloat64)
                            .add(tiny_prior_weights(9).at("resblocks.3.fc_in.weight").to(torch::kFloat64))
                            .div(2)
                            .to(torch::kFloat32);
  EXPECT_TRUE(torch::equal(weight, expected));

  auto other = tiny_prior_weights(8);
  other["resblocks.1.fc_out.weight"] = torch::zeros({32, 64});
  fs::remove_all(sharded.directory_for(800));
  write_sharded_prior(sharded.directory_for(800), other);
  EXPECT_THROW_WITH(export_weights(dir / "run", dir / "refused", {}, 2), Error, "step-000000800",
                    "resblocks.1.");
  EXPECT_FALSE(fs::exists(dir / "refused"));
}

// A sharded fine-tuning run (its blocks' norms trained and sharded, adapters on two matrices
// kept whole, the rest frozen in its base, sharded or whole) is exported one block at a time
// too: each block read from the run's shards or the base's, its adapters folded in as it is
// read. The file holds, bit for bit, the base with the run's norms and the adapters folded; it
// loads as a prior without adapters; the generator reads the run to the same model.
TEST(ExportWeights, AShardedFineTuningRunIsReadBlockByBlockFromItsShardsAndItsBases) {
  testing::ScratchDir dir;
  const auto base_weights = tiny_prior_weights(7);
  write_sharded_prior(dir / "sharded-base", base_weights);
  io::save_checkpoint(dir / "whole-base", {kPriorYaml, base_weights, {}, {}});
  torch::manual_seed(5);
  io::TensorMap run, expected = base_weights;
  for (int b = 0; b < 4; ++b) {
    for (const std::string part : {"weight", "bias"}) {
      const auto name = "resblocks." + std::to_string(b) + ".norm." + part;
      run[name] = expected[name] = torch::randn({32});
    }
  }
  for (const auto& [layer, out] : {std::pair{"resblocks.0.qkv", 96}, std::pair{"resblocks.3.fc_in", 128}}) {
    run[std::string(layer) + ".lora_A.weight"] = torch::randn({4, 32});
    run[std::string(layer) + ".lora_B.weight"] = torch::randn({out, 4});
  }
  expected = merge_adapter_tensors(expected, adapter_tensors(run), /*scale=*/8.0 / 4);
  const std::string yaml = std::string(kPriorYaml) + "adapter: {rank: 4, alpha: 8}\n";
  for (const std::string base : {"sharded-base", "whole-base"}) {
    const auto directory = write_sharded_prior(dir / ("run-on-" + base), run, std::nullopt, yaml, dir / base);
    const auto read = read_trained_prior_weights(directory);
    EXPECT_FALSE(read.unread.empty()) << base << ": not joined whole";
    EXPECT_EQ(read.weights.count("resblocks.0.qkv.weight"), base == "whole-base" ? 1u : 0u) << base;
    const auto exported = export_weights(directory, dir / ("out-" + base));
    EXPECT_TRUE(exported.streamed) << base;
    EXPECT_EQ(exported.merged_adapters, 2) << base;
    const auto file = io::read_safetensors(dir / ("out-" + base + "/model.safetensors"));
    ASSERT_EQ(file.tensors.size(), expected.size()) << base;
    for (const auto& [name, tensor] : expected) EXPECT_TRUE(torch::equal(file.tensors.at(name), tensor)) << name;
    const auto loaded = io::state_dict(*load_trained_prior(dir / ("out-" + base)).model);
    const auto from_run = io::state_dict(*load_trained_prior(directory).model);
    for (const auto& [name, tensor] : expected) {
      EXPECT_TRUE(torch::equal(loaded.at(name), tensor)) << name;
      EXPECT_TRUE(torch::equal(from_run.at(name), tensor)) << name;
    }
  }
}

// Averaging a run's checkpoints that hold adapters averages the models they make: each
// checkpoint's adapters folded into its weights first (the mean of B A, not the product of
// the means of B and of A).
TEST(ExportWeights, AveragingARunWithAdaptersAveragesTheModelsTheyMake) {
  testing::ScratchDir dir;
  const auto base = tiny_prior_weights(7);
  const std::string yaml = std::string(kPriorYaml) + "adapter: {rank: 2, alpha: 2}\n";
  io::CheckpointStore store(dir / "run/checkpoints", 0);
  std::vector<io::TensorMap> folded;
  for (int64_t step : {1, 2}) {
    auto weights = base;
    torch::manual_seed(static_cast<uint64_t>(step));
    weights["resblocks.1.fc_out.lora_A.weight"] = torch::randn({2, 128});
    weights["resblocks.1.fc_out.lora_B.weight"] = torch::randn({32, 2});
    folded.push_back(merge_adapter_tensors(weights, adapter_tensors(weights), 1.0));
    store.save(step, {yaml, weights, {}, {}});
  }
  const auto exported = export_weights(dir / "run", dir / "out", {}, 2);
  EXPECT_EQ(exported.merged_adapters, 1);
  const auto file = io::read_safetensors(dir / "out/model.safetensors").tensors;
  const std::string matrix = "resblocks.1.fc_out.weight";
  const auto expected =
      folded[0].at(matrix).to(torch::kFloat64).add(folded[1].at(matrix).to(torch::kFloat64)).div(2).to(torch::kFloat32);
  EXPECT_TRUE(torch::equal(file.at(matrix), expected));
  EXPECT_EQ(file.count("resblocks.1.fc_out.lora_A.weight"), 0u);
}

}  // namespace
}  // namespace dalle::models
