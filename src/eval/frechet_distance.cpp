#include "dalle/eval/frechet_distance.h"

#include <torch/torch.h>

#include <algorithm>
#include <string>

#include "dalle/error.h"

namespace dalle::eval {

GaussianStatistics gaussian_statistics(const torch::Tensor& features) {
  if (features.dim() != 2) throw Error("FID: features must be [N, D], got " + std::to_string(features.dim()) + " dims");
  if (features.size(0) < 2) {
    throw Error("FID: needs at least 2 feature vectors per set, got " + std::to_string(features.size(0)));
  }
  const auto x = features.to(torch::kCPU, torch::kFloat64);
  const auto mean = x.mean(0);
  const auto centred = x - mean;
  const auto covariance = centred.t().matmul(centred) / static_cast<double>(x.size(0) - 1);
  return {mean, covariance, x.size(0)};
}

torch::Tensor psd_sqrt(const torch::Tensor& matrix) {
  const auto [values, vectors] = torch::linalg_eigh((matrix + matrix.t()) / 2);
  return vectors.matmul(torch::diag(values.clamp_min(0).sqrt())).matmul(vectors.t());
}

double frechet_distance(const GaussianStatistics& a, const GaussianStatistics& b) {
  if (a.mean.numel() != b.mean.numel()) {
    throw Error("FID: feature sizes differ (" + std::to_string(a.mean.numel()) + " and " +
                std::to_string(b.mean.numel()) + ")");
  }
  const auto s1 = a.covariance.to(torch::kFloat64), s2 = b.covariance.to(torch::kFloat64);
  const double cross = torch::linalg_svdvals(psd_sqrt(s1).matmul(psd_sqrt(s2))).sum().item<double>();
  const double mean_term = (a.mean.to(torch::kFloat64) - b.mean.to(torch::kFloat64)).pow(2).sum().item<double>();
  // Never below zero; rounding can leave identical sets a hair under it.
  return std::max(0.0, mean_term + s1.trace().item<double>() + s2.trace().item<double>() - 2 * cross);
}

double frechet_distance(const torch::Tensor& features_a, const torch::Tensor& features_b) {
  return frechet_distance(gaussian_statistics(features_a), gaussian_statistics(features_b));
}

}  // namespace dalle::eval
