#include "dalle/train/stop_request.h"

#include <gtest/gtest.h>

#include <csignal>

namespace dalle::train {
namespace {

int earlier_handler_calls = 0;
void earlier_handler(int) { ++earlier_handler_calls; }

void (*current_handler(int signal))(int) {
  struct sigaction action {};
  sigaction(signal, nullptr, &action);
  return action.sa_handler;
}

TEST(StopRequest, SignalsRequestAStopASecondCtrlCEndsAndTheEarlierHandlersComeBack) {
  clear_stop_request();
  std::signal(SIGTERM, earlier_handler);
  std::signal(SIGINT, earlier_handler);
  {
    StopOnSignals stop_on_signals;
    const auto stop_handler = current_handler(SIGTERM);
    EXPECT_FALSE(stop_requested());
    std::raise(SIGTERM);
    EXPECT_TRUE(stop_requested());
    EXPECT_EQ(stop_signal(), SIGTERM);
    std::raise(SIGTERM);  // as `timeout` sends it: to the process, then to its group
    EXPECT_EQ(stop_signal(), SIGTERM) << "a second SIGTERM only asks again";
    EXPECT_NE(current_handler(SIGINT), SIG_DFL) << "SIGINT still only asks";
    std::raise(SIGINT);
    EXPECT_EQ(stop_signal(), SIGINT);
    EXPECT_EQ(current_handler(SIGINT), SIG_DFL) << "a second ^C would end the process";
    EXPECT_EQ(current_handler(SIGTERM), stop_handler);
  }
  EXPECT_EQ(earlier_handler_calls, 0);
  EXPECT_EQ(current_handler(SIGTERM), earlier_handler);
  EXPECT_EQ(current_handler(SIGINT), earlier_handler);
  std::raise(SIGTERM);
  EXPECT_EQ(earlier_handler_calls, 1);

  clear_stop_request();
  EXPECT_FALSE(stop_requested());
  EXPECT_EQ(stop_signal(), 0);
  request_stop();
  EXPECT_TRUE(stop_requested());
  EXPECT_EQ(stop_signal(), 0) << "asked by code, not by a signal";
  clear_stop_request();
  std::signal(SIGTERM, SIG_DFL);
  std::signal(SIGINT, SIG_DFL);
}

}  // namespace
}  // namespace dalle::train
