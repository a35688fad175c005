#include "dalle/distributed/powersgd.h"

#include "dalle/distributed/sharded_parameters.h"
#include "dalle/distributed/sharded_reducer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "distributed/on_ranks.h"
#include "test_support.h"

namespace dalle::distributed {
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
    EXPECT_TRUE(compresses({6, 4}, {.rank = 6, .min_compression_rate = 0.0}));
    EXPECT_FALSE(compresses({5}, {.rank = 6, .min_compression_rate = 0.0}));
    EXPECT_FALSE(compresses({6, 4}, {.rank = 6})) << "n m <= 2 (n + m) r";
    EXPECT_EQ(values_sent({6, 4}, {.rank = 1, .min_compression_rate = 0.0}), 10);
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

// Two models stepping with one reducer (the VQGAN and its discriminator): only the
// reductions of the first one's parameters count towards start_update.
TEST(PowerSgd, UpdatesAreCountedByTheParametersReducedFirst) {
  testing::on_ranks(2, [](const LaunchEnvironment& place) {
    PowerSgdReducer reducer(group_at(place), {.rank = 1, .start_update = 2, .min_compression_rate = 0.0});
    auto generator = torch::zeros({4, 3}).requires_grad_(), discriminator = torch::zeros({3, 4}).requires_grad_();
    const auto reduce = [&](torch::Tensor& parameter) {
      parameter.mutable_grad() = torch::ones(parameter.sizes());
      const int64_t before = reducer.bytes_reduced();
      reducer.reduce({parameter});
      return reducer.bytes_reduced() - before;
    };
    EXPECT_EQ(reduce(generator), 12 * 4) << "update 1: whole";
    EXPECT_EQ(reduce(discriminator), 12 * 4) << "still update 1";
    EXPECT_EQ(reduce(generator), (4 + 3) * 4) << "update 2: compressed";
    EXPECT_EQ(reduce(discriminator), (3 + 4) * 4);
  });
}

// In 16 bits, P and Q travel in half the bytes, and float16's infinities are clamped: a
// gradient beyond its range leaves finite error buffers and a finite average. A fixed Q is
// stored in 16 bits as well; a warm-started one stays float32.
TEST(PowerSgd, SixteenBitStateHalvesTheBytesAndClampsInfinities) {
  testing::on_ranks(2, [](const LaunchEnvironment& place) {
    auto group = group_at(place);
    for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
      PowerSgdReducer reducer(group, {.rank = 1, .start_update = 1, .min_compression_rate = 0.0, .dtype = dtype});
      auto parameter = torch::zeros({4, 3}).requires_grad_();
      parameter.mutable_grad() = torch::ones({4, 3}) * (place.rank == 1 ? 1e6 : 1.0);
      reducer.reduce({parameter});
      EXPECT_EQ(reducer.bytes_reduced(), (4 + 3) * 1 * 2) << dtype;
      EXPECT_TRUE(torch::isfinite(parameter.grad()).all().item<bool>()) << dtype;
      EXPECT_GT(parameter.grad().abs().max().item<double>(), 1000.0) << dtype;
      io::TensorMap state;
      reducer.save_state(state, "");
      EXPECT_TRUE(torch::isfinite(state.at("error.0")).all().item<bool>()) << dtype;
      EXPECT_EQ(state.at("q.0").scalar_type(), dtype) << "a fixed Q is kept in 16 bits too";
      EXPECT_TRUE(torch::equal(state.at("q.0"), initial_q({.rank = 1, .dtype = dtype}, 0, 4, 3, torch::kCPU)));
    }
    PowerSgdReducer warm(group, {.rank = 1, .start_update = 1, .min_compression_rate = 0.0, .warm_start = true,
                                 .dtype = torch::kBFloat16});
    auto parameter = torch::ones({4, 3}).requires_grad_();
    parameter.mutable_grad() = torch::ones({4, 3});
    warm.reduce({parameter});
    io::TensorMap state;
    warm.save_state(state, "");
    EXPECT_EQ(state.at("q.0").scalar_type(), torch::kFloat32) << "a warm Q carries the iteration in float32";
  });
}

// A group whose shards cut rows: a 6x4 matrix, a vector of 5 and a 3x5 matrix, 44 values,
// 22 a shard at 2 ranks: the first holds rows 0-4 of the first matrix and half of row 5, the
// second the other half, the vector and the 3x5 matrix.
TEST(RowsInShard, AreTheWholeRowsOfEveryMatrixInTheShard) {
  const std::vector<std::vector<int64_t>> shapes{{6, 4}, {5}, {3, 5}};
  const auto first = rows_in_shard(shapes, 0, 2);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].tensor, 0u);
  EXPECT_EQ(first[0].offset, 0);
  EXPECT_EQ(first[0].rows, 5);
  EXPECT_EQ(first[0].columns, 4);
  const auto second = rows_in_shard(shapes, 1, 2);
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(second[0].tensor, 2u);
  EXPECT_EQ(second[0].offset, 2 + 5);
  EXPECT_EQ(second[0].rows, 3);
  EXPECT_EQ(second[0].columns, 5);
  EXPECT_TRUE(rows_in_shard({{5}}, 0, 2).empty());
}

// DALL-E's layout (paper-facts.md): q, k, v, o (d x d) and the MLP's two matrices (4d x d,
// the longer side sharded), each sharded between the 8 GPUs of a machine and compressed at
// rank r/8 per shard, send exactly 5r/(8d) of their values (86% saved at d 3968, r 896).
TEST(RowsInShard, DallEsLayoutSendsFiveRankOverEightWidthsOfItsValues) {
  const int64_t d = 64, ranks = 8, rank_per_shard = 2;
  const std::vector<std::vector<int64_t>> matrices{{d, d}, {d, d}, {d, d}, {d, d}, {4 * d, d}, {4 * d, d}};
  int64_t sent = 0, values = 0;
  for (const auto& shape : matrices) {
    for (int64_t rank = 0; rank < ranks; ++rank) {
      for (const auto& rows : rows_in_shard({shape}, rank, ranks)) sent += (rows.rows + rows.columns) * rank_per_shard;
    }
    values += shape[0] * shape[1];
  }
  EXPECT_DOUBLE_EQ(static_cast<double>(sent) / static_cast<double>(values),
                   5.0 * static_cast<double>(rank_per_shard * ranks) / (8.0 * d));
}

// 4 ranks as two "machines" of two: the ranks of this one's machine, and this rank's replicas
// on the other machine (the subgroups of DALL-E's hierarchy), named after `prefix`.
struct TwoMachines {
  std::shared_ptr<ProcessGroup> within, across;
};
TwoMachines two_machines_of_two(const LaunchEnvironment& place, const std::string& prefix = "") {
  const int64_t node = place.rank / 2, local = place.rank % 2;
  return {testing::subgroup_at(place, prefix + "node" + std::to_string(node), local, 2),
          testing::subgroup_at(place, prefix + "local" + std::to_string(local), node, 2)};
}

// Gradients of the group above, drawn per rank.
std::vector<torch::Tensor> cut_group_of_rank(int64_t rank) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(11 + static_cast<uint64_t>(rank));
  std::vector<torch::Tensor> parameters;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{6, 4}, {5}, {3, 5}}) {
    parameters.push_back(torch::zeros(shape).requires_grad_());
    parameters.back().mutable_grad() = torch::randn(shape, generator, torch::kFloat32);
  }
  return parameters;
}

// DALL-E's hierarchy on 2 "machines" x 2 ranks: the gradients reduce-scattered within the
// machine, then each shard's blocks of rows averaged by PowerSGD across the machines and the
// rest of the shard whole. At full rank the shards become those of the exact mean over the 4
// ranks, as flat PowerSGD's gradients do; P and Q of each block, and the rest, cross machines,
// and of a replicated gradient each rank's half (reduce-scattered within the machine).
TEST(ShardedPowerSgd, AtFullRankEqualsTheFlatPathAndTheExactMean) {
  const auto mean = testing::mean_gradients(4, cut_group_of_rank);
  testing::on_ranks(4, [&](const LaunchEnvironment& place) {
    auto world = group_at(place);
    const auto [within, across] = two_machines_of_two(place);
    const PowerSgdOptions options{.rank = 5, .start_update = 1, .min_compression_rate = 0.0};
    auto flat = cut_group_of_rank(place.rank);
    PowerSgdReducer(world, options).reduce(flat);

    std::vector<std::vector<torch::Tensor>> tensors{{}};
    for (const auto& parameter : cut_group_of_rank(0)) tensors[0].push_back(torch::zeros_like(parameter).requires_grad_());
    auto sharded = std::make_shared<ShardedParameters>(tensors, within);
    sharded->gather(0);
    const auto own = cut_group_of_rank(place.rank);
    for (size_t i = 0; i < own.size(); ++i) tensors[0][i].mutable_grad() = own[i].grad();
    sharded->reduce_gradients(0);
    sharded->release(0);
    ShardedReducer reducer(sharded, world, within, across, 1 << 20, options);
    auto replicated = torch::zeros({7}).requires_grad_();  // mean 1.5, 4 of its 7 values cross per rank
    replicated.mutable_grad() = torch::full({7}, static_cast<double>(place.rank));
    auto parameters = sharded->shards();
    parameters.push_back(replicated);
    reducer.reduce(parameters);
    EXPECT_TRUE(torch::allclose(replicated.grad(), torch::full({7}, 1.5)));

    EXPECT_FALSE(sharded->shard(0).grad().defined()) << "kept compressed until the optimizer takes it";
    ASSERT_TRUE(reducer.keeps_gradients());
    const auto shard = reducer.take_gradient(sharded->shard(0), 1.0);
    EXPECT_FALSE(reducer.keeps_gradients());
    EXPECT_FALSE(reducer.take_gradient(sharded->shard(0), 1.0).defined()) << "taken once";
    std::vector<torch::Tensor> flat_gradients;
    for (const auto& parameter : flat) flat_gradients.push_back(parameter.grad());
    const double off_mean = testing::relative_error(shard, sharded->shard_of(0, mean));
    const double off_flat = testing::relative_error(shard, sharded->shard_of(0, flat_gradients));
    std::printf("rank %lld: %.2e from the exact mean, %.2e from flat PowerSGD\n", static_cast<long long>(place.rank),
                off_mean, off_flat);
    EXPECT_LT(off_mean, 1e-5);
    EXPECT_LT(off_flat, 1e-5);
    int64_t compressed = 0, bytes = 0;
    for (const auto& rows : sharded->rows_in_shard(0)) {
      compressed += rows.rows * rows.columns;
      bytes += (rows.rows + rows.columns) * effective_rank(rows.rows, rows.columns, options) * 4;
    }
    EXPECT_EQ(reducer.bytes_across_nodes(), bytes + (shard.numel() - compressed) * 4 + 4 * 4);
    const auto whole_norm = torch::linalg_vector_norm(
        torch::cat({mean[0].flatten(), mean[1], mean[2].flatten(), torch::full({7}, 1.5)}), 2);
    EXPECT_NEAR(reducer.gradient_norm(parameters), whole_norm.item<double>(), 1e-4) << "from Q and the rest";
  });
}

// Warm-started Q under sharding: each block's Q after an update starts the next power
// iteration; at full rank every update is still the exact mean, and the Q kept is the last.
TEST(ShardedPowerSgd, WarmQAtFullRankStaysTheExactMeanAndIsKept) {
  testing::on_ranks(4, [&](const LaunchEnvironment& place) {
    auto world = group_at(place);
    const auto [within, across] = two_machines_of_two(place);
    const PowerSgdOptions options{.rank = 5, .start_update = 1, .min_compression_rate = 0.0, .warm_start = true};
    std::vector<std::vector<torch::Tensor>> tensors{{}};
    for (const auto& parameter : cut_group_of_rank(0)) tensors[0].push_back(torch::zeros_like(parameter).requires_grad_());
    auto sharded = std::make_shared<ShardedParameters>(tensors, within);
    ShardedReducer reducer(sharded, world, within, across, 1 << 20, options);
    const auto first_q = reducer.shard_q(0);
    ASSERT_FALSE(first_q.empty());
    std::vector<torch::Tensor> before;
    for (const auto& q : first_q) before.push_back(q.clone());
    for (int64_t update = 0; update < 2; ++update) {
      // Each update's gradients are another draw: ranks 4u .. 4u + 3 of cut_group_of_rank.
      const auto of = [update](int64_t rank) { return cut_group_of_rank(4 * update + rank); };
      const auto mean = testing::mean_gradients(4, of);
      sharded->gather(0);
      const auto own = of(place.rank);
      for (size_t i = 0; i < own.size(); ++i) tensors[0][i].mutable_grad() = own[i].grad();
      sharded->reduce_gradients(0);
      sharded->release(0);
      sharded->shard(0).mutable_grad() = torch::Tensor();
      sharded->finish_reductions();
      reducer.reduce(sharded->shards());
      const auto taken = reducer.take_gradient(sharded->shard(0), 1.0);
      EXPECT_LT(testing::relative_error(taken, sharded->shard_of(0, mean)), 1e-5) << update;
    }
    const auto kept = reducer.shard_q(0);
    ASSERT_EQ(kept.size(), before.size());
    EXPECT_FALSE(torch::allclose(kept[0], before[0])) << "the last Q, not the first";
    reducer.set_shard_q(0, before);
    EXPECT_TRUE(torch::equal(reducer.shard_q(0)[0], before[0]));
    EXPECT_THROW_WITH(reducer.set_shard_q(0, {}), Error, "blocks of rows for shard 0");
  });
}

// DALL-E kept one buffer where PowerSGD has two: from before_backward the shard's gradient
// is its error feedback, brought to the backward's fp16 scale (8 here, as the update step's
// scaler does), so that backward adds into it. Over three lossy updates (rank 2, the error
// feedback carried) it takes the gradients and keeps the error feedback of two buffers bit
// for bit, in float32 and in bfloat16 (a power-of-two scale commutes with rounding); the
// buffer is the same storage at every update, and no gradient is left on the shard once it is
// reduced: the optimizer takes each, clipped by its factor.
TEST(ShardedPowerSgd, OneBufferForGradientAndErrorFeedbackReducesAsTwoDo) {
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    testing::on_ranks(4, [&](const LaunchEnvironment& place) {
      auto world = group_at(place);
      const PowerSgdOptions options{.rank = 2, .start_update = 1, .min_compression_rate = 0.0, .dtype = dtype};
      // Each path on subgroups of its own.
      const auto make = [&](const std::string& name) {
        std::vector<std::vector<torch::Tensor>> tensors{{}};
        for (const auto& parameter : cut_group_of_rank(0)) {
          tensors[0].push_back(torch::zeros_like(parameter).requires_grad_());
        }
        const auto groups = two_machines_of_two(place, name);
        auto sharded = std::make_shared<ShardedParameters>(tensors, groups.within);
        auto reducer =
            std::make_shared<ShardedReducer>(sharded, world, groups.within, groups.across, 1 << 20, options);
        return std::make_tuple(tensors, sharded, reducer);
      };
      auto [one_tensors, one, one_reducer] = make("one");
      auto [two_tensors, two, two_reducer] = make("two");
      const double scale = 8.0;
      const void* buffer = nullptr;
      for (int64_t update = 0; update < 3; ++update) {
        const auto own = cut_group_of_rank(4 * update + place.rank);
        one_reducer->before_backward(one->shards());
        auto& held = one->shard(0).mutable_grad();
        ASSERT_TRUE(held.defined()) << "the error feedback, as the gradient backward adds to";
        if (update == 0) buffer = held.data_ptr();
        EXPECT_EQ(held.data_ptr(), buffer) << "one buffer for every update";
        held.mul_(scale);
        const auto runs = {std::tuple{one_tensors, one, scale}, std::tuple{two_tensors, two, 1.0}};
        for (auto& [tensors, sharded, factor] : runs) {
          sharded->gather(0);
          for (size_t i = 0; i < own.size(); ++i) tensors[0][i].mutable_grad() = own[i].grad() * factor;
          sharded->reduce_gradients(0);
          sharded->release(0);
        }
        one_reducer->reduce_scaled(one->shards());
        one->shard(0).mutable_grad().div_(scale);
        one_reducer->reduce_unscaled(one->shards());
        two_reducer->reduce(two->shards());
        EXPECT_FALSE(one->shard(0).grad().defined());
        const auto taken = one_reducer->take_gradient(one->shard(0), 0.5);
        EXPECT_TRUE(torch::equal(taken, two_reducer->take_gradient(two->shard(0), 1.0) * 0.5)) << update;
      }
      EXPECT_TRUE(torch::equal(one_reducer->shard_error(0), two_reducer->shard_error(0)));
      EXPECT_GT(one_reducer->shard_error(0).abs().max().item<double>(), 0.0) << "lossy: the error feedback carries";
    });
  }
}

}  // namespace
}  // namespace dalle::distributed
