#include "dalle/distributed/data_parallel.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "dalle/distributed/job.h"
#include "distributed/on_ranks.h"
#include "test_support.h"

namespace dalle::distributed {
namespace {

using testing::group_at;

// Parameters of several sizes and dtypes, whose gradients on rank r are seeded by r.
// Generators of their own: the ranks are threads of one process.
std::vector<torch::Tensor> parameters_of_rank(int64_t rank) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(100 + static_cast<uint64_t>(rank));
  std::vector<torch::Tensor> parameters;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{7, 3}, {1000}, {5}, {2, 2, 2}}) {
    parameters.push_back(torch::zeros(shape).requires_grad_());
  }
  parameters.push_back(torch::zeros({4}, torch::kFloat64).requires_grad_());
  for (auto& parameter : parameters) {
    parameter.mutable_grad() = torch::randn(parameter.sizes(), generator, parameter.options());
  }
  return parameters;
}

class DataParallelAtWorldSize : public ::testing::TestWithParam<int64_t> {};

TEST_P(DataParallelAtWorldSize, EveryGradientBecomesTheMeanOverTheRanksWhateverTheBuckets) {
  const int64_t world = GetParam();
  const auto expected = testing::mean_gradients(world, parameters_of_rank);
  // 64 bytes: a bucket per tensor or two; 1 MB: one bucket per dtype.
  for (const int64_t bucket_bytes : {64, 1 << 20}) {
    testing::on_ranks(world, [&](const LaunchEnvironment& place) {
      DataParallelReducer reducer(group_at(place), bucket_bytes);
      auto parameters = parameters_of_rank(place.rank);
      reducer.reduce(parameters);
      for (size_t i = 0; i < parameters.size(); ++i) {
        EXPECT_LT((parameters[i].grad() - expected[i]).abs().max().item<double>(), 1e-6) << i;
      }
      EXPECT_EQ(reducer.replicas(), world);
      EXPECT_EQ(reducer.bytes_reduced(), (21 + 1000 + 5 + 8) * 4 + 4 * 8);
      // The defined-gradient check, then the buckets: one per dtype, or, at 64 bytes, {7x3},
      // {1000}, {5, 2x2x2} (52 bytes when the dtype changes) and {4}.
      EXPECT_EQ(reducer.collectives(), bucket_bytes == 64 ? 1 + 4 : 1 + 2);
    });
  }
}

TEST_P(DataParallelAtWorldSize, AGradientOneRankLacksCountsAsZerosAndOneNoRankHasStaysUndefined) {
  const int64_t world = GetParam();
  testing::on_ranks(world, [world](const LaunchEnvironment& place) {
    DataParallelReducer reducer(group_at(place), 1 << 20);
    std::vector<torch::Tensor> parameters{torch::zeros({3}).requires_grad_(), torch::zeros({2}).requires_grad_()};
    if (place.rank == 0) parameters[0].mutable_grad() = torch::full({3}, static_cast<double>(world));
    reducer.reduce(parameters);
    ASSERT_TRUE(parameters[0].grad().defined());
    EXPECT_TRUE(torch::allclose(parameters[0].grad(), torch::ones({3})));
    EXPECT_FALSE(parameters[1].grad().defined());
  });
}

TEST_P(DataParallelAtWorldSize, TheRanksAgreeAFlagIsTrueOnlyWhereItIsTrueOnEveryRank) {
  const int64_t world = GetParam();
  testing::on_ranks(world, [world](const LaunchEnvironment& place) {
    DataParallelReducer reducer(group_at(place), 1 << 20);
    // Group 1 is not finite on the last rank only.
    const auto flags = torch::tensor({true, place.rank != world - 1, true});
    EXPECT_TRUE(torch::equal(reducer.agree(flags), torch::tensor({true, false, true})));
  });
}

// Four 16 x 16 layers applied w0, w1, w2, w3, handed to the reducer last layer first, so that
// its first guess at backward's order (reverse registration) is backward's order reversed.
std::vector<torch::Tensor> chain_weights() {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(7);
  std::vector<torch::Tensor> weights;
  for (int i = 0; i < 4; ++i) weights.push_back((torch::randn({16, 16}, generator) / 4).requires_grad_());
  return {weights.rbegin(), weights.rend()};
}

// One update's backward through the chain on rank `rank`'s batch, reduced by `reducer`.
void backward_through_chain(DataParallelReducer& reducer, const std::vector<torch::Tensor>& registered, int64_t rank) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(200 + static_cast<uint64_t>(rank));
  auto x = torch::randn({4, 16}, generator);
  for (auto layer = registered.rbegin(); layer != registered.rend(); ++layer) x = torch::tanh(x.mm(*layer));
  for (const auto& weight : registered) weight.mutable_grad() = torch::Tensor();
  reducer.before_backward(registered);
  x.square().sum().backward();
  reducer.reduce_scaled(registered);
}

size_t first_start(const std::vector<ReducerEvent>& events) {
  for (size_t i = 0; i < events.size(); ++i) {
    if (events[i].kind == ReducerEvent::bucket_started) return i;
  }
  return events.size();
}

size_t last_gradient(const std::vector<ReducerEvent>& events) {
  size_t last = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    if (events[i].kind == ReducerEvent::gradient_ready) last = i;
  }
  return last;
}

// A bucket's all-reduce starts as soon as backward has accumulated its gradients, in the
// order backward made them once the first update showed it; without overlap the same
// buckets start after backward, and the gradients are the same bits.
TEST_P(DataParallelAtWorldSize, BucketsStartDuringBackwardInTheOrderItMakesGradientsWithTheSameResult) {
  const int64_t world = GetParam();
  testing::on_ranks(world, [world](const LaunchEnvironment& place) {
    auto group = group_at(place);
    DataParallelReducer overlapped(group, 1024), after(group, 1024, /*overlap=*/false);
    const auto weights = chain_weights(), same_weights = chain_weights();
    backward_through_chain(overlapped, weights, place.rank);
    using E = ReducerEvent;
    const auto first = overlapped.last_backward();
    ASSERT_EQ(first.size(), 8u);
    EXPECT_GT(first_start(first), last_gradient(first)) << "reverse registration guessed wrong here";
    EXPECT_EQ(overlapped.buckets(), (std::vector<std::vector<size_t>>{{0}, {1}, {2}, {3}}));

    backward_through_chain(overlapped, weights, place.rank);
    EXPECT_EQ(overlapped.last_backward(),
              (std::vector<E>{{E::gradient_ready, 0}, {E::bucket_started, 0}, {E::gradient_ready, 1},
                              {E::bucket_started, 1}, {E::gradient_ready, 2}, {E::bucket_started, 2},
                              {E::gradient_ready, 3}, {E::bucket_started, 3}}));
    backward_through_chain(after, same_weights, place.rank);
    backward_through_chain(after, same_weights, place.rank);
    const auto late = after.last_backward();
    EXPECT_GT(first_start(late), last_gradient(late));

    std::vector<torch::Tensor> mean(4);
    for (int64_t rank = 0; rank < world; ++rank) {
      const auto alone = chain_weights();
      auto generator = at::make_generator<at::CPUGeneratorImpl>(200 + static_cast<uint64_t>(rank));
      auto x = torch::randn({4, 16}, generator);
      for (auto layer = alone.rbegin(); layer != alone.rend(); ++layer) x = torch::tanh(x.mm(*layer));
      x.square().sum().backward();
      for (size_t i = 0; i < 4; ++i) {
        mean[i] = (mean[i].defined() ? mean[i] : torch::zeros_like(alone[i])) + alone[i].grad() / world;
      }
    }
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_TRUE(torch::equal(weights[i].grad(), same_weights[i].grad())) << i;
      EXPECT_LT((weights[i].grad() - mean[i]).abs().max().item<double>(), 1e-6) << i;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, DataParallelAtWorldSize, ::testing::Values(2, 4));

TEST(Job, RanksStartedWithAnotherConfigOrBuildAreRefusedByName) {
  testing::on_ranks(3, [](const LaunchEnvironment& place) {
    const Fingerprint mine{.config = place.rank == 2 ? 7u : 1u, .code = place.rank == 1 ? 9u : 2u};
    EXPECT_THROW_WITH(Job(place, {.timeout = std::chrono::seconds(30)}, mine), Error, "config (rank 2)",
                      "build of dalle (rank 1)", "same command");
  });
}

TEST(Job, AStopRequestOfOneRankStopsAllAndMetricsAreAveraged) {
  testing::on_ranks(2, [](const LaunchEnvironment& place) {
    Job job(place, {.timeout = std::chrono::seconds(30)}, {});
    EXPECT_TRUE(job.any(place.rank == 1));
    EXPECT_FALSE(job.any(false));
    std::vector<double> values{static_cast<double>(place.rank), 4.0};
    job.average(values);
    EXPECT_EQ(values, (std::vector<double>{0.5, 4.0}));
    job.check_same(3, "the step");
    EXPECT_THROW_WITH(job.check_same(place.rank, "the step"), Error, "the ranks disagree on the step",
                      "rank 0: 0; rank 1: 1");
  });
}

TEST(Job, AJobOfOneNeedsNoGroup) {
  Job job(LaunchEnvironment{}, {}, {});
  EXPECT_EQ(job.group(), nullptr);
  EXPECT_EQ(job.reducer()->replicas(), 1);
  EXPECT_TRUE(job.any(true));
  job.check_same(5, "anything");
}

}  // namespace
}  // namespace dalle::distributed
