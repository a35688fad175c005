#include "dalle/models/vqgan_detokenizer.h"

#include <torch/torch.h>

#include "dalle/error.h"
#include "dalle/models/token_grid.h"

namespace dalle::models {

VqganConfig dalle_mega_detokenizer_config() {
  VqganConfig config;
  config.ch_mult = {1, 1, 2, 2, 4};
  config.attn_resolutions = {16};
  config.n_embed = 16384;
  return config;
}

VqganDetokenizerImpl::VqganDetokenizerImpl(const VqganConfig& config) : config_(config) {
  config.validate();
  embedding = register_module("embedding", torch::nn::Embedding(config.n_embed, config.embed_dim));
  post_quant_conv = register_module(
      "post_quant_conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(config.embed_dim, config.z_channels, 1)));
  decoder = register_module("decoder", VqganDecoder(config));
  for (const auto& module : decoder->modules()) {
    if (auto* norm = module->as<torch::nn::GroupNormImpl>()) norm->options.eps(1e-5);
  }
}

torch::Tensor VqganDetokenizerImpl::forward(const torch::Tensor& tokens) {
  const auto expected = [&] {
    return "VQGAN detokenizer: expected tokens [B, side * side], got " + c10::str(tokens.sizes());
  };
  if (tokens.dim() != 2) throw Error(expected());
  const auto side = grid_side(tokens.size(1), expected());
  const auto codes = embedding(tokens).view({tokens.size(0), side, side, config_.embed_dim}).permute({0, 3, 1, 2});
  return decoder(post_quant_conv(codes.contiguous())).clamp(0, 1);
}

torch::Tensor min_dalle_grid(const torch::Tensor& images) {
  const auto expected = [&] {
    return "min-dalle grid: expected [g * g, C, H, W] images, got " + c10::str(images.sizes());
  };
  if (images.dim() != 4) throw Error(expected());
  const auto grid = grid_side(images.size(0), expected());
  const int64_t channels = images.size(1), height = images.size(2), width = images.size(3);
  // [column, row, C, H, W] -> [row, H, column, W, C]
  return (images.view({grid, grid, channels, height, width}).permute({1, 3, 0, 4, 2}) * 255)
      .reshape({grid * height, grid * width, channels});
}

}  // namespace dalle::models
