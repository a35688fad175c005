#pragma once
// DALL-E Mega / Mini's image decoder, min-dalle 0.4.11's VQGanDetokenizer (`detoker.pt`,
// docs/mega-prior.md section 6): a codebook `embedding`, `post_quant_conv` and taming's
// decoder (`decoder.*`, our VqganDecoder) without an encoder. 16 x 16 tokens -> 256 x 256.
// Its GroupNorms use PyTorch's eps (1e-5), not taming's 1e-6; it was trained to emit
// images in [0, 1], which it is clamped to.
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>

#include "dalle/models/vqgan.h"

namespace dalle::models {

// min-dalle's sizes: ch 128, ch_mult {1, 1, 2, 2, 4}, attention at 16, 16384 codes of 256.
VqganConfig dalle_mega_detokenizer_config();

class VqganDetokenizerImpl : public torch::nn::Module {
 public:
  explicit VqganDetokenizerImpl(const VqganConfig& config);
  // Tokens [B, side * side] -> images [B, 3, side * f, side * f] in [0, 1].
  torch::Tensor forward(const torch::Tensor& tokens);
  const VqganConfig& config() const { return config_; }

  torch::nn::Embedding embedding{nullptr};
  torch::nn::Conv2d post_quant_conv{nullptr};
  VqganDecoder decoder{nullptr};

 private:
  VqganConfig config_;
};
TORCH_MODULE(VqganDetokenizer);

// min-dalle's grid of `images` [g * g, 3, H, W] in [0, 1]: [g H, g W, 3] on its 0..255
// scale, image k at row k % g and column k / g (column-major, as min-dalle lays them).
torch::Tensor min_dalle_grid(const torch::Tensor& images);

}  // namespace dalle::models
