#include "dalle/data/token_dataset.h"

#include <torch/torch.h>

#include "dalle/error.h"
#include "dalle/io/safetensors.h"
#include "test_support.h"

namespace dalle::data {
namespace {

using testing::ScratchDir;

TokenDatasetInfo info(int64_t image_vocab = 512) {
  return {.image_vocab_size = image_vocab, .text_vocab_size = 100, .grid_height = 2, .grid_width = 3,
          .text_length = 4, .source = "test"};
}

TEST(TokenDataset, RoundTripsAcrossShardsWithSeveralCaptionsPerImage) {
  ScratchDir dir;
  TokenDatasetWriter writer(dir / "tokens", info(), /*images_per_shard=*/2);
  std::vector<torch::Tensor> grids;
  for (int64_t i = 0; i < 5; ++i) {
    grids.push_back(torch::arange(6).view({2, 3}) + 100 * i);
    const int64_t captions = 1 + i % 2;
    writer.add(grids.back(), torch::full({captions, 4}, i), std::vector<std::string>(captions, "image " + std::to_string(i)));
  }
  const auto written = writer.finish();
  EXPECT_EQ(written.shards, 3);
  EXPECT_EQ(written.images, 5);
  EXPECT_EQ(written.captions, 7);

  const auto dataset = TokenDataset::open(dir / "tokens");
  ASSERT_EQ(dataset->size(), 7u);
  std::mt19937_64 rng(0);
  for (size_t index = 0; index < dataset->size(); ++index) {
    const auto example = dataset->get(index, rng);
    const int64_t image = example->text_tokens[0].item<int64_t>();
    EXPECT_TRUE(torch::equal(example->image_tokens, grids[image])) << index;
    EXPECT_EQ(example->caption, "image " + std::to_string(image));
    EXPECT_EQ(example->image_tokens.scalar_type(), torch::kInt64);
  }
  EXPECT_EQ(dataset->info().grid_width, 3);
}

TEST(TokenDataset, LargeVocabulariesKeepTheirIds) {
  ScratchDir dir;
  TokenDatasetWriter writer(dir / "tokens", info(70000));
  writer.add(torch::full({2, 3}, 69999), torch::zeros({1, 4}), {"x"});
  writer.finish();
  std::mt19937_64 rng(0);
  EXPECT_EQ(TokenDataset::open(dir / "tokens")->get(0, rng)->image_tokens.max().item<int64_t>(), 69999);
}

TEST(TokenDataset, ReplacesOnlyTokenDatasetsAndOnlyWhenComplete) {
  ScratchDir dir;
  std::filesystem::create_directories(dir / "mine");
  testing::write_text(dir / "mine/notes.txt", "keep me");
  EXPECT_THROW_WITH(TokenDatasetWriter(dir / "mine", info()), Error, "is not a token dataset");
  EXPECT_EQ(testing::read_text(dir / "mine/notes.txt"), "keep me");

  TokenDatasetWriter first(dir / "tokens", info());
  first.add(torch::zeros({2, 3}), torch::zeros({1, 4}), {"old"});
  first.finish();
  {
    TokenDatasetWriter interrupted(dir / "tokens", info(), 1);
    interrupted.add(torch::ones({2, 3}), torch::ones({1, 4}), {"new"});  // a shard is written...
  }  // ...and the writer dies before finish()
  std::mt19937_64 rng(0);
  EXPECT_EQ(TokenDataset::open(dir / "tokens")->get(0, rng)->caption, "old");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 2) << "no temporary left";

  TokenDatasetWriter second(dir / "tokens", info());
  second.add(torch::ones({2, 3}), torch::ones({1, 4}), {"new \xff"});  // invalid UTF-8 is replaced
  second.finish();
  EXPECT_EQ(TokenDataset::open(dir / "tokens")->get(0, rng)->caption, "new \xef\xbf\xbd");
}

TEST(TokenDataset, RefusesIdsOutsideTheVocabulary) {
  ScratchDir dir;
  TokenDatasetWriter writer(dir / "tokens", info());
  writer.add(torch::full({2, 3}, 511), torch::zeros({1, 4}), {"x"});
  writer.finish();
  io::write_safetensors(dir / "tokens/shard-00000.safetensors",
                        {{"image_tokens", torch::full({1, 2, 3}, 512, torch::kInt16)},
                         {"text_tokens", torch::zeros({1, 4}, torch::kInt16)},
                         {"caption_image", torch::zeros({1}, torch::kInt32)}});
  EXPECT_THROW_WITH(TokenDataset::open(dir / "tokens"), Error, "'image_tokens' holds ids outside [0, 512)");
  io::write_safetensors(dir / "tokens/shard-00000.safetensors",
                        {{"image_tokens", torch::zeros({1, 2, 3})},
                         {"text_tokens", torch::zeros({1, 4}, torch::kInt16)},
                         {"caption_image", torch::zeros({1}, torch::kInt32)}});
  EXPECT_THROW_WITH(TokenDataset::open(dir / "tokens"), Error, "must hold integers");
}

TEST(TokenDataset, RefusesBadInputAndIncompleteFolders) {
  ScratchDir dir;
  TokenDatasetWriter writer(dir / "tokens", info());
  EXPECT_THROW_WITH(writer.add(torch::zeros({3, 3}), torch::zeros({1, 4}), {"x"}), Error, "[2, 3] grid");
  EXPECT_THROW_WITH(writer.add(torch::zeros({2, 3}), torch::zeros({2, 4}), {"x"}), Error, "one row per caption");
  writer.add(torch::zeros({2, 3}), torch::zeros({1, 4}), {"x"});
  EXPECT_THROW_WITH(TokenDataset::open(dir / "tokens"), Error, "no dataset.json");
  writer.finish();
  testing::write_text(dir / "tokens/shard-00000.jsonl", "\"x\"\n\"extra\"\n");
  EXPECT_THROW_WITH(TokenDataset::open(dir / "tokens"), Error, "caption count differs");
  testing::write_text(dir / "tokens/dataset.json", "{\"format\": \"something-else\"}");
  EXPECT_THROW_WITH(TokenDataset::open(dir / "tokens"), Error, "not a dalle-tokens-1 description");
}

}  // namespace
}  // namespace dalle::data
