#pragma once
// The queue between dalle-serve's connections and its one model: connections submit
// requests, one worker thread takes what has queued (after a short window, so that requests
// arriving together run together) and runs it through one Pipeline::generate call, which
// batches their candidates. The queue is bounded: a request beyond it is refused at once.
// One worker, because a Pipeline's generate is not safe to call from several threads (and
// concurrent calls would only contend for the same cores); batching is what serves many
// clients. The requests come prepared (Pipeline::prepare, on the connections' side).
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dalle/generate/pipeline.h"
#include "serve/memory_budget.h"

namespace dalle::serve {

// One request's passage through the queue. Its fields after `request` are the scheduler's,
// read by the submitter once progress() says the job is done.
struct Job {
  generate::PreparedRequest request;  // with the settings its images record
  // Called on the worker's thread, with no lock held, when the job gets previews and when it
  // is done: the connection that waits for it is woken, nothing blocks a thread on it.
  std::function<void(const std::shared_ptr<Job>&)> on_change;
  std::chrono::steady_clock::time_point admitted;
  std::vector<generate::GeneratedImage> images;  // its images, rank order
  std::vector<generate::Preview> previews;       // while it is drawn (request.preview_every), the last excepted
  std::string error;                             // why it failed; empty: it did not
  double generation_seconds = 0;                 // of the generate call it was part of
  int64_t batched_with = 0;                      // requests taken together, itself included
  MemoryBudget::Charge charge;                   // what it and its images hold of the memory budget
  enum class State { queued, running, done, abandoned } state = State::queued;
};

class Scheduler {
 public:
  using Generate = std::function<std::vector<generate::GeneratedImage>(
      const std::vector<generate::PreparedRequest>&, const generate::PreviewCallback&)>;
  struct Options {
    int64_t max_queue = 16;                   // queued (not running) jobs at most
    std::chrono::milliseconds batch_window{20};
    int64_t batch_rows = 32;                  // candidates per generate call, unless one request has more
  };
  enum class Refusal { none, queue_full, draining };

  Scheduler(Generate generate, Options options);
  ~Scheduler();  // drains, then stops the worker
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues `request`; nothing (and why) when the queue is full or the scheduler drains.
  // `on_change` becomes the job's (Job::on_change).
  std::shared_ptr<Job> submit(generate::PreparedRequest request, Refusal& refusal,
                              std::function<void(const std::shared_ptr<Job>&)> on_change = {});
  // Gives `job` up (its client left, its time ran out, it was cancelled): dropped from the
  // queue if it still waits there (freeing its place), its images thrown away if it is being
  // generated. A done job stays done.
  void cancel(const std::shared_ptr<Job>& job);

  struct Progress {
    Job::State state = Job::State::queued;
    int64_t queue_position = -1;              // 0: next; -1: not queued
    std::vector<generate::Preview> previews;  // those after the first `seen`
  };
  // Where `job` is, with its previews after the first `seen` (all of them before it is done).
  Progress progress(const std::shared_ptr<Job>& job, size_t seen = 0) const;
  // Refuses new jobs from now on and returns once every job admitted before is done.
  void drain();
  bool draining() const;

  int64_t queued() const;
  int64_t running() const;

 private:
  void work();
  // The jobs of the next generate call, taken from the front of the queue. Holds the lock.
  std::vector<std::shared_ptr<Job>> take_batch();
  void run(const std::vector<std::shared_ptr<Job>>& batch);
  // One generate call for `batch` (previews to their jobs): its images, or none and `error`.
  std::vector<generate::GeneratedImage> generate_batch(const std::vector<std::shared_ptr<Job>>& batch,
                                                       std::string& error);
  // Gives the batch's jobs their images, or the error, and marks them done. Holds the lock.
  void finish(const std::vector<std::shared_ptr<Job>>& batch, std::vector<generate::GeneratedImage> images,
              const std::string& error, double seconds, int64_t batched_with);
  // Calls each job's on_change. Holds no lock: a listener may ask for progress().
  static void notify(const std::vector<std::shared_ptr<Job>>& jobs);

  Generate generate_;
  Options options_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::shared_ptr<Job>> queue_;
  int64_t running_ = 0;
  bool draining_ = false;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace dalle::serve
