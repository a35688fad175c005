#pragma once
// The Fréchet distance between two Gaussians, which FID takes between the features of real
// and generated images: |m1 - m2|^2 + tr(S1) + tr(S2) - 2 tr((S1 S2)^1/2). Computed in
// float64 without a general (complex) matrix square root: tr((S1 S2)^1/2) is the sum of the
// singular values of S1^1/2 S2^1/2, each root taken by a symmetric eigendecomposition.
// Unlike the square roots of the eigenvalues of S1^1/2 S2 S1^1/2, singular values do not
// magnify the rounding noise of singular covariances (fewer samples than features, dead
// ReLU units), so identical sets come out at zero to float64 precision.
#include <torch/types.h>

#include <cstdint>

namespace dalle::eval {

struct GaussianStatistics {
  torch::Tensor mean;        // [D] float64
  torch::Tensor covariance;  // [D, D] float64, unbiased (divided by N - 1)
  int64_t count = 0;         // samples they were estimated from
};

// Mean and covariance of [N, D] features; N must be at least 2.
GaussianStatistics gaussian_statistics(const torch::Tensor& features);

double frechet_distance(const GaussianStatistics& a, const GaussianStatistics& b);
double frechet_distance(const torch::Tensor& features_a, const torch::Tensor& features_b);

// The symmetric square root of a symmetric positive semi-definite matrix (negative rounding
// noise in its eigenvalues counts as zero).
torch::Tensor psd_sqrt(const torch::Tensor& matrix);

}  // namespace dalle::eval
