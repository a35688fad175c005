#include "dalle/train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace dalle::train {

double CosineSchedule::at(int64_t step) const {
  if (steps <= 0 || step >= steps) return end;
  const double progress = static_cast<double>(std::max<int64_t>(step, 0)) / static_cast<double>(steps);
  return end + (start - end) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace dalle::train
