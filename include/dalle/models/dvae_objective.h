#pragma once
// The dVAE's training objective (DALL-E, section 2.1 and appendix A): a gumbel-softmax
// relaxation of the encoder's categorical, its KL against the uniform prior, and the
// logit-Laplace reconstruction likelihood.
#include <torch/types.h>

#include <optional>

namespace dalle::models {

// Soft one-hot codes: softmax((logits + g) / tau) over dim 1, g ~ Gumbel(0, 1) drawn from
// `generator` (torch's default when none). `straight_through`: the value is the one-hot
// argmax of that sample, the gradient is the soft sample's.
torch::Tensor gumbel_softmax(const torch::Tensor& logits, double tau,
                             std::optional<at::Generator> generator = std::nullopt, bool straight_through = false);

// KL(q || uniform) per token position, summed over the codebook and averaged over the
// batch and positions: sum_k q_k (log q_k + log K).
torch::Tensor kl_to_uniform(const torch::Tensor& logits);

// Negative log-likelihood of pixels x in (0, 1) (already mapped by map_pixels) under the
// logit-Laplace density f(x | mu, b) = exp(-|logit x - mu| / b) / (2 b x (1 - x)), with
// mu = output[:, :C] and ln b = output[:, C:]. Returns the mean over pixels and channels.
torch::Tensor logit_laplace_nll(const torch::Tensor& decoder_output, const torch::Tensor& mapped_pixels);

// Squared error of the decoded pixels sigmoid(mu) against pixels already mapped by
// map_pixels, both in [eps, 1 - eps]: unlike an error taken after unmap_pixels' clamp to
// [0, 1], it still sends a gradient to a pixel pushed below eps (a mostly black dataset
// otherwise teaches the decoder to push every pixel there and stop; docs/dvae.md).
torch::Tensor mapped_pixel_mse(const torch::Tensor& decoder_output, const torch::Tensor& mapped_pixels);

// Peak signal-to-noise ratio in dB of images in [0, 1], averaged over the batch.
double psnr(const torch::Tensor& reconstruction, const torch::Tensor& target);

// Codebook usage of a batch of tokens: perplexity exp(H) of the empirical code
// distribution and the fraction of the `vocab_size` codes used at least once.
struct CodebookUsage {
  double perplexity = 0.0;
  double used_fraction = 0.0;
};
CodebookUsage codebook_usage(const torch::Tensor& tokens, int64_t vocab_size);

}  // namespace dalle::models
