#include "serve/connection_table.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>

#include "test_support.h"

namespace dalle::serve {
namespace {

using namespace std::chrono_literals;
using Clock = ConnectionTable::Clock;

// A connected pair of sockets: the server's end (in the table) and the client's.
struct SocketPair {
  std::array<int, 2> ends{-1, -1};
  SocketPair() { EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, ends.data()), 0); }
  ~SocketPair() {
    close(ends[0]);
    close(ends[1]);
  }
  int server() const { return ends[0]; }
  // Whether the server's end was shut down: the client reads its end of stream.
  bool shut_down() const {
    pollfd watch{.fd = ends[1], .events = POLLIN, .revents = 0};
    char byte;
    return poll(&watch, 1, 0) == 1 && recv(ends[1], &byte, 1, MSG_DONTWAIT) == 0;
  }
};

TEST(ConnectionTable, TheCapsRefuseAtOnceInAllAndPerClientAndClosingMakesRoom) {
  ConnectionTable table({.max_connections = 3, .max_per_client = 2});
  int ids[4];
  ASSERT_TRUE(table.admit("10.0.0.1"));
  table.opened(&ids[0], -1, "10.0.0.1");
  ASSERT_TRUE(table.admit("10.0.0.1"));
  table.opened(&ids[1], -1, "10.0.0.1");
  EXPECT_FALSE(table.admit("10.0.0.1")) << "a third from one client";
  ASSERT_TRUE(table.admit("10.0.0.2"));
  table.opened(&ids[2], -1, "10.0.0.2");
  EXPECT_FALSE(table.admit("10.0.0.3")) << "a fourth in all";
  table.closed(&ids[0]);
  EXPECT_TRUE(table.admit("10.0.0.1")) << "a closed connection makes room for its client";
  const auto counts = table.counts();
  EXPECT_EQ(counts.open, 2);
  EXPECT_EQ(counts.opened_total, 3);
  EXPECT_EQ(counts.refused_total, 2);
}

TEST(ConnectionTable, ASweepShutsDownWhatIsOverdueInItsPhaseAndNothingElse) {
  ConnectionTable table({.header_timeout = 10s, .body_timeout = 60s});
  SocketPair idle, slow_headers, slow_body, answering, answered;
  const auto start = Clock::now();
  for (const auto* pair : {&idle, &slow_headers, &slow_body, &answering, &answered}) {
    table.opened(pair, pair->server(), "127.0.0.1", start);
  }
  table.headers_read(&slow_body, start + 1s);
  table.headers_read(&answering, start + 1s);
  table.body_read(&answering);  // being answered: the server's request timeout bounds it, not the table
  table.headers_read(&answered, start + 1s);
  table.answered(&answered, start + 5s);  // its next request's headers are due 10 s after its answer

  EXPECT_EQ(table.sweep(start + 9s), 0);
  EXPECT_EQ(table.sweep(start + 11s), 2) << "the idle one and the one whose headers never came";
  EXPECT_TRUE(idle.shut_down());
  EXPECT_TRUE(slow_headers.shut_down());
  EXPECT_FALSE(slow_body.shut_down() || answering.shut_down() || answered.shut_down());
  EXPECT_EQ(table.sweep(start + 12s), 0) << "a connection is shut down once";
  EXPECT_EQ(table.sweep(start + 16s), 1) << "the answered one, 10 s after its answer";
  EXPECT_TRUE(answered.shut_down());
  EXPECT_EQ(table.sweep(start + 62s), 1) << "the body 60 s after its headers";
  EXPECT_TRUE(slow_body.shut_down());
  EXPECT_FALSE(answering.shut_down());
  EXPECT_EQ(table.counts().timed_out_total, 4);
  table.closed(&idle);
  EXPECT_EQ(table.counts().open, 4);
}

TEST(ConnectionTable, ATrustedProxyIsBoundByMaxConnectionsAloneNotThePerClientCap) {
  ConnectionTable table({.max_connections = 10, .max_per_client = 2, .unbounded_clients = {"10.0.0.1"}});
  int ids[8];
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(table.admit("203.0.113.9"));
    table.opened(&ids[i], -1, "203.0.113.9");
  }
  EXPECT_FALSE(table.admit("203.0.113.9")) << "a client's third connection";
  for (int i = 2; i < 8; ++i) {
    ASSERT_TRUE(table.admit("10.0.0.1")) << "the proxy's connection " << i - 1;
    table.opened(&ids[i], -1, "10.0.0.1");
  }
  int more[3];
  for (auto& id : more) {
    if (table.admit("10.0.0.1")) table.opened(&id, -1, "10.0.0.1");
  }
  EXPECT_EQ(table.counts().open, 10) << "max_connections still binds it";
}

}  // namespace
}  // namespace dalle::serve
