#pragma once
// The residual attention blocks both CLIP towers stack, named as in OpenAI's CLIP and
// open_clip so that their state dicts load by name: resblocks.N.ln_1, resblocks.N.attn
// (nn.MultiheadAttention's in_proj_weight, in_proj_bias, out_proj.{weight,bias}),
// resblocks.N.ln_2, resblocks.N.mlp.c_fc, resblocks.N.mlp.c_proj. Pre-LayerNorm:
// x + attn(ln_1(x)), then x + mlp(ln_2(x)).
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dalle::models {

enum class ClipActivation { gelu, quick_gelu };

// "gelu" (erf GELU, open_clip's default) or "quick_gelu" (x * sigmoid(1.702 x), OpenAI's
// released weights); throws for anything else.
ClipActivation parse_clip_activation(const std::string& name);
torch::Tensor clip_activation(const torch::Tensor& x, ClipActivation activation);

// Multi-head self-attention with nn.MultiheadAttention's packed input projection.
class ClipAttentionImpl : public torch::nn::Module {
 public:
  ClipAttentionImpl(int64_t width, int64_t heads);
  // [B, L, width] -> [B, L, width]; `causal`: position i attends to positions <= i only.
  torch::Tensor forward(const torch::Tensor& x, bool causal);

  torch::Tensor in_proj_weight, in_proj_bias;  // [3 width, width], [3 width]: q, k, v stacked
  torch::nn::Linear out_proj{nullptr};

 private:
  int64_t heads_;
};
TORCH_MODULE(ClipAttention);

// c_fc (width -> hidden), the activation, c_proj (hidden -> width).
class ClipMlpImpl : public torch::nn::Module {
 public:
  ClipMlpImpl(int64_t width, int64_t hidden, ClipActivation activation);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear c_fc{nullptr}, c_proj{nullptr};

 private:
  ClipActivation activation_;
};
TORCH_MODULE(ClipMlp);

class ClipResidualBlockImpl : public torch::nn::Module {
 public:
  ClipResidualBlockImpl(int64_t width, int64_t heads, int64_t mlp_width, ClipActivation activation);
  torch::Tensor forward(const torch::Tensor& x, bool causal);

  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  ClipAttention attn{nullptr};
  ClipMlp mlp{nullptr};
};
TORCH_MODULE(ClipResidualBlock);

// `resblocks.0` ... `resblocks.{layers-1}`, run in order on [B, L, width] (batch first).
class ClipTransformerImpl : public torch::nn::Module {
 public:
  ClipTransformerImpl(int64_t width, int64_t layers, int64_t heads, int64_t mlp_width, ClipActivation activation);
  torch::Tensor forward(torch::Tensor x, bool causal);
  const std::vector<ClipResidualBlock>& blocks() const { return blocks_; }
  int64_t width() const { return width_; }

 private:
  int64_t width_;
  std::vector<ClipResidualBlock> blocks_;
};
TORCH_MODULE(ClipTransformer);

}  // namespace dalle::models
