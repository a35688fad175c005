#include "dalle/models/decode_graphs.h"

#include <torch/torch.h>

#include "test_support.h"

namespace dalle::models {
namespace {

TEST(DecodeGraphs, KeepsATensorWhileItsShapeHoldsAndZerosANewOne) {
  DecodeGraphs graphs;
  auto first = graphs.buffer("keys.0", {2, 3}, torch::kFloat32);
  EXPECT_TRUE(torch::equal(first, torch::zeros({2, 3})));
  first.fill_(5);
  const auto again = graphs.buffer("keys.0", {2, 3}, torch::kFloat32);
  EXPECT_EQ(again.data_ptr(), first.data_ptr());
  EXPECT_TRUE(torch::equal(again, torch::full({2, 3}, 5.0f))) << "a kept tensor holds what it was given";
  const auto resized = graphs.buffer("keys.0", {4, 3}, torch::kFloat32);
  EXPECT_TRUE(torch::equal(resized, torch::zeros({4, 3})));
  const auto retyped = graphs.buffer("keys.0", {4, 3}, torch::kInt64);
  EXPECT_EQ(retyped.scalar_type(), torch::kInt64);
  EXPECT_NE(graphs.buffer("values.0", {4, 3}, torch::kInt64).data_ptr(), retyped.data_ptr());
  retyped.fill_(7);
  graphs.clear();
  EXPECT_TRUE(torch::equal(graphs.buffer("keys.0", {4, 3}, torch::kInt64), torch::zeros({4, 3}, torch::kInt64)))
      << "cleared: made anew";
}

TEST(DecodeGraphs, OnTheCpuStepsRunEagerlyOverExactLengths) {
  DecodeGraphs graphs;
  EXPECT_FALSE(graphs.captures_on(torch::kCPU));
  int steps = 0;
  for (int i = 0; i < 3; ++i) graphs.run(7, torch::kCPU, [&] { ++steps; });
  EXPECT_EQ(steps, 3);
  EXPECT_EQ(graphs.graphs(), 0);
  EXPECT_EQ(graphs.replays(), 0);
  EXPECT_EQ(graphs.keys_for(70, 1152, torch::kCPU), 70);
  EXPECT_EQ(graphs.keys_for(70, 1152, torch::Device(torch::kCUDA, 0)), 128) << "a GPU's lengths come in buckets";
  EXPECT_EQ(graphs.keys_for(1150, 1152, torch::Device(torch::kCUDA, 0)), 1152) << "never past the cache";
  EXPECT_FALSE(DecodeGraphs(false).captures_on(torch::Device(torch::kCUDA, 0)));
}

TEST(DecodeGraphs, OnAGpuAStepIsCapturedOnceAndReplayed) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "torch sees no CUDA device";
  const torch::Device gpu(torch::kCUDA, 0);
  DecodeGraphs graphs;
  ASSERT_TRUE(graphs.captures_on(gpu));
  auto counter = graphs.buffer("counter", {1}, torch::TensorOptions().dtype(torch::kInt64).device(gpu));
  auto sum = graphs.buffer("sum", {1}, torch::TensorOptions().dtype(torch::kInt64).device(gpu));
  const auto step = [&] {
    sum.add_(counter * 10);
    counter.add_(1);
  };
  for (int i = 0; i < 5; ++i) graphs.run(64, gpu, step);
  EXPECT_EQ(graphs.graphs(), 1);
  EXPECT_EQ(graphs.replays(), 4) << "the first step runs eagerly, then is captured";
  EXPECT_EQ(counter.item<int64_t>(), 5);
  EXPECT_EQ(sum.item<int64_t>(), 100) << "each step ran once: 0 + 10 + 20 + 30 + 40";
  graphs.expect("other constants");
  EXPECT_EQ(graphs.graphs(), 0);
}

}  // namespace
}  // namespace dalle::models
