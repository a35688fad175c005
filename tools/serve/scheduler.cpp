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

std::shared_ptr<Job> Scheduler::submit(generate::PreparedRequest request, Refusal& refusal,
                                       std::function<void(const std::shared_ptr<Job>&)> on_change) {
  std::lock_guard lock(mutex_);
  refusal = draining_ ? Refusal::draining
            : static_cast<int64_t>(queue_.size()) >= options_.max_queue ? Refusal::queue_full
                                                                         : Refusal::none;
  if (refusal != Refusal::none) return nullptr;
  auto job = std::make_shared<Job>();
  job->request = std::move(request);
  job->on_change = std::move(on_change);
  job->admitted = Clock::now();
  queue_.push_back(job);
  changed_.notify_all();
  return job;
}

void Scheduler::cancel(const std::shared_ptr<Job>& job) {
  std::lock_guard lock(mutex_);
  if (job->state == Job::State::done) return;
  const auto at = std::find(queue_.begin(), queue_.end(), job);
  if (at != queue_.end()) queue_.erase(at);
  job->state = Job::State::abandoned;
  changed_.notify_all();  // drain() may be waiting for the queue to empty
}

Scheduler::Progress Scheduler::progress(const std::shared_ptr<Job>& job, size_t seen) const {
  std::lock_guard lock(mutex_);
  Progress progress;
  progress.state = job->state;
  const auto at = std::find(queue_.begin(), queue_.end(), job);
  if (at != queue_.end()) progress.queue_position = at - queue_.begin();
  if (job->previews.size() > seen) {
    progress.previews.assign(job->previews.begin() + static_cast<std::ptrdiff_t>(seen), job->previews.end());
  }
  return progress;
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
    const auto candidates = queue_.front()->request.request().candidates;
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
      for (const auto& job : queue_) rows += job->request.request().candidates;
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
  const auto start = Clock::now();
  std::string error;
  auto images = generate_batch(batch, error);
  if (!error.empty() && batch.size() > 1) {
    // Which request failed is not known: each is tried alone, so that one request's failure
    // (its image prompt, its settings) is its own and its batch-mates still get their images.
    log::warn("serve: generating ", batch.size(), " requests together failed (", error, "); each is tried alone");
    for (const auto& job : batch) {
      std::string alone_error;
      std::vector<generate::GeneratedImage> alone;
      if (progress(job).state != Job::State::abandoned) alone = generate_batch({job}, alone_error);
      const auto seconds = std::chrono::duration<double>(Clock::now() - start).count();
      {
        std::lock_guard lock(mutex_);
        finish({job}, std::move(alone), alone_error, seconds, static_cast<int64_t>(batch.size()));
      }
      notify({job});
    }
    return;
  }
  const auto seconds = std::chrono::duration<double>(Clock::now() - start).count();
  {
    std::lock_guard lock(mutex_);
    finish(batch, std::move(images), error, seconds, static_cast<int64_t>(batch.size()));
  }
  notify(batch);
}

std::vector<generate::GeneratedImage> Scheduler::generate_batch(const std::vector<std::shared_ptr<Job>>& batch,
                                                                std::string& error) {
  std::vector<generate::PreparedRequest> requests;
  for (const auto& job : batch) requests.push_back(job->request);
  // A preview goes to its job; the last of each candidate is its image, which the job gets whole.
  // A job tried again alone after a failed batch is not shown again what it was shown.
  const auto to_jobs = [&](const std::vector<generate::Preview>& previews) {
    std::vector<std::shared_ptr<Job>> changed;
    {
      std::lock_guard lock(mutex_);
      for (const auto& preview : previews) {
        const auto& job = batch.at(static_cast<size_t>(preview.request));
        const bool shown = std::any_of(job->previews.begin(), job->previews.end(), [&](const generate::Preview& seen) {
          return seen.candidate == preview.candidate && seen.drawn >= preview.drawn;
        });
        if (preview.drawn < preview.total && !shown && job->state != Job::State::abandoned) {
          job->previews.push_back(preview);
          if (changed.empty() || changed.back() != job) changed.push_back(job);
        }
      }
    }
    notify(changed);
  };
  try {
    return generate_(requests, to_jobs);
  } catch (const std::exception& failure) {
    error = failure.what();
    log::error("serve: generating ", batch.size(), " requests failed: ", error);
  }
  return {};
}

void Scheduler::finish(const std::vector<std::shared_ptr<Job>>& batch, std::vector<generate::GeneratedImage> images,
                       const std::string& error, double seconds, int64_t batched_with) {
  for (auto& image : images) {
    auto& job = *batch.at(static_cast<size_t>(image.request));
    job.images.push_back(std::move(image));
  }
  for (const auto& job : batch) {
    job->error = error;
    job->generation_seconds = seconds;
    job->batched_with = batched_with;
    if (job->state == Job::State::abandoned) job->images.clear();  // nobody waits for them
    job->state = Job::State::done;
  }
}

void Scheduler::notify(const std::vector<std::shared_ptr<Job>>& jobs) {
  for (const auto& job : jobs) {
    if (job->on_change) job->on_change(job);
  }
}

}  // namespace dalle::serve
