#pragma once
// The requests parked until their job ends, which the server must wake before its event loop
// stops (a parked connection nobody wakes holds the loop's stop for ever). A request joins
// before it is parked; once the set is closed (the server stopping) none may join, so none can
// be parked after the last wake-up.
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

namespace dalle::serve {

template <class Request>
class WaitingSet {
 public:
  // Whether `request` joined: false once the set is closed.
  bool join(const std::shared_ptr<Request>& request) {
    std::lock_guard lock(mutex_);
    if (closed_) return false;
    members_.insert(request);
    return true;
  }
  void leave(const std::shared_ptr<Request>& request) {
    std::lock_guard lock(mutex_);
    members_.erase(request);
    changed_.notify_all();
  }
  // Closes the set and calls `wake` on each member, under the set's lock (so that none leaves
  // while it is woken).
  template <class Wake>
  void close(const Wake& wake) {
    std::lock_guard lock(mutex_);
    closed_ = true;
    for (const auto& request : members_) wake(*request);
  }
  // Whether every member left within `timeout`.
  bool wait_until_empty(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, timeout, [&] { return members_.empty(); });
  }
  // The members now, to visit without the set's lock.
  std::vector<std::shared_ptr<Request>> members() const {
    std::lock_guard lock(mutex_);
    return {members_.begin(), members_.end()};
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::set<std::shared_ptr<Request>> members_;
  bool closed_ = false;
};

}  // namespace dalle::serve
