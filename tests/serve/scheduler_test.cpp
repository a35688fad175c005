#include "serve/scheduler.h"

#include <torch/torch.h>

#include <atomic>
#include <future>

#include "test_support.h"

namespace dalle::serve {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// A stand-in for Pipeline::generate: records each call's requests, takes `delay`, and
// returns kept() images per request whose pixel value is the request's seed. Its images have
// kPositions positions: a request with preview_every is shown after each such number of them
// and at the last.
struct FakeModel {
  std::chrono::milliseconds delay{0};
  std::mutex mutex;
  std::vector<std::vector<std::string>> calls;
  std::promise<void> first_call_started;
  std::atomic<bool> started{false};

  static constexpr int64_t kPositions = 8;

  std::vector<generate::GeneratedImage> operator()(const std::vector<generate::PreparedRequest>& prepared,
                                                   const generate::PreviewCallback& on_preview = {}) {
    std::vector<generate::PromptRequest> requests;
    for (const auto& request : prepared) requests.push_back(request.request());
    {
      std::lock_guard lock(mutex);
      calls.emplace_back();
      for (const auto& request : requests) calls.back().push_back(request.prompt);
    }
    if (!started.exchange(true)) first_call_started.set_value();
    std::this_thread::sleep_for(delay);
    for (int64_t done = 1; on_preview && done <= kPositions; ++done) {
      std::vector<generate::Preview> due;
      for (size_t index = 0; index < requests.size(); ++index) {
        const auto every = requests[index].preview_every;
        if (every > 0 && (done % every == 0 || done == kPositions)) {
          due.push_back({.request = static_cast<int64_t>(index), .drawn = done, .total = kPositions});
        }
      }
      if (!due.empty()) on_preview(due);
    }
    std::vector<generate::GeneratedImage> images;
    for (size_t index = 0; index < requests.size(); ++index) {
      if (requests[index].prompt == "fail") throw Error("the model failed");
      for (int64_t rank = 0; rank < requests[index].kept(); ++rank) {
        generate::GeneratedImage image;
        image.request = static_cast<int64_t>(index);
        image.rank = rank;
        image.image = torch::full({3, 2, 2}, static_cast<double>(requests[index].sampling.seed));
        images.push_back(std::move(image));
      }
    }
    return images;
  }
};

// Requests come prepared, as the server prepares them: by the shipped demo pipeline, which
// the stand-in model then draws in place of.
const generate::Pipeline& demo_pipeline() {
  static const auto* pipeline = [] {
    const std::string models = std::string(DALLE_SOURCE_DIR) + "/models/fashion-compose-f8/";
    return new generate::Pipeline({.prior = models + "prior", .tokenizer = models + "tokenizer.model",
                                   .decoder = models + "vqgan", .threads = 1});
  }();
  return *pipeline;
}

generate::PreparedRequest request(const std::string& prompt, int64_t seed = 0, int64_t candidates = 1,
                                  int64_t preview_every = 0) {
  return demo_pipeline().prepare(prompt, 0, [&](generate::PromptRequest& request) {
    request.candidates = candidates;
    request.keep = 0;
    request.sampling.seed = seed;
    request.preview_every = preview_every;
  });
}

Scheduler::Generate through(FakeModel& model) {
  return [&model](const std::vector<generate::PreparedRequest>& requests, const generate::PreviewCallback& on_preview) {
    return model(requests, on_preview);
  };
}

// Whether `job` is done within 30 s (a hung worker fails the test, not CI's clock).
bool finished(const Scheduler& scheduler, const std::shared_ptr<Job>& job) {
  for (const auto give_up = Clock::now() + 30s; Clock::now() < give_up; std::this_thread::sleep_for(1ms)) {
    if (scheduler.progress(job).state == Job::State::done) return true;
  }
  return false;
}

TEST(Scheduler, RequestsArrivingTogetherShareOneGenerateCall) {
  FakeModel model;
  Scheduler scheduler(through(model), {.max_queue = 8, .batch_window = 200ms, .batch_rows = 8});
  Scheduler::Refusal refusal;
  std::vector<std::shared_ptr<Job>> jobs;
  for (int64_t seed = 1; seed <= 3; ++seed) jobs.push_back(scheduler.submit(request("p", seed, 2), refusal));
  for (size_t i = 0; i < jobs.size(); ++i) {
    ASSERT_TRUE(finished(scheduler, jobs[i]));
    ASSERT_EQ(jobs[i]->images.size(), 2u) << "keep 0: all candidates";
    EXPECT_EQ(jobs[i]->images[0].image[0][0][0].item<double>(), static_cast<double>(i + 1)) << "its own images";
    EXPECT_EQ(jobs[i]->batched_with, 3);
  }
  ASSERT_EQ(model.calls.size(), 1u);
  // A batch takes at most batch_rows candidates (but always one request).
  for (int64_t seed = 1; seed <= 3; ++seed) jobs[static_cast<size_t>(seed - 1)] = scheduler.submit(request("q", seed, 4), refusal);
  jobs.push_back(scheduler.submit(request("big", 9, 20), refusal));
  for (const auto& job : jobs) ASSERT_TRUE(finished(scheduler, job));
  ASSERT_EQ(model.calls.size(), 4u);
  EXPECT_EQ(model.calls[1].size(), 2u);
  EXPECT_EQ(model.calls[2].size(), 1u);
  EXPECT_EQ(model.calls[3], std::vector<std::string>{"big"});
}

TEST(Scheduler, AJobsPreviewsReachItsListenerInOrderBeforeItIsDoneAndNoOtherJobsDo) {
  FakeModel model;
  Scheduler scheduler(through(model), {.max_queue = 8, .batch_window = 200ms, .batch_rows = 8});
  Scheduler::Refusal refusal;
  const auto previewed = request("previewed", 1, 1, 3);
  // Written by the worker's thread; read here once both listeners were told the end.
  std::vector<int64_t> shown;
  std::vector<Job::State> states_told;
  std::promise<void> first_told_done, second_told_done;
  const auto first = scheduler.submit(previewed, refusal, [&](const std::shared_ptr<Job>& job) {
    const auto progress = scheduler.progress(job, shown.size());
    for (const auto& preview : progress.previews) shown.push_back(preview.drawn);
    states_told.push_back(progress.state);
    if (progress.state == Job::State::done) first_told_done.set_value();
  });
  std::atomic<int> other_calls{0};
  const auto second = scheduler.submit(request("plain", 2), refusal, [&](const std::shared_ptr<Job>&) {
    if (++other_calls == 1) second_told_done.set_value();
  });
  ASSERT_EQ(first_told_done.get_future().wait_for(30s), std::future_status::ready);
  ASSERT_EQ(second_told_done.get_future().wait_for(30s), std::future_status::ready);
  scheduler.drain();  // the worker is done with both listeners
  EXPECT_EQ(shown, (std::vector<int64_t>{3, 6})) << "every 3 of 8 positions; the last is the image itself";
  EXPECT_EQ(states_told, (std::vector<Job::State>{Job::State::running, Job::State::running, Job::State::done}))
      << "told of each preview, then of the end";
  EXPECT_EQ(first->images.size(), 1u);
  EXPECT_EQ(other_calls.load(), 1) << "a job without previews is told once, when it is done";
  std::lock_guard lock(model.mutex);
  EXPECT_EQ(model.calls.size(), 1u) << "both in one call";
}

TEST(Scheduler, AFullQueueRefusesAtOnceAndAGivenUpRequestFreesItsPlace) {
  FakeModel model;
  model.delay = 300ms;
  Scheduler scheduler(through(model), {.max_queue = 2, .batch_window = 0ms, .batch_rows = 1});
  Scheduler::Refusal refusal;
  const auto running = scheduler.submit(request("running"), refusal);
  model.first_call_started.get_future().wait();
  const auto waiting = scheduler.submit(request("waiting"), refusal);
  const auto leaving = scheduler.submit(request("leaving"), refusal);
  ASSERT_TRUE(waiting && leaving);
  EXPECT_EQ(scheduler.queued(), 2);
  const auto start = Clock::now();
  EXPECT_EQ(scheduler.submit(request("refused"), refusal), nullptr);
  EXPECT_EQ(refusal, Scheduler::Refusal::queue_full);
  EXPECT_LT(Clock::now() - start, 50ms) << "refused at once, not after the running batch";

  // A client that leaves (or times out, or cancels) frees its place in the queue.
  EXPECT_EQ(scheduler.progress(leaving).queue_position, 1);
  scheduler.cancel(leaving);
  EXPECT_EQ(scheduler.progress(leaving).state, Job::State::abandoned);
  EXPECT_EQ(scheduler.progress(leaving).queue_position, -1);
  EXPECT_EQ(scheduler.queued(), 1);
  EXPECT_NE(scheduler.submit(request("admitted"), refusal), nullptr);
  EXPECT_EQ(scheduler.progress(waiting).queue_position, 0);
  scheduler.cancel(waiting);
  EXPECT_TRUE(finished(scheduler, running));
  scheduler.drain();
  for (const auto& call : model.calls) {
    EXPECT_NE(call.front(), "leaving");
    EXPECT_NE(call.front(), "waiting");
  }
}

TEST(Scheduler, DrainingRefusesNewRequestsAndFinishesAdmittedOnes) {
  FakeModel model;
  model.delay = 100ms;
  Scheduler scheduler(through(model), {.max_queue = 4, .batch_window = 0ms, .batch_rows = 1});
  Scheduler::Refusal refusal;
  std::vector<std::shared_ptr<Job>> jobs;
  for (int64_t seed = 0; seed < 3; ++seed) jobs.push_back(scheduler.submit(request("p", seed), refusal));
  auto drained = std::async(std::launch::async, [&] { scheduler.drain(); });
  while (!scheduler.draining()) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(scheduler.submit(request("late"), refusal), nullptr);
  EXPECT_EQ(refusal, Scheduler::Refusal::draining);
  drained.get();
  for (const auto& job : jobs) EXPECT_EQ(job->state, Job::State::done);
  EXPECT_EQ(model.calls.size(), 3u);
}

TEST(Scheduler, AFailingRequestFailsAloneItsBatchMatesGetTheirImagesAndTheWorkerGoesOn) {
  FakeModel model;
  Scheduler scheduler(through(model), {.max_queue = 4, .batch_window = 100ms, .batch_rows = 8});
  Scheduler::Refusal refusal;
  const auto before = scheduler.submit(request("ok", 3), refusal);
  const auto failing = scheduler.submit(request("fail"), refusal);
  const auto after_it = scheduler.submit(request("ok", 5), refusal);
  for (const auto& job : {before, failing, after_it}) ASSERT_TRUE(finished(scheduler, job));
  EXPECT_EQ(failing->error, "the model failed");
  EXPECT_TRUE(failing->images.empty());
  for (const auto& [job, seed] : {std::pair{before, 3.0}, std::pair{after_it, 5.0}}) {
    EXPECT_TRUE(job->error.empty()) << "a batch-mate of a failing request: " << job->error;
    ASSERT_EQ(job->images.size(), 1u);
    EXPECT_EQ(job->images[0].image[0][0][0].item<double>(), seed) << "its own image";
    EXPECT_EQ(job->batched_with, 3) << "taken with the other two";
  }
  {
    std::lock_guard lock(model.mutex);
    ASSERT_EQ(model.calls.size(), 4u) << "the three together, then each alone";
    EXPECT_EQ(model.calls[0].size(), 3u);
    EXPECT_EQ(model.calls[1], std::vector<std::string>{"ok"});
    EXPECT_EQ(model.calls[2], std::vector<std::string>{"fail"});
  }
  const auto later = scheduler.submit(request("ok"), refusal);
  ASSERT_TRUE(finished(scheduler, later));
  EXPECT_TRUE(later->error.empty());
  EXPECT_EQ(later->images.size(), 1u);
}

TEST(Scheduler, AJobTriedAgainAloneIsNotShownItsPreviewsTwice) {
  FakeModel model;
  Scheduler scheduler(through(model), {.max_queue = 4, .batch_window = 100ms, .batch_rows = 8});
  Scheduler::Refusal refusal;
  const auto previewed = scheduler.submit(request("ok", 1, 1, 3), refusal);
  const auto failing = scheduler.submit(request("fail"), refusal);
  ASSERT_TRUE(finished(scheduler, previewed));
  ASSERT_TRUE(finished(scheduler, failing));
  std::vector<int64_t> drawn;
  for (const auto& preview : scheduler.progress(previewed).previews) drawn.push_back(preview.drawn);
  EXPECT_EQ(drawn, (std::vector<int64_t>{3, 6})) << "the failed batch showed them; the retry adds none";
  EXPECT_TRUE(previewed->error.empty());
}

}  // namespace
}  // namespace dalle::serve
