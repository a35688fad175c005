#include "serve/scheduler.h"

#include <algorithm>
#include <exception>
#include <utility>

#include "dalle/log.h"

namespace dalle::serve {

using Clock = std::chrono::steady_clock;

Scheduler::Scheduler(Generate generate, Options options)
    : generate_(std::move(generate)), options_(options), worker_([this] { work(); }) {}

Scheduler::~Scheduler() {
  drain();
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  worker_.join();
}

std::shared_ptr<Job> Scheduler::submit(generate::PromptRequest request, Refusal& refusal) {
  std::lock_guard lock(mutex_);
  refusal = draining_ ? Refusal::draining
            : static_cast<int64_t>(queue_.size()) >= options_.max_queue ? Refusal::queue_full
                                                                         : Refusal::none;
  if (refusal != Refusal::none) return nullptr;
  auto job = std::make_shared<Job>();
  job->request = std::move(request);
  job->admitted = Clock::now();
  queue_.push_back(job);
  changed_.notify_all();
  return job;
}

bool Scheduler::wait(const std::shared_ptr<Job>& job, Clock::time_point deadline, const std::function<bool()>& give_up,
                     std::chrono::milliseconds poll, const PreviewSink& on_previews) {
  std::unique_lock lock(mutex_);
  size_t shown = 0;
  while (true) {
    if (on_previews && job->previews.size() > shown) {
      const std::vector<generate::Preview> fresh(job->previews.begin() + static_cast<std::ptrdiff_t>(shown),
                                                 job->previews.end());
      shown = job->previews.size();
      lock.unlock();  // the sink writes to a socket
      const bool taken = on_previews(fresh);
      lock.lock();
      if (!taken && job->state != Job::State::done) {
        abandon(job);
        return false;
      }
      continue;
    }
    if (job->state == Job::State::done) return true;
    const auto now = Clock::now();
    bool stop = now >= deadline;
    if (!stop && give_up) {
      lock.unlock();  // the question may take a system call; the worker need not wait for it
      stop = give_up();
      lock.lock();
      if (job->state == Job::State::done) continue;
    }
    if (stop) {
      abandon(job);
      return false;
    }
    changed_.wait_until(lock, std::min(deadline, now + poll));
  }
}

void Scheduler::abandon(const std::shared_ptr<Job>& job) {
  const auto at = std::find(queue_.begin(), queue_.end(), job);
  if (at != queue_.end()) queue_.erase(at);
  job->state = Job::State::abandoned;
  changed_.notify_all();  // drain() may be waiting for the queue to empty
}

void Scheduler::drain() {
  std::unique_lock lock(mutex_);
  draining_ = true;
  changed_.notify_all();
  changed_.wait(lock, [&] { return queue_.empty() && running_ == 0; });
}

bool Scheduler::draining() const {
  std::lock_guard lock(mutex_);
  return draining_;
}

int64_t Scheduler::queued() const {
  std::lock_guard lock(mutex_);
  return static_cast<int64_t>(queue_.size());
}

int64_t Scheduler::running() const {
  std::lock_guard lock(mutex_);
  return running_;
}

std::vector<std::shared_ptr<Job>> Scheduler::take_batch() {
  std::vector<std::shared_ptr<Job>> batch;
  int64_t rows = 0;
  while (!queue_.empty()) {
    const auto candidates = queue_.front()->request.candidates;
    if (!batch.empty() && rows + candidates > options_.batch_rows) break;
    rows += candidates;
    batch.push_back(std::move(queue_.front()));
    queue_.pop_front();
    batch.back()->state = Job::State::running;
  }
  running_ = static_cast<int64_t>(batch.size());
  return batch;
}

void Scheduler::work() {
  std::unique_lock lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    // The window opens with the oldest request: later ones join it until it closes or the
    // batch is full. A draining scheduler does not wait for requests that cannot come.
    const auto closes = queue_.front()->admitted + options_.batch_window;
    changed_.wait_until(lock, closes, [&] {
      int64_t rows = 0;
      for (const auto& job : queue_) rows += job->request.candidates;
      return draining_ || queue_.empty() || rows >= options_.batch_rows;
    });
    auto batch = take_batch();
    if (batch.empty()) continue;  // the requests waiting were given up on
    lock.unlock();
    run(batch);
    lock.lock();
    running_ = 0;
    changed_.notify_all();
  }
}

void Scheduler::run(const std::vector<std::shared_ptr<Job>>& batch) {
  std::vector<generate::PromptRequest> requests;
  for (const auto& job : batch) requests.push_back(job->request);
  const auto start = Clock::now();
  std::vector<generate::GeneratedImage> images;
  std::string error;
  // A preview goes to its job; the last of each candidate is its image, which the job gets whole.
  const auto to_jobs = [&](const std::vector<generate::Preview>& previews) {
    std::lock_guard lock(mutex_);
    for (const auto& preview : previews) {
      auto& job = *batch.at(static_cast<size_t>(preview.request));
      if (preview.drawn < preview.total && job.state != Job::State::abandoned) job.previews.push_back(preview);
    }
    changed_.notify_all();
  };
  try {
    images = generate_(requests, to_jobs);
  } catch (const std::exception& failure) {
    error = failure.what();
    log::error("serve: generating ", batch.size(), " requests failed: ", error);
  }
  const auto seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::lock_guard lock(mutex_);
  for (auto& image : images) {
    auto& job = *batch.at(static_cast<size_t>(image.request));
    job.images.push_back(std::move(image));
  }
  for (const auto& job : batch) {
    job->error = error;
    job->generation_seconds = seconds;
    job->batched_with = static_cast<int64_t>(batch.size());
    if (job->state == Job::State::abandoned) job->images.clear();  // nobody waits for them
    job->state = Job::State::done;
  }
}

}  // namespace dalle::serve
