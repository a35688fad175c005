#include "serve/metrics.h"

#include <algorithm>
#include <sstream>

namespace dalle::serve {

using Clock = std::chrono::steady_clock;
constexpr auto kRateWindow = std::chrono::seconds(60);

Metrics::Metrics() : latency_counts_(latency_buckets().size() + 1, 0), start_(Clock::now()) {}

const std::vector<double>& Metrics::latency_buckets() {
  static const std::vector<double> buckets = {0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600};
  return buckets;
}

void Metrics::count_response(const std::string& endpoint, int status) {
  std::lock_guard lock(mutex_);
  ++responses_[{endpoint, status}];
}

void Metrics::count_images(int64_t images) {
  std::lock_guard lock(mutex_);
  images_ += images;
  const auto now = Clock::now();
  recent_images_.emplace_back(now, images);
  while (!recent_images_.empty() && recent_images_.front().first < now - kRateWindow) recent_images_.pop_front();
}

void Metrics::observe_request_seconds(double seconds) {
  std::lock_guard lock(mutex_);
  const auto& bounds = latency_buckets();
  const auto bucket = std::lower_bound(bounds.begin(), bounds.end(), seconds) - bounds.begin();
  ++latency_counts_[static_cast<size_t>(bucket)];
  latency_sum_ += seconds;
  ++latency_count_;
}

double Metrics::images_per_second() const {
  const auto now = Clock::now();
  int64_t images = 0;
  for (const auto& [at, count] : recent_images_) images += at >= now - kRateWindow ? count : 0;
  const auto span = std::min(std::chrono::duration<double>(kRateWindow).count(),
                             std::chrono::duration<double>(now - start_).count());
  return span > 0 ? static_cast<double>(images) / span : 0.0;
}

std::string Metrics::prometheus_text(int64_t queued, int64_t running, bool draining) const {
  std::lock_guard lock(mutex_);
  std::ostringstream out;
  out << "# HELP dalle_http_requests_total HTTP requests answered, by endpoint and status.\n"
      << "# TYPE dalle_http_requests_total counter\n";
  for (const auto& [key, count] : responses_) {
    out << "dalle_http_requests_total{endpoint=\"" << key.first << "\",status=\"" << key.second << "\"} " << count
        << "\n";
  }
  out << "# HELP dalle_queue_depth Image requests waiting for the model.\n# TYPE dalle_queue_depth gauge\n"
      << "dalle_queue_depth " << queued << "\n"
      << "# HELP dalle_requests_generating Image requests in the generate call under way.\n"
      << "# TYPE dalle_requests_generating gauge\ndalle_requests_generating " << running << "\n"
      << "# HELP dalle_draining 1 once a stop signal came: new requests are refused, queued ones finish.\n"
      << "# TYPE dalle_draining gauge\ndalle_draining " << (draining ? 1 : 0) << "\n"
      << "# HELP dalle_images_generated_total Images returned to clients.\n"
      << "# TYPE dalle_images_generated_total counter\ndalle_images_generated_total " << images_ << "\n"
      << "# HELP dalle_images_per_second Images generated per second over the last minute.\n"
      << "# TYPE dalle_images_per_second gauge\ndalle_images_per_second " << images_per_second() << "\n"
      << "# HELP dalle_image_request_seconds Time from an image request's arrival to its answer.\n"
      << "# TYPE dalle_image_request_seconds histogram\n";
  int64_t cumulative = 0;
  const auto& bounds = latency_buckets();
  for (size_t bucket = 0; bucket < latency_counts_.size(); ++bucket) {
    cumulative += latency_counts_[bucket];
    out << "dalle_image_request_seconds_bucket{le=\"";
    if (bucket < bounds.size()) {
      out << bounds[bucket];
    } else {
      out << "+Inf";
    }
    out << "\"} " << cumulative << "\n";
  }
  out << "dalle_image_request_seconds_sum " << latency_sum_ << "\n"
      << "dalle_image_request_seconds_count " << latency_count_ << "\n";
  return out.str();
}

std::string Metrics::connection_text(int64_t open, int64_t opened_total, int64_t refused_total,
                                     int64_t timed_out_total) {
  std::ostringstream out;
  out << "# HELP dalle_http_connections_open Connections open now, idle ones included.\n"
      << "# TYPE dalle_http_connections_open gauge\ndalle_http_connections_open " << open << "\n"
      << "# HELP dalle_http_connections_total Connections accepted.\n"
      << "# TYPE dalle_http_connections_total counter\ndalle_http_connections_total " << opened_total << "\n"
      << "# HELP dalle_http_connections_refused_total Connections closed at once: over max_connections or "
         "max_connections_per_client.\n"
      << "# TYPE dalle_http_connections_refused_total counter\ndalle_http_connections_refused_total "
      << refused_total << "\n"
      << "# HELP dalle_http_connections_timed_out_total Connections closed for taking too long over a request's "
         "headers or body.\n"
      << "# TYPE dalle_http_connections_timed_out_total counter\ndalle_http_connections_timed_out_total "
      << timed_out_total << "\n";
  return out.str();
}

std::string Metrics::memory_text(int64_t limit, int64_t used, int64_t refusals) {
  std::ostringstream out;
  out << "# HELP dalle_memory_budget_bytes What requests may hold at once (max_memory_megabytes), the models aside.\n"
      << "# TYPE dalle_memory_budget_bytes gauge\ndalle_memory_budget_bytes " << limit << "\n"
      << "# HELP dalle_memory_charged_bytes What requests, bodies, decodes, stored answers and images hold now.\n"
      << "# TYPE dalle_memory_charged_bytes gauge\ndalle_memory_charged_bytes " << used << "\n"
      << "# HELP dalle_memory_refusals_total Charges the budget refused (each a 503 or 413, or an old stored "
         "answer or image pushed out).\n"
      << "# TYPE dalle_memory_refusals_total counter\ndalle_memory_refusals_total " << refusals << "\n";
  return out.str();
}

}  // namespace dalle::serve
