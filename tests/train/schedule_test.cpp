#include "dalle/train/schedule.h"

#include "test_support.h"

namespace dalle::train {
namespace {

TEST(CosineSchedule, MovesFromStartToEndAlongHalfACosine) {
  const CosineSchedule tau{.start = 1.0, .end = 1.0 / 16, .steps = 150000};
  EXPECT_DOUBLE_EQ(tau.at(0), 1.0);
  EXPECT_DOUBLE_EQ(tau.at(75000), (1.0 + 1.0 / 16) / 2);
  EXPECT_DOUBLE_EQ(tau.at(150000), 1.0 / 16);
  EXPECT_DOUBLE_EQ(tau.at(10'000'000), 1.0 / 16);
  EXPECT_NEAR(tau.at(37500), 1.0 / 16 + (1.0 - 1.0 / 16) * (1 + std::sqrt(0.5)) / 2, 1e-12);
  const CosineSchedule beta{.start = 0.0, .end = 6.6, .steps = 5000};
  for (int64_t step = 1; step <= 5000; ++step) EXPECT_GE(beta.at(step), beta.at(step - 1));
  EXPECT_DOUBLE_EQ(CosineSchedule({.start = 3, .end = 1, .steps = 0}).at(0), 1.0);
}

}  // namespace
}  // namespace dalle::train
