#pragma once
// The building blocks of taming-transformers' convolutional encoder and decoder, which
// ruDALL-E's VQGAN uses. Submodule and parameter names are taming's (norm1, conv1, norm2,
// conv2, nin_shortcut; norm, q, k, v, proj_out; downsample.conv, upsample.conv), so that
// its checkpoints load by name.
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <vector>

namespace dalle::models {

// taming's Normalize: GroupNorm with eps 1e-6 and affine parameters.
torch::nn::GroupNorm vqgan_norm(int64_t groups, int64_t channels);
// x * sigmoid(x), taming's "nonlinearity".
torch::Tensor swish(const torch::Tensor& x);

// norm1, swish, conv3x3, norm2, swish, conv3x3, plus a 1x1 `nin_shortcut` on the identity
// path where the widths differ.
class VqResnetBlockImpl : public torch::nn::Module {
 public:
  VqResnetBlockImpl(int64_t in, int64_t out, int64_t groups);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::GroupNorm norm1_{nullptr}, norm2_{nullptr};
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr}, nin_shortcut_{nullptr};
};
TORCH_MODULE(VqResnetBlock);

// Single-head self-attention over all positions, 1x1 convs for q, k, v and the output,
// added to the input.
class VqAttnBlockImpl : public torch::nn::Module {
 public:
  VqAttnBlockImpl(int64_t channels, int64_t groups);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::GroupNorm norm_{nullptr};
  torch::nn::Conv2d q_{nullptr}, k_{nullptr}, v_{nullptr}, proj_out_{nullptr};
};
TORCH_MODULE(VqAttnBlock);

// Pad right and bottom by one, then a stride-2 3x3 conv: halves even sides exactly.
class VqDownsampleImpl : public torch::nn::Module {
 public:
  explicit VqDownsampleImpl(int64_t channels);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::Conv2d conv_{nullptr};
};
TORCH_MODULE(VqDownsample);

// Nearest-neighbour 2x, then a 3x3 conv.
class VqUpsampleImpl : public torch::nn::Module {
 public:
  explicit VqUpsampleImpl(int64_t channels);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::Conv2d conv_{nullptr};
};
TORCH_MODULE(VqUpsample);

// One resolution level: `block.i` residual blocks, each followed by `attn.i` where the level
// attends, then `downsample` (encoder) or `upsample` (decoder) except at the last level.
// AttentionOrder::every_after_each_block runs all of the level's attention blocks, in order,
// after each residual block instead (block 0, attn 0, attn 1, block 1, attn 0, attn 1):
// vqgan-jax's order until its 2022-07-09 fix (VqganConfig::level_attention).
class VqLevelImpl : public torch::nn::Module {
 public:
  enum class Resample { none, down, up };
  enum class AttentionOrder { own_after_each_block, every_after_each_block };
  VqLevelImpl(int64_t in, int64_t out, int64_t blocks, bool attention, Resample resample, int64_t groups,
              AttentionOrder order = AttentionOrder::own_after_each_block);
  torch::Tensor forward(torch::Tensor x);

 private:
  std::vector<VqResnetBlock> blocks_;
  std::vector<VqAttnBlock> attention_;
  VqDownsample downsample_{nullptr};
  VqUpsample upsample_{nullptr};
  AttentionOrder order_;
};
TORCH_MODULE(VqLevel);

// block_1, attn_1, block_2 at the lowest resolution.
class VqMidImpl : public torch::nn::Module {
 public:
  VqMidImpl(int64_t channels, int64_t groups);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  VqResnetBlock block_1_{nullptr};
  VqAttnBlock attn_1_{nullptr};
  VqResnetBlock block_2_{nullptr};
};
TORCH_MODULE(VqMid);

}  // namespace dalle::models
