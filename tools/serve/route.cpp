#include "serve/route.h"

#include <algorithm>

namespace dalle::serve {

namespace {

constexpr std::string_view kJobPrefix = "/v1/images/jobs/", kImagePrefix = "/v1/images/",
                           kModelPrefix = "/v1/models/", kPng = ".png";

// 128 random bits as the server writes them: 32 lowercase hex digits.
bool is_id(std::string_view text) {
  return text.size() == 32 &&
         std::all_of(text.begin(), text.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

bool starts_with(std::string_view text, std::string_view prefix) { return text.substr(0, prefix.size()) == prefix; }

}  // namespace

Route route_of(std::string_view path) {
  if (path == "/v1/images/generations") return {RouteKind::generations, ""};
  if (path == "/v1/images/edits") return {RouteKind::edits, ""};
  if (path == "/v1/images/jobs") return {RouteKind::jobs, ""};
  if (path == "/v1/models") return {RouteKind::models, ""};
  if (path == "/health") return {RouteKind::health, ""};
  if (path == "/metrics") return {RouteKind::metrics, ""};
  if (path == "/") return {RouteKind::page, ""};
  if (starts_with(path, kJobPrefix) && is_id(path.substr(kJobPrefix.size()))) {
    return {RouteKind::job, std::string(path.substr(kJobPrefix.size()))};
  }
  if (starts_with(path, kModelPrefix) && path.size() > kModelPrefix.size()) {
    return {RouteKind::model, std::string(path.substr(kModelPrefix.size()))};
  }
  if (starts_with(path, kImagePrefix) && path.size() == kImagePrefix.size() + 32 + kPng.size() &&
      path.substr(path.size() - kPng.size()) == kPng && is_id(path.substr(kImagePrefix.size(), 32))) {
    return {RouteKind::image, std::string(path.substr(kImagePrefix.size(), 32))};
  }
  return {};
}

std::string Route::allowed_methods() const {
  switch (kind) {
    case RouteKind::generations:
    case RouteKind::edits:
    case RouteKind::jobs:
      return "POST";
    case RouteKind::job:
      return "GET, HEAD, DELETE";
    case RouteKind::unknown:
      return "";
    default:
      return "GET, HEAD";
  }
}

bool Route::takes(std::string_view method) const {
  const auto allowed = allowed_methods();
  for (size_t start = 0; start < allowed.size();) {
    const auto end = std::min(allowed.find(", ", start), allowed.size());
    if (std::string_view(allowed).substr(start, end - start) == method) return true;
    start = end + 2;
  }
  return false;
}

bool Route::needs_key() const {
  switch (kind) {
    case RouteKind::generations:
    case RouteKind::edits:
    case RouteKind::jobs:
    case RouteKind::job:
    case RouteKind::models:
    case RouteKind::model:
      return true;
    default:
      return false;
  }
}

std::string Route::endpoint() const {
  switch (kind) {
    case RouteKind::generations: return "/v1/images/generations";
    case RouteKind::edits: return "/v1/images/edits";
    case RouteKind::jobs: return "/v1/images/jobs";
    case RouteKind::job: return "/v1/images/jobs/{id}";
    case RouteKind::models: return "/v1/models";
    case RouteKind::model: return "/v1/models/{model}";
    case RouteKind::image: return "/v1/images/{id}.png";
    case RouteKind::health: return "/health";
    case RouteKind::metrics: return "/metrics";
    case RouteKind::page: return "/";
    case RouteKind::unknown: break;
  }
  return "other";
}

}  // namespace dalle::serve
