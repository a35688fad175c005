#pragma once
// The open connections of dalle-serve's event loop and the limits on them: how many at most
// (in all and per client address; one more is closed at once, before a byte of it is read),
// and how long each phase of a request may take (its line and headers; its body). The loop
// reports what each connection does; sweep(), from another thread, shuts down the sockets
// that are overdue, which the loop then sees closed. A request being answered has no
// deadline here: the server bounds it by request_timeout_seconds.
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>

namespace dalle::serve {

struct ConnectionLimits {
  int64_t max_connections = 4096;
  int64_t max_per_client = 256;
  std::set<std::string> unbounded_clients;  // trusted proxies: each carries many clients
  std::chrono::milliseconds header_timeout{10000};  // from the opening, or the answer before
  std::chrono::milliseconds body_timeout{60000};    // from the end of the headers
};

class ConnectionTable {
 public:
  using Clock = std::chrono::steady_clock;
  using Id = const void*;

  explicit ConnectionTable(ConnectionLimits limits);

  // Whether a new connection from `client` (an address) may open; a refusal is counted.
  bool admit(const std::string& client);
  void opened(Id id, int socket, const std::string& client, Clock::time_point now = Clock::now());
  void closed(Id id);
  // A request's headers arrived / its body was read / it was answered (the connection waits
  // for the next one).
  void headers_read(Id id, Clock::time_point now = Clock::now());
  void body_read(Id id);
  void answered(Id id, Clock::time_point now = Clock::now());

  // Shuts down the sockets past their phase's deadline at `now`; how many.
  int64_t sweep(Clock::time_point now = Clock::now());

  struct Counts {
    int64_t open = 0;
    int64_t opened_total = 0;
    int64_t refused_total = 0;    // over max_connections or max_per_client
    int64_t timed_out_total = 0;  // shut down by sweep()
  };
  Counts counts() const;

 private:
  enum class Phase { awaiting_request, reading_body, answering, shut_down };
  struct Connection {
    int socket = -1;
    std::string client;
    Phase phase = Phase::awaiting_request;
    Clock::time_point since;
  };
  void enter(Id id, Phase phase, Clock::time_point now);  // holds the lock

  ConnectionLimits limits_;
  mutable std::mutex mutex_;
  std::map<Id, Connection> connections_;
  std::map<std::string, int64_t> per_client_;
  Counts counts_;
};

}  // namespace dalle::serve
