#include "dalle/distributed/sharded_parameters.h"
#include "dalle/distributed/sharded_reducer.h"

#include <torch/torch.h>

#include "dalle/train/model_precision.h"
#include "dalle/train/update_step.h"
#include "distributed/on_ranks.h"
#include "test_support.h"

namespace dalle::distributed {
namespace {

using testing::group_at;

// Two groups whose sizes (7 + 3, 5) do not divide by the ranks: the shards are padded.
std::vector<std::vector<torch::Tensor>> model() {
  return {{torch::arange(7.0).requires_grad_(), torch::arange(3.0).reshape({3, 1}).requires_grad_()},
          {torch::arange(5.0).mul(-1).requires_grad_()}};
}

class ShardedParametersAtWorldSize : public ::testing::TestWithParam<int64_t> {};

TEST_P(ShardedParametersAtWorldSize, EachRankKeepsItsShardAndGathersTheWholeBlockOnDemand) {
  const int64_t world = GetParam();
  testing::on_ranks(world, [world](const LaunchEnvironment& place) {
    const auto original = model();
    auto tensors = model();
    ShardedParameters sharded(tensors, group_at(place));
    EXPECT_EQ(sharded.shard(0).numel(), (10 + world - 1) / world);
    EXPECT_TRUE(sharded.shard(0).requires_grad());
    EXPECT_EQ(tensors[0][0].numel(), 0) << "released until gathered";
    sharded.gather(0);
    EXPECT_TRUE(torch::equal(tensors[0][0], original[0][0]));
    EXPECT_TRUE(torch::equal(tensors[0][1], original[0][1]));
    EXPECT_TRUE(tensors[0][1].requires_grad());
    EXPECT_EQ(tensors[1][0].numel(), 0) << "only the group asked for";
    sharded.release(0);
    EXPECT_EQ(tensors[0][1].numel(), 0);
    // Prefetched, the gather finds the values the all-gather started before brought.
    sharded.prefetch(1);
    sharded.gather(1);
    EXPECT_TRUE(torch::equal(tensors[1][0], original[1][0]));
    sharded.release(1);
    // A moment of a model not sharded yet becomes its shard and comes back whole.
    const auto moment = sharded.shard_of(1, {torch::full({5}, 2.0)});
    const auto whole = sharded.unshard(1, moment);
    EXPECT_TRUE(torch::equal(whole[0], torch::full({5}, 2.0)));
    // Read from the rank's range of the tensors alone (bfloat16 here), padding zero: the
    // part of the group flattened whole that is this rank's.
    const int64_t share = sharded.shard(0).numel();
    const auto flat = torch::constant_pad_nd(
        torch::cat({original[0][0].detach(), original[0][1].detach().flatten()}), {0, share * world - 10});
    const auto from_bf16 = sharded.shard_of(0, {original[0][0].detach().to(torch::kBFloat16),
                                                original[0][1].detach().to(torch::kBFloat16)});
    EXPECT_EQ(from_bf16.scalar_type(), torch::kFloat32);
    EXPECT_TRUE(torch::equal(from_bf16, flat.narrow(0, place.rank * share, share)));
    EXPECT_THROW_WITH(sharded.shard_of(1, {torch::zeros({5 + world * ((5 + world - 1) / world)})}), Error,
                      "more values than group 1 holds");
  });
}

// Started in backward, the reduce-scatter is complete only once finished (with overlap);
// without, at once.
TEST_P(ShardedParametersAtWorldSize, GradientsBecomeTheShardOfTheirMeanOverTheRanks) {
  const int64_t world = GetParam();
  for (const bool overlap : {true, false}) {
  testing::on_ranks(world, [world, overlap](const LaunchEnvironment& place) {
    auto tensors = model();
    ShardedParameters sharded(tensors, group_at(place), overlap);
    for (int pass = 0; pass < 2; ++pass) {  // a second backward adds to the shard's gradient
      sharded.gather(0);
      tensors[0][0].mutable_grad() = torch::full({7}, static_cast<double>(place.rank));
      tensors[0][1].mutable_grad() = torch::full({3, 1}, 1.0);
      sharded.reduce_gradients(0);
      EXPECT_FALSE(tensors[0][0].grad().defined());
      EXPECT_EQ(sharded.shard(0).grad().defined(), pass > 0 || !overlap);
      sharded.release(0);
      sharded.finish_reductions();
    }
    const double mean_rank = static_cast<double>(world - 1) / 2.0;
    auto expected = torch::cat({torch::full({7}, 2 * mean_rank), torch::full({3}, 2.0)});
    expected = torch::constant_pad_nd(expected, {0, sharded.shard(0).numel() * world - 10});
    const auto mine = expected.narrow(0, place.rank * sharded.shard(0).numel(), sharded.shard(0).numel());
    EXPECT_TRUE(torch::allclose(sharded.shard(0).grad(), mine));
    EXPECT_FALSE(sharded.shard(1).grad().defined());
  });
  }
}

TEST(ShardedReducer, AveragesTheReplicatedGradientsAndMeasuresTheNormOfEveryShard) {
  testing::on_ranks(2, [](const LaunchEnvironment& place) {
    auto group = group_at(place);
    auto tensors = model();
    auto sharded = std::make_shared<ShardedParameters>(tensors, group);
    ShardedReducer reducer(sharded, group, group, nullptr, 1 << 20);
    auto replicated = torch::zeros({2}).requires_grad_();
    replicated.mutable_grad() = torch::full({2}, static_cast<double>(2 * place.rank));  // mean 1
    sharded->shard(0).mutable_grad() = torch::full({5}, 1.0);  // 10 ones across the two ranks
    const std::vector<torch::Tensor> parameters{replicated, sharded->shard(0)};
    reducer.reduce(parameters);
    EXPECT_TRUE(torch::equal(replicated.grad(), torch::ones({2})));
    EXPECT_TRUE(torch::equal(sharded->shard(0).grad(), torch::ones({5}))) << "already the shard of the mean";
    EXPECT_NEAR(reducer.gradient_norm(parameters), std::sqrt(2.0 + 10.0), 1e-6);
  });
}

// fp16 with one scale per sharded group: an inf in one rank's gradient of group 0 skips the
// update on both ranks, leaves every shard as it was, and backs off group 0's scale alone,
// the same on both ranks, as one process does (PriorTrainerTest.InfInOneResblock...).
TEST(ShardedReducer, AnInfOnOneRankSkipsTheUpdateEverywhereAndBacksOffOnlyItsGroup) {
  testing::on_ranks(2, [](const LaunchEnvironment& place) {
    auto group = group_at(place);
    auto tensors = model();
    auto sharded = std::make_shared<ShardedParameters>(tensors, group);
    train::PrecisionConfig config;
    config.mode = "float16";
    train::ModelPrecision precision(config, sharded->shards(), {{sharded->shard(0)}, {sharded->shard(1)}},
                                    /*replicas=*/2);
    torch::optim::SGD sgd(sharded->shards(), torch::optim::SGDOptions(0.1));
    train::UpdateStep update(sgd, precision, {.what = "test"});
    update.set_reducer(std::make_shared<ShardedReducer>(sharded, group, group, nullptr, 1 << 20));
    const auto before = sharded->shard(0).detach().clone();
    const double poison = place.rank == 1 ? INFINITY : 1.0;
    const auto loss = (sharded->shard(0) * poison).sum() + sharded->shard(1).sum();
    EXPECT_TRUE(update.apply(loss, 1).skipped);
    EXPECT_TRUE(torch::equal(sharded->shard(0), before));
    const auto* scaler = precision.scaler();
    EXPECT_LT(scaler->scale(0), scaler->scale(1));
    EXPECT_DOUBLE_EQ(scaler->scale(1), 2 * std::exp2(13.001)) << "M x 2^13, grown as after a good update";
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ShardedParametersAtWorldSize, ::testing::Values(2, 4));

}  // namespace
}  // namespace dalle::distributed
