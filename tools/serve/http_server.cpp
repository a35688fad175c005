#include "serve/http_server.h"

#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstring>
#include <ctime>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <thread>
#include <utility>

#include "dalle/data/image.h"
#include "dalle/input_limits.h"
#include "dalle/log.h"
#include "serve/api_error.h"
#include "serve/connection_table.h"
#include "serve/edit_request.h"
#include "serve/image_request.h"
#include "serve/image_store.h"
#include "serve/job_store.h"
#include "serve/metrics.h"
#include "serve/scheduler.h"
#include "serve/web_page.h"

namespace dalle::serve {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr const char* kJson = "application/json";
constexpr const char* kGenerations = "/v1/images/generations";
constexpr const char* kJobs = "/v1/images/jobs";
constexpr const char* kEdits = "/v1/images/edits";
// A status of our own, as nginx's: the client left before its answer.
constexpr int kClientClosedRequest = 499;
// How often the responder looks for overdue requests and connections, and clients gone.
constexpr auto kSweepEvery = std::chrono::milliseconds(100);
// A stream waiting for its first image says it is alive this often, so that proxies keep it.
constexpr auto kStreamKeepAlive = std::chrono::seconds(15);
// Per connection: the request line, headers and read buffer (libmicrohttpd's default).
constexpr size_t kConnectionMemory = 32 * 1024;

std::string base64(std::string_view bytes) {
  static constexpr char kDigits[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t at = 0; at < bytes.size(); at += 3) {
    uint32_t group = static_cast<unsigned char>(bytes[at]) << 16;
    if (at + 1 < bytes.size()) group |= static_cast<unsigned char>(bytes[at + 1]) << 8;
    if (at + 2 < bytes.size()) group |= static_cast<unsigned char>(bytes[at + 2]);
    out += kDigits[(group >> 18) & 63];
    out += kDigits[(group >> 12) & 63];
    out += at + 1 < bytes.size() ? kDigits[(group >> 6) & 63] : '=';
    out += at + 2 < bytes.size() ? kDigits[group & 63] : '=';
  }
  return out;
}

// Compares in time independent of where the strings differ: a key must not leak by timing.
bool same_secret(std::string_view given, std::string_view key) {
  unsigned char difference = given.size() == key.size() ? 0 : 1;
  for (size_t i = 0; i < given.size(); ++i) {
    difference |= static_cast<unsigned char>(given[i] ^ key[i % std::max<size_t>(key.size(), 1)]);
  }
  return difference == 0;
}

// What goes back on a connection: built off the event loop, sent by it.
struct Answer {
  int status = 200;
  std::string content_type = kJson;
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
};

Answer json_answer(int status, std::string body) { return {.status = status, .body = std::move(body)}; }

Answer error_answer(const ApiError& error) {
  auto answer = json_answer(error.status(), error.json());
  if (error.status() == 429 || error.status() == 503) answer.headers.emplace_back("Retry-After", "1");
  return answer;
}

ApiError timeout_error(double seconds) {
  return ApiError(504, "The request took longer than this server allows (" + json(seconds).dump() + " s).", "",
                  "timeout");
}

ApiError generation_error(const std::string& why) {
  return ApiError(500, "Generation failed: " + why, "", "generation_failed");
}

const std::regex& job_path() {
  static const std::regex path(R"(/v1/images/jobs/([0-9a-f]{32}))");
  return path;
}

// The route a request took, for the metrics' labels: a bounded set whatever clients ask.
std::string endpoint_of(const std::string& path) {
  for (const char* route : {kGenerations, kEdits, kJobs, "/v1/models", "/health", "/metrics", "/"}) {
    if (path == route) return route;
  }
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models/{model}";
  if (std::regex_match(path, job_path())) return "/v1/images/jobs/{id}";
  if (path.rfind("/v1/images/", 0) == 0) return "/v1/images/{id}.png";
  return "other";
}

// The methods a route takes; "" for an unknown one.
std::string allowed_methods(const std::string& path) {
  static const std::regex get_routes(R"(/v1/models(/.+)?|/v1/images/[0-9a-f]{32}\.png|/health|/metrics|/)");
  if (path == kGenerations || path == kEdits || path == kJobs) return "POST";
  if (std::regex_match(path, job_path())) return "GET, HEAD, DELETE";
  return std::regex_match(path, get_routes) ? "GET, HEAD" : "";
}

bool takes(const std::string& allowed, const std::string& method) {
  std::string list = ", " + allowed + ",";
  return list.find(" " + method + ",") != std::string::npos;
}

// One server-sent event as OpenAI's streams send them: its type twice, as the event's name
// and in the data.
std::string sse_event(const std::string& type, json data) {
  data["type"] = type;
  return "event: " + type + "\ndata: " + data.dump() + "\n\n";
}

// The fields OpenAI's image stream events share, for an image of `side` pixels.
json image_event(std::string b64_png, int64_t side) {
  return {{"b64_json", std::move(b64_png)}, {"created_at", std::time(nullptr)}, {"size", side_by_side(side)},
          {"quality", "auto"}, {"background", "opaque"}, {"output_format", "png"}};
}

std::string numeric_address(const sockaddr* address) {
  char host[NI_MAXHOST];
  const socklen_t length = address->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  if (getnameinfo(address, length, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) return "?";
  return host;
}

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

std::string header(MHD_Connection* connection, const char* name) {
  const char* value = MHD_lookup_connection_value(connection, MHD_HEADER_KIND, name);
  return value ? value : "";
}

// Raises the open-file limit to what `connections` need (and the kernel allows); the number
// of connections it leaves room for.
int64_t make_room_for(int64_t connections) {
  constexpr int64_t kOtherFiles = 256;  // the model's files, logs, torch's threads' pipes
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return connections;
  const auto wanted = static_cast<rlim_t>(connections + kOtherFiles);
  if (limit.rlim_cur < wanted) {
    limit.rlim_cur = limit.rlim_max == RLIM_INFINITY ? wanted : std::min(wanted, limit.rlim_max);
    setrlimit(RLIMIT_NOFILE, &limit);
    getrlimit(RLIMIT_NOFILE, &limit);
  }
  return std::min<int64_t>(connections, static_cast<int64_t>(limit.rlim_cur) - kOtherFiles);
}

}  // namespace

// One request on its connection, from its headers to its answer (libmicrohttpd's
// per-request context, held by a shared pointer that the responder thread shares).
struct Exchange {
  MHD_Connection* connection = nullptr;
  int socket = -1;
  std::string method, path, endpoint, host, authorization, client;
  Clock::time_point arrived = Clock::now();
  std::string body;      // but a form's, which goes to `form`
  size_t body_bytes = 0;
  bool too_large = false;
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
  // Answers `request` once its job is done, or streams it.
  MHD_Result answer_with_job(const std::shared_ptr<Exchange>& exchange, const ImageRequest& request,
                             generate::PromptRequest prompt);
  void take_body(Exchange& exchange, const char* data, size_t size);
  int64_t body_limit(const Exchange& exchange) const {
    return exchange.form_reader ? 2 * config.max_image_bytes + config.max_body_bytes : config.max_body_bytes;
  }
  MHD_Result stream(const std::shared_ptr<Exchange>& exchange, const ImageRequest& request,
                    generate::PromptRequest prompt);
  Answer submit_job(const Exchange& exchange);
  Answer job(const Exchange& exchange, const std::string& id);
  Answer get(const Exchange& exchange);

  void authorize(const Exchange& exchange) const;
  ApiError body_too_large(const Exchange& exchange) const {
    return ApiError(413, "The request body is larger than this server takes (" + std::to_string(body_limit(exchange)) +
                             " bytes).", "", "request_too_large");
  }
  void check_admissible(const Exchange& exchange) const;
  ImageRequest read_request(const Exchange& exchange) const;
  generate::PromptRequest prompt_of(const ImageRequest& request,
                                    std::shared_ptr<const generate::PromptImage> image_prompt = nullptr);
  std::shared_ptr<Job> admit(generate::PromptRequest prompt, std::function<void(const std::shared_ptr<Job>&)> on_change);
  json answer_json(const std::string& host, const ImageRequest& request, const Job& job);
  std::string base_url(const std::string& host) const;
  json model_object() const;
  json job_object(const StoredJob& stored);
  int64_t random_seed();
  void log_answered(const ImageRequest& request, const Job& job, Clock::time_point arrived);

  // The responder thread: answers for finished jobs, stream events, deadlines.
  void post(std::function<void()> task);
  void respond();
  void settle(const std::shared_ptr<Exchange>& exchange, const std::shared_ptr<Job>& job);
  std::string stream_events(Exchange& exchange, const Job& job, const Scheduler::Progress& progress);
  void settle_stored(const std::string& id, const std::string& host, const ImageRequest& request,
                     const std::shared_ptr<Job>& job);
  void sweep();
  void drop_waiting();  // before the event loop stops: nothing may stay suspended

  ServeConfig config;
  generate::Pipeline& pipeline;
  ServedModel model;
  std::string api_key;
  Metrics metrics;
  ImageStore images;
  JobStore jobs;
  ConnectionTable connections;
  std::time_t started = std::time(nullptr);
  std::mutex seeds_mutex;
  std::mt19937_64 seeds{std::random_device{}()};

  std::mutex tasks_mutex;
  std::condition_variable tasks_changed;
  std::deque<std::function<void()>> tasks;
  bool stopping = false;
  std::mutex waiting_mutex;
  std::set<std::shared_ptr<Exchange>> waiting;  // requests with a job, until the loop is done with them
  std::condition_variable waiting_changed;
  bool stop_requested = false;

  Scheduler scheduler;  // after what its jobs' callbacks use, so that it stops before them
  std::thread responder;
  MHD_Daemon* daemon = nullptr;
  int port = 0;
};

HttpServer::State::State(const ServeConfig& config_, generate::Pipeline& pipeline_, std::string model_id,
                         std::string api_key_)
    : config(config_),
      pipeline(pipeline_),
      api_key(std::move(api_key_)),
      images(std::chrono::seconds(config_.image_ttl_seconds), config_.max_stored_images),
      jobs(std::chrono::seconds(config_.image_ttl_seconds), config_.max_stored_jobs),
      connections({.max_connections = config_.max_connections,
                   .max_per_client = config_.max_connections_per_client,
                   .header_timeout = std::chrono::milliseconds(static_cast<int64_t>(config_.header_timeout_seconds * 1000)),
                   .body_timeout = std::chrono::milliseconds(static_cast<int64_t>(config_.body_timeout_seconds * 1000))}),
      scheduler([&pipeline_](const std::vector<generate::PromptRequest>& requests,
                             const generate::PreviewCallback& on_preview) { return pipeline_.generate(requests, on_preview); },
                {.max_queue = config_.max_queue,
                 .batch_window = std::chrono::milliseconds(config_.batch_window_ms),
                 .batch_rows = pipeline_.config().batch_size}),
      responder([this] { respond(); }) {
  model = {.id = std::move(model_id),
           .plain_size = pipeline.image_size(false),
           .superres_size = pipeline.config().superres.empty() ? 0 : pipeline.image_size(true),
           .image_tokens = pipeline.image_tokens(),
           .has_clip = !pipeline.config().clip.empty(),
           .default_candidates = pipeline.config().candidates,
           .max_n = config.max_n,
           .max_candidates = config.max_candidates,
           .max_prompt_length = config.max_prompt_length};
  if (config.connection_threads != 0) {
    log::warn("serve: connection_threads is no longer used (one event loop holds every connection; "
              "max_connections bounds them)");
  }
}

HttpServer::State::~State() {
  if (daemon) {
    drop_waiting();
    MHD_stop_daemon(daemon);
  }
  {
    std::lock_guard lock(tasks_mutex);
    stopping = true;
  }
  tasks_changed.notify_all();
  responder.join();
}

// ---- the event loop's side

MHD_Result HttpServer::State::on_accept(void* self, const sockaddr* address, socklen_t) {
  return static_cast<State*>(self)->connections.admit(numeric_address(address)) ? MHD_YES : MHD_NO;
}

void HttpServer::State::on_connection(void* self, MHD_Connection* connection, void**,
                                      MHD_ConnectionNotificationCode what) {
  auto& state = *static_cast<State*>(self);
  if (what == MHD_CONNECTION_NOTIFY_CLOSED) {
    state.connections.closed(connection);
    return;
  }
  const auto* socket = MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
  const auto* address = MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
  state.connections.opened(connection, socket ? socket->connect_fd : -1,
                           address ? numeric_address(address->client_addr) : "?");
}

void HttpServer::State::on_log(void*, const char* format, va_list arguments) {
  char message[512];
  std::vsnprintf(message, sizeof message, format, arguments);
  std::string text = message;
  while (!text.empty() && text.back() == '\n') text.pop_back();
  log::debug("serve: libmicrohttpd: ", text);
}

MHD_Result HttpServer::State::on_request(void* self, MHD_Connection* connection, const char* url, const char* method,
                                         const char*, const char* data, size_t* size, void** context) {
  auto& state = *static_cast<State*>(self);
  try {
    if (!*context) return state.begin(connection, url, method, context);
    const auto& exchange = *static_cast<std::shared_ptr<Exchange>*>(*context);
    if (exchange->answered) {
      *size = 0;
      return MHD_YES;
    }
    if (*size > 0) {
      state.take_body(*exchange, data, *size);
      *size = 0;
      return MHD_YES;
    }
    if (!exchange->read) {
      exchange->read = true;
      state.connections.body_read(connection);
      return state.dispatch(exchange);
    }
    return state.resumed(exchange);
  } catch (const std::exception& error) {
    log::error("serve: ", method, " ", excerpt(url), ": ", error.what());
    return MHD_NO;
  }
}

// A piece of the body: kept (or parsed, for a form) within the limit, the rest read and dropped.
void HttpServer::State::take_body(Exchange& exchange, const char* data, size_t size) {
  exchange.body_bytes += size;
  exchange.too_large = exchange.too_large || exchange.body_bytes > static_cast<size_t>(body_limit(exchange));
  if (exchange.too_large) return;
  if (!exchange.form_reader) {
    exchange.body.append(data, size);
    return;
  }
  if (!exchange.form_unreadable && exchange.oversized_field.empty() &&
      MHD_post_process(exchange.form_reader, data, size) != MHD_YES && exchange.oversized_field.empty()) {
    exchange.form_unreadable = true;
  }
}

MHD_Result HttpServer::State::read_form(void* context, MHD_ValueKind, const char* key, const char* filename,
                                        const char* content_type, const char*, const char* data, uint64_t,
                                        size_t size) {
  auto& exchange = *static_cast<Exchange*>(context);
  auto& part = exchange.form[key];
  if (filename) part.filename = filename;
  if (content_type) part.content_type = content_type;
  const auto& limits = *exchange.limits;
  const auto limit = is_file_field(key) ? limits.max_image_bytes : limits.max_body_bytes;
  if (part.data.size() + size > static_cast<size_t>(limit)) {
    exchange.oversized_field = key;
    return MHD_NO;
  }
  part.data.append(data, size);
  return MHD_YES;
}

MHD_Result HttpServer::State::begin(MHD_Connection* connection, const char* url, const char* method, void** context) {
  auto exchange = std::make_shared<Exchange>();
  exchange->connection = connection;
  exchange->method = method;
  exchange->path = url;
  exchange->endpoint = endpoint_of(exchange->path);
  exchange->host = header(connection, "Host");
  exchange->authorization = header(connection, "Authorization");
  if (const auto* socket = MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD)) {
    exchange->socket = socket->connect_fd;
  }
  if (const auto* address = MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CLIENT_ADDRESS)) {
    exchange->client = numeric_address(address->client_addr);
  }
  *context = new std::shared_ptr<Exchange>(exchange);
  connections.headers_read(connection);
  if (exchange->path == kEdits && exchange->method == "POST") {
    exchange->limits = &config;
    exchange->form_reader = MHD_create_post_processor(connection, 64 * 1024, read_form, exchange.get());
    if (!exchange->form_reader) {
      exchange->read = true;
      return send(*exchange, error_answer(ApiError(400, "POST /v1/images/edits takes a multipart/form-data body "
                                                        "(OpenAI's form: image, mask, prompt...).", "",
                                                   "invalid_content_type")));
    }
  }
  // A body declared too large is read and dropped (body_timeout_seconds bounds that), then
  // refused: a client that sends it whole reads the answer only after. One that waits for
  // `100 Continue` is refused at once (the connection then closes).
  const auto length = header(connection, "Content-Length");
  if (!length.empty() && (length.size() > 18 || std::stoll(length) > body_limit(*exchange))) {
    exchange->too_large = true;
    if (!header(connection, "Expect").empty()) {
      exchange->read = true;
      return send(*exchange, error_answer(body_too_large(*exchange)));
    }
  }
  // Answering now would close the connection (libmicrohttpd's rule): the answer comes once
  // the body, even an empty one, is read.
  return MHD_YES;
}

MHD_Result HttpServer::State::send(Exchange& exchange, const Answer& answer) {
  auto* response = MHD_create_response_from_buffer(answer.body.size(), const_cast<char*>(answer.body.data()),
                                                   MHD_RESPMEM_MUST_COPY);
  if (!response) return MHD_NO;
  MHD_add_response_header(response, "Content-Type", answer.content_type.c_str());
  for (const auto& [name, value] : answer.headers) MHD_add_response_header(response, name.c_str(), value.c_str());
  const auto queued = MHD_queue_response(exchange.connection, static_cast<unsigned>(answer.status), response);
  MHD_destroy_response(response);
  exchange.answered = true;
  metrics.count_response(exchange.endpoint, answer.status);
  log::debug("serve: ", exchange.client, " ", exchange.method, " ", excerpt(exchange.path), " ", answer.status);
  return queued;
}

MHD_Result HttpServer::State::dispatch(const std::shared_ptr<Exchange>& exchange) {
  try {
    return route(exchange);
  } catch (const ApiError& error) {
    return send(*exchange, error_answer(error));
  } catch (const std::exception& error) {
    log::error("serve: ", exchange->method, " ", excerpt(exchange->path), ": ", error.what());
    return send(*exchange, json_answer(500, error_json(500, "The server had an error while processing your request.")));
  }
}

MHD_Result HttpServer::State::route(const std::shared_ptr<Exchange>& exchange) {
  const auto& path = exchange->path;
  const auto allowed = allowed_methods(path);
  if (allowed.empty()) throw ApiError(404, "Invalid URL (" + exchange->method + " " + excerpt(path) + ")");
  if (!takes(allowed, exchange->method)) {
    auto answer = error_answer(ApiError(405, "Invalid method for URL (" + exchange->method + " " + excerpt(path) +
                                                 "); it takes " + allowed + ".", "", "method_not_allowed"));
    answer.headers.emplace_back("Allow", allowed);
    return send(*exchange, answer);
  }
  if (exchange->too_large) return send(*exchange, error_answer(body_too_large(*exchange)));
  if (path == kGenerations) return generations(exchange);
  if (path == kEdits) return edits(exchange);
  if (path == kJobs) return send(*exchange, submit_job(*exchange));
  std::smatch match;
  if (std::regex_match(path, match, job_path())) return send(*exchange, job(*exchange, match[1]));
  return send(*exchange, get(*exchange));
}

Answer HttpServer::State::get(const Exchange& exchange) {
  const auto& path = exchange.path;
  if (path == "/health") {
    const bool draining = scheduler.draining();
    return json_answer(draining ? 503 : 200, json{{"status", draining ? "draining" : "ok"},
                                                  {"model", model.id},
                                                  {"queued", scheduler.queued()},
                                                  {"generating", scheduler.running()}}
                                                 .dump());
  }
  if (path == "/metrics") {
    const auto counts = connections.counts();
    return {.content_type = "text/plain; version=0.0.4",
            .body = metrics.prometheus_text(scheduler.queued(), scheduler.running(), scheduler.draining()) +
                    Metrics::connection_text(counts.open, counts.opened_total, counts.refused_total,
                                             counts.timed_out_total)};
  }
  if (path == "/") return {.content_type = "text/html; charset=utf-8", .body = kWebPage};
  static const std::regex image_path(R"(/v1/images/([0-9a-f]{32})\.png)");
  std::smatch match;
  if (std::regex_match(path, match, image_path)) {
    // No key asked: the id is the permission (128 random bits), as OpenAI's signed URLs are.
    auto png = images.get(match[1]);
    if (!png) throw ApiError(404, "No such image: it expired, or was never made here.", "", "image_not_found");
    return {.content_type = "image/png", .body = std::move(*png)};
  }
  authorize(exchange);
  if (path == "/v1/models") return json_answer(200, json{{"object", "list"}, {"data", json::array({model_object()})}}.dump());
  const auto id = path.substr(std::string("/v1/models/").size());
  if (id != model.id) {
    throw ApiError(404, "The model `" + excerpt(id) + "` does not exist or you do not have access to it.", "model",
                   "model_not_found");
  }
  return json_answer(200, model_object().dump());
}

MHD_Result HttpServer::State::resumed(const std::shared_ptr<Exchange>& exchange) {
  std::unique_lock lock(exchange->mutex);
  if (exchange->dropped) return MHD_NO;
  if (!exchange->answer) {  // woken early: waits on
    exchange->park();
    return MHD_YES;
  }
  const auto answer = std::move(*exchange->answer);
  lock.unlock();
  return send(*exchange, answer);
}

void HttpServer::State::on_completed(void* self, MHD_Connection* connection, void** context,
                                     MHD_RequestTerminationCode how) {
  auto& state = *static_cast<State*>(self);
  auto* held = static_cast<std::shared_ptr<Exchange>*>(*context);
  *context = nullptr;
  state.connections.answered(connection);
  if (!held) return;
  const auto exchange = std::move(*held);
  delete held;
  if (exchange->form_reader) MHD_destroy_post_processor(exchange->form_reader);
  exchange->form_reader = nullptr;
  bool left = false;
  {
    std::lock_guard lock(exchange->mutex);
    left = exchange->job && exchange->waiting() && how != MHD_REQUEST_TERMINATED_COMPLETED_OK;
    exchange->finished = true;
    if (exchange->job) state.scheduler.cancel(exchange->job);  // a done job stays done
  }
  if (left) {
    log::info("serve: a client left before its images were ready (", exchange->client, ")");
    state.metrics.count_response(exchange->endpoint, kClientClosedRequest);
  }
  std::lock_guard lock(state.waiting_mutex);
  state.waiting.erase(exchange);
  state.waiting_changed.notify_all();
}

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

void HttpServer::State::check_admissible(const Exchange& exchange) const {
  authorize(exchange);
  if (scheduler.draining()) {
    throw ApiError(503, "The server is shutting down and takes no new requests.", "", "server_shutting_down");
  }
}

ImageRequest HttpServer::State::read_request(const Exchange& exchange) const {
  check_admissible(exchange);
  return read_image_request(exchange.body, model);
}

int64_t HttpServer::State::random_seed() {
  std::lock_guard lock(seeds_mutex);
  // Below 2^53, so that a JavaScript client reads the seed back exactly.
  return static_cast<int64_t>(seeds() >> 11);
}

generate::PromptRequest HttpServer::State::prompt_of(const ImageRequest& request,
                                                     std::shared_ptr<const generate::PromptImage> image_prompt) {
  auto prompt = to_prompt_request(request, pipeline.request(request.prompt), random_seed());
  prompt.image_prompt = std::move(image_prompt);
  try {
    pipeline.check(prompt);  // what the model itself refuses (a BART prior's filters, say)
  } catch (const Error& error) {
    throw ApiError(400, error.what(), "", "invalid_value");
  }
  prompt.preview_every = request.preview_every(model);
  return prompt;
}

std::shared_ptr<Job> HttpServer::State::admit(generate::PromptRequest prompt,
                                              std::function<void(const std::shared_ptr<Job>&)> on_change) {
  Scheduler::Refusal refusal = Scheduler::Refusal::none;
  auto job = scheduler.submit(std::move(prompt), refusal, std::move(on_change));
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
  return answer_with_job(exchange, request, prompt_of(request));
}

MHD_Result HttpServer::State::edits(const std::shared_ptr<Exchange>& exchange) {
  check_admissible(*exchange);
  if (!exchange->oversized_field.empty()) {
    const auto& name = exchange->oversized_field;
    throw ApiError(413, "Invalid '" + name + "': larger than this server takes (" +
                            std::to_string(is_file_field(name) ? config.max_image_bytes : config.max_body_bytes) +
                            " bytes).", name, "request_too_large");
  }
  if (exchange->form_unreadable) throw ApiError(400, "The multipart form could not be read.", "", "invalid_body");
  auto edit = read_edit_request(exchange->form, model);
  exchange->form.clear();
  auto prompt = prompt_of(edit.request, std::make_shared<const generate::PromptImage>(std::move(edit.image_prompt)));
  return answer_with_job(exchange, edit.request, std::move(prompt));
}

MHD_Result HttpServer::State::answer_with_job(const std::shared_ptr<Exchange>& exchange, const ImageRequest& request,
                                              generate::PromptRequest prompt) {
  if (request.stream) return stream(exchange, request, std::move(prompt));
  {
    // Held until the connection is parked: the job's answer cannot come before.
    std::lock_guard lock(exchange->mutex);
    exchange->request = request;
    exchange->deadline = exchange->arrived + std::chrono::duration_cast<Clock::duration>(
                                                 std::chrono::duration<double>(config.request_timeout_seconds));
    std::weak_ptr<Exchange> weak = exchange;
    exchange->job = admit(std::move(prompt), [this, weak](const std::shared_ptr<Job>& job) {
      post([this, weak, job] {
        if (auto exchange = weak.lock()) settle(exchange, job);
      });
    });
    exchange->park();
  }
  std::lock_guard lock(waiting_mutex);
  waiting.insert(exchange);
  return MHD_YES;
}

MHD_Result HttpServer::State::stream(const std::shared_ptr<Exchange>& exchange, const ImageRequest& request,
                                     generate::PromptRequest prompt) {
  {
    std::lock_guard lock(exchange->mutex);
    exchange->streaming = true;
    exchange->request = request;
    exchange->deadline = exchange->arrived + std::chrono::duration_cast<Clock::duration>(
                                                 std::chrono::duration<double>(config.request_timeout_seconds));
    exchange->last_event = Clock::now();
    std::weak_ptr<Exchange> weak = exchange;
    exchange->job = admit(std::move(prompt), [this, weak](const std::shared_ptr<Job>& job) {
      post([this, weak, job] {
        if (auto exchange = weak.lock()) settle(exchange, job);
      });
    });
  }
  {
    std::lock_guard lock(waiting_mutex);
    waiting.insert(exchange);
  }
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
  auto prompt = prompt_of(request);
  prompt.preview_every = 0;
  const auto id = random_id();
  if (!jobs.add(id)) {
    throw ApiError(429, "The server keeps " + std::to_string(config.max_stored_jobs) +
                            " unfinished jobs at most. Try again once some have finished.",
                   "", "rate_limit_exceeded", "requests");
  }
  std::shared_ptr<Job> job;
  try {
    job = admit(std::move(prompt), [this, id, host = exchange.host, request](const std::shared_ptr<Job>& job) {
      post([this, id, host, request, job] { settle_stored(id, host, request, job); });
    });
  } catch (...) {
    jobs.remove(id);
    throw;
  }
  jobs.attach(id, job);
  auto answer = json_answer(202, job_object(*jobs.find(id)).dump());
  answer.headers.emplace_back("Location", std::string(kJobs) + "/" + id);
  return answer;
}

Answer HttpServer::State::job(const Exchange& exchange, const std::string& id) {
  authorize(exchange);
  auto stored = exchange.method == "DELETE" ? jobs.cancel(id) : jobs.find(id);
  if (!stored) throw ApiError(404, "No such job: it expired, or was never made here.", "", "job_not_found");
  if (exchange.method == "DELETE" && stored->job) scheduler.cancel(stored->job);
  return json_answer(200, job_object(*stored).dump());
}

json HttpServer::State::job_object(const StoredJob& stored) {
  json object = {{"id", stored.id}, {"object", "image.job"}, {"created", stored.created}};
  if (stored.cancelled) {
    object["status"] = "cancelled";
  } else if (stored.ended) {
    object["status"] = stored.error.empty() ? "succeeded" : "failed";
    if (stored.error.empty()) {
      object["result"] = json::parse(stored.answer);
    } else {
      object["error"] = json::parse(stored.error)["error"];
    }
  } else {
    const auto progress = stored.job ? scheduler.progress(stored.job) : Scheduler::Progress{};
    object["status"] = progress.state == Job::State::queued ? "queued" : "in_progress";
    if (progress.queue_position >= 0) object["queue_position"] = progress.queue_position;
  }
  return object;
}

void HttpServer::State::settle_stored(const std::string& id, const std::string& host, const ImageRequest& request,
                                      const std::shared_ptr<Job>& job) {
  if (scheduler.progress(job).state != Job::State::done) return;
  if (!job->error.empty()) {
    jobs.end(id, "", generation_error(job->error).json());
    return;
  }
  if (jobs.end(id, answer_json(host, request, *job).dump(), "")) log_answered(request, *job, job->admitted);
}

// ---- the responder thread

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
  const bool done = progress.state == Job::State::done;
  if (exchange->streaming) {
    auto events = stream_events(*exchange, *job, progress);
    std::lock_guard lock(exchange->mutex);
    if (!exchange->waiting()) return;
    exchange->previews_seen = seen + progress.previews.size();
    exchange->events += events;
    exchange->stream_ended = done;
    exchange->last_event = Clock::now();
    exchange->wake();
  } else if (done) {
    auto answer = job->error.empty() ? json_answer(200, answer_json(exchange->host, exchange->request, *job).dump())
                                     : error_answer(generation_error(job->error));
    std::lock_guard lock(exchange->mutex);
    if (!exchange->waiting()) return;
    exchange->answer = std::move(answer);
    exchange->wake();
  }
  if (done && job->error.empty()) log_answered(exchange->request, *job, exchange->arrived);
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
  const auto settings = pipeline.config_of(job.request);
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
  std::vector<std::shared_ptr<Exchange>> watched;
  {
    std::lock_guard lock(waiting_mutex);
    watched.assign(waiting.begin(), waiting.end());
  }
  const auto now = Clock::now();
  for (const auto& exchange : watched) {
    std::lock_guard lock(exchange->mutex);
    if (!exchange->waiting()) continue;
    if (now >= exchange->deadline) {
      scheduler.cancel(exchange->job);
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
      scheduler.cancel(exchange->job);
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
  std::lock_guard lock(waiting_mutex);
  for (const auto& exchange : waiting) {
    std::lock_guard exchange_lock(exchange->mutex);
    exchange->dropped = true;
    exchange->wake();
  }
}

// ---- answers

json HttpServer::State::model_object() const {
  return {{"id", model.id}, {"object", "model"}, {"created", started}, {"owned_by", "dalle"}};
}

std::string HttpServer::State::base_url(const std::string& host) const {
  // The address the client used, when its Host header is a plain host[:port].
  static const std::regex plain_host(R"([A-Za-z0-9.\-]+(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?)");
  if (!host.empty() && host.size() < 256 && std::regex_match(host, plain_host)) return "http://" + host;
  return "http://" + config.host + ":" + std::to_string(port);
}

json HttpServer::State::answer_json(const std::string& host, const ImageRequest& request, const Job& job) {
  const auto settings = pipeline.config_of(job.request);
  json data = json::array();
  for (const auto& image : job.images) {
    auto png = generate::encode_generated_png(settings, image);
    if (request.response_format == "b64_json") {
      data.push_back({{"b64_json", base64(png)}});
    } else {
      data.push_back({{"url", base_url(host) + "/v1/images/" + images.put(std::move(png)) + ".png"}});
    }
  }
  return {{"created", std::time(nullptr)}, {"data", std::move(data)}};
}

void HttpServer::State::log_answered(const ImageRequest& request, const Job& job, Clock::time_point arrived) {
  const auto seconds = std::chrono::duration<double>(Clock::now() - arrived).count();
  metrics.count_images(static_cast<int64_t>(job.images.size()));
  metrics.observe_request_seconds(seconds);
  log::info("serve: ", job.images.size(), " images for ", excerpt(request.prompt), " in ", seconds,
            " s (generated with ", job.batched_with - 1, " other requests in ", job.generation_seconds, " s)",
            request.stream ? ", streamed" : "");
}

// ---- the server

HttpServer::HttpServer(const ServeConfig& config, generate::Pipeline& pipeline, std::string model_id,
                       std::string api_key)
    : state_(std::make_unique<State>(config, pipeline, std::move(model_id), std::move(api_key))) {}

HttpServer::~HttpServer() = default;

int HttpServer::bind() {
  auto& s = *state_;
  const std::string where = s.config.host + ":" + std::to_string(s.config.port);
  const auto room = make_room_for(s.config.max_connections);
  if (room < s.config.max_connections) {
    throw Error("max_connections " + std::to_string(s.config.max_connections) +
                " needs more open files than this process may have (ulimit -n); lower it to " +
                std::to_string(std::max<int64_t>(room, 1)) + " or raise the limit");
  }
  addrinfo hints{.ai_flags = AI_PASSIVE | AI_NUMERICSERV, .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
  addrinfo* found = nullptr;
  if (getaddrinfo(s.config.host.c_str(), std::to_string(s.config.port).c_str(), &hints, &found) != 0 || !found) {
    throw Error("cannot listen on " + where + ": not an address of this machine");
  }
  sockaddr_storage address{};
  std::memcpy(&address, found->ai_addr, found->ai_addrlen);
  freeaddrinfo(found);
  unsigned flags = MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
  if (address.ss_family == AF_INET6) flags |= MHD_USE_IPv6;
  s.daemon = MHD_start_daemon(
      flags, 0, State::on_accept, &s, State::on_request, &s, MHD_OPTION_SOCK_ADDR, &address,
      // The table refuses over the cap; this margin lets it see (and count) the one refused.
      MHD_OPTION_CONNECTION_LIMIT, static_cast<unsigned>(s.config.max_connections + 16),
      MHD_OPTION_CONNECTION_TIMEOUT, static_cast<unsigned>(s.config.idle_timeout_seconds),
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, kConnectionMemory, MHD_OPTION_LISTEN_BACKLOG_SIZE,
      static_cast<unsigned>(SOMAXCONN), MHD_OPTION_NOTIFY_COMPLETED, State::on_completed, &s,
      MHD_OPTION_NOTIFY_CONNECTION, State::on_connection, &s, MHD_OPTION_EXTERNAL_LOGGER, State::on_log, &s,
      MHD_OPTION_END);
  if (!s.daemon) throw Error("cannot listen on " + where + " (in use, or not an address of this machine)");
  const auto* info = MHD_get_daemon_info(s.daemon, MHD_DAEMON_INFO_BIND_PORT);
  s.port = info ? info->port : static_cast<int>(s.config.port);
  return s.port;
}

void HttpServer::listen() {
  auto& s = *state_;
  {
    std::unique_lock lock(s.waiting_mutex);
    s.waiting_changed.wait(lock, [&] { return s.stop_requested; });
  }
  s.drop_waiting();
  MHD_stop_daemon(s.daemon);
  s.daemon = nullptr;
}

void HttpServer::drain_and_stop() {
  auto& s = *state_;
  log::info("serve: draining: new image requests are refused; ", s.scheduler.queued() + s.scheduler.running(),
            " admitted ones finish first");
  s.scheduler.drain();
  // Their answers go out before the loop stops; a client that does not take its answer
  // within a grace period is not waited for.
  std::unique_lock lock(s.waiting_mutex);
  s.waiting_changed.wait_for(lock, std::chrono::seconds(30), [&] { return s.waiting.empty(); });
  s.stop_requested = true;
  s.waiting_changed.notify_all();
}

}  // namespace dalle::serve
