#pragma once
// Whether a request's client is still there. cpp-httplib 0.11.4 (Debian 12's) tells a
// handler neither its socket nor whether the client left (Request::is_connection_closed
// came in later versions). A handler's connection stays open until the handler returns, so
// its socket can be found among the process's descriptors by the connection's two
// addresses, which httplib does give (Request::local_addr/port, remote_addr/port), and
// peeked at while the handler waits.
#include <string>

namespace dalle::serve {

class ConnectionSocket {
 public:
  // The descriptor of the TCP connection between these addresses; none found: an object
  // whose client_gone() is always false (the request is then only bounded by its timeout).
  ConnectionSocket(const std::string& local_address, int local_port, const std::string& remote_address,
                   int remote_port);
  bool found() const { return descriptor_ >= 0; }
  // Whether the client closed its end (or the connection broke): its FIN, an error, or a
  // hang-up. Data it sent ahead (a pipelined request) does not count.
  bool client_gone() const;

 private:
  int descriptor_ = -1;
};

// Sets the accept backlog of this process's listening TCP socket on `port` to `backlog` (the
// kernel caps it at net.core.somaxconn); false when no such socket is found. cpp-httplib
// 0.11.4 listens with a backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG, compiled into Debian's
// libcpp-httplib.so, so not ours to define): a burst of more simultaneous connections than
// that overflows the accept queue, and on Linux with SYN cookies some of them are reset
// instead of being answered (bench/serve_load.py's 32 clients saw it). Linux takes a second
// listen() on a listening socket as a new backlog.
bool set_listen_backlog(int port, int backlog);

}  // namespace dalle::serve
