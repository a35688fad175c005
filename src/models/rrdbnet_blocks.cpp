#include "dalle/models/rrdbnet_blocks.h"

#include <torch/torch.h>

namespace dalle::models {
namespace F = torch::nn::functional;

namespace {

torch::nn::Conv2d conv3x3(int64_t in, int64_t out) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1));
}

// basicsr's default_init_weights(..., 0.1): kaiming_normal_ (fan_in, gain sqrt(2)) scaled
// down, so that a fresh dense block starts close to the identity.
void init_small(torch::nn::Conv2d& conv, double scale) {
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_normal_(conv->weight);
  conv->weight.mul_(scale);
  conv->bias.zero_();
}

torch::Tensor lrelu(const torch::Tensor& x) { return F::leaky_relu(x, F::LeakyReLUFuncOptions().negative_slope(kRrdbLeakySlope)); }

}  // namespace

ResidualDenseBlockImpl::ResidualDenseBlockImpl(int64_t num_feat, int64_t num_grow_ch) {
  conv1_ = register_module("conv1", conv3x3(num_feat, num_grow_ch));
  conv2_ = register_module("conv2", conv3x3(num_feat + num_grow_ch, num_grow_ch));
  conv3_ = register_module("conv3", conv3x3(num_feat + 2 * num_grow_ch, num_grow_ch));
  conv4_ = register_module("conv4", conv3x3(num_feat + 3 * num_grow_ch, num_grow_ch));
  conv5_ = register_module("conv5", conv3x3(num_feat + 4 * num_grow_ch, num_feat));
  for (auto* conv : {&conv1_, &conv2_, &conv3_, &conv4_, &conv5_}) init_small(*conv, 0.1);
}

torch::Tensor ResidualDenseBlockImpl::forward(const torch::Tensor& x) {
  const auto x1 = lrelu(conv1_->forward(x));
  const auto x2 = lrelu(conv2_->forward(torch::cat({x, x1}, 1)));
  const auto x3 = lrelu(conv3_->forward(torch::cat({x, x1, x2}, 1)));
  const auto x4 = lrelu(conv4_->forward(torch::cat({x, x1, x2, x3}, 1)));
  const auto x5 = conv5_->forward(torch::cat({x, x1, x2, x3, x4}, 1));
  return x5 * kRrdbResidualScale + x;
}

RrdbImpl::RrdbImpl(int64_t num_feat, int64_t num_grow_ch) {
  rdb1_ = register_module("rdb1", ResidualDenseBlock(num_feat, num_grow_ch));
  rdb2_ = register_module("rdb2", ResidualDenseBlock(num_feat, num_grow_ch));
  rdb3_ = register_module("rdb3", ResidualDenseBlock(num_feat, num_grow_ch));
}

torch::Tensor RrdbImpl::forward(const torch::Tensor& x) {
  return rdb3_->forward(rdb2_->forward(rdb1_->forward(x))) * kRrdbResidualScale + x;
}

}  // namespace dalle::models
