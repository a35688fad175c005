#include "dalle/models/token_grid.h"

#include <torch/torch.h>

#include <limits>

#include "dalle/models/vqgan_detokenizer.h"
#include "test_support.h"

namespace dalle::models {
namespace {

TEST(TokenGrid, TheSideOfASquareCountAndAClearErrorForAnyOther) {
  EXPECT_EQ(grid_side(0, "none"), 0);
  EXPECT_EQ(grid_side(1, "one"), 1);
  EXPECT_EQ(grid_side(64, "demo"), 8);
  EXPECT_EQ(grid_side(256, "mega"), 16);
  EXPECT_EQ(grid_side(int64_t{3037000499} * 3037000499, "largest"), 3037000499);
  EXPECT_THROW_WITH(grid_side(63, "the prior's image positions"), Error,
                    "the prior's image positions: 63 cells make no square grid");
  // Above 2^53 a double cannot tell these counts from the square next to them.
  EXPECT_THROW_WITH(grid_side(int64_t{3037000499} * 3037000499 - 1, "one below"), Error, "make no square grid");
  EXPECT_THROW_WITH(grid_side(int64_t{3037000000} * 3037000000 + 1, "one above"), Error, "make no square grid");
  EXPECT_THROW_WITH(grid_side(-4, "negative"), Error, "negative: -4 cells");
  EXPECT_THROW_WITH(grid_side(std::numeric_limits<int64_t>::max(), "max"), Error, "make no square grid");
}

TEST(TokenGrid, MinDallesGridOfImagesRefusesACountThatIsNotASquare) {
  EXPECT_EQ(min_dalle_grid(torch::zeros({4, 3, 2, 2})).sizes(), (std::vector<int64_t>{4, 4, 3}));
  EXPECT_THROW_WITH(min_dalle_grid(torch::zeros({3, 3, 2, 2})), Error, "min-dalle grid: expected [g * g, C, H, W]",
                    "3 cells make no square grid");
}

}  // namespace
}  // namespace dalle::models
