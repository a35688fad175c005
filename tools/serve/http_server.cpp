#include "serve/http_server.h"

#include <microhttpd.h>
#include <netdb.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdarg>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>

#include "dalle/input_limits.h"
#include "dalle/log.h"
#include "dalle/models/adapter.h"
#include "serve/api_error.h"
#include "serve/client_address.h"
#include "serve/edit_request.h"
#include "serve/route.h"
#include "serve/server_state.h"
#include "serve/web_page.h"

namespace dalle::serve {

namespace {

using nlohmann::json;

// Per connection: the request line, headers and read buffer (libmicrohttpd's default).
constexpr size_t kConnectionMemory = 32 * 1024;

std::string numeric_address(const sockaddr* address) {
  char host[NI_MAXHOST];
  const socklen_t length = address->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  if (getnameinfo(address, length, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) return "?";
  return host;
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

HttpServer::State::State(const ServeConfig& config_, generate::Pipeline& pipeline_, std::string model_id,
                         std::string api_key_)
    : config(config_),
      pipeline(pipeline_),
      api_key(std::move(api_key_)),
      budget(config_.max_memory_megabytes > 0 ? config_.max_memory_megabytes << 20 : default_memory_budget_bytes()),
      images(std::chrono::seconds(config_.image_ttl_seconds), config_.max_stored_images, &budget),
      jobs(std::chrono::seconds(config_.image_ttl_seconds), config_.max_stored_jobs, &budget),
      trusted_proxies(config_.trusted_proxies.begin(), config_.trusted_proxies.end()),
      connections({.max_connections = config_.max_connections,
                   .max_per_client = config_.max_connections_per_client,
                   .unbounded_clients = trusted_proxies,
                   .header_timeout = std::chrono::milliseconds(static_cast<int64_t>(config_.header_timeout_seconds * 1000)),
                   .body_timeout = std::chrono::milliseconds(static_cast<int64_t>(config_.body_timeout_seconds * 1000))}),
      scheduler([&pipeline_](const std::vector<generate::PreparedRequest>& requests,
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
           .max_prompt_length = config.max_prompt_length,
           .adapters = {}};
  for (const auto& spec : pipeline.config().named_adapters) {
    model.adapters.push_back(models::parse_named_adapter(spec).name);
  }
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
  if (exchange.too_large || exchange.refusal) return;
  const auto held = static_cast<int64_t>(exchange.body_bytes);
  if (held > exchange.body_charge.bytes() && !exchange.body_charge.grow(held - exchange.body_charge.bytes())) {
    exchange.refusal = over_memory_budget(held, budget.limit(), "the request's body");
    exchange.body = std::string();
    exchange.form.clear();
    return;
  }
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
  exchange->route = route_of(exchange->path);
  exchange->endpoint = exchange->route.endpoint();
  exchange->host = header(connection, "Host");
  exchange->authorization = header(connection, "Authorization");
  if (const auto* socket = MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD)) {
    exchange->socket = socket->connect_fd;
  }
  if (const auto* address = MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CLIENT_ADDRESS)) {
    exchange->client = client_address(numeric_address(address->client_addr), header(connection, "X-Forwarded-For"),
                                      trusted_proxies);
  }
  *context = new std::shared_ptr<Exchange>(exchange);
  connections.headers_read(connection);
  // Decided from the request line and headers: a refused request's body is read and dropped,
  // never kept.
  exchange->refusal = refusal(*exchange);
  if (!exchange->refusal && exchange->route.kind == RouteKind::edits && exchange->method == "POST") {
    exchange->limits = &config;
    exchange->form_reader = MHD_create_post_processor(connection, 64 * 1024, read_form, exchange.get());
    if (!exchange->form_reader) {
      exchange->read = true;
      return send(*exchange, error_answer(ApiError(400, "POST /v1/images/edits takes a multipart/form-data body "
                                                        "(OpenAI's form: image, mask, prompt...).", "",
                                                   "invalid_content_type")));
    }
  }
  // A refused body, or one declared too large, is read and dropped (body_timeout_seconds
  // bounds that), then refused: a client that sends it whole reads the answer only after. One
  // that waits for `100 Continue` is refused at once (the connection then closes).
  const auto length = header(connection, "Content-Length");
  if (!length.empty() && (length.size() > 18 || std::stoll(length) > body_limit(*exchange))) {
    exchange->too_large = true;
  }
  exchange->body_charge = budget.open();
  if (!exchange->refusal && !exchange->too_large && !length.empty()) {
    // A declared body is charged before a byte of it comes; a chunked one as it comes.
    const auto declared = std::stoll(length);
    if (!exchange->body_charge.grow(declared)) {
      exchange->refusal = over_memory_budget(declared, budget.limit(), "the request's body");
    } else if (!exchange->form_reader) {
      exchange->body.reserve(static_cast<size_t>(declared));  // one allocation, never regrown
    }
  }
  if ((exchange->refusal || exchange->too_large) && !header(connection, "Expect").empty()) {
    exchange->read = true;
    return send(*exchange, refused_answer(*exchange));
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

std::optional<ApiError> HttpServer::State::refusal(const Exchange& exchange) const {
  const auto& path = exchange.path;
  if (path.size() > kMaxPathLength) {
    return ApiError(414, "The URL is longer than this server takes (" + std::to_string(kMaxPathLength) + " bytes).",
                    "", "uri_too_long");
  }
  const auto& route = exchange.route;
  if (route.kind == RouteKind::unknown) {
    return ApiError(404, "Invalid URL (" + exchange.method + " " + excerpt(path) + ")");
  }
  if (!route.takes(exchange.method)) {
    return ApiError(405, "Invalid method for URL (" + exchange.method + " " + excerpt(path) + "); it takes " +
                             route.allowed_methods() + ".", "", "method_not_allowed");
  }
  if (!route.needs_key()) return std::nullopt;
  try {
    authorize(exchange);
  } catch (const ApiError& error) {
    return error;
  }
  return std::nullopt;
}

Answer HttpServer::State::refused_answer(const Exchange& exchange) const {
  if (!exchange.refusal) return error_answer(body_too_large(exchange));
  auto answer = error_answer(*exchange.refusal);
  if (exchange.refusal->status() == 405) answer.headers.emplace_back("Allow", exchange.route.allowed_methods());
  return answer;
}

MHD_Result HttpServer::State::route(const std::shared_ptr<Exchange>& exchange) {
  if (exchange->refusal || exchange->too_large) return send(*exchange, refused_answer(*exchange));
  switch (exchange->route.kind) {
    case RouteKind::generations: return generations(exchange);
    case RouteKind::edits: return edits(exchange);
    case RouteKind::jobs: return send(*exchange, submit_job(*exchange));
    case RouteKind::job: return send(*exchange, job(*exchange, exchange->route.id));
    default: return send(*exchange, get(*exchange));
  }
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
                                             counts.timed_out_total) +
                    Metrics::memory_text(budget.limit(), budget.used(), budget.refusals()),
            .headers = {}};
  }
  if (path == "/") return {.content_type = "text/html; charset=utf-8", .body = kWebPage, .headers = {}};
  const auto& route = exchange.route;
  if (route.kind == RouteKind::image) {
    auto png = images.get(route.id);
    if (!png) throw ApiError(404, "No such image: it expired, or was never made here.", "", "image_not_found");
    return {.content_type = "image/png", .body = std::move(*png), .headers = {}};
  }
  if (route.kind == RouteKind::models) {
    return json_answer(200, json{{"object", "list"}, {"data", json::array({model_object()})}}.dump());
  }
  const auto& id = route.id;
  if (id != model.id) {
    throw ApiError(404, "The model `" + excerpt(id) + "` does not exist or you do not have access to it.", "model",
                   "model_not_found");
  }
  return json_answer(200, model_object().dump());
}

MHD_Result HttpServer::State::resumed(const std::shared_ptr<Exchange>& exchange) {
  std::unique_lock lock(exchange->mutex);
  if (exchange->dropped) return MHD_NO;
  if (!exchange->answer && exchange->streaming && (exchange->stream_ready || exchange->stream_ended)) {
    lock.unlock();  // an edit admitted (or past its deadline) off the loop: its stream starts here
    return stream(exchange);
  }
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
  state.waiting.leave(exchange);
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
  addrinfo hints{};
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
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
    std::unique_lock lock(s.stop_mutex);
    s.stop_changed.wait(lock, [&] { return s.stop_requested; });
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
  s.waiting.wait_until_empty(std::chrono::seconds(30));
  std::lock_guard lock(s.stop_mutex);
  s.stop_requested = true;
  s.stop_changed.notify_all();
}

}  // namespace dalle::serve
