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
#include "run_directory.h"

namespace dalle::train::detail {

struct LoopIntervals {
  int64_t steps = 0;
  int64_t log_every = 1;
  int64_t validate_every = 1;
  int64_t checkpoint_every = 1;
};

// Every trainer config names its intervals alike.
template <class Config>
LoopIntervals intervals_of(const Config& config) {
  return {config.steps, config.log_every, config.validate_every, config.checkpoint_every};
}

// The intervals' keys and keep_checkpoints, as every trainer config visits them;
// `validation` says what a validation measures.
template <class Config>
void visit_interval_keys(ConfigVisitor& v, Config& c, const std::string& validation) {
  v.field("steps", c.steps, "updates to train for", {.min = 1});
  v.field("log_every", c.log_every, "updates between metric lines", {.min = 1});
  v.field("validate_every", c.validate_every, "updates between validations (" + validation + ")", {.min = 1});
  v.field("checkpoint_every", c.checkpoint_every, "updates between checkpoints", {.min = 1});
  v.field("keep_checkpoints", c.keep_checkpoints, "checkpoints kept (0: all)", {.min = 0});
}

// seed, threads and device, as every trainer config visits them: `seeded` lists what the
// seed fixes, `trains` says what trains where ("the prior trains").
template <class Config>
void visit_seed_and_device_keys(ConfigVisitor& v, Config& c, const std::string& seeded, const std::string& trains) {
  v.field("seed", c.seed, "seed of " + seeded, {.min = 0});
  v.field("threads", c.threads, "CPU threads for torch (0: one per idle core)", {.min = 0, .max = 1024});
  v.field("device", c.device, "where " + trains + ": auto (a GPU when torch sees one), cpu or cuda",
          {.choices = {"auto", "cpu", "cuda"}});
}

// Keys every trainer lets a resume change: how long and how often, the threads, the loader's
// workers and the device, not what is trained.
bool is_run_control_key(const std::string& key);

struct LoopActions {
  std::function<double()> update;   // one update, which advances the step; returns its loss
  std::function<void()> log;        // appends the last update's metrics line
  std::function<void()> validate;   // validates and says how it went
  std::function<void()> checkpoint;
};

// Runs `actions.update` until the run's step reaches `intervals.steps` or a stop is requested.
void run_training_loop(const RunRecord& record, const LoopIntervals& intervals, const LoopActions& actions);

}  // namespace dalle::train::detail
