#pragma once
// dalle-serve's server state, shared by its three parts: the event loop and its routes
// (http_server.cpp), the responder thread (responder.cpp) and OpenAI's answers
// (openai_answers.cpp). An Exchange is one request on its connection; HttpServer::State holds
// the config, the pipeline's side (scheduler, jobs, images) and the connections.
#include <microhttpd.h>
#include <sys/socket.h>

#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <ctime>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "serve/api_error.h"
#include "serve/connection_table.h"
#include "serve/edit_request.h"
#include "serve/http_server.h"
#include "serve/image_request.h"
#include "serve/image_store.h"
#include "serve/job_store.h"
#include "serve/memory_budget.h"
#include "serve/metrics.h"
#include "serve/openai_answers.h"
#include "serve/route.h"
#include "serve/scheduler.h"
#include "serve/task_thread.h"
#include "serve/waiting_set.h"

namespace dalle::serve {

using Clock = std::chrono::steady_clock;

inline constexpr const char* kJobs = "/v1/images/jobs";
// A status of our own, as nginx's: the client left before its answer.
inline constexpr int kClientClosedRequest = 499;

// One request on its connection, from its headers to its answer (libmicrohttpd's
// per-request context, held by a shared pointer that the responder thread shares).
struct Exchange {
  MHD_Connection* connection = nullptr;
  int socket = -1;
  std::string method, path, endpoint, host, authorization, client;
  Route route;
  // What the request line and headers alone refuse it for (an unknown route, a method, a
  // missing key, a URL too long), decided before any body byte: its body is then not kept.
  std::optional<ApiError> refusal;
  Clock::time_point arrived = Clock::now();
  std::string body;      // but a form's, which goes to `form`
  size_t body_bytes = 0;
  bool too_large = false;
  MemoryBudget::Charge body_charge;  // the body's bytes, declared or read, until it is read
  // POST /v1/images/edits: its form, as the parser reads it.
  MHD_PostProcessor* form_reader = nullptr;
  Form form;
  bool form_unreadable = false;
  std::string oversized_field;  // a field over its limit; its bytes are not kept
  const ServeConfig* limits = nullptr;  // a form's, for its parser's callback
  bool read = false;      // the body is read and the request dispatched
  bool answered = false;  // an answer is queued (libmicrohttpd may still call for the body)

  // Shared with the responder thread, under `mutex`.
  std::mutex mutex;
  bool suspended = false;
  bool dropped = false;   // its client left, or the server stops: the connection is closed
  bool finished = false;  // the event loop is done with the request
  std::shared_ptr<Job> job;
  ImageRequest request;
  Clock::time_point deadline;
  std::optional<Answer> answer;  // a waiting request's, once known
  // A stream's events not yet sent, from `events_sent` on; ended: no more will come.
  bool streaming = false;
  bool stream_ready = false;  // an edit's stream may start: its job is admitted
  std::string events;
  size_t events_sent = 0;
  bool stream_ended = false;
  Clock::time_point last_event;
  // The responder's alone.
  size_t previews_seen = 0;
  std::map<int64_t, int64_t> partials_sent;  // by candidate

  bool waiting() const { return !answer && !stream_ended && !dropped && !finished; }
  // Lets the event loop go on with the connection. Holds the mutex.
  void wake() {
    if (!suspended) return;
    suspended = false;
    MHD_resume_connection(connection);
  }
  // Parks the connection until wake(). Holds the mutex; on the event loop's thread.
  void park() {
    suspended = true;
    MHD_suspend_connection(connection);
  }
};

struct HttpServer::State {
  State(const ServeConfig& config, generate::Pipeline& pipeline, std::string model_id, std::string api_key);
  ~State();

  // libmicrohttpd's callbacks, on the event loop's thread.
  static MHD_Result on_accept(void* self, const sockaddr* address, socklen_t);
  static void on_connection(void* self, MHD_Connection* connection, void**, MHD_ConnectionNotificationCode what);
  static MHD_Result on_request(void* self, MHD_Connection* connection, const char* url, const char* method,
                               const char*, const char* data, size_t* size, void** context);
  static void on_completed(void* self, MHD_Connection* connection, void** context, MHD_RequestTerminationCode how);
  static void on_log(void*, const char* format, va_list arguments);
  static ssize_t read_stream(void* exchange, uint64_t, char* buffer, size_t max);
  static void free_stream(void* exchange);
  static MHD_Result read_form(void* exchange, MHD_ValueKind, const char* key, const char* filename,
                              const char* content_type, const char*, const char* data, uint64_t, size_t size);

  MHD_Result begin(MHD_Connection* connection, const char* url, const char* method, void** context);
  MHD_Result dispatch(const std::shared_ptr<Exchange>& exchange);
  MHD_Result route(const std::shared_ptr<Exchange>& exchange);
  MHD_Result resumed(const std::shared_ptr<Exchange>& exchange);
  MHD_Result send(Exchange& exchange, const Answer& answer);
  MHD_Result generations(const std::shared_ptr<Exchange>& exchange);
  MHD_Result edits(const std::shared_ptr<Exchange>& exchange);
  // Admits `prompt` for `request`, which the responder then answers once its job is done or
  // streams as it is drawn: one path for both, the deadline running from the request's arrival.
  MHD_Result answer_with_job(const std::shared_ptr<Exchange>& exchange, const ImageRequest& request,
                             generate::PreparedRequest prompt, MemoryBudget::Charge held);
  // On the intake thread: an edit's image decoded, its request prepared and admitted, and its
  // parked connection woken to stream, or answered with why it was refused.
  void admit_edit(const std::shared_ptr<Exchange>& exchange, const ImageRequest& request, int64_t decoding,
                  MemoryBudget::Charge held);
  // Among the requests that wait for a job (what drop_waiting wakes); 503 once the server stops.
  void register_waiting(const std::shared_ptr<Exchange>& exchange);
  // The exchange's fields for a request that waits for its job. Holds its mutex.
  void expect_job(Exchange& exchange, const ImageRequest& request) const;
  // A job's listener that has the responder settle `exchange` (while it lives) as the job goes.
  std::function<void(const std::shared_ptr<Job>&)> settle_on_change(const std::shared_ptr<Exchange>& exchange);
  void take_body(Exchange& exchange, const char* data, size_t size);
  int64_t body_limit(const Exchange& exchange) const {
    return exchange.form_reader ? 2 * config.max_image_bytes + config.max_body_bytes : config.max_body_bytes;
  }
  // Answers an admitted streaming request with server-sent events as the responder adds them.
  MHD_Result stream(const std::shared_ptr<Exchange>& exchange);
  Answer submit_job(const Exchange& exchange);
  Answer job(const Exchange& exchange, const std::string& id);
  Answer get(const Exchange& exchange);

  void authorize(const Exchange& exchange) const;
  std::optional<ApiError> refusal(const Exchange& exchange) const;
  // The answer of a request refused from its headers, or whose body is too large.
  Answer refused_answer(const Exchange& exchange) const;
  ApiError body_too_large(const Exchange& exchange) const {
    return ApiError(413, "The request body is larger than this server takes (" + std::to_string(body_limit(exchange)) +
                             " bytes).", "", "request_too_large");
  }
  void check_not_draining() const;
  ImageRequest read_request(const Exchange& exchange) const;
  // The memory a request holds from admission to its end: its image prompt and the images it
  // makes (candidates, decoded and upscaled).
  int64_t job_bytes(const ImageRequest& request) const;
  // `bytes` of the budget for `what`, or ApiError 503 (413 when over the whole budget).
  MemoryBudget::Charge charge(int64_t bytes, const std::string& what);
  // `request` (with an edit's image prompt) as the pipeline prepares it: the pipeline's one call
  // for a request outside generate. Throws ApiError 400 for what the model refuses.
  generate::PreparedRequest prepare(const ImageRequest& request,
                                    std::shared_ptr<const generate::PromptImage> image_prompt = nullptr);
  std::shared_ptr<Job> admit(generate::PreparedRequest prompt, MemoryBudget::Charge charge,
                             std::function<void(const std::shared_ptr<Job>&)> on_change);
  nlohmann::json answer_json(const std::string& host, const ImageRequest& request, const Job& job);
  std::string base_url(const std::string& host) const;
  nlohmann::json model_object() const;
  std::string job_object(const StoredJob& stored);  // its JSON
  int64_t random_seed();
  void log_answered(const ImageRequest& request, const Job& job, Clock::time_point arrived);

  // The responder thread: answers for finished jobs, stream events, deadlines.
  void post(std::function<void()> task);
  void respond();
  void settle(const std::shared_ptr<Exchange>& exchange, const std::shared_ptr<Job>& job);
  std::string stream_events(Exchange& exchange, const Job& job, const Scheduler::Progress& progress);
  void settle_stored(const std::string& id, const std::string& host, const ImageRequest& request,
                     const std::shared_ptr<Job>& job);
  // The newest of `previews` for each candidate, as a job shows them while it runs:
  // [{candidate, partial_image_index, b64_json}].
  static nlohmann::json latest_partial_images(const std::vector<generate::Preview>& previews);
  void sweep();
  void drop_waiting();  // before the event loop stops: nothing may stay suspended

  ServeConfig config;
  // Const: only its thread-safe methods here; generate() runs on the scheduler's worker alone.
  const generate::Pipeline& pipeline;
  ServedModel model;
  std::string api_key;
  Metrics metrics;
  MemoryBudget budget;  // before what it charges, so that it goes after them
  ImageStore images;
  JobStore jobs;
  std::set<std::string> trusted_proxies;
  ConnectionTable connections;
  std::time_t started = std::time(nullptr);
  std::mutex seeds_mutex;
  std::mt19937_64 seeds{std::random_device{}()};

  std::mutex tasks_mutex;
  std::condition_variable tasks_changed;
  std::deque<std::function<void()>> tasks;
  bool stopping = false;
  WaitingSet<Exchange> waiting;  // requests with a job, until the loop is done with them
  std::mutex stop_mutex;
  std::condition_variable stop_changed;
  bool stop_requested = false;

  Scheduler scheduler;  // after what its jobs' callbacks use, so that it stops before them
  TaskThread intake{"decoding an edit's image"};  // what the event loop must not wait for
  std::thread responder;
  MHD_Daemon* daemon = nullptr;
  int port = 0;
};

}  // namespace dalle::serve
