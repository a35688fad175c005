#include "dalle/train/ema.h"

#include <torch/torch.h>

#include "test_support.h"

namespace dalle::train {
namespace {

TEST(Ema, AveragesUpdatesButTakesOverwrittenRowsAsTheyAre) {
  torch::nn::Embedding codes(3, 2);
  {
    torch::NoGradGuard no_grad;
    codes->weight.fill_(0.0);
  }
  Ema ema(*codes, 0.75);
  {
    torch::NoGradGuard no_grad;
    codes->weight.fill_(4.0);
  }
  ema.update(*codes);  // 0.75 * 0 + 0.25 * 4
  EXPECT_TRUE(torch::allclose(ema.weights().at("weight"), torch::full({3, 2}, 1.0)));

  ema.overwrite_rows("weight", torch::tensor({2}, torch::kInt64), torch::full({1, 2}, 7.0));
  const auto& average = ema.weights().at("weight");
  EXPECT_TRUE(torch::allclose(average[2], torch::full({2}, 7.0)));
  EXPECT_TRUE(torch::allclose(average.slice(0, 0, 2), torch::full({2, 2}, 1.0)));
  EXPECT_THROW_WITH(ema.overwrite_rows("bias", torch::tensor({0}, torch::kInt64), torch::zeros({1, 2})), Error,
                    "no parameter named 'bias'");
}

}  // namespace
}  // namespace dalle::train
