#include "dalle/models/dvae_objective.h"

#include <torch/torch.h>

#include <cmath>

#include "dalle/models/dvae.h"

namespace dalle::models {

torch::Tensor gumbel_softmax(const torch::Tensor& logits, double tau, std::optional<at::Generator> generator,
                             bool straight_through) {
  // -log(-log U) with U kept away from 0 and 1 so that neither log overflows.
  auto uniform = torch::empty_like(logits).uniform_(1e-10, 1.0 - 1e-7, generator);
  auto gumbel = -torch::log(-torch::log(uniform));
  auto soft = torch::softmax((logits + gumbel) / tau, 1);
  if (!straight_through) return soft;
  const auto hard = torch::zeros_like(soft).scatter_(1, soft.argmax(1, true), 1.0);
  return hard - soft.detach() + soft;
}

torch::Tensor kl_to_uniform(const torch::Tensor& logits) {
  const auto log_q = torch::log_softmax(logits, 1);
  const double log_k = std::log(static_cast<double>(logits.size(1)));
  return (log_q.exp() * (log_q + log_k)).sum(1).mean();
}

torch::Tensor logit_laplace_nll(const torch::Tensor& decoder_output, const torch::Tensor& mapped_pixels) {
  const int64_t channels = decoder_output.size(1) / 2;
  const auto mu = decoder_output.slice(1, 0, channels);
  const auto log_b = decoder_output.slice(1, channels, 2 * channels);
  const auto x = mapped_pixels;
  const auto logit_x = torch::log(x) - torch::log1p(-x);
  // -log f = |logit x - mu| / b + log 2 + ln b + log x + log(1 - x)
  const auto nll = (logit_x - mu).abs() * torch::exp(-log_b) + log_b + std::log(2.0) + torch::log(x) +
                   torch::log1p(-x);
  return nll.mean();
}

torch::Tensor mapped_pixel_mse(const torch::Tensor& decoder_output, const torch::Tensor& mapped_pixels) {
  return torch::mse_loss(DvaeImpl::mapped_reconstruction(decoder_output), mapped_pixels);
}

double psnr(const torch::Tensor& reconstruction, const torch::Tensor& target) {
  const auto mse = (reconstruction - target).pow(2).flatten(1).mean(1).clamp_min(1e-10);
  return (-10.0 * torch::log10(mse)).mean().item<double>();
}

CodebookUsage codebook_usage(const torch::Tensor& tokens, int64_t vocab_size) {
  const auto counts = torch::bincount(tokens.flatten().to(torch::kCPU), {}, vocab_size).to(torch::kFloat64);
  const auto p = counts / counts.sum();
  const auto entropy = -(p * torch::log(p.clamp_min(1e-300))).sum().item<double>();
  return {std::exp(entropy), (counts > 0).sum().item<double>() / static_cast<double>(vocab_size)};
}

}  // namespace dalle::models
