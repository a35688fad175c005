#pragma once
// dalle-serve's counters in Prometheus' text format (GET /metrics): answers by endpoint and
// status, images generated and their recent rate, and a histogram of how long image requests
// took from arrival to answer. Safe to update from every connection's thread.
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace dalle::serve {

class Metrics {
 public:
  Metrics();
  void count_response(const std::string& endpoint, int status);
  void count_images(int64_t images);
  void observe_request_seconds(double seconds);
  // The text, with the gauges the caller reads at that moment.
  std::string prometheus_text(int64_t queued, int64_t running, bool draining) const;

  // The connection gauges and counters, in the same format (appended to prometheus_text).
  static std::string connection_text(int64_t open, int64_t opened_total, int64_t refused_total,
                                     int64_t timed_out_total);

  // The memory budget's gauges and refusals, in the same format.
  static std::string memory_text(int64_t limit, int64_t used, int64_t refusals);

  // The upper bounds of the latency histogram's buckets, in seconds (+Inf beyond).
  static const std::vector<double>& latency_buckets();

 private:
  double images_per_second() const;  // over the last minute (or since the start, if sooner)

  mutable std::mutex mutex_;
  std::map<std::pair<std::string, int>, int64_t> responses_;
  int64_t images_ = 0;
  std::deque<std::pair<std::chrono::steady_clock::time_point, int64_t>> recent_images_;
  std::vector<int64_t> latency_counts_;  // per bucket, not cumulative; the last is +Inf
  double latency_sum_ = 0;
  int64_t latency_count_ = 0;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace dalle::serve
