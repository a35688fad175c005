#pragma once
// The PatchGAN discriminator taming-transformers trains its VQGANs against (pix2pix's
// NLayerDiscriminator): 4x4 convs, stride 2 for the first `layers`, then two of stride 1,
// BatchNorm and LeakyReLU(0.2) between; one logit per overlapping patch. Parameters are
// named main.N.* as taming's, so its `loss.discriminator.*` weights load by name.
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>

namespace dalle::models {

class PatchDiscriminatorImpl : public torch::nn::Module {
 public:
  PatchDiscriminatorImpl(int64_t in_channels, int64_t channels, int64_t layers);
  // [B, C, H, W] images in [-1, 1] -> [B, 1, h, w] patch logits (real > 0 > fake).
  torch::Tensor forward(const torch::Tensor& x);
  // The smallest image side that leaves at least one patch.
  static int64_t min_image_size(int64_t layers);

 private:
  torch::nn::Sequential main_;
};
TORCH_MODULE(PatchDiscriminator);

// Hinge losses: the discriminator's 0.5 (mean relu(1 - real) + mean relu(1 + fake)), and the
// generator's -mean(fake).
torch::Tensor discriminator_hinge_loss(const torch::Tensor& real_logits, const torch::Tensor& fake_logits);
torch::Tensor generator_hinge_loss(const torch::Tensor& fake_logits);

}  // namespace dalle::models
