#include "serve/memory_budget.h"

#include <unistd.h>

#include <algorithm>
#include <utility>

#include "dalle/error.h"

namespace dalle::serve {

bool MemoryBudget::Account::take(int64_t bytes) {
  int64_t now = used.load();
  do {
    if (now + bytes > limit) {
      ++refusals;
      return false;
    }
  } while (!used.compare_exchange_weak(now, now + bytes));
  return true;
}

MemoryBudget::MemoryBudget(int64_t bytes) : account_(std::make_shared<Account>(bytes)) {
  if (bytes <= 0) throw Error("serve: the memory budget must be positive");
}

std::optional<MemoryBudget::Charge> MemoryBudget::charge(int64_t bytes) {
  if (bytes < 0 || !account_->take(bytes)) return std::nullopt;
  return Charge(account_, bytes);
}

MemoryBudget::Charge::Charge(Charge&& other) noexcept
    : account_(std::move(other.account_)), bytes_(std::exchange(other.bytes_, 0)) {}

MemoryBudget::Charge& MemoryBudget::Charge::operator=(Charge&& other) noexcept {
  if (this != &other) {
    shrink_to(0);
    account_ = std::move(other.account_);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

bool MemoryBudget::Charge::grow(int64_t more) {
  if (more <= 0) return true;
  if (!account_ || !account_->take(more)) return false;
  bytes_ += more;
  return true;
}

void MemoryBudget::Charge::shrink_to(int64_t bytes) {
  const int64_t given = bytes_ - std::clamp<int64_t>(bytes, 0, bytes_);
  if (given > 0 && account_) account_->give(given);
  bytes_ -= given;
}

int64_t default_memory_budget_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return int64_t{2} << 30;
  return static_cast<int64_t>(pages) * page / 4;
}

}  // namespace dalle::serve
