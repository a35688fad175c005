#include "dalle/models/patch_discriminator.h"

#include <torch/torch.h>

#include <algorithm>

#include "dalle/error.h"

namespace dalle::models {

namespace {

torch::nn::Conv2d conv4x4(int64_t in, int64_t out, int64_t stride, bool bias) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 4).stride(stride).padding(1).bias(bias));
}

torch::nn::LeakyReLU leaky() { return torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)); }

}  // namespace

PatchDiscriminatorImpl::PatchDiscriminatorImpl(int64_t in_channels, int64_t channels, int64_t layers) {
  if (layers < 1) throw Error("patch discriminator: layers must be at least 1");
  // Widths double per layer up to 8x; convs followed by BatchNorm need no bias.
  main_->push_back(conv4x4(in_channels, channels, 2, true));
  main_->push_back(leaky());
  int64_t width = channels;
  for (int64_t n = 1; n <= layers; ++n) {
    const int64_t out = channels * std::min<int64_t>(int64_t{1} << n, 8);
    main_->push_back(conv4x4(width, out, n < layers ? 2 : 1, false));
    main_->push_back(torch::nn::BatchNorm2d(out));
    main_->push_back(leaky());
    width = out;
  }
  main_->push_back(conv4x4(width, 1, 1, true));
  register_module("main", main_);

  // taming's weights_init: convs N(0, 0.02), BatchNorm gains N(1, 0.02) and zero biases.
  torch::NoGradGuard no_grad;
  for (auto& child : main_->children()) {
    if (auto* conv = child->as<torch::nn::Conv2dImpl>()) conv->weight.normal_(0.0, 0.02);
    if (auto* norm = child->as<torch::nn::BatchNorm2dImpl>()) {
      norm->weight.normal_(1.0, 0.02);
      norm->bias.zero_();
    }
  }
}

torch::Tensor PatchDiscriminatorImpl::forward(const torch::Tensor& x) {
  if (x.dim() != 4) throw Error("patch discriminator: expected [batch, channels, H, W] images");
  return main_->forward(x);
}

int64_t PatchDiscriminatorImpl::min_image_size(int64_t layers) {
  // Each stride-2 conv halves the side, the two stride-1 convs take one pixel each.
  return int64_t{3} << layers;
}

torch::Tensor discriminator_hinge_loss(const torch::Tensor& real_logits, const torch::Tensor& fake_logits) {
  return 0.5 * (torch::relu(1.0 - real_logits).mean() + torch::relu(1.0 + fake_logits).mean());
}

torch::Tensor generator_hinge_loss(const torch::Tensor& fake_logits) { return -fake_logits.mean(); }

}  // namespace dalle::models
