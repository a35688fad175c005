#include "serve/job_store.h"

#include <nlohmann/json.hpp>
#include <thread>

#include "test_support.h"

namespace dalle::serve {
namespace {

using namespace std::chrono_literals;

TEST(JobStore, UnfinishedJobsAreBoundedAndEndedOnesMakeRoomOldestFirst) {
  JobStore store(600s, 2);
  ASSERT_TRUE(store.add("a"));
  ASSERT_TRUE(store.add("b"));
  EXPECT_FALSE(store.add("c")) << "two unfinished jobs fill a store of two";
  store.end("a", R"({"data": []})", "");
  ASSERT_TRUE(store.add("c")) << "an ended job is pushed out for a new one";
  EXPECT_FALSE(store.find("a")) << "the oldest ended job went first";
  ASSERT_TRUE(store.find("b"));
  EXPECT_FALSE(store.find("b")->ended);
  store.remove("c");
  EXPECT_FALSE(store.find("c"));
}

TEST(JobStore, AnEndIsRecordedOnceAndACancelledJobStaysCancelled) {
  JobStore store(600s, 4);
  ASSERT_TRUE(store.add("done"));
  ASSERT_TRUE(store.add("cancelled"));
  auto job = std::make_shared<Job>();
  store.attach("done", job);
  EXPECT_TRUE(store.end("done", "answer", ""));
  EXPECT_FALSE(store.end("done", "", "a later error"));
  const auto done = store.find("done");
  ASSERT_TRUE(done && done->ended);
  EXPECT_EQ(done->job, nullptr) << "an ended job keeps its answer, not its images";
  EXPECT_EQ(job.use_count(), 1);
  EXPECT_EQ(done->answer, "answer");
  EXPECT_TRUE(done->error.empty()) << "the first end holds";
  EXPECT_FALSE(store.cancel("done")->cancelled) << "a finished job is not cancelled";

  ASSERT_TRUE(store.cancel("cancelled")->cancelled);
  EXPECT_FALSE(store.end("cancelled", "answer", ""));  // the generate call it was part of finishes after
  EXPECT_TRUE(store.find("cancelled")->answer.empty());
  EXPECT_FALSE(store.cancel("unknown"));
}

TEST(JobStore, AnEndedJobExpiresAfterItsLifetime) {
  JobStore store(0s, 4);
  ASSERT_TRUE(store.add("quick"));
  EXPECT_TRUE(store.find("quick")) << "an unfinished job does not expire";
  store.end("quick", "answer", "");
  EXPECT_FALSE(store.find("quick"));
}

TEST(JobStore, AJobWhoseAnswerCannotBeBuiltEndsFailedAndSaysWhy) {
  JobStore store(600s, 1);
  ASSERT_TRUE(store.add("broken"));
  EXPECT_FALSE(store.end_with("broken", []() -> std::string { throw Error("the PNG encoder ran out of memory"); }));
  const auto broken = store.find("broken");
  ASSERT_TRUE(broken && broken->ended) << "not in progress for ever";
  EXPECT_TRUE(broken->answer.empty());
  const auto error = nlohmann::json::parse(broken->error)["error"];
  EXPECT_EQ(error["code"], "answer_failed");
  EXPECT_NE(error["message"].get<std::string>().find("the PNG encoder ran out of memory"), std::string::npos);
  EXPECT_TRUE(store.add("next")) << "the failed job no longer holds the one unfinished place";

  EXPECT_TRUE(store.end_with("next", [] { return std::string(R"({"data": []})"); }));
  EXPECT_EQ(store.find("next")->answer, R"({"data": []})");
}

TEST(JobStore, UnfinishedJobsPastTheDeadlineEndFailedAndTheirJobsAreHandedBackToCancel) {
  JobStore store(600s, 2);
  ASSERT_TRUE(store.add("stuck"));
  auto job = std::make_shared<Job>();
  store.attach("stuck", job);
  EXPECT_TRUE(store.end_overdue(1h, "{}").empty()) << "not yet due";
  ASSERT_TRUE(store.add("done"));
  store.end("done", "answer", "");
  std::this_thread::sleep_for(5ms);
  const auto overdue = store.end_overdue(1ms, R"({"error": {"code": "timeout"}})");
  ASSERT_EQ(overdue.size(), 1u) << "the unfinished job alone; the done one stays done";
  EXPECT_EQ(overdue[0], job);
  const auto stuck = store.find("stuck");
  ASSERT_TRUE(stuck && stuck->ended);
  EXPECT_EQ(stuck->error, R"({"error": {"code": "timeout"}})");
  EXPECT_EQ(store.find("done")->answer, "answer") << "an ended job is left as it ended";
  EXPECT_TRUE(store.find("done")->error.empty());
  EXPECT_TRUE(store.end_overdue(1ms, "{}").empty()) << "ended once";
}

}  // namespace
}  // namespace dalle::serve
