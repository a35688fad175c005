#pragma once
// Errors as OpenAI's API answers them: an HTTP status and
// {"error": {"message", "type", "param", "code"}}, so that OpenAI's clients raise their own
// exception types (BadRequestError, AuthenticationError, NotFoundError, RateLimitError...).
#include <string>

#include "dalle/error.h"

namespace dalle::serve {

class ApiError : public Error {
 public:
  // `type` empty: the one OpenAI gives `status` (invalid_request_error below 500, server_error
  // from 500). `param` and `code` empty: null.
  ApiError(int status, const std::string& message, std::string param = "", std::string code = "",
           std::string type = "");
  int status() const { return status_; }
  const std::string& param() const { return param_; }
  const std::string& code() const { return code_; }
  // The response body.
  std::string json() const;

 private:
  int status_;
  std::string param_, code_, type_;
};

// The body of an error answer for a status and message: ApiError(status, message).json().
std::string error_json(int status, const std::string& message, const std::string& code = "");

}  // namespace dalle::serve
