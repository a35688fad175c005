#pragma once
// dalle-serve's one bound on what its requests hold in memory (the models aside): bodies being
// read, the decode of an uploaded image, queued and running requests with the images they
// will make, stored answers of jobs and images served by URL. Each holder takes a Charge,
// which is given back when it goes; a charge that would pass the budget is refused, and the
// server then answers 503 with Retry-After (or 413 when the request alone is larger than
// the whole budget). Safe from every thread.
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>

namespace dalle::serve {

class MemoryBudget {
  struct Account {
    explicit Account(int64_t limit) : limit(limit) {}
    const int64_t limit;
    std::atomic<int64_t> used{0}, refusals{0};
    bool take(int64_t bytes);
    void give(int64_t bytes) { used -= bytes; }
  };

 public:
  explicit MemoryBudget(int64_t bytes);

  // Bytes held against the budget until the charge is destroyed, reset or shrunk.
  class Charge {
   public:
    Charge() = default;
    Charge(Charge&& other) noexcept;
    Charge& operator=(Charge&& other) noexcept;
    Charge(const Charge&) = delete;
    Charge& operator=(const Charge&) = delete;
    ~Charge() { shrink_to(0); }

    int64_t bytes() const { return bytes_; }
    // Holds `more` bytes besides, unless that would pass the budget (then nothing changes).
    bool grow(int64_t more);
    // Gives back all but `bytes` (no more than it holds).
    void shrink_to(int64_t bytes);

   private:
    friend class MemoryBudget;
    Charge(std::shared_ptr<Account> account, int64_t bytes) : account_(std::move(account)), bytes_(bytes) {}
    std::shared_ptr<Account> account_;
    int64_t bytes_ = 0;
  };

  // `bytes` charged, or nothing when they would pass the budget (a refusal, counted).
  std::optional<Charge> charge(int64_t bytes);
  // A charge of nothing yet, to grow as a body arrives.
  Charge open() { return Charge(account_, 0); }
  int64_t limit() const { return account_->limit; }
  int64_t used() const { return account_->used; }
  int64_t refusals() const { return account_->refusals; }

 private:
  std::shared_ptr<Account> account_;
};

// The budget when none is configured: a quarter of the machine's physical memory.
int64_t default_memory_budget_bytes();

}  // namespace dalle::serve
