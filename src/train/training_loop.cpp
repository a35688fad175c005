#include "training_loop.h"

#include "dalle/log.h"

namespace dalle::train::detail {

bool is_run_control_key(const std::string& key) {
  return key == "steps" || key == "log_every" || key == "validate_every" || key == "checkpoint_every" ||
         key == "keep_checkpoints" || key == "threads" || key == "data.workers" || key == "device";
}

void run_training_loop(const RunRecord& record, const LoopIntervals& intervals, const LoopActions& actions) {
  const int64_t& step = record.step;  // advanced by actions.update
  if (step >= intervals.steps) {
    log::info(record.what, ": already trained for ", step, " updates");
    return;
  }
  log::info(record.what, ": training from update ", step, " to ", intervals.steps, " in ", record.run.string());
  log::Progress progress(record.what, intervals.steps - step);
  while (step < intervals.steps) {
    const double loss = actions.update();
    progress.advance();
    progress.set_loss(loss);
    const bool last = step == intervals.steps;
    if (step % intervals.log_every == 0 || last) actions.log();
    if (step % intervals.validate_every == 0 || last) actions.validate();
    if (step % intervals.checkpoint_every == 0 || last) actions.checkpoint();
  }
  progress.finish();
}

}  // namespace dalle::train::detail
