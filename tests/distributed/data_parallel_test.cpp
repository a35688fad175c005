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
