#include "serve/openai_answers.h"

#include <ctime>
#include <regex>

#include "serve/image_request.h"
#include "serve/server_state.h"

namespace dalle::serve {

namespace {

using nlohmann::json;

}  // namespace

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

Answer json_answer(int status, std::string body) {
  return {.status = status, .content_type = kJson, .body = std::move(body), .headers = {}};
}

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

ApiError answer_failed(const std::exception& why) {
  return ApiError(500, std::string("The images were made, but their answer could not be built: ") + why.what(), "",
                  "answer_failed");
}

ApiError over_memory_budget(int64_t bytes, int64_t limit, const std::string& what) {
  const auto megabytes = [](int64_t b) { return std::to_string((b + (1 << 20) - 1) >> 20) + " MB"; };
  if (bytes > limit) {
    return ApiError(413, what + " needs " + megabytes(bytes) + " of memory, more than this server's whole budget (" +
                             megabytes(limit) + ", max_memory_megabytes).", "", "request_too_large");
  }
  return ApiError(503, "The server is busy: " + what + " needs " + megabytes(bytes) +
                           " of memory, which its budget does not have free now. Try again shortly.",
                  "", "memory_budget_exceeded");
}

std::string sse_event(const std::string& type, json data) {
  data["type"] = type;
  return "event: " + type + "\ndata: " + data.dump() + "\n\n";
}

json image_event(std::string b64_png, int64_t side) {
  return {{"b64_json", std::move(b64_png)}, {"created_at", std::time(nullptr)}, {"size", side_by_side(side)},
          {"quality", "auto"}, {"background", "opaque"}, {"output_format", "png"}};
}

namespace {

// `object`'s JSON with `key` holding `raw`, JSON text kept as it is: a stored answer
// (megabytes of base64) is never parsed again.
std::string with_raw_field(const json& object, const std::string& key, const std::string& raw) {
  auto text = object.dump();
  text.pop_back();
  return text + ",\"" + key + "\":" + raw + "}";
}

}  // namespace

std::string HttpServer::State::job_object(const StoredJob& stored) {
  json object = {{"id", stored.id}, {"object", "image.job"}, {"created", stored.created}};
  if (stored.cancelled) {
    object["status"] = "cancelled";
  } else if (stored.ended) {
    object["status"] = stored.error.empty() ? "succeeded" : "failed";
    if (stored.error.empty()) return with_raw_field(object, "result", stored.answer);
    object["error"] = json::parse(stored.error)["error"];
  } else {
    const auto progress = stored.job ? scheduler.progress(stored.job) : Scheduler::Progress{};
    object["status"] = progress.state == Job::State::queued ? "queued" : "in_progress";
    if (progress.queue_position >= 0) object["queue_position"] = progress.queue_position;
    if (!stored.partial.empty()) return with_raw_field(object, "partial_images", stored.partial);
  }
  return object.dump();
}

json HttpServer::State::model_object() const {
  // Ours: the adapters a request may choose (its `adapters`).
  return {{"id", model.id},
          {"object", "model"},
          {"created", started},
          {"owned_by", "dalle"},
          {"adapters", model.adapters}};
}

std::string HttpServer::State::base_url(const std::string& host) const {
  // The address the client used, when its Host header is a plain host[:port].
  static const std::regex plain_host(R"([A-Za-z0-9.\-]+(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?)");
  if (!host.empty() && host.size() < 256 && std::regex_match(host, plain_host)) return "http://" + host;
  return "http://" + config.host + ":" + std::to_string(port);
}

json HttpServer::State::answer_json(const std::string& host, const ImageRequest& request, const Job& job) {
  const auto& settings = job.request.settings();
  json data = json::array();
  for (const auto& image : job.images) {
    auto png = generate::encode_generated_png(settings, image);
    // Ours beside OpenAI's field: what draws the image again (the PNG's metadata holds the rest).
    json item = {{"seed", image.seed}, {"candidate", image.candidate}};
    if (request.response_format == "b64_json") {
      item["b64_json"] = base64(png);
    } else {
      item["url"] = base_url(host) + "/v1/images/" + images.put(std::move(png)) + ".png";
    }
    data.push_back(std::move(item));
  }
  return {{"created", std::time(nullptr)}, {"data", std::move(data)}};
}

}  // namespace dalle::serve
