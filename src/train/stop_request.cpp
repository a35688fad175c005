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
  // Reads interrupted by the signal go on. A second ^C takes the default action; SIGTERM
  // keeps asking, since `timeout` sends it to the process and again to its process group,
  // and a second delivery must not cost the checkpoint the first one asked for.
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, &previous_terminate_);
  action.sa_flags = SA_RESETHAND | SA_RESTART;
  sigaction(SIGINT, &action, &previous_interrupt_);
}

StopOnSignals::~StopOnSignals() {
  sigaction(SIGINT, &previous_interrupt_, nullptr);
  sigaction(SIGTERM, &previous_terminate_, nullptr);
}

}  // namespace dalle::train
