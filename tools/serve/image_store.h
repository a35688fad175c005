#pragma once
// The PNGs of requests that asked for `response_format: url`, served at
// GET /v1/images/<id>.png until they expire or, when the store is full, until newer ones push
// the oldest out; with a memory budget, an image that does not fit it pushes the oldest out
// too. Ids are 128 random bits: knowing one is the permission to fetch it, as OpenAI's signed
// image URLs are.
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "serve/memory_budget.h"

namespace dalle::serve {

// 128 random bits as 32 hexadecimal digits: the ids of stored images and jobs.
std::string random_id();

class ImageStore {
 public:
  // `budget` (when given, outliving the store) is charged each PNG's bytes.
  ImageStore(std::chrono::seconds lifetime, int64_t capacity, MemoryBudget* budget = nullptr);
  // Keeps `png` and returns its id (32 hexadecimal digits). Throws ApiError 503 when the budget
  // has no room for it even with every other image gone.
  std::string put(std::string png);
  // The PNG under `id`, unless it expired or was pushed out.
  std::optional<std::string> get(const std::string& id);

 private:
  void forget_expired(std::chrono::steady_clock::time_point now);  // holds the lock

  std::chrono::seconds lifetime_;
  int64_t capacity_;
  std::mutex mutex_;
  MemoryBudget* budget_;
  std::map<std::string, std::string> images_;
  std::map<std::string, MemoryBudget::Charge> charges_;
  std::deque<std::pair<std::chrono::steady_clock::time_point, std::string>> expiry_;  // oldest first
};

}  // namespace dalle::serve
