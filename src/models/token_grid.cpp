#include "dalle/models/token_grid.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "dalle/error.h"

namespace dalle::models {

int64_t grid_side(int64_t cells, std::string_view what) {
  if (cells >= 0) {
    // The rounded root, corrected where a double is off by one for large counts; no square of
    // a side beyond the largest one below 2^63 is formed.
    constexpr int64_t kLargestSide = 3037000499;
    auto side = std::min(static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(cells)))), kLargestSide);
    while (side > 0 && side * side > cells) --side;
    while (side < kLargestSide && (side + 1) * (side + 1) <= cells) ++side;
    if (side * side == cells) return side;
  }
  throw Error(std::string(what) + ": " + std::to_string(cells) +
              " cells make no square grid (a grid of side s has s * s of them)");
}

}  // namespace dalle::models
