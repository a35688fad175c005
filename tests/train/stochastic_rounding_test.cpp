// Stochastic rounding to 16 bits, and AdamW stepping 16-bit parameters with it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "dalle/train/adamw.h"
#include "dalle/train/stochastic_rounding.h"

namespace dalle::train {
namespace {

// The two neighbours of `value` in `dtype`, below and above.
std::pair<double, double> neighbours(double value, torch::ScalarType dtype) {
  const auto nearest = torch::tensor({value}, torch::kFloat64).to(dtype).to(torch::kFloat64).item<double>();
  const auto spacing = [&](double at) {
    int exponent = 0;
    std::frexp(at, &exponent);
    const int mantissa = dtype == torch::kBFloat16 ? 7 : 10;
    const int smallest = dtype == torch::kBFloat16 ? -126 : -14;
    return std::ldexp(1.0, std::max(exponent - 1, smallest) - mantissa);
  };
  if (nearest <= value) return {nearest, nearest + spacing(nearest)};
  return {nearest - spacing(value), nearest};
}

class StochasticRounding : public ::testing::TestWithParam<torch::ScalarType> {};

TEST_P(StochasticRounding, LandsOnANeighbourAndIsUnbiased) {
  const auto dtype = GetParam();
  for (const double value : {1.0 + 1.0 / 3.0, -0.0123456, 3.0e-6, 1000.7, -7.77e-3}) {
    auto generator = rounding_generator(torch::kCPU, 7);
    const auto values = torch::full({200000}, value, torch::kFloat32);
    const auto rounded = round_stochastically(values, dtype, generator);
    ASSERT_EQ(rounded.scalar_type(), dtype);
    const auto [low, high] = neighbours(static_cast<double>(values[0].item<float>()), dtype);
    const auto as_double = rounded.to(torch::kFloat64);
    EXPECT_TRUE(((as_double == low) | (as_double == high)).all().item<bool>()) << value;
    // The mean is the value: within 5 standard errors of the draws' binomial spread.
    const double exact = static_cast<double>(values[0].item<float>());
    const double p = (exact - low) / (high - low);
    const double standard_error = (high - low) * std::sqrt(p * (1 - p) / 200000.0);
    EXPECT_NEAR(as_double.mean().item<double>(), exact, 5 * standard_error + 1e-12) << value;
    // Rounding to nearest would be biased by up to half a spacing; here both neighbours occur.
    EXPECT_GT((as_double == high).sum().item<int64_t>(), 0) << value;
    EXPECT_GT((as_double == low).sum().item<int64_t>(), 0) << value;
  }
}

TEST_P(StochasticRounding, KeepsRepresentableValuesAndInfinitiesAndRepeatsWithTheSeed) {
  const auto dtype = GetParam();
  const auto exact = torch::tensor({0.0, 1.0, -2.5, 0.125, 6.0e-8}).to(dtype).to(torch::kFloat32);
  auto generator = rounding_generator(torch::kCPU, 1);
  EXPECT_TRUE(torch::equal(round_stochastically(exact, dtype, generator).to(torch::kFloat32), exact));
  const auto special = torch::tensor({INFINITY, -INFINITY});
  EXPECT_TRUE(torch::equal(round_stochastically(special, dtype, generator).to(torch::kFloat32), special));
  const auto values = torch::randn({1000});
  auto first = rounding_generator(torch::kCPU, 42), second = rounding_generator(torch::kCPU, 42);
  EXPECT_TRUE(torch::equal(round_stochastically(values, dtype, first), round_stochastically(values, dtype, second)));
}

INSTANTIATE_TEST_SUITE_P(Types, StochasticRounding, ::testing::Values(torch::kBFloat16, torch::kFloat16));

// A step a hundred times smaller than bfloat16's spacing: rounding to nearest would never
// move the weight; rounded stochastically, it moves by the steps' sum on average.
TEST(AdamWWithSixteenBitParameters, SmallStepsAddUpAndTheRoundingRepeatsWithTheSeed) {
  const int64_t values = 20000, steps = 50;
  const double lr = 1.0 / 256 / 100;  // 1.0's bfloat16 spacing is 1/128; Adam's step is about lr
  const auto train = [&](uint64_t seed) {
    auto weight = torch::ones({values}, torch::kBFloat16).requires_grad_(true);
    AdamW adamw({torch::optim::OptimizerParamGroup({weight})}, torch::optim::AdamWOptions(lr).weight_decay(0),
                torch::kBFloat16);
    adamw.set_rounding_seed(seed);
    for (int64_t step = 0; step < steps; ++step) {
      weight.mutable_grad() = torch::ones({values}, torch::kBFloat16);
      adamw.step();
    }
    return weight.detach().to(torch::kFloat64);
  };
  const auto moved = train(3);
  EXPECT_EQ(moved.scalar_type(), torch::kFloat64);
  // Every step is -lr (Adam's normalised gradient of a constant is 1).
  EXPECT_NEAR(moved.mean().item<double>(), 1.0 - steps * lr, 2e-4);
  EXPECT_TRUE(torch::equal(moved, train(3)));
  EXPECT_FALSE(torch::equal(moved, train(4)));
}

}  // namespace
}  // namespace dalle::train
