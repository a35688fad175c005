#include "serve/task_thread.h"

#include <exception>
#include <utility>

#include "dalle/log.h"

namespace dalle::serve {

TaskThread::TaskThread(std::string name) : name_(std::move(name)), thread_([this] { run(); }) {}

TaskThread::~TaskThread() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    tasks_.clear();
  }
  changed_.notify_all();
  thread_.join();
}

void TaskThread::post(std::function<void()> task) {
  {
    std::lock_guard lock(mutex_);
    tasks_.push_back(std::move(task));
  }
  changed_.notify_all();
}

void TaskThread::run() {
  std::unique_lock lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
    if (stopping_) return;
    auto task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    try {
      task();
    } catch (const std::exception& error) {
      log::error("serve: ", name_, ": ", error.what());
    }
    task = nullptr;  // what it holds goes before the lock is taken again
    lock.lock();
  }
}

}  // namespace dalle::serve
