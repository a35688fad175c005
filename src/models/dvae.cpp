#include "dalle/models/dvae.h"

#include <torch/torch.h>

#include <cmath>

#include "dalle/error.h"

namespace dalle::models {

torch::Tensor map_pixels(const torch::Tensor& image, double epsilon) {
  return image * (1.0 - 2.0 * epsilon) + epsilon;
}

torch::Tensor unmap_pixels(const torch::Tensor& image, double epsilon) {
  return ((image - epsilon) / (1.0 - 2.0 * epsilon)).clamp(0.0, 1.0);
}
namespace F = torch::nn::functional;

void DvaeConfig::validate() const {
  if (downsamplings > groups - 1) {
    throw Error("dvae: downsamplings (" + std::to_string(downsamplings) + ") must be at most groups - 1 (" +
                std::to_string(groups - 1) + ")");
  }
  if (hidden % 4 != 0) throw Error("dvae: hidden must be a multiple of 4 (blocks are 4x narrower inside)");
}

DvaeConv2dImpl::DvaeConv2dImpl(int64_t in, int64_t out, int64_t kernel) : padding_((kernel - 1) / 2) {
  // OpenAI's initialisation: N(0, 1 / fan_in), zero bias.
  w = register_parameter("w", torch::randn({out, in, kernel, kernel}) / std::sqrt(double(in * kernel * kernel)));
  b = register_parameter("b", torch::zeros({out}));
}

torch::Tensor DvaeConv2dImpl::forward(const torch::Tensor& x) {
  return F::conv2d(x, w, F::Conv2dFuncOptions().bias(b).padding(padding_));
}

DvaeBlockImpl::DvaeBlockImpl(int64_t in, int64_t out, int64_t layers, Kind kind)
    : post_gain_(1.0 / double(layers * layers)) {
  const int64_t hid = out / 4;
  if (in != out) id_path_ = register_module("id_path", DvaeConv2d(in, out, 1));
  const bool encoder = kind == Kind::encoder;
  const int64_t kernels[4] = {encoder ? 3 : 1, 3, 3, encoder ? 1 : 3};
  const int64_t widths[5] = {in, hid, hid, hid, out};
  for (int i = 0; i < 4; ++i) {
    res_path_->push_back("relu_" + std::to_string(i + 1), torch::nn::ReLU());
    res_path_->push_back("conv_" + std::to_string(i + 1), DvaeConv2d(widths[i], widths[i + 1], kernels[i]));
  }
  register_module("res_path", res_path_);
}

torch::Tensor DvaeBlockImpl::forward(const torch::Tensor& x) {
  return (id_path_ ? id_path_->forward(x) : x) + post_gain_ * res_path_->forward(x);
}

namespace {

int64_t group_width(const DvaeConfig& config, int64_t group) {  // group is 1-based
  return config.hidden << (group - 1);
}

}  // namespace

DvaeEncoderImpl::DvaeEncoderImpl(const DvaeConfig& config) : config_(config) {
  config.validate();
  const int64_t layers = config.groups * config.blocks_per_group;
  blocks_->push_back("input", DvaeConv2d(config.input_channels, config.hidden, 7));
  for (int64_t g = 1; g <= config.groups; ++g) {
    Stack group;
    for (int64_t i = 0; i < config.blocks_per_group; ++i) {
      const int64_t in = i == 0 ? group_width(config, std::max<int64_t>(g - 1, 1)) : group_width(config, g);
      group->push_back("block_" + std::to_string(i + 1),
                       DvaeBlock(in, group_width(config, g), layers, DvaeBlockImpl::Kind::encoder));
    }
    if (g <= config.downsamplings) group->push_back("pool", torch::nn::MaxPool2d(2));
    blocks_->push_back("group_" + std::to_string(g), group);
  }
  Stack output;
  output->push_back("relu", torch::nn::ReLU());
  output->push_back("conv", DvaeConv2d(group_width(config, config.groups), config.vocab_size, 1));
  blocks_->push_back("output", output);
  register_module("blocks", blocks_);
}

torch::Tensor DvaeEncoderImpl::forward(const torch::Tensor& x) {
  if (x.dim() != 4 || x.size(1) != config_.input_channels) {
    throw Error("dvae encoder: expected [batch, " + std::to_string(config_.input_channels) + ", H, W] pixels");
  }
  const int64_t f = config_.downsampling_factor();
  if (x.size(2) % f != 0 || x.size(3) % f != 0) {
    throw Error("dvae encoder: image sides must be multiples of " + std::to_string(f));
  }
  return blocks_->forward(x);
}

DvaeDecoderImpl::DvaeDecoderImpl(const DvaeConfig& config) : config_(config) {
  config.validate();
  const int64_t layers = config.groups * config.blocks_per_group;
  blocks_->push_back("input", DvaeConv2d(config.vocab_size, config.decoder_init, 1));
  for (int64_t g = 1; g <= config.groups; ++g) {
    // The decoder mirrors the encoder: group g is as wide as encoder group (groups - g + 1).
    const int64_t width = group_width(config, config.groups - g + 1);
    Stack group;
    for (int64_t i = 0; i < config.blocks_per_group; ++i) {
      const int64_t in = i > 0 ? width : g == 1 ? config.decoder_init : group_width(config, config.groups - g + 2);
      group->push_back("block_" + std::to_string(i + 1), DvaeBlock(in, width, layers, DvaeBlockImpl::Kind::decoder));
    }
    if (g <= config.downsamplings) {
      group->push_back("upsample", torch::nn::Upsample(torch::nn::UpsampleOptions()
                                                           .scale_factor(std::vector<double>{2.0, 2.0})
                                                           .mode(torch::kNearest)));
    }
    blocks_->push_back("group_" + std::to_string(g), group);
  }
  Stack output;
  output->push_back("relu", torch::nn::ReLU());
  output->push_back("conv", DvaeConv2d(config.hidden, 2 * config.input_channels, 1));
  blocks_->push_back("output", output);
  register_module("blocks", blocks_);
}

torch::Tensor DvaeDecoderImpl::forward(const torch::Tensor& z) {
  if (z.dim() != 4 || z.size(1) != config_.vocab_size) {
    throw Error("dvae decoder: expected [batch, " + std::to_string(config_.vocab_size) + ", h, w] codes");
  }
  return blocks_->forward(z);
}

DvaeImpl::DvaeImpl(const DvaeConfig& config) : config_(config) {
  encoder = register_module("encoder", DvaeEncoder(config));
  decoder = register_module("decoder", DvaeDecoder(config));
}

torch::Tensor DvaeImpl::encode_tokens(const torch::Tensor& images) {
  return encoder->forward(map_pixels(images)).argmax(1);
}

torch::Tensor DvaeImpl::decode_tokens(const torch::Tensor& tokens) {
  // Scattered straight into float: one_hot would build an int64 tensor 2x the size first.
  auto codes = torch::zeros({tokens.size(0), config_.vocab_size, tokens.size(1), tokens.size(2)},
                            torch::TensorOptions().device(tokens.device()))
                   .scatter_(1, tokens.unsqueeze(1), 1.0);
  return reconstruction(decoder->forward(codes));
}

torch::Tensor DvaeImpl::reconstruction(const torch::Tensor& decoder_output) {
  return unmap_pixels(mapped_reconstruction(decoder_output));
}

torch::Tensor DvaeImpl::mapped_reconstruction(const torch::Tensor& decoder_output) {
  const int64_t channels = decoder_output.size(1) / 2;
  return torch::sigmoid(decoder_output.slice(1, 0, channels));
}

}  // namespace dalle::models
