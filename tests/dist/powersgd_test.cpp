#include "dalle/dist/powersgd.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "dist/on_ranks.h"
#include "test_support.h"

namespace dalle::dist {
namespace {

using testing::group_at;

// A 6x4 matrix, a 2x3x2 tensor (compressed as 2x6) and a vector, whose gradients on rank r
// are drawn from a generator seeded by r.
std::vector<torch::Tensor> parameters_of_rank(int64_t rank) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(7 + static_cast<uint64_t>(rank));
  std::vector<torch::Tensor> parameters{torch::zeros({6, 4}).requires_grad_(), torch::zeros({2, 3, 2}).requires_grad_(),
                                        torch::zeros({5}).requires_grad_()};
  for (auto& parameter : parameters) {
    parameter.mutable_grad() = torch::randn(parameter.sizes(), generator, torch::kFloat32);
  }
  return parameters;
}

class PowerSgdAtWorldSize : public ::testing::TestWithParam<int64_t> {};

// At full rank the power iteration spans every column: the exact mean, but for the 1e-6 I.
TEST_P(PowerSgdAtWorldSize, FullRankEqualsTheExactMean) {
  const int64_t world = GetParam();
  const auto mean = testing::mean_gradients(world, parameters_of_rank);
  testing::on_ranks(world, [&](const LaunchEnvironment& place) {
    PowerSgdReducer reducer(group_at(place), {.rank = 6, .start_update = 1, .min_compression_rate = 0.0});
    auto parameters = parameters_of_rank(place.rank);
    EXPECT_TRUE(PowerSgdReducer::compresses({6, 4}, {.rank = 6, .min_compression_rate = 0.0}));
    EXPECT_FALSE(PowerSgdReducer::compresses({5}, {.rank = 6, .min_compression_rate = 0.0}));
    EXPECT_FALSE(PowerSgdReducer::compresses({6, 4}, {.rank = 6})) << "n m <= 2 (n + m) r";
    EXPECT_EQ(PowerSgdReducer::values_sent({6, 4}, {.rank = 1, .min_compression_rate = 0.0}), 10);
    reducer.reduce(parameters);
    for (size_t i = 0; i < parameters.size(); ++i) {
      EXPECT_LT((parameters[i].grad() - mean[i]).abs().max().item<double>(), 1e-5) << i;
    }
  });
}

// At rank 1 the result is an approximation, but every replica takes the same one.
TEST_P(PowerSgdAtWorldSize, ReplicasStayBitIdenticalAtLowRank) {
  const int64_t world = GetParam();
  std::vector<torch::Tensor> rank0;
  std::mutex mutex;
  testing::on_ranks(world, [&](const LaunchEnvironment& place) {
    PowerSgdReducer reducer(group_at(place), {.rank = 1, .start_update = 1, .min_compression_rate = 0.0});
    auto parameters = parameters_of_rank(place.rank);
    for (int update = 0; update < 3; ++update) reducer.reduce(parameters);
    std::lock_guard lock(mutex);
    if (rank0.empty()) {
      for (const auto& parameter : parameters) rank0.push_back(parameter.grad().clone());
      return;
    }
    for (size_t i = 0; i < parameters.size(); ++i) EXPECT_TRUE(torch::equal(parameters[i].grad(), rank0[i])) << i;
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, PowerSgdAtWorldSize, ::testing::Values(2, 4));

// A rank-2 matrix at rank 1: the first update passes one direction on, and the error
// feedback passes what it dropped on with the next (zero) gradient.
TEST(PowerSgd, ErrorFeedbackCarriesWhatOneUpdateDropsIntoTheNext) {
  testing::on_ranks(2, [](const LaunchEnvironment& place) {
    PowerSgdReducer reducer(group_at(place), {.rank = 1, .start_update = 1, .min_compression_rate = 0.0});
    const auto u = torch::tensor({1.0f, 0.0f, 0.0f, 0.0f}), v = torch::tensor({0.0f, 1.0f, 0.0f});
    const auto w = torch::tensor({0.0f, 1.0f, 0.0f, 0.0f}), x = torch::tensor({0.0f, 0.0f, 1.0f});
    const auto matrix = 3 * torch::outer(u, v) + torch::outer(w, x);  // rank 2, singular values 3 and 1
    auto parameter = torch::zeros({4, 3}).requires_grad_();
    parameter.mutable_grad() = matrix.clone();
    reducer.reduce({parameter});
    const auto first = parameter.grad().clone();
    EXPECT_GT((matrix - first).norm().item<double>(), 0.5) << "rank 1 drops a direction";
    parameter.mutable_grad() = torch::zeros({4, 3});
    reducer.reduce({parameter});
    EXPECT_GT(parameter.grad().norm().item<double>(), 0.5) << "the dropped part comes with the next update";
    EXPECT_LT((matrix - first - parameter.grad()).norm().item<double>(), (matrix - first).norm().item<double>());
  });
}

// An inf in one rank's gradient of matrix A: every replica's decompressed A is not finite,
// so the update is skipped everywhere (the flags agree), and A's error buffers, which hold
// it, are zeroed at the next update while B's keep what they carry.
TEST(PowerSgd, ANonFiniteGradientSkipsEverywhereAndZeroesOnlyTheBuffersHoldingIt) {
  testing::on_ranks(2, [](const LaunchEnvironment& place) {
    PowerSgdReducer reducer(group_at(place), {.rank = 1, .start_update = 1, .min_compression_rate = 0.0});
    std::vector<torch::Tensor> parameters{torch::zeros({4, 3}).requires_grad_(), torch::zeros({3, 4}).requires_grad_()};
    parameters[0].mutable_grad() = torch::ones({4, 3});
    parameters[1].mutable_grad() = torch::arange(12.0f).view({3, 4});
    if (place.rank == 1) parameters[0].mutable_grad()[0][0] = INFINITY;
    reducer.reduce(parameters);
    const auto finite = torch::stack({torch::isfinite(parameters[0].grad()).all(), torch::isfinite(parameters[1].grad()).all()});
    EXPECT_TRUE(torch::equal(reducer.agree(finite), torch::tensor({false, true}))) << "every rank skips";
    io::TensorMap state;
    reducer.save_state(state, "");
    EXPECT_FALSE(torch::isfinite(state.at("error.0")).all().item<bool>());
    EXPECT_TRUE(torch::isfinite(state.at("error.1")).all().item<bool>());
    const auto kept = state.at("error.1").clone();
    EXPECT_GT(kept.abs().max().item<double>(), 0.1) << "rank 1 drops part of a rank-2 matrix";

    parameters[0].mutable_grad() = torch::ones({4, 3});
    parameters[1].mutable_grad() = torch::zeros({3, 4});
    reducer.reduce(parameters);
    EXPECT_TRUE(torch::allclose(parameters[0].grad(), torch::ones({4, 3}), 1e-4, 1e-4)) << "A starts afresh: rank 1";
    EXPECT_GT(parameters[1].grad().abs().max().item<double>(), 0.1) << "B passes on what it kept";
  });
}

// P (n x r) and Q (m x r) per compressed matrix, in fp32; the rest whole.
TEST(PowerSgd, BytesFollowTheFormula) {
  testing::on_ranks(2, [](const LaunchEnvironment& place) {
    const int64_t width = 64, rank = 4;
    PowerSgdReducer reducer(group_at(place), {.rank = rank, .start_update = 2});
    std::vector<torch::Tensor> parameters{torch::zeros({3 * width, width}), torch::zeros({4 * width, width}),
                                          torch::zeros({width})};
    for (auto& parameter : parameters) {
      parameter.requires_grad_();
      parameter.mutable_grad() = torch::ones_like(parameter);
    }
    reducer.reduce(parameters);  // update 1: whole
    const int64_t whole = (3 + 4) * width * width * 4 + width * 4;
    EXPECT_EQ(reducer.bytes_reduced(), whole);
    reducer.reduce(parameters);  // update 2: compressed
    EXPECT_EQ(reducer.bytes_reduced() - whole, ((3 * width + width) + (4 * width + width)) * rank * 4 + width * 4);
  });
}

}  // namespace
}  // namespace dalle::dist
