// Image requests from their body to the scheduler: authorised (from the headers, before the
// body: http_server.cpp's refusal), read, prepared by the pipeline
// (its one call on this side), admitted or refused (429: the queue is full; 503: the server
// drains), then answered once their job is done, streamed as it is drawn, or kept as a job
// that outlives its connection. On the event loop's thread.
#include <algorithm>
#include <cstring>
#include <string_view>
#include <utility>

#include "dalle/log.h"
#include "serve/api_error.h"
#include "serve/edit_request.h"
#include "serve/image_request.h"
#include "serve/server_state.h"

namespace dalle::serve {

namespace {

// Compares in time independent of where the strings differ: a key must not leak by timing.
bool same_secret(std::string_view given, std::string_view key) {
  unsigned char difference = given.size() == key.size() ? 0 : 1;
  for (size_t i = 0; i < given.size(); ++i) {
    difference |= static_cast<unsigned char>(given[i] ^ key[i % std::max<size_t>(key.size(), 1)]);
  }
  return difference == 0;
}

}  // namespace

// ---- requests

void HttpServer::State::authorize(const Exchange& exchange) const {
  if (api_key.empty()) return;
  const auto& header = exchange.authorization;
  const std::string scheme = "Bearer ";
  if (header.rfind(scheme, 0) == 0 && same_secret(std::string_view(header).substr(scheme.size()), api_key)) return;
  throw ApiError(401,
                 header.empty() ? "You didn't provide an API key. Send it as `Authorization: Bearer <key>`."
                                : "Incorrect API key provided.",
                 "", "invalid_api_key");
}

void HttpServer::State::check_not_draining() const {
  if (scheduler.draining()) {
    throw ApiError(503, "The server is shutting down and takes no new requests.", "", "server_shutting_down");
  }
}

ImageRequest HttpServer::State::read_request(const Exchange& exchange) const {
  check_not_draining();
  return read_image_request(exchange.body, model);
}

int64_t HttpServer::State::random_seed() {
  std::lock_guard lock(seeds_mutex);
  // Below 2^53, so that a JavaScript client reads the seed back exactly.
  return static_cast<int64_t>(seeds() >> 11);
}

generate::PreparedRequest HttpServer::State::prepare(const ImageRequest& request,
                                                     std::shared_ptr<const generate::PromptImage> image_prompt) {
  const auto seed = random_seed();
  try {
    return pipeline.prepare(request.prompt, 0, [&](generate::PromptRequest& prompt) {
      prompt = to_prompt_request(request, std::move(prompt), seed);
      prompt.image_prompt = std::move(image_prompt);
      prompt.preview_every = request.preview_every(model);
      prompt.preview_candidates = request.preview_candidates();
    });
  } catch (const Error& error) {  // what the model itself refuses (a BART prior's filters, say)
    throw ApiError(400, error.what(), "", "invalid_value");
  }
}

int64_t HttpServer::State::job_bytes(const ImageRequest& request) const {
  const auto pixels = [](int64_t side) { return 3 * side * side * int64_t{4}; };  // an image, float32
  const int64_t candidates = request.candidates, side = request.image_size(model);
  int64_t bytes = pixels(model.plain_size);                                    // an edit's image prompt
  bytes += candidates * pixels(model.plain_size);                               // the candidates decoded
  if (request.superres) bytes += request.n * pixels(side);                      // the kept ones upscaled
  bytes += request.partial_images * request.n * pixels(model.plain_size);       // previews
  bytes += request.n * side * side * 4;                                         // PNGs and their base64
  return bytes + (64 << 10);                                                    // the request itself
}

MemoryBudget::Charge HttpServer::State::charge(int64_t bytes, const std::string& what) {
  auto charged = budget.charge(bytes);
  if (!charged) throw over_memory_budget(bytes, budget.limit(), what);
  return std::move(*charged);
}

std::shared_ptr<Job> HttpServer::State::admit(generate::PreparedRequest prompt, MemoryBudget::Charge charge,
                                              std::function<void(const std::shared_ptr<Job>&)> on_change) {
  Scheduler::Refusal refusal = Scheduler::Refusal::none;
  auto job = scheduler.submit(std::move(prompt), refusal, std::move(on_change));
  if (job) job->charge = std::move(charge);
  if (refusal == Scheduler::Refusal::queue_full) {
    throw ApiError(429,
                   "The server is busy: " + std::to_string(config.max_queue) +
                       " requests are already waiting for the model. Try again shortly.",
                   "", "rate_limit_exceeded", "requests");
  }
  if (refusal == Scheduler::Refusal::draining) {
    throw ApiError(503, "The server is shutting down and takes no new requests.", "", "server_shutting_down");
  }
  return job;
}

MHD_Result HttpServer::State::generations(const std::shared_ptr<Exchange>& exchange) {
  const auto request = read_request(*exchange);
  request.check_partial_images_streamed();
  exchange->body = std::string();
  exchange->body_charge.shrink_to(0);
  auto held = charge(job_bytes(request), "the request");
  return answer_with_job(exchange, request, prepare(request), std::move(held));
}

MHD_Result HttpServer::State::edits(const std::shared_ptr<Exchange>& exchange) {
  check_not_draining();
  if (!exchange->oversized_field.empty()) {
    const auto& name = exchange->oversized_field;
    throw ApiError(413, "Invalid '" + name + "': larger than this server takes (" +
                            std::to_string(is_file_field(name) ? config.max_image_bytes : config.max_body_bytes) +
                            " bytes).", name, "request_too_large");
  }
  if (exchange->form_unreadable) throw ApiError(400, "The multipart form could not be read.", "", "invalid_body");
  const auto request = read_edit_fields(exchange->form, model);
  request.check_partial_images_streamed();
  const auto decoding = decode_bytes(exchange->form);
  if (decoding > budget.limit()) throw over_memory_budget(decoding, budget.limit(), "decoding the image");
  auto held = std::make_shared<MemoryBudget::Charge>(charge(job_bytes(request), "the request"));
  register_waiting(exchange);
  {
    // Parked, streamed or not, until the intake has decoded and admitted it (or refused it).
    std::lock_guard lock(exchange->mutex);
    expect_job(*exchange, request);
    if (!exchange->dropped) exchange->park();
  }
  intake.post([this, exchange, request, decoding, held] { admit_edit(exchange, request, decoding, std::move(*held)); });
  return MHD_YES;
}

void HttpServer::State::admit_edit(const std::shared_ptr<Exchange>& exchange, const ImageRequest& request,
                                   int64_t decoding, MemoryBudget::Charge held) {
  std::optional<Answer> refused;
  try {
    // Charged here, not on admission: edits are decoded one at a time, so only one decode
    // holds the budget however many wait for the intake.
    auto decode = charge(decoding, "decoding the image");
    auto image = read_edit_image(exchange->form, model);  // the loop is done with the form
    decode.shrink_to(0);
    exchange->form.clear();
    exchange->body_charge.shrink_to(0);
    auto prompt = prepare(request, std::make_shared<const generate::PromptImage>(std::move(image)));
    auto job = admit(std::move(prompt), std::move(held), settle_on_change(exchange));
    std::lock_guard lock(exchange->mutex);
    exchange->job = job;
    if (!exchange->waiting()) {
      scheduler.cancel(job);  // its client left, or its time ran out, while it was decoded
    } else if (exchange->streaming) {
      exchange->stream_ready = true;
      exchange->wake();
    }
    return;
  } catch (const ApiError& error) {
    refused = error_answer(error);
  } catch (const std::exception& error) {
    log::error("serve: POST /v1/images/edits: ", error.what());
    refused = json_answer(500, error_json(500, "The server had an error while processing your request."));
  }
  std::lock_guard lock(exchange->mutex);
  if (!exchange->waiting()) return;
  exchange->answer = std::move(refused);
  exchange->wake();
}

void HttpServer::State::register_waiting(const std::shared_ptr<Exchange>& exchange) {
  // Registered before it can be parked, so that drop_waiting (the server stopping) wakes it
  // whenever it comes: a parked connection nobody wakes would hold the event loop's stop.
  if (!waiting.join(exchange)) {
    throw ApiError(503, "The server is shutting down and takes no new requests.", "", "server_shutting_down");
  }
}

std::function<void(const std::shared_ptr<Job>&)> HttpServer::State::settle_on_change(
    const std::shared_ptr<Exchange>& exchange) {
  std::weak_ptr<Exchange> weak = exchange;
  return [this, weak](const std::shared_ptr<Job>& job) {
    post([this, weak, job] {
      if (auto exchange = weak.lock()) settle(exchange, job);
    });
  };
}

void HttpServer::State::expect_job(Exchange& exchange, const ImageRequest& request) const {
  exchange.streaming = request.stream;
  exchange.request = request;
  exchange.deadline = exchange.arrived + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(config.request_timeout_seconds));
  exchange.last_event = Clock::now();
}

MHD_Result HttpServer::State::answer_with_job(const std::shared_ptr<Exchange>& exchange, const ImageRequest& request,
                                              generate::PreparedRequest prompt, MemoryBudget::Charge held) {
  register_waiting(exchange);
  try {
    // Held until the connection is parked, or streams: the job's answer cannot come before.
    std::lock_guard lock(exchange->mutex);
    expect_job(*exchange, request);
    exchange->job = admit(std::move(prompt), std::move(held), settle_on_change(exchange));
    if (!request.stream && !exchange->dropped) exchange->park();
  } catch (...) {
    waiting.leave(exchange);
    throw;
  }
  return request.stream ? stream(exchange) : MHD_YES;
}

MHD_Result HttpServer::State::stream(const std::shared_ptr<Exchange>& exchange) {
  auto* response = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, read_stream,
                                                     new std::shared_ptr<Exchange>(exchange), free_stream);
  MHD_add_response_header(response, "Content-Type", "text/event-stream");
  MHD_add_response_header(response, "Cache-Control", "no-cache");
  const auto queued = MHD_queue_response(exchange->connection, 200, response);
  MHD_destroy_response(response);
  exchange->answered = true;
  metrics.count_response(exchange->endpoint, 200);
  return queued;
}

ssize_t HttpServer::State::read_stream(void* context, uint64_t, char* buffer, size_t max) {
  auto& exchange = **static_cast<std::shared_ptr<Exchange>*>(context);
  std::lock_guard lock(exchange.mutex);
  if (exchange.events_sent < exchange.events.size()) {
    const size_t length = std::min(max, exchange.events.size() - exchange.events_sent);
    std::memcpy(buffer, exchange.events.data() + exchange.events_sent, length);
    exchange.events_sent += length;
    if (exchange.events_sent == exchange.events.size()) {
      exchange.events.clear();
      exchange.events_sent = 0;
    }
    return static_cast<ssize_t>(length);
  }
  if (exchange.stream_ended) return MHD_CONTENT_READER_END_OF_STREAM;
  if (exchange.dropped) return MHD_CONTENT_READER_END_WITH_ERROR;
  exchange.park();  // until the responder has more
  return 0;
}

void HttpServer::State::free_stream(void* context) { delete static_cast<std::shared_ptr<Exchange>*>(context); }

// ---- jobs that outlive their connection

Answer HttpServer::State::submit_job(const Exchange& exchange) {
  const auto request = read_request(exchange);
  if (request.stream) {
    throw ApiError(400, "A job is fetched, not streamed: `stream` is for POST /v1/images/generations.", "stream",
                   "invalid_value");
  }
  auto held = charge(job_bytes(request), "the job");
  auto prompt = prepare(request);  // with partial_images, GET shows the latest of each image
  const auto id = random_id();
  if (!jobs.add(id)) {
    throw ApiError(429, "The server keeps " + std::to_string(config.max_stored_jobs) +
                            " unfinished jobs at most. Try again once some have finished.",
                   "", "rate_limit_exceeded", "requests");
  }
  std::shared_ptr<Job> job;
  try {
    job = admit(std::move(prompt), std::move(held),
                [this, id, host = exchange.host, request](const std::shared_ptr<Job>& job) {
      post([this, id, host, request, job] { settle_stored(id, host, request, job); });
    });
  } catch (...) {
    jobs.remove(id);
    throw;
  }
  jobs.attach(id, job);
  auto answer = json_answer(202, job_object(*jobs.find(id)));
  answer.headers.emplace_back("Location", std::string(kJobs) + "/" + id);
  return answer;
}

Answer HttpServer::State::job(const Exchange& exchange, const std::string& id) {
  auto stored = exchange.method == "DELETE" ? jobs.cancel(id) : jobs.find(id);
  if (!stored) throw ApiError(404, "No such job: it expired, or was never made here.", "", "job_not_found");
  if (exchange.method == "DELETE" && stored->job) scheduler.cancel(stored->job);
  return json_answer(200, job_object(*stored));
}

}  // namespace dalle::serve
