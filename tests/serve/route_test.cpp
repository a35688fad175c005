#include "serve/route.h"

#include "test_support.h"

namespace dalle::serve {
namespace {

const std::string kId = "0123456789abcdef0123456789abcdef";

TEST(Route, EveryRouteIsFoundByItsPathWithTheIdItNames) {
  EXPECT_EQ(route_of("/v1/images/generations").kind, RouteKind::generations);
  EXPECT_EQ(route_of("/v1/images/edits").kind, RouteKind::edits);
  EXPECT_EQ(route_of("/v1/images/jobs").kind, RouteKind::jobs);
  EXPECT_EQ(route_of("/v1/models").kind, RouteKind::models);
  EXPECT_EQ(route_of("/health").kind, RouteKind::health);
  EXPECT_EQ(route_of("/metrics").kind, RouteKind::metrics);
  EXPECT_EQ(route_of("/").kind, RouteKind::page);
  const auto job = route_of("/v1/images/jobs/" + kId);
  EXPECT_EQ(job.kind, RouteKind::job);
  EXPECT_EQ(job.id, kId);
  const auto image = route_of("/v1/images/" + kId + ".png");
  EXPECT_EQ(image.kind, RouteKind::image);
  EXPECT_EQ(image.id, kId);
  const auto model = route_of("/v1/models/dalle-demo");
  EXPECT_EQ(model.kind, RouteKind::model);
  EXPECT_EQ(model.id, "dalle-demo");
}

TEST(Route, NearMissesAreUnknownAndLabelledOther) {
  const std::vector<std::string> paths = {
      "", "/v1/images/jobs/" + kId.substr(1), "/v1/images/jobs/" + kId + "0", "/v1/images/jobs/" + kId + "/",
      "/v1/images/jobs/0123456789ABCDEF0123456789ABCDEF", "/v1/images/" + kId + ".jpg", "/v1/images/" + kId,
      "/v1/images/" + kId.substr(1) + "g.png", "/v1/models/", "/health/", "/v1/images/generations/x", "//"};
  for (const auto& path : paths) {
    const auto route = route_of(path);
    EXPECT_EQ(route.kind, RouteKind::unknown) << path;
    EXPECT_EQ(route.endpoint(), "other") << path;
    EXPECT_EQ(route.allowed_methods(), "") << path;
    EXPECT_FALSE(route.takes("GET")) << path;
  }
}

TEST(Route, MethodsKeysAndLabelsFollowTheRoute) {
  const auto generations = route_of("/v1/images/generations");
  EXPECT_TRUE(generations.takes("POST"));
  EXPECT_FALSE(generations.takes("GET"));
  EXPECT_FALSE(generations.takes("POS")) << "whole names only";
  EXPECT_FALSE(generations.takes(""));
  EXPECT_TRUE(generations.needs_key());
  EXPECT_EQ(generations.endpoint(), "/v1/images/generations");
  const auto job = route_of("/v1/images/jobs/" + kId);
  EXPECT_EQ(job.allowed_methods(), "GET, HEAD, DELETE");
  EXPECT_TRUE(job.takes("DELETE"));
  EXPECT_TRUE(job.needs_key());
  EXPECT_EQ(job.endpoint(), "/v1/images/jobs/{id}") << "a bounded set of labels, whatever the id";
  const auto image = route_of("/v1/images/" + kId + ".png");
  EXPECT_FALSE(image.needs_key()) << "the id is the permission";
  EXPECT_TRUE(image.takes("HEAD"));
  EXPECT_FALSE(image.takes("POST"));
  EXPECT_TRUE(route_of("/v1/models/x").needs_key());
  EXPECT_FALSE(route_of("/health").needs_key());
  EXPECT_FALSE(route_of("/metrics").needs_key());
  EXPECT_FALSE(route_of("/").needs_key());
}

}  // namespace
}  // namespace dalle::serve
