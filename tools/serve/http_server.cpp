#include "serve/http_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <chrono>
#include <ctime>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <thread>
#include <utility>

#include "dalle/data/image.h"
#include "dalle/input_limits.h"
#include "dalle/log.h"
#include "serve/api_error.h"
#include "serve/connection_socket.h"
#include "serve/image_request.h"
#include "serve/image_store.h"
#include "serve/metrics.h"
#include "serve/scheduler.h"
#include "serve/web_page.h"

namespace dalle::serve {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr const char* kJson = "application/json";
constexpr const char* kGenerations = "/v1/images/generations";
// A status of our own, as nginx's: the client left before its answer.
constexpr int kClientClosedRequest = 499;

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

void answer_json(httplib::Response& res, int status, const std::string& body) {
  res.status = status;
  res.set_content(body, kJson);
}

void answer_error(httplib::Response& res, const ApiError& error) {
  answer_json(res, error.status(), error.json());
  if (error.status() == 429 || error.status() == 503) res.set_header("Retry-After", "1");
}

// The route a request took, for the metrics' labels: a bounded set whatever clients ask.
std::string endpoint_of(const httplib::Request& req) {
  for (const char* route : {kGenerations, "/v1/models", "/health", "/metrics", "/"}) {
    if (req.path == route) return route;
  }
  if (req.path.rfind("/v1/models/", 0) == 0) return "/v1/models/{model}";
  if (req.path.rfind("/v1/images/", 0) == 0) return "/v1/images/{id}.png";
  return "other";
}

// The methods a known route takes ("" for an unknown one): httplib answers 404 to a known
// route asked with another method, which becomes 405 with Allow.
std::string allowed_methods(const std::string& path) {
  static const std::regex get_routes(R"(/v1/models(/.+)?|/v1/images/[0-9a-f]{32}\.png|/health|/metrics|/)");
  if (path == kGenerations) return "POST";
  return std::regex_match(path, get_routes) ? "GET, HEAD" : "";
}

// What httplib answers by itself (a malformed request, an unknown route, a body over the
// limit) gets OpenAI's error body.
std::string default_error_message(const httplib::Request& req, int status, int64_t max_body_bytes) {
  switch (status) {
    case 404:
      return "Invalid URL (" + req.method + " " + excerpt(req.path) + ")";
    case 413:
      return "The request body is larger than this server takes (" + std::to_string(max_body_bytes) + " bytes).";
    case 400:
      return "Malformed HTTP request.";
    default:
      return "The server could not answer the request (HTTP " + std::to_string(status) + ").";
  }
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

}  // namespace

struct HttpServer::State {
  State(const ServeConfig& config, generate::Pipeline& pipeline, std::string model_id, std::string api_key);

  void route();
  bool authorized(const httplib::Request& req, httplib::Response& res) const;
  void generations(const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader);
  std::string read_body(const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader);
  std::shared_ptr<Job> admit(const ImageRequest& request);
  json answer(const httplib::Request& req, const ImageRequest& request, const Job& job);
  // Answers `job` as server-sent events (`stream`): each candidate's partial images as it is
  // drawn, then each kept image; what fails after the first event comes as an `error` event.
  void stream(const httplib::Request& req, httplib::Response& res, const ImageRequest& request,
              const std::shared_ptr<Job>& job, Clock::time_point arrived);
  // Writes the job's events to `sink` until it is done; false when the client left.
  bool stream_events(httplib::DataSink& sink, const ConnectionSocket& connection, const ImageRequest& request,
                     const std::shared_ptr<Job>& job, Clock::time_point deadline);
  Clock::time_point deadline_of(Clock::time_point arrived) const {
    return arrived +
           std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(config.request_timeout_seconds));
  }
  void log_answered(const ImageRequest& request, const Job& job, Clock::time_point arrived);
  std::string base_url(const httplib::Request& req) const;
  json model_object() const;
  int64_t random_seed();

  ServeConfig config;
  generate::Pipeline& pipeline;
  ServedModel model;
  std::string api_key;
  Metrics metrics;
  ImageStore images;
  Scheduler scheduler;
  httplib::Server http;
  std::time_t started = std::time(nullptr);
  std::mutex seeds_mutex;
  std::mt19937_64 seeds{std::random_device{}()};
  int port = 0;
};

HttpServer::State::State(const ServeConfig& config_, generate::Pipeline& pipeline_, std::string model_id,
                         std::string api_key_)
    : config(config_),
      pipeline(pipeline_),
      api_key(std::move(api_key_)),
      images(std::chrono::seconds(config_.image_ttl_seconds), config_.max_stored_images),
      scheduler([&pipeline_](const std::vector<generate::PromptRequest>& requests,
                             const generate::PreviewCallback& on_preview) { return pipeline_.generate(requests, on_preview); },
                {.max_queue = config_.max_queue,
                 .batch_window = std::chrono::milliseconds(config_.batch_window_ms),
                 .batch_rows = pipeline_.config().batch_size}) {
  model = {.id = std::move(model_id),
           .plain_size = pipeline.image_size(false),
           .superres_size = pipeline.config().superres.empty() ? 0 : pipeline.image_size(true),
           .image_tokens = pipeline.image_tokens(),
           .has_clip = !pipeline.config().clip.empty(),
           .default_candidates = pipeline.config().candidates,
           .max_n = config.max_n,
           .max_candidates = config.max_candidates,
           .max_prompt_length = config.max_prompt_length};
  route();
}

int64_t HttpServer::State::random_seed() {
  std::lock_guard lock(seeds_mutex);
  // Below 2^53, so that a JavaScript client reads the seed back exactly.
  return static_cast<int64_t>(seeds() >> 11);
}

bool HttpServer::State::authorized(const httplib::Request& req, httplib::Response& res) const {
  if (api_key.empty()) return true;
  const auto header = req.get_header_value("Authorization");
  const std::string scheme = "Bearer ";
  if (header.rfind(scheme, 0) == 0 && same_secret(std::string_view(header).substr(scheme.size()), api_key)) {
    return true;
  }
  answer_error(res, ApiError(401,
                             header.empty() ? "You didn't provide an API key. Send it as `Authorization: Bearer <key>`."
                                            : "Incorrect API key provided.",
                             "", "invalid_api_key"));
  return false;
}

json HttpServer::State::model_object() const {
  return {{"id", model.id}, {"object", "model"}, {"created", started}, {"owned_by", "dalle"}};
}

std::string HttpServer::State::base_url(const httplib::Request& req) const {
  // The address the client used, when its Host header is a plain host[:port].
  static const std::regex plain_host(R"([A-Za-z0-9.\-]+(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?)");
  const auto host = req.get_header_value("Host");
  if (!host.empty() && host.size() < 256 && std::regex_match(host, plain_host)) return "http://" + host;
  return "http://" + config.host + ":" + std::to_string(port);
}

void HttpServer::State::route() {
  http.new_task_queue = [threads = config.threads_for_connections()] {
    return new httplib::ThreadPool(static_cast<size_t>(threads));
  };
  http.set_payload_max_length(static_cast<size_t>(config.max_body_bytes));
  http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    metrics.count_response(endpoint_of(req), res.status);
    log::debug("serve: ", req.remote_addr, " ", req.method, " ", excerpt(req.path), " ", res.status);
  });
  http.set_error_handler(
      httplib::Server::HandlerWithResponse([this](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        const auto allowed = res.status == 404 ? allowed_methods(req.path) : "";
        if (!allowed.empty()) {
          res.set_header("Allow", allowed);
          answer_error(res, ApiError(405,
                                     "Invalid method for URL (" + req.method + " " + excerpt(req.path) +
                                         "); it takes " + allowed + ".",
                                     "", "method_not_allowed"));
          return httplib::Server::HandlerResponse::Handled;
        }
        res.set_content(error_json(res.status, default_error_message(req, res.status, config.max_body_bytes)), kJson);
        return httplib::Server::HandlerResponse::Handled;
      }));
  http.set_exception_handler([](const httplib::Request& req, httplib::Response& res, std::exception_ptr failure) {
    std::string message = "The server had an error while processing your request.";
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& error) {
      log::error("serve: ", req.method, " ", excerpt(req.path), ": ", error.what());
    } catch (...) {
    }
    answer_json(res, 500, error_json(500, message));
  });

  http.Post(kGenerations, [this](const httplib::Request& req, httplib::Response& res,
                                 const httplib::ContentReader& reader) { generations(req, res, reader); });
  http.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
    if (!authorized(req, res)) return;
    answer_json(res, 200, json{{"object", "list"}, {"data", json::array({model_object()})}}.dump());
  });
  http.Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
    if (!authorized(req, res)) return;
    if (req.matches[1] != model.id) {
      answer_error(res, ApiError(404, "The model `" + excerpt(req.matches[1].str()) + "` does not exist or you do not "
                                      "have access to it.", "model", "model_not_found"));
      return;
    }
    answer_json(res, 200, model_object().dump());
  });
  // No key asked: the id is the permission (128 random bits), as OpenAI's signed URLs are.
  http.Get(R"(/v1/images/([0-9a-f]{32})\.png)", [this](const httplib::Request& req, httplib::Response& res) {
    const auto png = images.get(req.matches[1]);
    if (!png) {
      answer_error(res, ApiError(404, "No such image: it expired, or was never made here.", "", "image_not_found"));
      return;
    }
    res.set_content(*png, "image/png");
  });
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    const bool draining = scheduler.draining();
    answer_json(res, draining ? 503 : 200,
                json{{"status", draining ? "draining" : "ok"},
                     {"model", model.id},
                     {"queued", scheduler.queued()},
                     {"generating", scheduler.running()}}
                    .dump());
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.prometheus_text(scheduler.queued(), scheduler.running(), scheduler.draining()),
                    "text/plain; version=0.0.4");
  });
  http.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(kWebPage, "text/html; charset=utf-8");
  });
}

std::string HttpServer::State::read_body(const httplib::Request& req, httplib::Response& res,
                                         const httplib::ContentReader& reader) {
  // A body declared too large is skipped by httplib (status 413); a chunked one is cut here,
  // as soon as it passes the limit, so that it never costs more memory than the limit.
  std::string body;
  bool too_large = false;
  const bool read = reader([&](const char* data, size_t length) {
    if (body.size() + length > static_cast<size_t>(config.max_body_bytes)) {
      too_large = true;
      return false;
    }
    body.append(data, length);
    return true;
  });
  if (too_large || res.status == 413) {
    if (too_large) res.set_header("Connection", "close");  // the rest of the body is left unread
    throw ApiError(413, default_error_message(req, 413, config.max_body_bytes), "", "request_too_large");
  }
  if (!read) throw ApiError(400, "The request body could not be read.", "", "invalid_body");
  return body;
}

std::shared_ptr<Job> HttpServer::State::admit(const ImageRequest& request) {
  auto prompt = to_prompt_request(request, pipeline.request(request.prompt), random_seed());
  try {
    pipeline.check(prompt);  // what the model itself refuses (a BART prior's filters, say)
  } catch (const Error& error) {
    throw ApiError(400, error.what(), "", "invalid_value");
  }
  prompt.preview_every = request.preview_every(model);
  Scheduler::Refusal refusal = Scheduler::Refusal::none;
  auto job = scheduler.submit(std::move(prompt), refusal);
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

json HttpServer::State::answer(const httplib::Request& req, const ImageRequest& request, const Job& job) {
  const auto settings = pipeline.config_of(job.request);
  json data = json::array();
  for (const auto& image : job.images) {
    auto png = generate::encode_generated_png(settings, image);
    if (request.response_format == "b64_json") {
      data.push_back({{"b64_json", base64(png)}});
    } else {
      data.push_back({{"url", base_url(req) + "/v1/images/" + images.put(std::move(png)) + ".png"}});
    }
  }
  return {{"created", std::time(nullptr)}, {"data", std::move(data)}};
}

void HttpServer::State::generations(const httplib::Request& req, httplib::Response& res,
                                    const httplib::ContentReader& reader) {
  const auto arrived = Clock::now();
  try {
    const auto body = read_body(req, res, reader);
    if (!authorized(req, res)) return;
    if (scheduler.draining()) {
      throw ApiError(503, "The server is shutting down and takes no new requests.", "", "server_shutting_down");
    }
    const auto request = read_image_request(body, model);
    const auto job = admit(request);
    if (request.stream) {
      stream(req, res, request, job, arrived);
      return;
    }
    const ConnectionSocket connection(req.local_addr, req.local_port, req.remote_addr, req.remote_port);
    const auto deadline = deadline_of(arrived);
    if (!scheduler.wait(job, deadline, [&] { return connection.client_gone(); })) {
      if (Clock::now() < deadline) {
        log::info("serve: a client left before its images were ready (", req.remote_addr, ")");
        res.status = kClientClosedRequest;
        return;
      }
      throw ApiError(504, "The request took longer than this server allows (" +
                              json(config.request_timeout_seconds).dump() + " s).", "", "timeout");
    }
    if (!job->error.empty()) throw ApiError(500, "Generation failed: " + job->error, "", "generation_failed");
    answer_json(res, 200, answer(req, request, *job).dump());
    log_answered(request, *job, arrived);
  } catch (const ApiError& error) {
    answer_error(res, error);
  }
}

void HttpServer::State::log_answered(const ImageRequest& request, const Job& job, Clock::time_point arrived) {
  const auto seconds = std::chrono::duration<double>(Clock::now() - arrived).count();
  metrics.count_images(static_cast<int64_t>(job.images.size()));
  metrics.observe_request_seconds(seconds);
  log::info("serve: ", job.images.size(), " images for ", excerpt(request.prompt), " in ", seconds,
            " s (generated with ", job.batched_with - 1, " other requests in ", job.generation_seconds, " s)",
            request.stream ? ", streamed" : "");
}

void HttpServer::State::stream(const httplib::Request& req, httplib::Response& res, const ImageRequest& request,
                               const std::shared_ptr<Job>& job, Clock::time_point arrived) {
  res.status = 200;
  res.set_header("Cache-Control", "no-cache");
  // The provider runs on this connection's thread once the handler returns, while httplib
  // still holds the connection open.
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, request, job, arrived, local = std::pair(req.local_addr, req.local_port),
       remote = std::pair(req.remote_addr, req.remote_port)](size_t, httplib::DataSink& sink) {
        const ConnectionSocket connection(local.first, local.second, remote.first, remote.second);
        if (stream_events(sink, connection, request, job, deadline_of(arrived))) {
          log_answered(request, *job, arrived);
        } else {
          log::info("serve: a client left its stream before its images were ready (", remote.first, ")");
        }
        sink.done();
        return true;
      });
}

bool HttpServer::State::stream_events(httplib::DataSink& sink, const ConnectionSocket& connection,
                                      const ImageRequest& request, const std::shared_ptr<Job>& job,
                                      Clock::time_point deadline) {
  const auto send = [&](const std::string& event) { return sink.write(event.data(), event.size()); };
  std::map<int64_t, int64_t> partials_sent;  // by candidate
  const auto send_previews = [&](const std::vector<generate::Preview>& previews) {
    for (const auto& preview : previews) {
      auto event = image_event(base64(data::encode_png(preview.image)), preview.image.size(-1));
      event["partial_image_index"] = partials_sent[preview.candidate]++;
      event["candidate"] = preview.candidate;
      if (!send(sse_event("image_generation.partial_image", std::move(event)))) return false;
    }
    return true;
  };
  if (!scheduler.wait(job, deadline, [&] { return connection.client_gone(); }, std::chrono::milliseconds(100),
                      send_previews)) {
    if (Clock::now() < deadline) return false;
    const ApiError timeout(504, "The request took longer than this server allows (" +
                                    json(config.request_timeout_seconds).dump() + " s).", "", "timeout");
    send(sse_event("error", json::parse(timeout.json())));
    return true;
  }
  if (!job->error.empty()) {
    send(sse_event("error", json::parse(ApiError(500, "Generation failed: " + job->error, "", "generation_failed").json())));
    return true;
  }
  const auto settings = pipeline.config_of(job->request);
  for (const auto& image : job->images) {
    auto event = image_event(base64(generate::encode_generated_png(settings, image)), image.image.size(-1));
    event["candidate"] = image.candidate;
    event["usage"] = {{"input_tokens", 0}, {"output_tokens", model.image_tokens}, {"total_tokens", model.image_tokens},
                      {"input_tokens_details", {{"text_tokens", 0}, {"image_tokens", 0}}}};
    if (!send(sse_event("image_generation.completed", std::move(event)))) return false;
  }
  return true;
}

HttpServer::HttpServer(const ServeConfig& config, generate::Pipeline& pipeline, std::string model_id,
                       std::string api_key)
    : state_(std::make_unique<State>(config, pipeline, std::move(model_id), std::move(api_key))) {}

HttpServer::~HttpServer() = default;

int HttpServer::bind() {
  auto& s = *state_;
  const int port = s.config.port == 0 ? s.http.bind_to_any_port(s.config.host)
                                      : (s.http.bind_to_port(s.config.host, static_cast<int>(s.config.port))
                                             ? static_cast<int>(s.config.port)
                                             : -1);
  if (port < 0) {
    throw Error("cannot listen on " + s.config.host + ":" + std::to_string(s.config.port) +
                " (in use, or not an address of this machine)");
  }
  s.port = port;
  // httplib's own backlog is 5: a burst of connections would be reset (connection_socket.h).
  if (!set_listen_backlog(port, SOMAXCONN)) {
    log::warn("serve: could not widen the listening socket's backlog from httplib's 5; a burst of more "
              "simultaneous connections may see some of them reset");
  }
  return port;
}

void HttpServer::listen() {
  if (!state_->http.listen_after_bind()) throw Error("the server stopped listening unexpectedly");
}

void HttpServer::drain_and_stop() {
  auto& s = *state_;
  // A signal right at the start may come before listen() runs, when stopping does nothing.
  for (int tries = 0; !s.http.is_running() && tries < 500; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  log::info("serve: draining: new image requests are refused; ", s.scheduler.queued() + s.scheduler.running(),
            " admitted ones finish first");
  s.scheduler.drain();
  // Stopping closes the listening socket; httplib's threads answer what they hold (the
  // drained requests' answers among it) before listen() returns.
  s.http.stop();
}

}  // namespace dalle::serve
