#include "dalle/models/vqgan_blocks.h"

#include <torch/torch.h>

namespace dalle::models {
namespace F = torch::nn::functional;

namespace {

torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t kernel, int64_t stride = 1) {
  // taming pads "same" for every stride-1 conv; the stride-2 conv pads by hand, asymmetrically.
  const int64_t padding = stride == 1 ? (kernel - 1) / 2 : 0;
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, kernel).stride(stride).padding(padding));
}

}  // namespace

torch::nn::GroupNorm vqgan_norm(int64_t groups, int64_t channels) {
  return torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, channels).eps(1e-6).affine(true));
}

torch::Tensor swish(const torch::Tensor& x) { return x * torch::sigmoid(x); }

VqResnetBlockImpl::VqResnetBlockImpl(int64_t in, int64_t out, int64_t groups) {
  norm1_ = register_module("norm1", vqgan_norm(groups, in));
  conv1_ = register_module("conv1", conv(in, out, 3));
  norm2_ = register_module("norm2", vqgan_norm(groups, out));
  conv2_ = register_module("conv2", conv(out, out, 3));
  if (in != out) nin_shortcut_ = register_module("nin_shortcut", conv(in, out, 1));
}

torch::Tensor VqResnetBlockImpl::forward(const torch::Tensor& x) {
  auto h = conv1_->forward(swish(norm1_->forward(x)));
  h = conv2_->forward(swish(norm2_->forward(h)));
  return (nin_shortcut_ ? nin_shortcut_->forward(x) : x) + h;
}

VqAttnBlockImpl::VqAttnBlockImpl(int64_t channels, int64_t groups) {
  norm_ = register_module("norm", vqgan_norm(groups, channels));
  q_ = register_module("q", conv(channels, channels, 1));
  k_ = register_module("k", conv(channels, channels, 1));
  v_ = register_module("v", conv(channels, channels, 1));
  proj_out_ = register_module("proj_out", conv(channels, channels, 1));
}

torch::Tensor VqAttnBlockImpl::forward(const torch::Tensor& x) {
  const auto h = norm_->forward(x);
  const int64_t b = x.size(0), c = x.size(1), height = x.size(2), width = x.size(3);
  // [B, C, H, W] -> [B, 1, HW, C]: one head whose width is every channel, scaled by 1/sqrt(C).
  auto tokens = [&](const torch::Tensor& t) { return t.reshape({b, 1, c, height * width}).transpose(2, 3); };
  const auto attended = torch::scaled_dot_product_attention(tokens(q_->forward(h)), tokens(k_->forward(h)),
                                                            tokens(v_->forward(h)));
  return x + proj_out_->forward(attended.transpose(2, 3).reshape({b, c, height, width}));
}

VqDownsampleImpl::VqDownsampleImpl(int64_t channels) { conv_ = register_module("conv", conv(channels, channels, 3, 2)); }

torch::Tensor VqDownsampleImpl::forward(const torch::Tensor& x) {
  return conv_->forward(F::pad(x, F::PadFuncOptions({0, 1, 0, 1})));
}

VqUpsampleImpl::VqUpsampleImpl(int64_t channels) { conv_ = register_module("conv", conv(channels, channels, 3)); }

torch::Tensor VqUpsampleImpl::forward(const torch::Tensor& x) {
  return conv_->forward(F::interpolate(
      x, F::InterpolateFuncOptions().scale_factor(std::vector<double>{2.0, 2.0}).mode(torch::kNearest)));
}

VqLevelImpl::VqLevelImpl(int64_t in, int64_t out, int64_t blocks, bool attention, Resample resample,
                         int64_t groups, AttentionOrder order)
    : order_(order) {
  torch::nn::ModuleList block, attn;
  for (int64_t i = 0; i < blocks; ++i) {
    blocks_.push_back(VqResnetBlock(i == 0 ? in : out, out, groups));
    block->push_back(blocks_.back());
    if (attention) {
      attention_.push_back(VqAttnBlock(out, groups));
      attn->push_back(attention_.back());
    }
  }
  register_module("block", block);
  register_module("attn", attn);
  if (resample == Resample::down) downsample_ = register_module("downsample", VqDownsample(out));
  if (resample == Resample::up) upsample_ = register_module("upsample", VqUpsample(out));
}

torch::Tensor VqLevelImpl::forward(torch::Tensor x) {
  for (size_t i = 0; i < blocks_.size(); ++i) {
    x = blocks_[i]->forward(x);
    if (attention_.empty()) continue;
    if (order_ == AttentionOrder::own_after_each_block) {
      x = attention_[i]->forward(x);
    } else {
      for (auto& attention : attention_) x = attention->forward(x);
    }
  }
  if (downsample_) return downsample_->forward(x);
  if (upsample_) return upsample_->forward(x);
  return x;
}

VqMidImpl::VqMidImpl(int64_t channels, int64_t groups) {
  block_1_ = register_module("block_1", VqResnetBlock(channels, channels, groups));
  attn_1_ = register_module("attn_1", VqAttnBlock(channels, groups));
  block_2_ = register_module("block_2", VqResnetBlock(channels, channels, groups));
}

torch::Tensor VqMidImpl::forward(const torch::Tensor& x) {
  return block_2_->forward(attn_1_->forward(block_1_->forward(x)));
}

}  // namespace dalle::models
