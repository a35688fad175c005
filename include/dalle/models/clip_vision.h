#pragma once
// CLIP's image tower, a ViT named as open_clip's VisionTransformer (`visual.` in the full
// model): conv1 (patch embedding, no bias), class_embedding, positional_embedding, ln_pre,
// transformer.resblocks.N, ln_post, proj. The class token's output, after ln_post, times
// proj is the image feature.
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>

#include "dalle/models/clip_config.h"
#include "dalle/models/clip_transformer.h"

namespace dalle::models {

class ClipVisionTransformerImpl : public torch::nn::Module {
 public:
  explicit ClipVisionTransformerImpl(const ClipConfig& config);
  // Preprocessed (normalised) images [B, 3, image_size, image_size] -> [B, embed_dim].
  torch::Tensor forward(const torch::Tensor& images);

  torch::nn::Conv2d conv1{nullptr};
  torch::Tensor class_embedding, positional_embedding, proj;
  torch::nn::LayerNorm ln_pre{nullptr}, ln_post{nullptr};
  ClipTransformer transformer{nullptr};

 private:
  ClipConfig config_;
};
TORCH_MODULE(ClipVisionTransformer);

}  // namespace dalle::models
