#include "dalle/models/rrdbnet.h"

#include <torch/torch.h>

#include "dalle/error.h"

namespace dalle::models {
namespace F = torch::nn::functional;

namespace {

torch::nn::Conv2d conv3x3(int64_t in, int64_t out) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1));
}

torch::Tensor lrelu(const torch::Tensor& x) {
  return F::leaky_relu(x, F::LeakyReLUFuncOptions().negative_slope(kRrdbLeakySlope));
}

torch::Tensor upsample_nearest_2x(const torch::Tensor& x) {
  return F::interpolate(x, F::InterpolateFuncOptions().scale_factor(std::vector<double>{2.0, 2.0}).mode(torch::kNearest));
}

}  // namespace

void RrdbNetConfig::visit(ConfigVisitor& v) {
  v.field("num_in_ch", num_in_ch, "image channels the network reads", {.min = 1, .max = 16});
  v.field("num_out_ch", num_out_ch, "image channels the network writes", {.min = 1, .max = 16});
  v.field("scale", scale,
          "upscaling factor: 4 and 8 upsample the input as it is (8: ruDALL-E's third upsampling conv), 2 and 1 "
          "pixel-unshuffle it by 2 and 4 first (Real-ESRGAN); 1, 2, 4 or 8",
          {.min = 1, .max = 8});
  v.field("num_feat", num_feat, "channels of the trunk (Real-ESRGAN: 64)", {.min = 1, .max = 4096});
  v.field("num_block", num_block, "residual-in-residual dense blocks in the trunk (Real-ESRGAN: 23)",
          {.min = 1, .max = 1024});
  v.field("num_grow_ch", num_grow_ch, "channels each dense conv adds (Real-ESRGAN: 32)", {.min = 1, .max = 4096});
}

void RrdbNetConfig::validate() const {
  if (scale != 1 && scale != 2 && scale != 4 && scale != 8) {
    throw Error("rrdbnet: scale must be 1, 2, 4 or 8, got " + std::to_string(scale));
  }
  if (num_in_ch < 1 || num_out_ch < 1 || num_feat < 1 || num_block < 1 || num_grow_ch < 1) {
    throw Error("rrdbnet: num_in_ch, num_out_ch, num_feat, num_block and num_grow_ch must be positive");
  }
}

int64_t RrdbNetConfig::unshuffle_factor() const {
  if (scale == 1) return 4;
  if (scale == 2) return 2;
  return 1;
}

int64_t RrdbNetConfig::receptive_radius() const {
  // Each 3x3 conv at the unshuffled resolution reaches u input pixels further; conv_first,
  // 15 per RRDB and conv_body run there. The convs after the upsamplings reach at most
  // u/2 + u/4 + u/4 + u/4 < 1.25u more, the unshuffle block and nearest rounding u - 1 + 1.
  const int64_t trunk_convs = 2 + 15 * num_block;
  return unshuffle_factor() * (trunk_convs + 3);
}

RrdbNetImpl::RrdbNetImpl(const RrdbNetConfig& config) : config_(config) {
  config.validate();
  const int64_t u = config.unshuffle_factor();
  conv_first_ = register_module("conv_first", conv3x3(config.num_in_ch * u * u, config.num_feat));
  torch::nn::ModuleList body;
  for (int64_t i = 0; i < config.num_block; ++i) {
    body_.push_back(Rrdb(config.num_feat, config.num_grow_ch));
    body->push_back(body_.back());
  }
  register_module("body", body);
  conv_body_ = register_module("conv_body", conv3x3(config.num_feat, config.num_feat));
  for (int64_t k = 1; k <= config.upsamplings(); ++k) {
    conv_up_.push_back(register_module("conv_up" + std::to_string(k), conv3x3(config.num_feat, config.num_feat)));
  }
  conv_hr_ = register_module("conv_hr", conv3x3(config.num_feat, config.num_feat));
  conv_last_ = register_module("conv_last", conv3x3(config.num_feat, config.num_out_ch));
}

torch::Tensor RrdbNetImpl::forward(const torch::Tensor& x) {
  const int64_t u = config_.unshuffle_factor();
  if (x.dim() != 4 || x.size(1) != config_.num_in_ch) {
    throw Error("rrdbnet: expected [batch, " + std::to_string(config_.num_in_ch) + ", H, W] images");
  }
  if (x.size(2) % u != 0 || x.size(3) % u != 0) {
    throw Error("rrdbnet: at scale " + std::to_string(config_.scale) + " the input is pixel-unshuffled by " +
                std::to_string(u) + ", so its sides must be multiples of " + std::to_string(u) + ", got " +
                std::to_string(x.size(2)) + "x" + std::to_string(x.size(3)));
  }
  // torch's pixel_unshuffle orders channels c * u^2 + i * u + j, as basicsr's does.
  auto feat = conv_first_->forward(u > 1 ? torch::pixel_unshuffle(x, u) : x);
  auto trunk = feat;
  for (auto& block : body_) trunk = block->forward(trunk);
  feat = feat + conv_body_->forward(trunk);
  for (auto& conv : conv_up_) feat = lrelu(conv->forward(upsample_nearest_2x(feat)));
  return conv_last_->forward(lrelu(conv_hr_->forward(feat)));
}

}  // namespace dalle::models
