#include "dalle/models/clip_vision.h"

#include <torch/torch.h>

#include <cmath>
#include <sstream>

#include "dalle/error.h"

namespace dalle::models {

ClipVisionTransformerImpl::ClipVisionTransformerImpl(const ClipConfig& config) : config_(config) {
  config.validate();
  const int64_t width = config.vision_width;
  conv1 = register_module(
      "conv1", torch::nn::Conv2d(
                   torch::nn::Conv2dOptions(3, width, config.patch_size).stride(config.patch_size).bias(false)));
  // open_clip: width^-0.5 * N(0, 1) for the class and position embeddings and the projection.
  const double scale = 1.0 / std::sqrt(static_cast<double>(width));
  class_embedding = register_parameter("class_embedding", torch::randn({width}) * scale);
  positional_embedding =
      register_parameter("positional_embedding", torch::randn({config.vision_tokens(), width}) * scale);
  ln_pre = register_module("ln_pre", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width}).eps(1e-5)));
  transformer = register_module("transformer", ClipTransformer(width, config.vision_layers, config.vision_heads,
                                                               config.vision_mlp_width(), config.activation_kind()));
  ln_post = register_module("ln_post", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width}).eps(1e-5)));
  proj = register_parameter("proj", torch::randn({width, config.embed_dim}) * scale);
}

torch::Tensor ClipVisionTransformerImpl::forward(const torch::Tensor& images) {
  const int64_t side = config_.image_size;
  if (images.dim() != 4 || images.size(1) != 3 || images.size(2) != side || images.size(3) != side) {
    std::ostringstream got;
    got << images.sizes();
    throw Error("clip image tower: expected preprocessed images [batch, 3, " + std::to_string(side) + ", " +
                std::to_string(side) + "], got " + got.str() + " (see clip_preprocess)");
  }
  const int64_t batch = images.size(0);
  // [B, width, grid, grid] -> [B, grid^2, width], row-major patches after the class token.
  auto x = conv1->forward(images).flatten(2).transpose(1, 2);
  const auto cls = class_embedding.to(x.dtype()).view({1, 1, -1}).expand({batch, 1, x.size(2)});
  x = torch::cat({cls, x}, 1) + positional_embedding.to(x.dtype());
  x = transformer->forward(ln_pre->forward(x), /*causal=*/false);
  // ln_post on the class token alone equals open_clip's ln_post over all tokens, then pooling.
  return torch::matmul(ln_post->forward(x.select(1, 0)), proj);
}

}  // namespace dalle::models
