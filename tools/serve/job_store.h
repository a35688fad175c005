#pragma once
// The jobs of POST /v1/images/jobs: requests that outlive their connection. A client submits,
// gets an id at once, and fetches the job's state, queue position and (once it is done) its
// answer with GET /v1/images/jobs/{id}, from any connection, as often as it likes; DELETE
// cancels it. A finished job is kept `lifetime`, and beyond `capacity` jobs the oldest
// finished go first; unfinished ones are bounded by `capacity` and by a deadline (a job not
// done in time, or whose answer cannot be built, ends failed: none stays unfinished for
// ever). Ids are 128 random bits, as the images' are.
#include <chrono>
#include <cstdint>
#include <ctime>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "serve/memory_budget.h"
#include "serve/scheduler.h"

namespace dalle::serve {

struct StoredJob {
  std::string id;
  std::time_t created = 0;
  std::chrono::steady_clock::time_point added;  // its deadline runs from here
  std::shared_ptr<Job> job;  // until it ends: an ended job keeps its answer, not its images
  std::string answer;  // once it succeeded: the JSON of the synchronous answer ({created, data})
  std::string error;   // once it failed: the JSON of an OpenAI error body
  std::string partial;  // while it runs, with partial_images: the JSON array of its latest partial images
  bool cancelled = false;
  std::optional<std::chrono::steady_clock::time_point> ended;
};

class JobStore {
 public:
  // `budget` (when given, outliving the store) is charged each ended job's answer; an answer
  // that does not fit pushes the oldest ended jobs out, and when even that is not enough the
  // job ends failed (memory_budget_exceeded).
  JobStore(std::chrono::seconds lifetime, int64_t capacity, MemoryBudget* budget = nullptr);

  // Keeps a new job under `id` unless `capacity` unfinished jobs are kept already. Added
  // before its Job is submitted (so that the job cannot end before it is here), which
  // attach() then gives it, or remove() forgets it when it is refused.
  bool add(const std::string& id);
  void attach(const std::string& id, std::shared_ptr<Job> job);
  void remove(const std::string& id);
  // A copy of the job under `id`, unless there is none (never was, expired, pushed out).
  std::optional<StoredJob> find(const std::string& id);
  // While the job runs: `partial` (a JSON array) replaces its partial images, charged to the
  // budget; when the budget has no room they are left as they were (they are only previews).
  void set_partial(const std::string& id, std::string partial);
  // Records how the job ended: its answer, or its error; false (nothing recorded) once it
  // ended (cancelled) or is gone.
  bool end(const std::string& id, std::string answer, std::string error);
  // Ends the job with the answer `build` makes (outside the store's lock): true once that is
  // recorded; false when it ended before, or `build` threw (the job then ends failed, with a
  // server error that says why).
  bool end_with(const std::string& id, const std::function<std::string()>& build);
  // Ends every unfinished job added `timeout` or longer ago failed with `error` (the JSON of
  // an OpenAI error body), and returns their Jobs (those attached) for the scheduler to cancel.
  std::vector<std::shared_ptr<Job>> end_overdue(std::chrono::steady_clock::duration timeout, const std::string& error);
  // Marks the job cancelled and ended (if it had not ended) and returns it as it is then.
  std::optional<StoredJob> cancel(const std::string& id);

 private:
  void forget_expired(std::chrono::steady_clock::time_point now);  // holds the lock
  // The answer and error of `id` charged to the budget (others' pushed out if need be), or
  // the error that says it could not be. Holds the lock.
  void charge_end(const std::string& id, std::string& answer, std::string& error);
  void forget(const std::string& id);  // holds the lock

  std::chrono::seconds lifetime_;
  int64_t capacity_;
  MemoryBudget* budget_;
  std::mutex mutex_;
  std::map<std::string, StoredJob> jobs_;
  std::map<std::string, MemoryBudget::Charge> charges_;
};

}  // namespace dalle::serve
