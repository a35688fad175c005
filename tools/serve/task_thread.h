#pragma once
// A thread of its own that runs the tasks posted to it, in order: dalle-serve's work that
// must not hold its event loop (decoding an uploaded image, say). Tasks still queued when
// it is destroyed are dropped; the one running finishes first.
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace dalle::serve {

class TaskThread {
 public:
  explicit TaskThread(std::string name);
  ~TaskThread();
  TaskThread(const TaskThread&) = delete;
  TaskThread& operator=(const TaskThread&) = delete;

  // A task that throws is logged under the thread's name; the thread goes on.
  void post(std::function<void()> task);

 private:
  void run();

  std::string name_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace dalle::serve
