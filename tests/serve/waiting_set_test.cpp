#include "serve/waiting_set.h"

#include <gtest/gtest.h>

#include <thread>

namespace dalle::serve {
namespace {

struct Parked {
  bool woken = false;
};

// What makes the stop safe: a request joins before it is parked, so a close either wakes it
// or refuses it; none is left parked after the close.
TEST(WaitingSet, ACloseWakesEveryMemberAndRefusesLaterOnes) {
  WaitingSet<Parked> waiting;
  const auto first = std::make_shared<Parked>(), second = std::make_shared<Parked>();
  ASSERT_TRUE(waiting.join(first));
  ASSERT_TRUE(waiting.join(second));
  waiting.leave(second);  // answered before the stop
  waiting.close([](Parked& parked) { parked.woken = true; });
  EXPECT_TRUE(first->woken);
  EXPECT_FALSE(second->woken) << "it had left";
  EXPECT_FALSE(waiting.join(std::make_shared<Parked>())) << "after the close, a request is refused, never parked";
  EXPECT_EQ(waiting.members().size(), 1u);
}

TEST(WaitingSet, WaitsUntilTheLastLeavesOrTheTimeout) {
  WaitingSet<Parked> waiting;
  const auto parked = std::make_shared<Parked>();
  waiting.join(parked);
  EXPECT_FALSE(waiting.wait_until_empty(std::chrono::milliseconds(20)));
  std::thread leaving([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    waiting.leave(parked);
  });
  EXPECT_TRUE(waiting.wait_until_empty(std::chrono::seconds(30)));
  leaving.join();
}

}  // namespace
}  // namespace dalle::serve
