#pragma once
// Where a request to dalle-serve goes, read from its path by plain comparisons (no regular
// expression runs on what a client sends): the route, the id it names, the methods it takes,
// whether it needs the API key, and its label in the metrics (a bounded set whatever clients
// ask). A path longer than kMaxPathLength is refused (414) before anything else is read.
#include <cstddef>
#include <string>
#include <string_view>

namespace dalle::serve {

inline constexpr size_t kMaxPathLength = 2048;

enum class RouteKind { generations, edits, jobs, job, models, model, image, health, metrics, page, unknown };

struct Route {
  RouteKind kind = RouteKind::unknown;
  std::string id;  // a job's or an image's 32 hex digits, or the model named

  // "POST", "GET, HEAD", ...; empty for an unknown route.
  std::string allowed_methods() const;
  bool takes(std::string_view method) const;
  // Whether a request must carry the API key (the images by URL do not: their 128-bit id is
  // the permission, as OpenAI's signed URLs are).
  bool needs_key() const;
  std::string endpoint() const;
};

Route route_of(std::string_view path);

}  // namespace dalle::serve
