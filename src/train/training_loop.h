#pragma once
// The loop every trainer runs: updates up to the configured count, with a metrics line, a
// validation and a checkpoint at their intervals and after the last update, and a progress
// line; a stop request (dalle/train/stop_request.h) ends it early with a checkpoint. The
// trainers differ in what an update, a validation and a checkpoint are, not in when they
// happen. Private to the library.
#include <cstdint>
#include <functional>
#include <string>

#include "dalle/config.h"
#include "dalle/train/recipe.h"
#include "train/run_directory.h"

namespace dalle::train::detail {

struct LoopIntervals {
  int64_t steps = 0;
  int64_t log_every = 1;
  int64_t validate_every = 1;
  int64_t checkpoint_every = 1;
};

// A recipe's `run` section's intervals.
inline LoopIntervals intervals_of(const RunConfig& run) {
  return {run.steps, run.log_every, run.validate_every, run.checkpoint_every};
}

struct LoopActions {
  std::function<double()> update;   // one update, which advances the step; returns its loss
  std::function<void()> log;        // appends the last update's metrics line
  std::function<void()> validate;   // validates and says how it went
  std::function<void()> checkpoint;
};

// Runs `actions.update` until the run's step reaches `intervals.steps` or a stop is requested.
void run_training_loop(const RunRecord& record, const LoopIntervals& intervals, const LoopActions& actions);

}  // namespace dalle::train::detail
