#include "dalle/models/clip_transformer.h"

#include <torch/torch.h>

#include "dalle/error.h"

namespace dalle::models {
namespace F = torch::nn::functional;

ClipActivation parse_clip_activation(const std::string& name) {
  if (name == "gelu") return ClipActivation::gelu;
  if (name == "quick_gelu") return ClipActivation::quick_gelu;
  throw Error("clip: activation must be 'gelu' or 'quick_gelu', got '" + name + "'");
}

torch::Tensor clip_activation(const torch::Tensor& x, ClipActivation activation) {
  if (activation == ClipActivation::quick_gelu) return x * torch::sigmoid(1.702 * x);
  return torch::gelu(x);
}

ClipAttentionImpl::ClipAttentionImpl(int64_t width, int64_t heads) : heads_(heads) {
  if (heads < 1 || width % heads != 0) {
    throw Error("clip: attention width " + std::to_string(width) + " is not a multiple of its " +
                std::to_string(heads) + " heads");
  }
  // nn.MultiheadAttention's initialisation: xavier-uniform packed projection, zero biases.
  in_proj_weight = register_parameter("in_proj_weight", torch::empty({3 * width, width}));
  torch::nn::init::xavier_uniform_(in_proj_weight);
  in_proj_bias = register_parameter("in_proj_bias", torch::zeros({3 * width}));
  out_proj = register_module("out_proj", torch::nn::Linear(width, width));
  torch::nn::init::zeros_(out_proj->bias);
}

torch::Tensor ClipAttentionImpl::forward(const torch::Tensor& x, bool causal) {
  const int64_t batch = x.size(0), length = x.size(1), width = x.size(2);
  // [B, L, 3W] -> 3 x [B, heads, L, head width]
  const auto qkv = F::linear(x, in_proj_weight, in_proj_bias)
                       .view({batch, length, 3, heads_, width / heads_})
                       .permute({2, 0, 3, 1, 4});
  const auto attended = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], /*attn_mask=*/{},
                                                         /*dropout_p=*/0.0, /*is_causal=*/causal);
  return out_proj->forward(attended.transpose(1, 2).reshape({batch, length, width}));
}

ClipMlpImpl::ClipMlpImpl(int64_t width, int64_t hidden, ClipActivation activation) : activation_(activation) {
  c_fc = register_module("c_fc", torch::nn::Linear(width, hidden));
  c_proj = register_module("c_proj", torch::nn::Linear(hidden, width));
}

torch::Tensor ClipMlpImpl::forward(const torch::Tensor& x) {
  return c_proj->forward(clip_activation(c_fc->forward(x), activation_));
}

namespace {

torch::nn::LayerNorm layer_norm(int64_t width) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({width}).eps(1e-5));
}

}  // namespace

ClipResidualBlockImpl::ClipResidualBlockImpl(int64_t width, int64_t heads, int64_t mlp_width,
                                             ClipActivation activation) {
  ln_1 = register_module("ln_1", layer_norm(width));
  attn = register_module("attn", ClipAttention(width, heads));
  ln_2 = register_module("ln_2", layer_norm(width));
  mlp = register_module("mlp", ClipMlp(width, mlp_width, activation));
}

torch::Tensor ClipResidualBlockImpl::forward(const torch::Tensor& x, bool causal) {
  const auto h = x + attn->forward(ln_1->forward(x), causal);
  return h + mlp->forward(ln_2->forward(h));
}

ClipTransformerImpl::ClipTransformerImpl(int64_t width, int64_t layers, int64_t heads, int64_t mlp_width,
                                         ClipActivation activation)
    : width_(width) {
  torch::nn::ModuleList resblocks;
  for (int64_t i = 0; i < layers; ++i) {
    blocks_.push_back(ClipResidualBlock(width, heads, mlp_width, activation));
    resblocks->push_back(blocks_.back());
  }
  register_module("resblocks", resblocks);
}

torch::Tensor ClipTransformerImpl::forward(torch::Tensor x, bool causal) {
  if (x.dim() != 3 || x.size(2) != width_) {
    throw Error("clip transformer: expected [batch, length, " + std::to_string(width_) + "] activations");
  }
  for (auto& block : blocks_) x = block->forward(x, causal);
  return x;
}

}  // namespace dalle::models
