#include "serve/job_store.h"

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
  EXPECT_EQ(done->job, job);
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

}  // namespace
}  // namespace dalle::serve
