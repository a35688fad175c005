#include "train/training_loop.h"

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>

#include "dalle/log.h"
#include "dalle/runtime.h"
#include "dalle/train/stop_request.h"

namespace dalle::train::detail {

namespace {

// On a stop request: the last update's metrics line and a checkpoint, unless the loop wrote
// them already, so that a rerun resumes from the last update.
void save_before_stopping(const RunRecord& record, const LoopIntervals& intervals, const LoopActions& actions,
                          int64_t first, int64_t checkpointed) {
  const int64_t step = record.step;
  if (step > first && step % intervals.log_every != 0) actions.log();
  if (step > checkpointed) actions.checkpoint();
}

// With DALLE_MEMORY_PHASES set (docs/benchmarks.md, "Memory at resume" (f)), each phase's peak
// resident memory is logged: the start (resume included) as the high-water mark so far, then
// each update, validation and checkpoint with the mark reset as it begins (Linux's
// /proc/self/clear_refs), so that each peak is that phase's own.
class MemoryPhases {
 public:
  explicit MemoryPhases(const RunRecord& record)
      : record_(record), enabled_(std::getenv("DALLE_MEMORY_PHASES") != nullptr) {
    if (enabled_) log_peak("start");
  }
  void run(const char* phase, const std::function<void()>& action) const {
    if (!enabled_) return action();
    std::ofstream("/proc/self/clear_refs") << "5";
    action();
    log_peak(phase);
  }

 private:
  void log_peak(const char* phase) const {
    log::info(record_.what, ": memory phase ", phase, " at update ", record_.step, ": peak ",
              static_cast<int64_t>(process_memory_mib("VmHWM")), " MiB, resident ",
              static_cast<int64_t>(process_memory_mib("VmRSS")), " MiB");
  }
  const RunRecord& record_;
  bool enabled_;
};

void log_stop(const RunRecord& record, const LoopIntervals& intervals) {
  const int signal = stop_signal();
  log::warn(record.what, ": stopped", signal == SIGINT ? " by SIGINT" : signal == SIGTERM ? " by SIGTERM" : "",
            " after update ", record.step, " of ", intervals.steps, "; rerun the same command to resume from it");
}

}  // namespace

void run_training_loop(const RunRecord& record, const LoopIntervals& intervals, const LoopActions& actions) {
  const int64_t& step = record.step;  // advanced by actions.update
  const MemoryPhases phases(record);
  if (step >= intervals.steps) {
    log::info(record.what, ": already trained for ", step, " updates");
    return;
  }
  log::info(record.what, ": training from update ", step, " to ", intervals.steps, " in ", record.run.string());
  log::Progress progress(record.what, intervals.steps - step);
  const int64_t first = step;
  int64_t checkpointed = step;
  double resident_after_update = -1;
  while (step < intervals.steps && !record.should_stop()) {
    const auto started = std::chrono::steady_clock::now();
    double loss = 0;
    phases.run("update", [&] { loss = actions.update(); });
    record.update_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    ++record.updates_timed;
    resident_after_update = process_memory_mib("VmRSS");
    progress.advance();
    progress.set_loss(loss);
    const bool last = step == intervals.steps;
    if (step % intervals.log_every == 0 || last) actions.log();
    if (step % intervals.validate_every == 0 || last) phases.run("validation", actions.validate);
    if (step % intervals.checkpoint_every == 0 || last) {
      phases.run("checkpoint", actions.checkpoint);
      checkpointed = step;
    }
  }
  const bool stopped = step < intervals.steps;
  if (stopped) save_before_stopping(record, intervals, actions, first, checkpointed);
  progress.finish();
  // Each rank's own memory: what a user sizing a machine (or checking dalle-plan) needs.
  log::info(record.what, ": resident memory ", static_cast<int64_t>(resident_after_update),
            " MiB after the last update, peak ", static_cast<int64_t>(process_memory_mib("VmHWM")), " MiB");
  if (stopped) log_stop(record, intervals);
}

}  // namespace dalle::train::detail
