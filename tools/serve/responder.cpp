// The responder thread: turns finished jobs into answers and stream events, wakes their
// connections, enforces the deadlines and sees clients leave.
#include <poll.h>
#include <sys/socket.h>

#include <exception>

#include "dalle/data/image.h"
#include "dalle/input_limits.h"
#include "dalle/log.h"
#include "serve/server_state.h"

namespace dalle::serve {

namespace {

using nlohmann::json;

// How often the responder looks for overdue requests and connections, and clients gone.
constexpr auto kSweepEvery = std::chrono::milliseconds(100);
// A stream waiting for its first image says it is alive this often, so that proxies keep it.
constexpr auto kStreamKeepAlive = std::chrono::seconds(15);

// Whether the client closed its end (or the connection broke). Data it sent ahead (a
// pipelined request) does not count. Only for a suspended connection, whose socket the event
// loop leaves alone.
bool client_gone(int socket) {
  pollfd watch{.fd = socket, .events = POLLIN | POLLRDHUP, .revents = 0};
  if (poll(&watch, 1, 0) <= 0) return false;
  if (watch.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
  char byte;
  return recv(socket, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

}  // namespace

void HttpServer::State::post(std::function<void()> task) {
  {
    std::lock_guard lock(tasks_mutex);
    tasks.push_back(std::move(task));
  }
  tasks_changed.notify_all();
}

void HttpServer::State::respond() {
  std::unique_lock lock(tasks_mutex);
  auto next_sweep = Clock::now() + kSweepEvery;
  while (!stopping) {
    tasks_changed.wait_until(lock, next_sweep, [&] { return stopping || !tasks.empty(); });
    while (!tasks.empty()) {
      auto task = std::move(tasks.front());
      tasks.pop_front();
      lock.unlock();
      try {
        task();
      } catch (const std::exception& error) {
        log::error("serve: answering: ", error.what());
      }
      lock.lock();
    }
    if (Clock::now() >= next_sweep) {
      lock.unlock();
      sweep();
      lock.lock();
      next_sweep = Clock::now() + kSweepEvery;
    }
  }
}

void HttpServer::State::settle(const std::shared_ptr<Exchange>& exchange, const std::shared_ptr<Job>& job) {
  size_t seen = 0;
  {
    std::lock_guard lock(exchange->mutex);
    if (!exchange->waiting()) return;
    seen = exchange->previews_seen;
  }
  const auto progress = scheduler.progress(job, seen);
  bool done = progress.state == Job::State::done;
  bool answered = done && job->error.empty();
  if (exchange->streaming) {
    std::string events;
    try {
      events = stream_events(*exchange, *job, progress);
    } catch (const std::exception& failure) {
      events = sse_event("error", json::parse(answer_failed(failure).json()));
      done = true;
      answered = false;
    }
    std::lock_guard lock(exchange->mutex);
    if (!exchange->waiting()) return;
    exchange->previews_seen = seen + progress.previews.size();
    exchange->events += events;
    exchange->stream_ended = done;
    exchange->last_event = Clock::now();
    exchange->wake();
  } else if (done) {
    std::optional<Answer> answer;
    try {
      answer = job->error.empty() ? json_answer(200, answer_json(exchange->host, exchange->request, *job).dump())
                                  : error_answer(generation_error(job->error));
    } catch (const std::exception& failure) {
      answer = error_answer(answer_failed(failure));
      answered = false;
    }
    std::lock_guard lock(exchange->mutex);
    if (!exchange->waiting()) return;
    exchange->answer = std::move(answer);
    exchange->wake();
  }
  if (answered) log_answered(exchange->request, *job, exchange->arrived);
}

std::string HttpServer::State::stream_events(Exchange& exchange, const Job& job, const Scheduler::Progress& progress) {
  std::string events;
  for (const auto& preview : progress.previews) {
    auto event = image_event(base64(data::encode_png(preview.image)), preview.image.size(-1));
    event["partial_image_index"] = exchange.partials_sent[preview.candidate]++;
    event["candidate"] = preview.candidate;
    events += sse_event("image_generation.partial_image", std::move(event));
  }
  if (progress.state != Job::State::done) return events;
  if (!job.error.empty()) return events + sse_event("error", json::parse(generation_error(job.error).json()));
  const auto& settings = job.request.settings();
  for (const auto& image : job.images) {
    auto event = image_event(base64(generate::encode_generated_png(settings, image)), image.image.size(-1));
    event["candidate"] = image.candidate;
    event["usage"] = {{"input_tokens", 0}, {"output_tokens", model.image_tokens}, {"total_tokens", model.image_tokens},
                      {"input_tokens_details", {{"text_tokens", 0}, {"image_tokens", 0}}}};
    events += sse_event("image_generation.completed", std::move(event));
  }
  return events;
}

void HttpServer::State::sweep() {
  connections.sweep();
  const auto timeout = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(config.request_timeout_seconds));
  for (const auto& job : jobs.end_overdue(timeout, timeout_error(config.request_timeout_seconds).json())) {
    scheduler.cancel(job);
  }
  const auto watched = waiting.members();
  const auto now = Clock::now();
  for (const auto& exchange : watched) {
    std::lock_guard lock(exchange->mutex);
    if (!exchange->waiting()) continue;
    if (now >= exchange->deadline) {
      if (exchange->job) scheduler.cancel(exchange->job);  // an edit being decoded has none yet
      const auto timeout = timeout_error(config.request_timeout_seconds);
      if (exchange->streaming) {
        exchange->events += sse_event("error", json::parse(timeout.json()));
        exchange->stream_ended = true;
      } else {
        exchange->answer = error_answer(timeout);
      }
      exchange->wake();
    } else if (exchange->suspended && client_gone(exchange->socket)) {
      // A parked connection is not watched by the event loop: the client's leaving is seen here.
      if (exchange->job) scheduler.cancel(exchange->job);
      exchange->dropped = true;
      exchange->wake();
      log::info("serve: a client left before its images were ready (", exchange->client, ")");
      metrics.count_response(exchange->endpoint, kClientClosedRequest);
    } else if (exchange->streaming && exchange->suspended && now - exchange->last_event > kStreamKeepAlive) {
      exchange->events += ": keep-alive\n\n";
      exchange->last_event = now;
      exchange->wake();
    }
  }
}

void HttpServer::State::drop_waiting() {
  waiting.close([](Exchange& exchange) {
    std::lock_guard lock(exchange.mutex);
    exchange.dropped = true;
    exchange.wake();
  });
}

void HttpServer::State::settle_stored(const std::string& id, const std::string& host, const ImageRequest& request,
                                      const std::shared_ptr<Job>& job) {
  const auto progress = scheduler.progress(job);
  if (progress.state != Job::State::done) {
    if (!progress.previews.empty()) jobs.set_partial(id, latest_partial_images(progress.previews).dump());
    return;
  }
  if (!job->error.empty()) {
    jobs.end(id, "", generation_error(job->error).json());
    return;
  }
  if (jobs.end_with(id, [&] { return answer_json(host, request, *job).dump(); })) {
    log_answered(request, *job, job->admitted);
  }
}

json HttpServer::State::latest_partial_images(const std::vector<generate::Preview>& previews) {
  std::map<int64_t, std::pair<const generate::Preview*, int64_t>> latest;  // by candidate: the last, its index
  for (const auto& preview : previews) {
    auto& [last, index] = latest.try_emplace(preview.candidate, nullptr, -1).first->second;
    last = &preview;
    ++index;
  }
  json images = json::array();
  for (const auto& [candidate, last] : latest) {
    images.push_back({{"candidate", candidate},
                      {"partial_image_index", last.second},
                      {"b64_json", base64(data::encode_png(last.first->image))}});
  }
  return images;
}

void HttpServer::State::log_answered(const ImageRequest& request, const Job& job, Clock::time_point arrived) {
  const auto seconds = std::chrono::duration<double>(Clock::now() - arrived).count();
  metrics.count_images(static_cast<int64_t>(job.images.size()));
  metrics.observe_request_seconds(seconds);
  log::info("serve: ", job.images.size(), " images for ", excerpt(request.prompt), " in ", seconds,
            " s (generated with ", job.batched_with - 1, " other requests in ", job.generation_seconds, " s)",
            request.stream ? ", streamed" : "");
}

}  // namespace dalle::serve
