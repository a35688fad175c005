#include "serve/client_address.h"

#include <arpa/inet.h>

#include <string_view>
#include <vector>

namespace dalle::serve {

namespace {

bool is_address(const std::string& text) {
  unsigned char buffer[sizeof(in6_addr)];
  return inet_pton(AF_INET, text.c_str(), buffer) == 1 || inet_pton(AF_INET6, text.c_str(), buffer) == 1;
}

std::string trimmed(std::string_view text) {
  const auto first = text.find_first_not_of(" \t");
  if (first == std::string_view::npos) return "";
  return std::string(text.substr(first, text.find_last_not_of(" \t") - first + 1));
}

}  // namespace

std::string client_address(const std::string& peer, const std::string& forwarded_for,
                           const std::set<std::string>& trusted_proxies) {
  if (!trusted_proxies.count(peer) || forwarded_for.empty()) return peer;
  std::vector<std::string> hops;
  for (size_t start = 0; start <= forwarded_for.size();) {
    const auto comma = std::min(forwarded_for.find(',', start), forwarded_for.size());
    hops.push_back(trimmed(std::string_view(forwarded_for).substr(start, comma - start)));
    start = comma + 1;
  }
  std::string client = peer;
  for (auto hop = hops.rbegin(); hop != hops.rend(); ++hop) {
    if (!is_address(*hop)) break;
    client = *hop;
    if (!trusted_proxies.count(client)) break;
  }
  return client;
}

}  // namespace dalle::serve
