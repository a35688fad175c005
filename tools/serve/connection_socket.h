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

}  // namespace dalle::serve
