#include "serve/connection_table.h"

#include <sys/socket.h>

namespace dalle::serve {

ConnectionTable::ConnectionTable(ConnectionLimits limits) : limits_(limits) {}

bool ConnectionTable::admit(const std::string& client) {
  std::lock_guard lock(mutex_);
  const auto at = per_client_.find(client);
  const int64_t from_client = at == per_client_.end() ? 0 : at->second;
  const bool unbounded = limits_.unbounded_clients.count(client) > 0;
  if (counts_.open < limits_.max_connections && (unbounded || from_client < limits_.max_per_client)) return true;
  ++counts_.refused_total;
  return false;
}

void ConnectionTable::opened(Id id, int socket, const std::string& client, Clock::time_point now) {
  std::lock_guard lock(mutex_);
  connections_[id] = {.socket = socket, .client = client, .phase = Phase::awaiting_request, .since = now};
  ++per_client_[client];
  ++counts_.open;
  ++counts_.opened_total;
}

void ConnectionTable::closed(Id id) {
  std::lock_guard lock(mutex_);
  // Forgotten before the loop closes the socket: sweep() never shuts down a reused number.
  const auto at = connections_.find(id);
  if (at == connections_.end()) return;
  if (--per_client_[at->second.client] == 0) per_client_.erase(at->second.client);
  connections_.erase(at);
  --counts_.open;
}

void ConnectionTable::enter(Id id, Phase phase, Clock::time_point now) {
  const auto at = connections_.find(id);
  if (at == connections_.end() || at->second.phase == Phase::shut_down) return;
  at->second.phase = phase;
  at->second.since = now;
}

void ConnectionTable::headers_read(Id id, Clock::time_point now) {
  std::lock_guard lock(mutex_);
  enter(id, Phase::reading_body, now);
}

void ConnectionTable::body_read(Id id) {
  std::lock_guard lock(mutex_);
  enter(id, Phase::answering, Clock::now());
}

void ConnectionTable::answered(Id id, Clock::time_point now) {
  std::lock_guard lock(mutex_);
  enter(id, Phase::awaiting_request, now);
}

int64_t ConnectionTable::sweep(Clock::time_point now) {
  std::lock_guard lock(mutex_);
  int64_t shut = 0;
  for (auto& [id, connection] : connections_) {
    const bool overdue =
        (connection.phase == Phase::awaiting_request && now - connection.since > limits_.header_timeout) ||
        (connection.phase == Phase::reading_body && now - connection.since > limits_.body_timeout);
    if (!overdue) continue;
    // The loop sees the socket end (a hang-up) and closes the connection itself.
    shutdown(connection.socket, SHUT_RDWR);
    connection.phase = Phase::shut_down;
    ++shut;
  }
  counts_.timed_out_total += shut;
  return shut;
}

ConnectionTable::Counts ConnectionTable::counts() const {
  std::lock_guard lock(mutex_);
  return counts_;
}

}  // namespace dalle::serve
