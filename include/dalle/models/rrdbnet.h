#pragma once
// Real-ESRGAN's generator: basicsr 1.4.2's `RRDBNet(num_in_ch, num_out_ch, scale, num_feat,
// num_block, num_grow_ch)` (ESRGAN's network, extended by Real-ESRGAN to x2 and x1 through
// a pixel-unshuffle of the input), plus ruDALL-E's x8 variant with a third upsampling conv.
// Parameter names are basicsr's, so released weights load by name:
//   conv_first, body.N.rdb{1,2,3}.conv{1..5}, conv_body, conv_up1, conv_up2, [conv_up3],
//   conv_hr, conv_last (each .weight and .bias).
// Forward: pixel-unshuffle by 4 (x1) or 2 (x2), conv_first, feat + conv_body(body(feat)),
// then two (three for x8) rounds of nearest 2x upsampling, conv_upK and LeakyReLU(0.2),
// then conv_last(lrelu(conv_hr(.))). Images are in [0, 1]; the output is not clamped.
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>

#include <cstdint>
#include <vector>

#include "dalle/config.h"
#include "dalle/models/rrdbnet_blocks.h"

namespace dalle::models {

struct RrdbNetConfig {
  int64_t num_in_ch = 3;
  int64_t num_out_ch = 3;
  int64_t scale = 4;
  int64_t num_feat = 64;
  int64_t num_block = 23;
  int64_t num_grow_ch = 32;

  void visit(ConfigVisitor& v);
  // Throws unless the scale is 1, 2, 4 or 8.
  void validate() const;
  // The input is pixel-unshuffled by this before conv_first: 4 for x1, 2 for x2, 1 otherwise.
  // Input sides must be multiples of it.
  int64_t unshuffle_factor() const;
  // Nearest 2x upsamplings: 3 for x8, 2 otherwise.
  int64_t upsamplings() const { return scale == 8 ? 3 : 2; }
  // A bound, in input pixels, on how far an output pixel's receptive field reaches from the
  // input pixel it lies over: a change to the input farther away than this leaves it as it
  // is. u * (3x3 convs at the unshuffled resolution + 3), u the unshuffle factor.
  int64_t receptive_radius() const;
};

class RrdbNetImpl : public torch::nn::Module {
 public:
  explicit RrdbNetImpl(const RrdbNetConfig& config);
  // [B, num_in_ch, H, W] -> [B, num_out_ch, H * scale, W * scale]; H and W multiples of the
  // unshuffle factor.
  torch::Tensor forward(const torch::Tensor& x);
  const RrdbNetConfig& config() const { return config_; }

 private:
  RrdbNetConfig config_;
  torch::nn::Conv2d conv_first_{nullptr}, conv_body_{nullptr};
  std::vector<Rrdb> body_;
  std::vector<torch::nn::Conv2d> conv_up_;  // conv_up1, conv_up2[, conv_up3]
  torch::nn::Conv2d conv_hr_{nullptr}, conv_last_{nullptr};
};
TORCH_MODULE(RrdbNet);

}  // namespace dalle::models
