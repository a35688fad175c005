#include "dalle/eval/frechet_distance.h"

#include "test_support.h"

namespace dalle::eval {
namespace {

using testing::relative_error;

TEST(FrechetDistance, IdenticalSetsAreAtZero) {
  torch::manual_seed(0);
  const auto features = torch::randn({500, 16}, torch::kFloat64).matmul(torch::randn({16, 16}, torch::kFloat64));
  EXPECT_NEAR(frechet_distance(features, features), 0.0, 1e-8);
  EXPECT_NEAR(frechet_distance(features.to(torch::kFloat32), features.to(torch::kFloat32)), 0.0, 1e-3);
  // Fewer samples than features and dead (always zero) features: singular covariances of a
  // large scale, whose rounding noise must not come out as distance.
  auto few = torch::relu(torch::randn({40, 128}, torch::kFloat64) * 30 + 5);
  few.slice(1, 0, 20).zero_();
  EXPECT_NEAR(frechet_distance(few, few), 0.0, 1e-6);
  EXPECT_GT(frechet_distance(few, few * 1.01), 1e-3);
}

TEST(FrechetDistance, ShiftedSetCostsTheSquaredShift) {
  torch::manual_seed(1);
  const auto features = torch::randn({400, 8}, torch::kFloat64) * torch::linspace(0.5, 3, 8, torch::kFloat64);
  const auto shift = torch::linspace(-1, 2, 8, torch::kFloat64);
  // Same covariance, means apart by `shift`: the distance is |shift|^2 exactly.
  EXPECT_NEAR(frechet_distance(features, features + shift), shift.pow(2).sum().item<double>(), 1e-8);
}

TEST(FrechetDistance, StatisticsAreTheSampleMeanAndUnbiasedCovariance) {
  const auto x = torch::tensor({{1.0, 2.0}, {3.0, 0.0}, {5.0, 4.0}}, torch::kFloat64);
  const auto stats = gaussian_statistics(x);
  EXPECT_EQ(stats.count, 3);
  EXPECT_LT(relative_error(stats.mean, torch::tensor({3.0, 2.0}, torch::kFloat64)), 1e-12);
  // Deviations (-2, 0), (0, -2), (2, 2): sums of products 8, 4, 8, over N - 1 = 2.
  EXPECT_LT(relative_error(stats.covariance, torch::tensor({{4.0, 2.0}, {2.0, 4.0}}, torch::kFloat64)), 1e-12);
}

TEST(FrechetDistance, MatchesTheClosedFormForGaussians) {
  // Diagonal covariances: |m1 - m2|^2 + sum (sqrt(a) - sqrt(b))^2.
  GaussianStatistics a{torch::tensor({0.0, 1.0, 2.0}, torch::kFloat64),
                       torch::diag(torch::tensor({1.0, 4.0, 9.0}, torch::kFloat64)), 100};
  GaussianStatistics b{torch::tensor({1.0, 1.0, 0.0}, torch::kFloat64),
                       torch::diag(torch::tensor({4.0, 1.0, 1.0}, torch::kFloat64)), 100};
  EXPECT_NEAR(frechet_distance(a, b), (1 + 0 + 4) + (1 + 1 + 4), 1e-9);
  EXPECT_NEAR(frechet_distance(b, a), frechet_distance(a, b), 1e-9);

  // Covariances that do not commute: S1 = s I and S2 = Q diag(d) Q^T with Q a rotation, so
  // tr((S1 S2)^1/2) = sum sqrt(s d).
  torch::manual_seed(2);
  const auto [q, r] = torch::linalg_qr(torch::randn({5, 5}, torch::kFloat64));
  const auto d = torch::tensor({0.5, 1.0, 2.0, 3.0, 7.0}, torch::kFloat64);
  const double s = 2.0;
  GaussianStatistics c{torch::zeros({5}, torch::kFloat64), s * torch::eye(5, torch::kFloat64), 100};
  GaussianStatistics e{torch::zeros({5}, torch::kFloat64), q.matmul(torch::diag(d)).matmul(q.t()), 100};
  const double expected = 5 * s + d.sum().item<double>() - 2 * (d * s).sqrt().sum().item<double>();
  EXPECT_NEAR(frechet_distance(c, e), expected, 1e-9);

  // Two general covariances S1 = A A^T, S2 = B B^T: the library roots S1; the expected value
  // roots S2 instead, tr((S1 S2)^1/2) = tr((S2^1/2 S1 S2^1/2)^1/2).
  const auto A = torch::randn({4, 4}, torch::kFloat64), B = torch::randn({4, 4}, torch::kFloat64);
  const auto s1 = A.matmul(A.t()), s2 = B.matmul(B.t());
  const auto [values2, vectors2] = torch::linalg_eigh(s2);
  const auto root2 = vectors2.matmul(torch::diag(values2.sqrt())).matmul(vectors2.t());
  const double cross = torch::linalg_eigvalsh(root2.matmul(s1).matmul(root2)).clamp_min(0).sqrt().sum().item<double>();
  GaussianStatistics f{torch::ones({4}, torch::kFloat64), s1, 10}, g{torch::zeros({4}, torch::kFloat64), s2, 10};
  EXPECT_NEAR(frechet_distance(f, g), 4 + s1.trace().item<double>() + s2.trace().item<double>() - 2 * cross, 1e-8);
}

TEST(FrechetDistance, SamplesApproachTheDistanceOfTheirGaussians) {
  // 1-D: (m1 - m2)^2 + (sd1 - sd2)^2.
  torch::manual_seed(3);
  const auto x = torch::randn({200000, 1}, torch::kFloat64) * 2.0 + 1.0;
  const auto y = torch::randn({200000, 1}, torch::kFloat64) * 0.5 - 1.0;
  EXPECT_NEAR(frechet_distance(x, y), 4.0 + 2.25, 0.05);
}

TEST(FrechetDistance, RefusesTooFewOrMismatchedFeatures) {
  EXPECT_THROW_WITH(gaussian_statistics(torch::zeros({1, 4})), Error, "at least 2");
  EXPECT_THROW_WITH(gaussian_statistics(torch::zeros({4})), Error, "[N, D]");
  EXPECT_THROW_WITH(frechet_distance(torch::randn({5, 3}), torch::randn({5, 4})), Error, "feature sizes differ");
}

}  // namespace
}  // namespace dalle::eval
