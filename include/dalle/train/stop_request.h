#pragma once
// Stopping a training run early without losing it. Every trainer checks for a stop request
// before each update; when there is one it writes a checkpoint of the updates since the
// last one and returns from run(), so that rerunning the same command resumes where it
// stopped. The dalle-train* tools request a stop on SIGINT (Ctrl-C) and on SIGTERM, which
// batch schedulers send some time before they end a job.
#include <signal.h>

namespace dalle::train {

// Asks the running trainer to stop before its next update. Async-signal-safe, so a signal
// handler or another thread may call it; `signal` names the signal that asked (0: none).
void request_stop(int signal = 0);
bool stop_requested();
// The signal given to request_stop, 0 when none was or no stop is requested.
int stop_signal();
// Lets the next run() train again.
void clear_stop_request();

// While alive, the first SIGINT or SIGTERM requests a stop; a second SIGINT has its default
// effect and ends the process at once. Further SIGTERMs only ask again: `timeout` and batch
// schedulers may deliver one twice, and end a run that will not stop with SIGKILL.
// Restores the earlier handlers when destroyed.
class StopOnSignals {
 public:
  StopOnSignals();
  ~StopOnSignals();
  StopOnSignals(const StopOnSignals&) = delete;
  StopOnSignals& operator=(const StopOnSignals&) = delete;

 private:
  struct sigaction previous_interrupt_ {};
  struct sigaction previous_terminate_ {};
};

}  // namespace dalle::train
