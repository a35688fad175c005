#include "dalle/models/vqgan.h"

#include <torch/torch.h>

#include <algorithm>

#include "dalle/error.h"

namespace dalle::models {

namespace {

std::string join(const std::vector<int64_t>& values) {
  std::string text;
  for (size_t i = 0; i < values.size(); ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text;
}

torch::nn::Conv2d conv3x3(int64_t in, int64_t out) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1));
}

torch::nn::Conv2d conv1x1(int64_t in, int64_t out) { return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1)); }

}  // namespace

void VqganConfig::visit(ConfigVisitor& v) {
  v.field("in_channels", in_channels, "image channels the encoder reads", {.min = 1, .max = 16});
  v.field("out_channels", out_channels, "image channels the decoder writes (taming: out_ch)", {.min = 1, .max = 16});
  v.field("ch", ch, "channels of the first level; level L has ch * ch_mult[L] (ruDALL-E: 128)",
          {.min = 1, .max = 4096});
  v.field("ch_mult", ch_mult,
          "channel multiplier per resolution level; a 2x downsampling between consecutive levels, so the "
          "token grid is the image side / 2^(levels - 1) (ruDALL-E: [1, 1, 2, 4], f8)",
          {.min = 1, .max = 64});
  v.field("num_res_blocks", num_res_blocks,
          "residual blocks per level in the encoder; the decoder has one more (ruDALL-E: 2)", {.min = 1, .max = 16});
  v.field("attn_resolutions", attn_resolutions,
          "levels whose configured side (resolution / 2^level) is listed get self-attention after each "
          "block (ruDALL-E: [32])",
          {.min = 1, .max = 65536});
  v.field("z_channels", z_channels, "channels of the encoder's output and the decoder's input (ruDALL-E: 256)",
          {.min = 1, .max = 65536});
  v.field("embed_dim", embed_dim, "width of a code vector; quant_conv maps z_channels to it (ruDALL-E: 256)",
          {.min = 1, .max = 65536});
  v.field("n_embed", n_embed, "codebook size K, the image vocabulary (ruDALL-E: 8192)", {.min = 2, .max = 1 << 20});
  v.field("resolution", resolution,
          "image side the model is built for; decides where attention sits, any multiple of the "
          "downsampling factor can be encoded (ruDALL-E: 256)",
          {.min = 1, .max = 65536});
  v.field("norm_groups", norm_groups, "GroupNorm groups; every level's width must be a multiple (taming: 32)",
          {.min = 1, .max = 4096});
  v.field("quantizer", quantizer,
          "gumbel: ruDALL-E's GumbelQuantize (logits, hard gumbel-softmax in training, KL to uniform); "
          "vector: nearest code, straight-through, codebook + commitment loss",
          {.choices = {"gumbel", "vector"}});
  v.field("pixel_range", pixel_range,
          "pixels the encoder reads and the decoder writes: minus_one_to_one (taming, ruDALL-E: 2x - 1 on the way "
          "in, (x + 1) / 2 on the way out) or zero_to_one (dalle-mini's use of the VQGAN behind DALL-E Mega's tokens: "
          "images as they are)",
          {.choices = {"minus_one_to_one", "zero_to_one"}});
  v.field("level_attention", level_attention,
          "order of a level's attention blocks in the encoder (the decoder's is taming's): taming (block i, then "
          "attn i) or vqgan_jax_2021 (every attention block of the level after each residual block, as vqgan-jax "
          "ran them until its 2022-07-09 fix: the order behind DALL-E Mega's training tokens)",
          {.choices = {"taming", "vqgan_jax_2021"}});
}

void VqganConfig::validate() const {
  if (ch_mult.empty()) throw Error("vqgan: ch_mult needs at least one level");
  for (int64_t m : ch_mult) {
    if (m < 1) throw Error("vqgan: ch_mult entries must be positive, got [" + join(ch_mult) + "]");
    if ((ch * m) % norm_groups != 0) {
      throw Error("vqgan: every level's width ch * ch_mult (" + std::to_string(ch * m) +
                  ") must be a multiple of norm_groups (" + std::to_string(norm_groups) + ")");
    }
  }
  if (resolution % downsampling_factor() != 0) {
    throw Error("vqgan: resolution (" + std::to_string(resolution) + ") must be a multiple of 2^(levels - 1) = " +
                std::to_string(downsampling_factor()));
  }
  for (int64_t side : attn_resolutions) {
    bool found = false;
    for (int64_t level = 0; level < levels(); ++level) found = found || (resolution >> level) == side;
    if (!found) {
      std::vector<int64_t> sides;
      for (int64_t level = 0; level < levels(); ++level) sides.push_back(resolution >> level);
      throw Error("vqgan: attn_resolutions entry " + std::to_string(side) + " is no level's side (levels are " +
                  join(sides) + ")");
    }
  }
  if (quantizer != "gumbel" && quantizer != "vector") {
    throw Error("vqgan: quantizer must be 'gumbel' or 'vector', got '" + quantizer + "'");
  }
  if (pixel_range != "minus_one_to_one" && pixel_range != "zero_to_one") {
    throw Error("vqgan: pixel_range must be 'minus_one_to_one' or 'zero_to_one', got '" + pixel_range + "'");
  }
  if (level_attention != "taming" && level_attention != "vqgan_jax_2021") {
    throw Error("vqgan: level_attention must be 'taming' or 'vqgan_jax_2021', got '" + level_attention + "'");
  }
}

bool VqganConfig::attends_at(int64_t level) const {
  return std::find(attn_resolutions.begin(), attn_resolutions.end(), resolution >> level) != attn_resolutions.end();
}

VqganEncoderImpl::VqganEncoderImpl(const VqganConfig& config) : config_(config) {
  config.validate();
  conv_in_ = register_module("conv_in", conv3x3(config.in_channels, config.ch));
  torch::nn::ModuleList down;
  int64_t width = config.ch;
  for (int64_t level = 0; level < config.levels(); ++level) {
    const int64_t out = config.ch * config.ch_mult[level];
    const auto resample = level + 1 < config.levels() ? VqLevelImpl::Resample::down : VqLevelImpl::Resample::none;
    const auto order = config.vqgan_jax_2021_attention() ? VqLevelImpl::AttentionOrder::every_after_each_block
                                                         : VqLevelImpl::AttentionOrder::own_after_each_block;
    down_.push_back(
        VqLevel(width, out, config.num_res_blocks, config.attends_at(level), resample, config.norm_groups, order));
    down->push_back(down_.back());
    width = out;
  }
  register_module("down", down);
  mid_ = register_module("mid", VqMid(width, config.norm_groups));
  norm_out_ = register_module("norm_out", vqgan_norm(config.norm_groups, width));
  conv_out_ = register_module("conv_out", conv3x3(width, config.z_channels));
}

torch::Tensor VqganEncoderImpl::forward(const torch::Tensor& x) {
  auto h = conv_in_->forward(x);
  for (auto& level : down_) h = level->forward(h);
  return conv_out_->forward(swish(norm_out_->forward(mid_->forward(h))));
}

VqganDecoderImpl::VqganDecoderImpl(const VqganConfig& config) : config_(config) {
  config.validate();
  int64_t width = config.ch * config.ch_mult.back();
  conv_in_ = register_module("conv_in", conv3x3(config.z_channels, width));
  mid_ = register_module("mid", VqMid(width, config.norm_groups));
  // Built from the lowest resolution up, as it runs, but listed by level as taming lists them.
  up_.resize(static_cast<size_t>(config.levels()), nullptr);
  for (int64_t level = config.levels() - 1; level >= 0; --level) {
    const int64_t out = config.ch * config.ch_mult[level];
    const auto resample = level > 0 ? VqLevelImpl::Resample::up : VqLevelImpl::Resample::none;
    up_[level] = VqLevel(width, out, config.num_res_blocks + 1, config.attends_at(level), resample, config.norm_groups);
    width = out;
  }
  torch::nn::ModuleList up;
  for (auto& level : up_) up->push_back(level);
  register_module("up", up);
  norm_out_ = register_module("norm_out", vqgan_norm(config.norm_groups, width));
  conv_out_ = register_module("conv_out", conv3x3(width, config.out_channels));
}

torch::Tensor VqganDecoderImpl::forward(const torch::Tensor& z) {
  if (z.dim() != 4 || z.size(1) != config_.z_channels) {
    throw Error("vqgan decoder: expected [batch, " + std::to_string(config_.z_channels) + ", h, w] latents");
  }
  auto h = mid_->forward(conv_in_->forward(z));
  for (auto level = up_.rbegin(); level != up_.rend(); ++level) h = (*level)->forward(h);
  return conv_out_->forward(swish(norm_out_->forward(h)));
}

VqganImpl::VqganImpl(const VqganConfig& config) : config_(config) {
  config.validate();
  encoder = register_module("encoder", VqganEncoder(config));
  decoder = register_module("decoder", VqganDecoder(config));
  // ruDALL-E declares proj with z_channels inputs but feeds it quant_conv's embed_dim
  // outputs; the two are equal in every released model, and embed_dim is what works.
  if (config.gumbel()) gumbel = register_module("quantize", GumbelQuantizer(config.embed_dim, config.n_embed, config.embed_dim));
  else vector = register_module("quantize", VectorQuantizer(config.n_embed, config.embed_dim));
  quant_conv = register_module("quant_conv", conv1x1(config.z_channels, config.embed_dim));
  post_quant_conv = register_module("post_quant_conv", conv1x1(config.embed_dim, config.z_channels));
}

void VqganImpl::check_images(const torch::Tensor& x) const {
  if (x.dim() != 4 || x.size(1) != config_.in_channels) {
    throw Error("vqgan encoder: expected [batch, " + std::to_string(config_.in_channels) + ", H, W] images");
  }
  const int64_t f = config_.downsampling_factor();
  if (x.size(2) % f != 0 || x.size(3) % f != 0) {
    throw Error("vqgan encoder: image sides must be multiples of " + std::to_string(f) + ", got " +
                std::to_string(x.size(2)) + "x" + std::to_string(x.size(3)));
  }
}

void VqganImpl::check_tokens(const torch::Tensor& tokens) const {
  if (tokens.dim() != 3 || tokens.scalar_type() != torch::kInt64) {
    throw Error("vqgan: expected [batch, h, w] int64 tokens");
  }
  if (tokens.numel() > 0 && (tokens.min().item<int64_t>() < 0 || tokens.max().item<int64_t>() >= config_.n_embed)) {
    throw Error("vqgan: tokens must lie in [0, " + std::to_string(config_.n_embed) + ")");
  }
}

torch::Tensor VqganImpl::encode_latents(const torch::Tensor& x) {
  check_images(x);
  return quant_conv->forward(encoder->forward(x));
}

torch::Tensor VqganImpl::decode_codes(const torch::Tensor& codes) {
  return decoder->forward(post_quant_conv->forward(codes));
}

VqganOutput VqganImpl::forward(const torch::Tensor& x, double temperature, std::optional<at::Generator> generator) {
  VqganOutput out;
  out.latents = encode_latents(x);
  out.quantized = gumbel ? gumbel->forward(out.latents, temperature, std::move(generator))
                         : vector->forward(out.latents);
  out.reconstruction = decode_codes(out.quantized.codes);
  return out;
}

torch::Tensor VqganImpl::to_model_range(const torch::Tensor& images) const {
  return config_.zero_to_one() ? images : images * 2 - 1;
}

torch::Tensor VqganImpl::from_model_range(const torch::Tensor& decoded) const {
  return config_.zero_to_one() ? decoded.clamp(0.0, 1.0) : (decoded.clamp(-1.0, 1.0) + 1.0) * 0.5;
}

torch::Tensor VqganImpl::logits(const torch::Tensor& images) {
  if (!gumbel) throw Error("vqgan: logits exist only with the gumbel quantizer");
  return gumbel->logits(encode_latents(to_model_range(images)));
}

torch::Tensor VqganImpl::encode_tokens(const torch::Tensor& images) {
  if (gumbel) return logits(images).argmax(1);
  return vector->nearest(encode_latents(to_model_range(images)));
}

torch::Tensor VqganImpl::lookup(const torch::Tensor& tokens) {
  check_tokens(tokens);
  return gumbel ? gumbel->lookup(tokens) : vector->lookup(tokens);
}

torch::Tensor VqganImpl::decode_tokens(const torch::Tensor& tokens) {
  return from_model_range(decode_codes(lookup(tokens)));
}

}  // namespace dalle::models
