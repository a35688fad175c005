#include "serve/job_store.h"

#include <algorithm>
#include <exception>
#include <utility>
#include <vector>

#include "dalle/log.h"
#include "serve/api_error.h"
#include "serve/openai_answers.h"

namespace dalle::serve {

using Clock = std::chrono::steady_clock;

JobStore::JobStore(std::chrono::seconds lifetime, int64_t capacity, MemoryBudget* budget)
    : lifetime_(lifetime), capacity_(capacity), budget_(budget) {}

void JobStore::forget(const std::string& id) {
  jobs_.erase(id);
  charges_.erase(id);
}

void JobStore::charge_end(const std::string& id, std::string& answer, std::string& error) {
  if (!budget_) return;
  const auto bytes = static_cast<int64_t>(answer.size() + error.size());
  auto charge = budget_->charge(bytes);
  if (!charge && bytes <= budget_->limit()) {
    std::vector<std::pair<Clock::time_point, std::string>> ended;
    for (const auto& [other, stored] : jobs_) {
      if (stored.ended && other != id) ended.emplace_back(*stored.ended, other);
    }
    std::sort(ended.begin(), ended.end());
    for (size_t i = 0; i < ended.size() && !charge; ++i) {
      forget(ended[i].second);
      charge = budget_->charge(bytes);
    }
  }
  if (charge) {
    charges_[id] = std::move(*charge);
    return;
  }
  answer.clear();
  error = ApiError(503, "The job's images were made, but the server's memory budget has no room to keep its answer.",
                   "", "memory_budget_exceeded")
              .json();
}

void JobStore::forget_expired(Clock::time_point now) {
  std::vector<std::pair<Clock::time_point, std::string>> ended;
  for (const auto& [id, stored] : jobs_) {
    if (stored.ended) ended.emplace_back(*stored.ended, id);
  }
  std::sort(ended.begin(), ended.end());
  auto kept = static_cast<int64_t>(jobs_.size());
  for (const auto& [at, id] : ended) {
    if (at + lifetime_ > now && kept <= capacity_) break;
    forget(id);
    --kept;
  }
}

bool JobStore::add(const std::string& id) {
  std::lock_guard lock(mutex_);
  forget_expired(Clock::now());
  const auto unfinished = std::count_if(jobs_.begin(), jobs_.end(), [](const auto& entry) { return !entry.second.ended; });
  if (unfinished >= capacity_) return false;
  StoredJob stored;
  stored.id = id;
  stored.created = std::time(nullptr);
  stored.added = Clock::now();
  jobs_[id] = std::move(stored);
  forget_expired(Clock::now());  // an ended job may make room for it
  return true;
}

void JobStore::attach(const std::string& id, std::shared_ptr<Job> job) {
  std::lock_guard lock(mutex_);
  const auto at = jobs_.find(id);
  if (at != jobs_.end()) at->second.job = std::move(job);
}

void JobStore::remove(const std::string& id) {
  std::lock_guard lock(mutex_);
  forget(id);
}

std::optional<StoredJob> JobStore::find(const std::string& id) {
  std::lock_guard lock(mutex_);
  forget_expired(Clock::now());
  const auto at = jobs_.find(id);
  if (at == jobs_.end()) return std::nullopt;
  return at->second;
}

void JobStore::set_partial(const std::string& id, std::string partial) {
  std::lock_guard lock(mutex_);
  const auto at = jobs_.find(id);
  if (at == jobs_.end() || at->second.ended) return;
  if (budget_) {
    auto charge = budget_->charge(static_cast<int64_t>(partial.size()));
    if (!charge) return;
    charges_[id] = std::move(*charge);  // the previous partial images' charge goes back
  }
  at->second.partial = std::move(partial);
}

bool JobStore::end(const std::string& id, std::string answer, std::string error) {
  std::lock_guard lock(mutex_);
  const auto at = jobs_.find(id);
  if (at == jobs_.end() || at->second.ended) return false;
  charges_.erase(id);  // the partial images go
  at->second.partial.clear();
  charge_end(id, answer, error);
  at->second.answer = std::move(answer);
  at->second.error = std::move(error);
  at->second.ended = Clock::now();
  at->second.job.reset();  // its images live on in the answer alone
  return true;
}

bool JobStore::end_with(const std::string& id, const std::function<std::string()>& build) {
  try {
    return end(id, build(), "");
  } catch (const std::exception& failure) {
    log::error("serve: job ", id, ": its answer could not be built: ", failure.what());
    end(id, "", answer_failed(failure).json());
    return false;
  }
}

std::vector<std::shared_ptr<Job>> JobStore::end_overdue(Clock::duration timeout, const std::string& error) {
  std::lock_guard lock(mutex_);
  const auto now = Clock::now();
  std::vector<std::shared_ptr<Job>> overdue;
  for (auto& [id, stored] : jobs_) {
    if (stored.ended || now - stored.added < timeout) continue;
    stored.error = error;
    stored.ended = now;
    stored.partial.clear();
    charges_.erase(id);
    if (stored.job) overdue.push_back(std::move(stored.job));
    stored.job.reset();
  }
  return overdue;
}

std::optional<StoredJob> JobStore::cancel(const std::string& id) {
  std::lock_guard lock(mutex_);
  const auto at = jobs_.find(id);
  if (at == jobs_.end()) return std::nullopt;
  if (!at->second.ended) {
    at->second.cancelled = true;
    at->second.ended = Clock::now();
    at->second.partial.clear();
    charges_.erase(id);
  }
  auto stored = at->second;  // with its Job, for the scheduler to cancel
  at->second.job.reset();
  return stored;
}

}  // namespace dalle::serve
