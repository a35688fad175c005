#include "dalle/train/stop_request.h"

#include <algorithm>
#include <atomic>

namespace dalle::train {
namespace {

// -1: no stop requested; otherwise the signal that asked (0 for a call from code).
std::atomic<int> requested{-1};
static_assert(std::atomic<int>::is_always_lock_free, "a signal handler may only touch lock-free atomics");

void on_signal(int signal) { request_stop(signal); }

}  // namespace

void request_stop(int signal) { requested.store(signal); }
bool stop_requested() { return requested.load() >= 0; }
int stop_signal() { return std::max(requested.load(), 0); }
void clear_stop_request() { requested.store(-1); }

StopOnSignals::StopOnSignals() {
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  // The second signal takes the default action; reads interrupted by the first go on.
  action.sa_flags = SA_RESETHAND | SA_RESTART;
  sigaction(SIGINT, &action, &previous_interrupt_);
  sigaction(SIGTERM, &action, &previous_terminate_);
}

StopOnSignals::~StopOnSignals() {
  sigaction(SIGINT, &previous_interrupt_, nullptr);
  sigaction(SIGTERM, &previous_terminate_, nullptr);
}

}  // namespace dalle::train
