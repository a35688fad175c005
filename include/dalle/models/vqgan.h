#pragma once
// A VQGAN image tokenizer in the layout of ruDALL-E's `rudalle.vae.model.GumbelVQ`
// (taming-transformers' Encoder and Decoder), so that its checkpoints load by name:
// encoder.conv_in, encoder.down.L.block.B.norm1, encoder.down.L.attn.B.q,
// encoder.down.L.downsample.conv, encoder.mid.{block_1,attn_1,block_2}, encoder.norm_out,
// encoder.conv_out, quant_conv, quantize.{proj,embed}, post_quant_conv, decoder.conv_in,
// decoder.mid.*, decoder.up.L.block.B.*, decoder.up.L.upsample.conv, decoder.norm_out,
// decoder.conv_out. With the classic quantizer the codebook is `quantize.embedding` as in
// taming's VQModel. Every size comes from the config.
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dalle/config.h"
#include "dalle/models/image_tokenizer.h"
#include "dalle/models/vqgan_blocks.h"
#include "dalle/models/vqgan_quantizers.h"

namespace dalle::models {

struct VqganConfig {
  int64_t in_channels = 3;
  int64_t out_channels = 3;
  int64_t ch = 128;
  std::vector<int64_t> ch_mult{1, 1, 2, 4};
  int64_t num_res_blocks = 2;
  std::vector<int64_t> attn_resolutions{32};
  int64_t z_channels = 256;
  int64_t embed_dim = 256;
  int64_t n_embed = 8192;
  int64_t resolution = 256;
  int64_t norm_groups = 32;
  std::string quantizer = "gumbel";
  // The pixel range the encoder reads and the decoder writes: taming's and ruDALL-E's
  // [-1, 1], or [0, 1] as dalle-mini feeds the VQGAN that DALL-E Mega's tokens come from.
  std::string pixel_range = "minus_one_to_one";
  // The order of a level's attention blocks in the encoder: taming's (block i, then attn i),
  // or vqgan-jax's before its 2022-07-09 fix, every attention block after each residual
  // block, which made the tokens DALL-E Mega was trained on (docs/generate.md).
  std::string level_attention = "taming";

  void visit(ConfigVisitor& v);
  // Throws when the values are inconsistent with each other.
  void validate() const;
  int64_t levels() const { return static_cast<int64_t>(ch_mult.size()); }
  // One 2x downsampling between consecutive levels.
  int64_t downsampling_factor() const { return int64_t{1} << (levels() - 1); }
  bool gumbel() const { return quantizer == "gumbel"; }
  bool zero_to_one() const { return pixel_range == "zero_to_one"; }
  bool vqgan_jax_2021_attention() const { return level_attention == "vqgan_jax_2021"; }
  // Whether level `level` (0 = full resolution) has attention blocks: taming compares
  // the configured resolution at that level, not the actual input size, with attn_resolutions.
  bool attends_at(int64_t level) const;
};

class VqganEncoderImpl : public torch::nn::Module {
 public:
  explicit VqganEncoderImpl(const VqganConfig& config);
  // [B, in_channels, H, W] in [-1, 1] -> [B, z_channels, H/f, W/f].
  torch::Tensor forward(const torch::Tensor& x);

 private:
  VqganConfig config_;
  torch::nn::Conv2d conv_in_{nullptr}, conv_out_{nullptr};
  std::vector<VqLevel> down_;
  VqMid mid_{nullptr};
  torch::nn::GroupNorm norm_out_{nullptr};
};
TORCH_MODULE(VqganEncoder);

class VqganDecoderImpl : public torch::nn::Module {
 public:
  explicit VqganDecoderImpl(const VqganConfig& config);
  // [B, z_channels, h, w] -> [B, out_channels, h*f, w*f], images in about [-1, 1].
  torch::Tensor forward(const torch::Tensor& z);
  // conv_out's weight: the layer the adversarial weight is balanced at.
  torch::Tensor last_layer_weight() const { return conv_out_->weight; }

 private:
  VqganConfig config_;
  torch::nn::Conv2d conv_in_{nullptr}, conv_out_{nullptr};
  VqMid mid_{nullptr};
  std::vector<VqLevel> up_;  // by level: up_[0] is full resolution, run last
  torch::nn::GroupNorm norm_out_{nullptr};
};
TORCH_MODULE(VqganDecoder);

// The result of a training pass through the whole model.
struct VqganOutput {
  torch::Tensor reconstruction;  // [B, C, H, W] decoder output, in about [-1, 1]
  torch::Tensor latents;         // [B, embed_dim, h, w] what the quantizer received
  Quantized quantized;
};

class VqganImpl : public torch::nn::Module, public ImageTokenizer {
 public:
  explicit VqganImpl(const VqganConfig& config);

  // Images in the model's range -> quant_conv(encoder(x)), the latents the quantizer receives.
  torch::Tensor encode_latents(const torch::Tensor& x);
  // Code vectors -> decoder(post_quant_conv(codes)), images in about the model's range.
  torch::Tensor decode_codes(const torch::Tensor& codes);
  // Training pass on images in the model's range; `temperature` and `generator` feed the gumbel quantizer.
  VqganOutput forward(const torch::Tensor& x, double temperature = 1.0,
                      std::optional<at::Generator> generator = std::nullopt);
  // Gumbel quantizer only: the logits over codes of images in [0, 1].
  torch::Tensor logits(const torch::Tensor& images);

  // Images in [0, 1] -> the range the encoder reads (config.pixel_range): 2x - 1 for
  // minus_one_to_one, unchanged for zero_to_one.
  torch::Tensor to_model_range(const torch::Tensor& images) const;
  // Decoder output -> images in [0, 1]: clamp to [-1, 1] and (x + 1) / 2 for
  // minus_one_to_one (ruDALL-E's decode), clamp to [0, 1] for zero_to_one (dalle-mini's).
  torch::Tensor from_model_range(const torch::Tensor& decoded) const;

  // ruDALL-E's get_codebook_indices (without the flattening): to_model_range, then the argmax
  // of the logits (gumbel) or the nearest code (vector, taming's VQModel.encode).
  torch::Tensor encode_tokens(const torch::Tensor& images) override;
  // ruDALL-E's decode: codebook lookup, post_quant_conv, decoder, from_model_range.
  torch::Tensor decode_tokens(const torch::Tensor& tokens) override;
  int64_t vocab_size() const override { return config_.n_embed; }
  int64_t downsampling_factor() const override { return config_.downsampling_factor(); }
  torch::nn::Module& module() override { return *this; }

  const VqganConfig& config() const { return config_; }
  torch::Tensor lookup(const torch::Tensor& tokens);

  VqganEncoder encoder{nullptr};
  VqganDecoder decoder{nullptr};
  torch::nn::Conv2d quant_conv{nullptr}, post_quant_conv{nullptr};
  GumbelQuantizer gumbel{nullptr};   // set when config.quantizer is "gumbel"
  VectorQuantizer vector{nullptr};   // set when config.quantizer is "vector"

 private:
  void check_images(const torch::Tensor& x) const;
  void check_tokens(const torch::Tensor& tokens) const;
  VqganConfig config_;
};
TORCH_MODULE(Vqgan);

}  // namespace dalle::models
