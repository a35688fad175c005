// ShardedResblocks built with the prior (models::ResblockBuilt): each block cut into its shards
// as soon as it is drawn holds, on every rank, the weights of a whole build from the same seed.
#include "dalle/train/sharded_resblocks.h"

#include <torch/torch.h>

#include <map>
#include <mutex>

#include "distributed/on_ranks.h"
#include "test_support.h"

namespace dalle::train {
namespace {

models::PriorConfig tiny_model() {
  return {.text_length = 6, .text_vocab_size = 20, .grid_size = 5, .image_vocab_size = 12, .layers = 3, .width = 32,
          .heads = 4, .conv_kernel = 3};
}

bool is_matrix(const std::string&, const torch::Tensor& parameter) { return parameter.dim() == 2; }

TEST(ShardedResblocks, APriorBuiltShardedHoldsTheWholeBuildsWeights) {
  const auto config = tiny_model();
  torch::manual_seed(5);
  const models::Prior whole(config);
  std::map<std::string, torch::Tensor> expected;
  for (const auto& item : whole->named_parameters()) expected.emplace(item.key(), item.value().detach());
  for (const int64_t ranks : {2, 3}) {
    std::mutex drawing;  // the ranks are threads of one process, sharing its random generator
    testing::on_ranks(ranks, [&](const distributed::LaunchEnvironment& place) {
      const size_t blocks = 2 * static_cast<size_t>(config.layers);
      const auto group = testing::group_at(place);
      ShardedResblocks shards(blocks, is_matrix, group, true, nullptr, torch::kBFloat16);
      models::Prior prior{nullptr};
      {
        std::lock_guard<std::mutex> lock(drawing);
        torch::manual_seed(5);
        prior = models::Prior(config, [&](size_t b, models::ResblockImpl& block) { shards.add_block(b, block); });
      }
      for (const auto& item : prior->named_parameters()) {
        if (item.key().starts_with("resblocks.")) {
          EXPECT_EQ(item.value().numel(), 0) << item.key() << " holds only its shard";
        } else {
          EXPECT_TRUE(torch::equal(item.value(), expected.at(item.key()))) << item.key();
        }
      }
      const auto& sharded = *shards.parameters();
      ASSERT_EQ(sharded.groups(), 3 * blocks);
      for (size_t g = 0; g < sharded.groups(); ++g) {
        const auto full = sharded.unshard(g, sharded.shard(g));
        ASSERT_EQ(full.size(), shards.names(g).size());
        for (size_t i = 0; i < full.size(); ++i) {
          const auto& name = shards.names(g)[i];
          const auto stored = g < 2 * blocks && g % 2 == 0 ? torch::kBFloat16 : torch::kFloat32;
          EXPECT_EQ(full[i].scalar_type(), stored) << name;
          EXPECT_TRUE(torch::equal(full[i], expected.at(name).to(stored))) << name;
        }
      }
      // The same blocks cut from a whole build: the same shards.
      models::Prior copy(config);
      torch::NoGradGuard no_grad;
      for (auto& item : copy->named_parameters()) item.value().copy_(expected.at(item.key()));
      ShardedResblocks cut(*copy, is_matrix, group, true, nullptr, torch::kBFloat16);
      for (size_t g = 0; g < sharded.groups(); ++g) {
        EXPECT_TRUE(torch::equal(cut.parameters()->shard(g), sharded.shard(g))) << "group " << g;
        EXPECT_EQ(cut.names(g), shards.names(g)) << "group " << g;
      }
    });
  }
}

}  // namespace
}  // namespace dalle::train
