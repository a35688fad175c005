#include "serve/client_address.h"

#include "test_support.h"

namespace dalle::serve {
namespace {

const std::set<std::string> kProxies = {"10.0.0.1", "10.0.0.2", "::1"};

TEST(ClientAddress, XForwardedForIsBelievedOnlyFromTrustedProxiesAndOnlyAsFarAsTheyGo) {
  EXPECT_EQ(client_address("203.0.113.9", "198.51.100.7", kProxies), "203.0.113.9")
      << "a client that writes the header itself is not believed";
  EXPECT_EQ(client_address("10.0.0.1", "", kProxies), "10.0.0.1") << "a proxy's own request";
  EXPECT_EQ(client_address("10.0.0.1", "198.51.100.7", kProxies), "198.51.100.7");
  EXPECT_EQ(client_address("10.0.0.1", "192.0.2.66, 198.51.100.7, 10.0.0.2", kProxies), "198.51.100.7")
      << "the last address a trusted proxy received from; what the client wrote before it is not believed";
  EXPECT_EQ(client_address("::1", " 2001:db8::5 ", kProxies), "2001:db8::5");
  EXPECT_EQ(client_address("10.0.0.1", "198.51.100.7, not-an-address", kProxies), "10.0.0.1")
      << "a malformed hop stops the walk at the proxy that appended it";
  EXPECT_EQ(client_address("10.0.0.1", "10.0.0.2", kProxies), "10.0.0.2") << "only proxies: the first of them";
  EXPECT_EQ(client_address("10.0.0.1", "198.51.100.7", {}), "10.0.0.1") << "no trusted proxies: the peer";
}

}  // namespace
}  // namespace dalle::serve
