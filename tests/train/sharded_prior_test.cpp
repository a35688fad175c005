// ShardedPrior: the prior built sharded (models::ResblockBuilt, each block cut into its shards
// as soon as it is drawn, then its embeddings and head) holds, on every rank, the weights of a
// whole build from the same seed; the sharded prior computes the ranks' mean gradients.
#include "dalle/train/sharded_prior.h"

#include <torch/torch.h>

#include <map>
#include <mutex>

#include "dalle/distributed/sharded_reducer.h"
#include "dalle/error.h"
#include "dalle/models/adapter.h"
#include "dalle/train/resblock_runner.h"
#include "distributed/on_ranks.h"
#include "test_support.h"

namespace dalle::train {
namespace {

models::PriorConfig tiny_model() {
  return {.text_length = 6, .text_vocab_size = 20, .grid_size = 5, .image_vocab_size = 12, .layers = 3, .width = 32,
          .heads = 4, .conv_kernel = 3};
}

bool is_matrix(const std::string&, const torch::Tensor& parameter) { return parameter.dim() == 2; }

// A batch of two token rows for each of `ranks` ranks.
std::vector<torch::Tensor> batch_per_rank(const models::PriorConfig& config, int64_t ranks) {
  std::vector<torch::Tensor> tokens;
  for (int64_t rank = 0; rank < ranks; ++rank) {
    auto text = torch::randint(4, config.text_vocab_size, {2, config.text_length});
    tokens.push_back(torch::cat({text, torch::randint(0, config.image_vocab_size, {2, config.image_length()})}, 1));
  }
  return tokens;
}

// A prior of `reference`'s config holding its values (built anew: no draws shared between ranks).
models::Prior copy_of(const models::Prior& reference) {
  models::Prior prior(reference->config());
  torch::NoGradGuard no_grad;
  const auto values = reference->named_parameters();
  for (auto& item : prior->named_parameters()) item.value().copy_(values[item.key()]);
  return prior;
}

TEST(ShardedPrior, APriorBuiltShardedHoldsTheWholeBuildsWeights) {
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
      ShardedPrior shards(blocks, is_matrix, group, {}, nullptr, torch::kBFloat16);
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
          EXPECT_TRUE(torch::equal(item.value(), expected.at(item.key()))) << item.key() << " is cut last";
        }
      }
      shards.add_ends(*prior);
      for (const auto& item : prior->named_parameters()) {
        EXPECT_EQ(item.value().numel(), 0) << item.key() << " holds only its shard";
      }
      EXPECT_THROW(shards.add_ends(*prior), Error);
      const auto& sharded = *shards.parameters();
      ASSERT_EQ(sharded.groups(), 4 * (blocks + 2)) << "each resblock, the embeddings and the head";
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
      ShardedPrior cut(*copy, is_matrix, group, {}, nullptr, torch::kBFloat16);
      for (size_t g = 0; g < sharded.groups(); ++g) {
        EXPECT_TRUE(torch::equal(cut.parameters()->shard(g), sharded.shard(g))) << "group " << g;
        EXPECT_EQ(cut.names(g), shards.names(g)) << "group " << g;
      }
    });
  }
}

// A fine-tuning run cuts its blocks as they are built, then adds its adapters to the whole
// prior (their draws follow the blocks' as in a whole build): the ends' cut keeps them whole,
// in their block's fp16 scale group; anything else added after a block's cut is refused.
TEST(ShardedPrior, AdaptersAddedOnceTheBlocksAreCutStayWhole) {
  const auto config = tiny_model();
  const models::AdapterConfig adapters{.rank = 2, .alpha = 2, .targets = {"resblocks.*.qkv"}};
  testing::on_ranks(2, [&](const distributed::LaunchEnvironment& place) {
    const size_t blocks = 2 * static_cast<size_t>(config.layers);
    const auto group = testing::group_at(place);  // one per rank: a second would rendezvous anew
    ShardedPrior shards(blocks, is_matrix, group, {}, models::is_adapter_tensor);
    models::Prior prior(config, [&](size_t b, models::ResblockImpl& block) {
      for (auto& parameter : block.parameters()) parameter.requires_grad_(false);
      shards.add_block(b, block);
    });
    models::add_adapters(*prior, adapters, torch::kFloat32);
    shards.add_ends(*prior);
    const auto scales = shards.scale_groups();
    ASSERT_EQ(scales.size(), blocks);
    for (size_t b = 0; b < blocks; ++b) {
      // An attention block: its two (empty) trained shards and qkv's A and B; an MLP block: its shards.
      const bool attends = prior->resblocks()[b]->named_parameters().contains("qkv.weight");
      ASSERT_EQ(scales[b].size(), attends ? 4u : 2u) << "block " << b;
      for (size_t i = 2; i < scales[b].size(); ++i) {
        EXPECT_EQ(scales[b][i].scalar_type(), torch::kFloat32);
        EXPECT_GT(scales[b][i].numel(), 0) << "kept whole";
      }
    }
    ShardedPrior late(blocks, is_matrix, group, {}, models::is_adapter_tensor);
    models::Prior other(config, [&](size_t b, models::ResblockImpl& block) { late.add_block(b, block); });
    other->resblocks()[1]->register_parameter("late", torch::zeros({2}));
    EXPECT_THROW_WITH(late.add_ends(*other), Error,
                      "resblocks.1.late was added after its block was cut, and only trained tensors that stay whole");
  });
}

// frozen_weights, sharded: a block's frozen matrices are one group, its shards kept (and
// gathered) in 16 bits, rounded as the whole model rounds them; its frozen vectors (norms,
// biases) and the ends' frozen tensors another, in fp32.
TEST(ShardedPrior, FrozenMatricesAreShardedInTheirStorage) {
  const auto config = tiny_model();
  torch::manual_seed(3);
  const models::Prior whole(config);
  testing::on_ranks(2, [&](const distributed::LaunchEnvironment& place) {
    auto prior = copy_of(whole);
    for (auto& parameter : prior->parameters()) parameter.requires_grad_(false);
    const auto group = testing::group_at(place);
    ShardedPrior shards(*prior, is_matrix, group, {}, nullptr, torch::kFloat32, torch::kBFloat16);
    auto& sharded = *shards.parameters();
    const auto expected = whole->named_parameters();
    const size_t blocks = prior->resblocks().size();
    for (size_t u = 0; u < shards.units(); ++u) {
      const size_t matrices = shards.trained_groups() + 2 * u, rest = matrices + 1;
      const auto stored = u < blocks ? torch::kBFloat16 : torch::kFloat32;
      EXPECT_EQ(sharded.shard(matrices).scalar_type(), stored) << "unit " << u;
      EXPECT_EQ(sharded.shard(rest).scalar_type(), torch::kFloat32) << "unit " << u;
      EXPECT_FALSE(shards.names(matrices).empty());
      for (const size_t g : {matrices, rest}) {
        const auto full = sharded.unshard(g, sharded.shard(g));
        for (size_t i = 0; i < full.size(); ++i) {
          const auto& name = shards.names(g)[i];
          EXPECT_EQ(full[i].dim() >= 2, g == matrices) << name;
          EXPECT_TRUE(torch::equal(full[i], expected[name].detach().to(full[i].scalar_type()))) << name;
        }
      }
    }
    auto& block = *prior->resblocks()[0];
    sharded.gather(shards.trained_groups());
    for (const auto& item : block.named_parameters()) {
      if (item.value().dim() >= 2) {
        EXPECT_EQ(item.value().scalar_type(), torch::kBFloat16) << item.key();
      }
    }
    sharded.release(shards.trained_groups());
  });
}

// On one machine the replicated parameters' buckets start during backward, on the world's
// group, while the units' all-gathers and reduce-scatters go on the machine's own group. A
// rank that lacks one replicated gradient (here a bias only rank 0's loss uses) starts that
// bucket after backward, not during it: were the two on one group, the ranks would issue
// their collectives in different orders. Each group keeps its own order: the update ends on
// both ranks, the missing gradient counts as zeros, and every gradient is the mean of the
// ranks' own, as one process computes them.
TEST(ShardedPrior, ARankLackingAReplicatedGradientOrdersItsCollectivesAsTheOthers) {
  const auto config = tiny_model();
  const int64_t ranks = 2;
  torch::manual_seed(3);
  const models::Prior reference(config);
  const auto tokens = batch_per_rank(config, ranks);
  const auto loss_of = [&](models::PriorImpl& prior, const torch::Tensor& bias, int64_t rank) {
    auto logits = prior.forward(tokens[rank]);
    if (rank == 0) logits = logits + bias;  // rank 1's loss never sees the bias
    return models::prior_loss(logits, tokens[rank], config).total;
  };
  // One process: each rank's gradients, averaged.
  std::map<std::string, torch::Tensor> mean;
  for (int64_t rank = 0; rank < ranks; ++rank) {
    auto alone = copy_of(reference);
    torch::NoGradGuard no_grad;
    auto bias = torch::zeros({config.text_classes() + config.image_vocab_size}).requires_grad_(true);
    {
      torch::AutoGradMode grad(true);
      loss_of(*alone, bias, rank).backward();
    }
    auto named = alone->named_parameters();
    named.insert("bias", bias);
    for (const auto& item : named) {
      const auto share = (item.value().grad().defined() ? item.value().grad() : torch::zeros_like(item.value())) / ranks;
      mean[item.key()] = mean.count(item.key()) ? mean[item.key()] + share : share;
    }
  }
  testing::on_ranks(ranks, [&](const distributed::LaunchEnvironment& place) {
    const auto world = testing::group_at(place);
    const auto machine = testing::subgroup_at(place, "machine", place.rank, ranks);
    auto prior = copy_of(reference);
    auto bias = torch::zeros({config.text_classes() + config.image_vocab_size}).requires_grad_(true);
    // The only replicated parameter: its bucket starts as backward begins on rank 0, before
    // any unit's reduce-scatter; rank 1 starts no bucket until the end.
    const std::vector<torch::Tensor> replicated = {bias};
    const std::vector<std::string> replicated_names = {"bias"};
    ShardedPrior shards(*prior, is_matrix, machine);
    prior->set_resblock_runner(shards.runner(
        [](models::ResblockImpl& block, const torch::Tensor& x, const models::ResblockContext& context) {
          return x + block.branch(x, context);
        }));
    // Small buckets: the bias has one of its own.
    distributed::ShardedReducer reducer(shards.parameters(), world, machine, nullptr, 1024);
    auto parameters = replicated;
    for (const auto& shard : shards.parameters()->shards()) parameters.push_back(shard);
    reducer.before_backward(parameters);
    loss_of(*prior, bias, place.rank).backward();
    reducer.reduce_scaled(parameters);
    reducer.reduce_unscaled(parameters);
    for (size_t i = 0; i < replicated.size(); ++i) {
      ASSERT_TRUE(replicated[i].grad().defined()) << replicated_names[i];
      EXPECT_TRUE(torch::allclose(replicated[i].grad(), mean.at(replicated_names[i]), 1e-5, 1e-6))
          << replicated_names[i];
    }
    for (size_t g = 0; g < shards.trained_groups(); ++g) {
      std::vector<torch::Tensor> whole;
      for (const auto& name : shards.names(g)) whole.push_back(mean.at(name));
      const auto expected = shards.parameters()->shard_of(g, whole);
      EXPECT_TRUE(torch::allclose(shards.parameters()->shard(g).grad(), expected, 1e-5, 1e-6)) << "group " << g;
    }
  });
}

// checkpointed_inputs, sharded: each gathered block keeps its input in bfloat16 for its
// backward, as the unsharded checkpointed runner does, so that the shards' gradients are the
// ranks' mean of that runner's (and not of the float32-kept one's).
TEST(ShardedPrior, SixteenBitKeptInputsGiveTheCheckpointedRunnersGradients) {
  const auto config = tiny_model();
  const int64_t ranks = 2;
  torch::manual_seed(8);
  const models::Prior reference(config);
  const auto tokens = batch_per_rank(config, ranks);
  // One process, each rank's batch through the checkpointed runner, the gradients averaged.
  const auto mean_of_checkpointed = [&](torch::ScalarType kept_as) {
    std::map<std::string, torch::Tensor> mean;
    for (int64_t rank = 0; rank < ranks; ++rank) {
      auto prior = copy_of(reference);
      prior->set_resblock_runner(
          make_training_runner(prior->resblocks(), {.checkpoint_every = 1, .checkpointed_inputs = kept_as}));
      models::prior_loss(prior->forward(tokens[rank]), tokens[rank], config).total.backward();
      for (const auto& item : prior->named_parameters()) {
        const auto share = item.value().grad() / ranks;
        mean[item.key()] = mean.count(item.key()) ? mean[item.key()] + share : share;
      }
    }
    return mean;
  };
  const auto rounded = mean_of_checkpointed(torch::kBFloat16), exact = mean_of_checkpointed(torch::kFloat32);
  testing::on_ranks(ranks, [&](const distributed::LaunchEnvironment& place) {
    auto prior = copy_of(reference);
    ShardedPrior shards(*prior, is_matrix, testing::group_at(place));
    prior->set_resblock_runner(shards.runner(
        [](models::ResblockImpl& block, const torch::Tensor& x, const models::ResblockContext& context) {
          return x + block.branch(x, context);
        },
        torch::kBFloat16));
    models::prior_loss(prior->forward(tokens[place.rank]), tokens[place.rank], config).total.backward();
    shards.parameters()->finish_reductions();
    double off_rounded = 0, off_exact = 0;
    for (size_t g = 0; g < shards.trained_groups(); ++g) {
      std::vector<torch::Tensor> whole_rounded, whole_exact;
      for (const auto& name : shards.names(g)) {
        whole_rounded.push_back(rounded.at(name));
        whole_exact.push_back(exact.at(name));
      }
      const auto& gradient = shards.parameters()->shard(g).grad();
      if (gradient.numel() == 0) continue;  // an empty group (the embeddings have no vectors)
      EXPECT_TRUE(torch::allclose(gradient, shards.parameters()->shard_of(g, whole_rounded), 1e-5, 1e-7))
          << "group " << g;
      const auto distance = [&](const std::vector<torch::Tensor>& whole) {
        return (gradient - shards.parameters()->shard_of(g, whole)).abs().max().item<double>();
      };
      off_rounded = std::max(off_rounded, distance(whole_rounded));
      off_exact = std::max(off_exact, distance(whole_exact));
    }
    EXPECT_GT(off_exact, 20 * off_rounded) << "the float32-kept runner's gradients differ";
  });
}

}  // namespace
}  // namespace dalle::train
