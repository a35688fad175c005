#include "serve/image_store.h"

#include <cstdio>
#include <random>
#include <utility>

#include "serve/api_error.h"

namespace dalle::serve {

using Clock = std::chrono::steady_clock;

std::string random_id() {
  thread_local std::random_device entropy;
  std::string id;
  for (int word = 0; word < 4; ++word) {
    char hex[9];
    std::snprintf(hex, sizeof hex, "%08x", static_cast<unsigned>(entropy()));
    id += hex;
  }
  return id;
}

ImageStore::ImageStore(std::chrono::seconds lifetime, int64_t capacity, MemoryBudget* budget)
    : lifetime_(lifetime), capacity_(capacity), budget_(budget) {}

void ImageStore::forget_expired(Clock::time_point now) {
  while (!expiry_.empty() &&
         (expiry_.front().first <= now || static_cast<int64_t>(expiry_.size()) > capacity_)) {
    images_.erase(expiry_.front().second);
    charges_.erase(expiry_.front().second);
    expiry_.pop_front();
  }
}

std::string ImageStore::put(std::string png) {
  std::lock_guard lock(mutex_);
  auto id = random_id();
  if (budget_) {
    const auto bytes = static_cast<int64_t>(png.size());
    auto charge = bytes <= budget_->limit() ? budget_->charge(bytes) : std::nullopt;
    while (!charge && bytes <= budget_->limit() && !expiry_.empty()) {  // the oldest images make room
      images_.erase(expiry_.front().second);
      charges_.erase(expiry_.front().second);
      expiry_.pop_front();
      charge = budget_->charge(bytes);
    }
    if (!charge) {
      throw ApiError(503, "The server's memory budget has no room for the images' URLs now; try again shortly, or "
                          "ask for response_format b64_json.", "", "memory_budget_exceeded");
    }
    charges_.emplace(id, std::move(*charge));
  }
  images_.emplace(id, std::move(png));
  expiry_.emplace_back(Clock::now() + lifetime_, id);
  forget_expired(Clock::now());
  return id;
}

std::optional<std::string> ImageStore::get(const std::string& id) {
  std::lock_guard lock(mutex_);
  forget_expired(Clock::now());
  const auto at = images_.find(id);
  if (at == images_.end()) return std::nullopt;
  return at->second;
}

}  // namespace dalle::serve
