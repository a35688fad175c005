#pragma once
// Who a request comes from. Behind a reverse proxy every connection comes from the proxy's
// address; the proxy names the client in X-Forwarded-For ("client, proxy1, proxy2", each hop
// appending the address it received from). That header is a client's to write, so it is
// believed only from the proxies the config names (trusted_proxies), and only as far back as
// they go: the client is the last address in it that is not a trusted proxy.
#include <set>
#include <string>

namespace dalle::serve {

// The client of a request that came from `peer` (the connection's numeric address) with the
// X-Forwarded-For header `forwarded_for` (empty: none): `peer` itself unless it is a trusted
// proxy; else the last listed address that is not one (a malformed entry stops the walk there,
// at the proxy that appended it).
std::string client_address(const std::string& peer, const std::string& forwarded_for,
                           const std::set<std::string>& trusted_proxies);

}  // namespace dalle::serve
