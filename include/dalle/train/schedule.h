#pragma once
// Schedules of a scalar over training updates (learning rate, gumbel temperature, KL weight).
#include <cstdint>

#include "dalle/config.h"

namespace dalle::train {

// Half a cosine from `start` to `end` over `steps` updates, then `end`: DALL-E's shape for
// the dVAE's temperature (1 -> 1/16), KL weight (0 -> 6.6) and learning rate.
struct CosineSchedule {
  double start = 1.0;
  double end = 0.0;
  int64_t steps = 1;

  double at(int64_t step) const;

  void visit(ConfigVisitor& v) {
    v.field("start", start, "value at update 0");
    v.field("end", end, "value from `steps` on");
    v.field("steps", steps, "updates over which the value moves from start to end", {.min = 0});
  }
};

}  // namespace dalle::train
