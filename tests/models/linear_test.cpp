#include "dalle/models/linear.h"

#include <torch/torch.h>

#include "test_support.h"

namespace dalle::models {
namespace {

TEST(Linear, HasTorchLinearsNamesAndInitialisation) {
  torch::manual_seed(1);
  torch::nn::Linear theirs(16, 8);
  torch::manual_seed(1);
  Linear ours(16, 8);
  EXPECT_EQ(ours->named_parameters().keys(), theirs->named_parameters().keys());
  EXPECT_TRUE(torch::equal(ours->weight, theirs->weight));
  EXPECT_TRUE(torch::equal(ours->bias, theirs->bias));
  const auto x = torch::randn({3, 16});
  EXPECT_TRUE(torch::equal(ours(x), theirs(x)));
  EXPECT_EQ(Linear(16, 8, /*bias=*/false)->named_parameters().keys(), std::vector<std::string>{"weight"});
}

TEST(Linear, Int8FollowsTheFloatLayerWithinItsQuantizationErrorAndDropsTheFloatWeight) {
  torch::manual_seed(0);
  for (const bool bias : {true, false}) {
    Linear linear(256, 384, bias);
    const auto x = torch::randn({2, 3, 256});
    const auto reference = linear(x);
    linear->quantize_int8();
    ASSERT_TRUE(linear->quantized());
    const auto out = linear(x);
    ASSERT_EQ(out.sizes(), reference.sizes());
    const double error = (out - reference).abs().max().item<double>();
    const double largest = reference.abs().max().item<double>();
    EXPECT_LT(error, 0.02 * largest) << "int8 against float32, bias " << bias;
    EXPECT_GT(error, 0.0) << "the int8 product, not the float weights";
    EXPECT_EQ(linear->weight.numel(), 0) << "the float32 weight is freed";
  }
}

TEST(Linear, Int8RefusesWhatItCannotRun) {
  Linear half(4, 4);
  half->to(torch::kBFloat16);
  EXPECT_THROW_WITH(half->quantize_int8(), Error, "int8 weights are made from float32 ones on the CPU, not BFloat16");
  Linear quantized(4, 4);
  quantized->quantize_int8();
  EXPECT_THROW_WITH(quantized(torch::ones({1, 4}, torch::kBFloat16)), Error, "takes float32 inputs on the CPU");
}

TEST(Linear, QuantizingAModelTakesEveryLinearLayerAndLeavesTheRest) {
  torch::nn::Sequential model(Linear(8, 8), torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})), Linear(8, 4));
  EXPECT_EQ(quantize_linears_int8(*model), 2);
  EXPECT_EQ(model->forward(torch::randn({5, 8})).sizes(), (std::vector<int64_t>{5, 4}));
}

}  // namespace
}  // namespace dalle::models
