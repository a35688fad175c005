#include "serve/connection_socket.h"

#include <dirent.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cstdlib>
#include <optional>
#include <utility>

namespace dalle::serve {

namespace {

// Numeric address and port, as httplib writes them (getnameinfo with NI_NUMERICHOST).
std::optional<std::pair<std::string, int>> address_of(int descriptor, bool peer) {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  auto* raw = reinterpret_cast<sockaddr*>(&address);
  if ((peer ? getpeername(descriptor, raw, &length) : getsockname(descriptor, raw, &length)) != 0) return std::nullopt;
  char host[NI_MAXHOST], port[NI_MAXSERV];
  if (getnameinfo(raw, length, host, sizeof host, port, sizeof port, NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return std::nullopt;
  }
  return std::pair{std::string(host), std::atoi(port)};
}

bool is_socket(int descriptor) {
  struct stat status {};
  return fstat(descriptor, &status) == 0 && S_ISSOCK(status.st_mode);
}

}  // namespace

ConnectionSocket::ConnectionSocket(const std::string& local_address, int local_port,
                                   const std::string& remote_address, int remote_port) {
  DIR* descriptors = opendir("/proc/self/fd");
  if (!descriptors) return;
  const std::pair local{local_address, local_port}, remote{remote_address, remote_port};
  while (const dirent* entry = readdir(descriptors)) {
    char* end = nullptr;
    const long number = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0') continue;  // "." and ".."
    const int descriptor = static_cast<int>(number);
    if (descriptor == dirfd(descriptors) || !is_socket(descriptor)) continue;
    if (address_of(descriptor, false) == local && address_of(descriptor, true) == remote) {
      descriptor_ = descriptor;
      break;
    }
  }
  closedir(descriptors);
}

bool set_listen_backlog(int port, int backlog) {
  DIR* descriptors = opendir("/proc/self/fd");
  if (!descriptors) return false;
  bool done = false;
  while (const dirent* entry = readdir(descriptors)) {
    char* end = nullptr;
    const long number = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0') continue;
    const int descriptor = static_cast<int>(number);
    if (descriptor == dirfd(descriptors) || !is_socket(descriptor)) continue;
    int listening = 0;
    socklen_t length = sizeof listening;
    if (getsockopt(descriptor, SOL_SOCKET, SO_ACCEPTCONN, &listening, &length) != 0 || !listening) continue;
    const auto local = address_of(descriptor, false);
    if (local && local->second == port && listen(descriptor, backlog) == 0) {
      done = true;
      break;
    }
  }
  closedir(descriptors);
  return done;
}

bool ConnectionSocket::client_gone() const {
  if (descriptor_ < 0) return false;
  pollfd watch{.fd = descriptor_, .events = POLLIN | POLLRDHUP, .revents = 0};
  if (poll(&watch, 1, 0) <= 0) return false;
  if (watch.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
  // Readable: its FIN (recv gives 0), or bytes of a next request, which leave it present.
  char byte;
  return recv(descriptor_, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

}  // namespace dalle::serve
