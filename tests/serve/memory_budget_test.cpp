#include "serve/memory_budget.h"

#include <nlohmann/json.hpp>

#include "serve/image_store.h"
#include "serve/job_store.h"
#include "test_support.h"

namespace dalle::serve {
namespace {

using namespace std::chrono_literals;

TEST(MemoryBudget, ChargesAreRefusedPastTheLimitAndGivenBackWhenTheirHoldersGo) {
  MemoryBudget budget(100);
  auto first = budget.charge(60);
  ASSERT_TRUE(first);
  EXPECT_FALSE(budget.charge(41)) << "60 + 41 passes 100";
  EXPECT_EQ(budget.refusals(), 1);
  {
    auto second = budget.charge(40);
    ASSERT_TRUE(second);
    EXPECT_EQ(budget.used(), 100);
  }
  EXPECT_EQ(budget.used(), 60) << "given back when it went";
  auto moved = std::move(*first);
  EXPECT_EQ(budget.used(), 60) << "a moved charge is held once";
  EXPECT_EQ(first->bytes(), 0);
  moved.shrink_to(10);
  EXPECT_EQ(budget.used(), 10);
  auto growing = budget.open();
  EXPECT_TRUE(growing.grow(90));
  EXPECT_FALSE(growing.grow(1));
  EXPECT_EQ(growing.bytes(), 90) << "a refused growth changes nothing";
  moved = std::move(growing);
  EXPECT_EQ(budget.used(), 90) << "assigning over a charge gives back what it held";
}

TEST(MemoryBudget, StoredAnswersPushOutTheOldestAndAnAnswerTooLargeEndsItsJobFailed) {
  MemoryBudget budget(1000);
  JobStore jobs(600s, 8, &budget);
  for (const auto* id : {"a", "b", "c"}) ASSERT_TRUE(jobs.add(id));
  EXPECT_TRUE(jobs.end("a", std::string(400, 'a'), ""));
  EXPECT_TRUE(jobs.end("b", std::string(400, 'b'), ""));
  EXPECT_EQ(budget.used(), 800);
  EXPECT_TRUE(jobs.end("c", std::string(400, 'c'), ""));
  EXPECT_FALSE(jobs.find("a")) << "the oldest ended job made room";
  EXPECT_EQ(jobs.find("c")->answer.size(), 400u);
  EXPECT_EQ(budget.used(), 800);

  ASSERT_TRUE(jobs.add("huge"));
  EXPECT_TRUE(jobs.end("huge", std::string(2000, 'h'), ""));
  const auto huge = jobs.find("huge");
  ASSERT_TRUE(huge && huge->ended);
  EXPECT_TRUE(huge->answer.empty()) << "not kept: larger than the whole budget";
  EXPECT_EQ(nlohmann::json::parse(huge->error)["error"]["code"], "memory_budget_exceeded");
  EXPECT_TRUE(jobs.find("b") && jobs.find("c")) << "nothing pushed out for an answer that could never fit";
  jobs.remove("c");
  EXPECT_EQ(budget.used(), 400) << "a forgotten job gives its answer's bytes back";
}

TEST(MemoryBudget, AJobsPartialImagesAreChargedWhileItRunsAndGoWhenItEnds) {
  MemoryBudget budget(1000);
  JobStore jobs(600s, 4, &budget);
  ASSERT_TRUE(jobs.add("running"));
  jobs.set_partial("running", std::string(300, 'p'));
  EXPECT_EQ(budget.used(), 300);
  jobs.set_partial("running", std::string(200, 'q'));
  EXPECT_EQ(budget.used(), 200) << "the newer replace the older";
  EXPECT_EQ(jobs.find("running")->partial, std::string(200, 'q'));
  jobs.set_partial("running", std::string(2000, 'r'));
  EXPECT_EQ(jobs.find("running")->partial, std::string(200, 'q')) << "no room: the last ones stay";
  EXPECT_TRUE(jobs.end("running", std::string(100, 'a'), ""));
  EXPECT_TRUE(jobs.find("running")->partial.empty());
  EXPECT_EQ(budget.used(), 100) << "the answer's bytes alone";
  jobs.set_partial("running", "late");
  EXPECT_TRUE(jobs.find("running")->partial.empty()) << "an ended job shows none";
  ASSERT_TRUE(jobs.add("cancelled"));
  jobs.set_partial("cancelled", std::string(300, 'c'));
  EXPECT_TRUE(jobs.cancel("cancelled")->partial.empty());
  EXPECT_EQ(budget.used(), 100) << "a cancelled job's partial images go at once";
}

TEST(MemoryBudget, ImagesForUrlsPushOutTheOldestAndOneLargerThanTheBudgetIsRefused) {
  MemoryBudget budget(1000);
  ImageStore images(600s, 16, &budget);
  const auto first = images.put(std::string(600, '1'));
  const auto second = images.put(std::string(600, '2'));
  EXPECT_FALSE(images.get(first)) << "pushed out to make room";
  EXPECT_EQ(images.get(second)->size(), 600u);
  EXPECT_EQ(budget.used(), 600);
  EXPECT_THROW(images.put(std::string(1001, '3')), Error);
  EXPECT_EQ(images.get(second)->size(), 600u) << "nothing pushed out for an image that could never fit";
  EXPECT_EQ(budget.used(), 600);
}

}  // namespace
}  // namespace dalle::serve
