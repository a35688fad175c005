#pragma once
// dalle-serve's answers in OpenAI's shapes, built off the event loop: an HTTP answer, the
// error answers, an image's PNG as base64, and the server-sent events of a stream. The answers
// that read the server's state (a job object, a generation's JSON) are HttpServer::State's, in
// openai_answers.cpp with these.
#include <cstdint>
#include <exception>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "serve/api_error.h"

namespace dalle::serve {

inline constexpr const char* kJson = "application/json";

// What goes back on a connection: built off the event loop, sent by it.
struct Answer {
  int status = 200;
  std::string content_type = kJson;
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
};

Answer json_answer(int status, std::string body);
// `error`'s JSON under its status; 429 and 503 say when to try again.
Answer error_answer(const ApiError& error);
ApiError timeout_error(double seconds);
ApiError generation_error(const std::string& why);
// The images were made but their answer could not be built (encoding them failed).
ApiError answer_failed(const std::exception& why);
// A request that needs `bytes` of the memory budget (max_memory_megabytes) of `limit`: 503
// while others hold it, 413 when it alone is larger.
ApiError over_memory_budget(int64_t bytes, int64_t limit, const std::string& what);

std::string base64(std::string_view bytes);
// One server-sent event as OpenAI's streams send them: its type twice, as the event's name
// and in the data.
std::string sse_event(const std::string& type, nlohmann::json data);
// The fields OpenAI's image stream events share, for an image of `side` pixels.
nlohmann::json image_event(std::string b64_png, int64_t side);

}  // namespace dalle::serve
