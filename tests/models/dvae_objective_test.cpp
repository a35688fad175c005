#include "dalle/models/dvae_objective.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>

#include "dalle/data/image.h"
#include "dalle/models/dvae.h"
#include "test_support.h"

namespace dalle::models {
namespace {

TEST(DvaeObjective, LogitLaplaceIsANormalisedDensityAndTheLossIsItsNll) {
  // A midpoint rule over x in (0, 1): the density must integrate to 1 for any (mu, ln b),
  // and the loss must be the mean of -log density.
  const int64_t n = 400000;
  const auto x = (torch::arange(n, torch::kFloat64) + 0.5) / n;
  const auto logit_x = torch::log(x) - torch::log1p(-x);
  for (auto [mu, log_b] : {std::pair{0.0, 0.0}, {1.5, -1.0}, {-2.0, 0.5}}) {
    const double b = std::exp(log_b);
    const auto density = torch::exp(-(logit_x - mu).abs() / b) / (2 * b * x * (1 - x));
    EXPECT_NEAR(density.mean().item<double>(), 1.0, 2e-3) << mu << " " << log_b;

    auto output = torch::empty({n, 2, 1, 1}, torch::kFloat64);
    output.select(1, 0).fill_(mu);
    output.select(1, 1).fill_(log_b);
    const auto loss = logit_laplace_nll(output, x.view({n, 1, 1, 1}));
    EXPECT_NEAR(loss.item<double>(), (-torch::log(density)).mean().item<double>(), 1e-9);
  }
}

TEST(DvaeObjective, MappedPixelMseStillPullsUpPixelsDecodedBelowEpsilon) {
  // A decoder whose output logits sit far below logit(eps) decodes black; the error after
  // unmap_pixels' clamp gives such pixels no gradient, the mapped-space error does.
  auto output = torch::full({1, 2, 2, 2}, -8.0, torch::requires_grad());
  const auto item = torch::full({1, 1, 2, 2}, 0.7);
  mapped_pixel_mse(output, map_pixels(item)).backward();
  const auto mu_gradient = output.grad().slice(1, 0, 1);
  EXPECT_TRUE((mu_gradient < 0).all().item<bool>()) << mu_gradient;

  auto clamped = torch::full({1, 2, 2, 2}, -8.0, torch::requires_grad());
  torch::mse_loss(DvaeImpl::reconstruction(clamped), item).backward();
  EXPECT_EQ(clamped.grad().abs().max().item<double>(), 0.0);

  // The loss is the squared error of sigmoid(mu) in the mapped range.
  const auto mu = torch::tensor({0.0, 2.0}).view({1, 1, 1, 2});
  const auto pixels = torch::tensor({0.5, 0.1}).view({1, 1, 1, 2});
  const double expected = (0.0 + std::pow(1.0 / (1.0 + std::exp(-2.0)) - 0.1, 2)) / 2;
  EXPECT_NEAR(mapped_pixel_mse(torch::cat({mu, torch::zeros_like(mu)}, 1), pixels).item<double>(), expected, 1e-7);
}

TEST(DvaeObjective, KlToUniformIsZeroForUniformAndLogKForCertain) {
  EXPECT_NEAR(kl_to_uniform(torch::zeros({2, 16, 3, 3})).item<float>(), 0.0f, 1e-6);
  auto certain = torch::full({1, 16, 2, 2}, -1e4);
  certain.select(1, 3).fill_(0);
  EXPECT_NEAR(kl_to_uniform(certain).item<float>(), std::log(16.0f), 1e-4);
  EXPECT_GT(kl_to_uniform(torch::randn({2, 16, 3, 3})).item<float>(), 0.0f);
}

TEST(DvaeObjective, GumbelSoftmaxSamplesTheCategorical) {
  torch::manual_seed(0);
  const auto p = torch::tensor({0.1, 0.2, 0.3, 0.4}, torch::kFloat64);
  const auto logits = p.log().view({1, 4, 1, 1}).expand({20000, 4, 1, 1}).contiguous();
  const auto relaxed = gumbel_softmax(logits, 1.0);
  EXPECT_TRUE(torch::allclose(relaxed.sum(1), torch::ones({20000, 1, 1}, torch::kFloat64)));
  // The argmax of the perturbed logits is an exact sample of p (the Gumbel-max trick).
  const auto frequency = torch::bincount(relaxed.argmax(1).flatten(), {}, 4).to(torch::kFloat64) / 20000;
  EXPECT_TRUE(torch::allclose(frequency, p, 0, 0.015)) << frequency;
  // Low temperature gives nearly one-hot codes.
  EXPECT_GT(std::get<0>(gumbel_softmax(logits, 1.0 / 16).max(1)).mean().item<double>(), 0.95);
}

TEST(DvaeObjective, StraightThroughGumbelIsTheSoftSamplesArgmaxWithItsGradient) {
  const auto logits = torch::randn({3, 5, 2, 2}, torch::requires_grad());
  auto generator = at::make_generator<at::CPUGeneratorImpl>(7);
  const auto soft = gumbel_softmax(logits, 0.5, generator);
  generator = at::make_generator<at::CPUGeneratorImpl>(7);
  const auto hard = gumbel_softmax(logits, 0.5, generator, true);
  EXPECT_TRUE(torch::equal(hard.argmax(1), soft.argmax(1)));
  EXPECT_TRUE(torch::equal(hard.detach(), torch::one_hot(soft.argmax(1), 5).permute({0, 3, 1, 2}).to(hard.dtype())));

  const auto weights = torch::randn({3, 5, 2, 2});
  const auto soft_gradient = torch::autograd::grad({(soft * weights).sum()}, {logits})[0];
  const auto hard_gradient = torch::autograd::grad({(hard * weights).sum()}, {logits})[0];
  EXPECT_TRUE(torch::allclose(hard_gradient, soft_gradient));
}

TEST(DvaeObjective, PsnrAndCodebookUsage) {
  const auto target = torch::zeros({2, 3, 4, 4});
  EXPECT_NEAR(psnr(target + 0.1, target), 20.0, 1e-4);
  const auto tokens = torch::tensor({0, 1, 2, 3, 0, 1, 2, 3});
  const auto usage = codebook_usage(tokens, 8);
  EXPECT_NEAR(usage.perplexity, 4.0, 1e-9);
  EXPECT_DOUBLE_EQ(usage.used_fraction, 0.5);
}

}  // namespace
}  // namespace dalle::models
