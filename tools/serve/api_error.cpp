#include "serve/api_error.h"

#include <nlohmann/json.hpp>
#include <utility>

namespace dalle::serve {

namespace {

nlohmann::json null_if_empty(const std::string& text) { return text.empty() ? nlohmann::json() : nlohmann::json(text); }

}  // namespace

ApiError::ApiError(int status, const std::string& message, std::string param, std::string code, std::string type)
    : Error(message), status_(status), param_(std::move(param)), code_(std::move(code)), type_(std::move(type)) {
  if (type_.empty()) type_ = status_ >= 500 ? "server_error" : "invalid_request_error";
}

std::string ApiError::json() const {
  const nlohmann::json body = {{"error",
                                {{"message", what()},
                                 {"type", type_},
                                 {"param", null_if_empty(param_)},
                                 {"code", null_if_empty(code_)}}}};
  // Replace, not throw, on invalid UTF-8: a message may quote what a client sent.
  return body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string error_json(int status, const std::string& message, const std::string& code) {
  return ApiError(status, message, "", code).json();
}

}  // namespace dalle::serve
