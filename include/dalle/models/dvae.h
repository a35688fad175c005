#pragma once
// OpenAI's discrete VAE (DALL-E stage 1), laid out as the released `dall_e` package so that
// its weights load by name: blocks.input.w, blocks.group_1.block_1.res_path.conv_1.w, ...,
// blocks.output.conv.w. No normalisation anywhere; every conv is stride 1 with "same"
// padding; residual branches are scaled by 1 / (groups * blocks_per_group)^2.
// Sizes are configurable so that a tiny CPU model and the 8192-token, 32x32 model share
// one code path.
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>

#include "dalle/config.h"
#include "dalle/models/image_tokenizer.h"

namespace dalle::models {

// The dVAE's pixel range: x -> (1 - 2 eps) x + eps keeps logits finite; unmap clamps back.
inline constexpr double kDvaePixelEpsilon = 0.1;
torch::Tensor map_pixels(const torch::Tensor& image, double epsilon = kDvaePixelEpsilon);
torch::Tensor unmap_pixels(const torch::Tensor& image, double epsilon = kDvaePixelEpsilon);

struct DvaeConfig {
  int64_t input_channels = 3;
  int64_t hidden = 256;          // n_hid: width of the first group; group g is 2^(g-1) times wider
  int64_t decoder_init = 128;    // n_init: width of the decoder's input conv (the codebook)
  int64_t groups = 4;
  int64_t blocks_per_group = 2;
  int64_t downsamplings = 3;     // groups followed by a 2x max-pool (encoder) / upsample (decoder)
  int64_t vocab_size = 8192;

  void visit(ConfigVisitor& v) {
    v.field("input_channels", input_channels, "image channels", {.min = 1, .max = 16});
    v.field("hidden", hidden, "n_hid: channels of the first group; each later group doubles them (OpenAI: 256)",
            {.min = 4, .max = 4096});
    v.field("decoder_init", decoder_init, "n_init: channels of the decoder's input conv (OpenAI: 128)",
            {.min = 1, .max = 4096});
    v.field("groups", groups, "groups of residual blocks in each of encoder and decoder (OpenAI: 4)",
            {.min = 1, .max = 8});
    v.field("blocks_per_group", blocks_per_group, "residual blocks per group (OpenAI: 2)", {.min = 1, .max = 16});
    v.field("downsamplings", downsamplings,
            "2x downsamplings: the token grid is the image side / 2^downsamplings (OpenAI: 3, 256 -> 32); "
            "at most groups - 1",
            {.min = 0, .max = 7});
    v.field("vocab_size", vocab_size, "codebook size K (OpenAI: 8192)", {.min = 2, .max = 1 << 20});
  }
  // Throws when the values are inconsistent with each other.
  void validate() const;
  int64_t downsampling_factor() const { return int64_t{1} << downsamplings; }
};

// A named sequence of modules taking and returning one tensor. torch::nn::Sequential cannot
// hold another Sequential (its forward is a template), and the released layout nests them.
class StackImpl : public torch::nn::SequentialImpl {
 public:
  using SequentialImpl::SequentialImpl;
  torch::Tensor forward(torch::Tensor x) { return SequentialImpl::forward(std::move(x)); }
};
TORCH_MODULE(Stack);

// A conv whose parameters are named `w` and `b`, as in the released weights.
class DvaeConv2dImpl : public torch::nn::Module {
 public:
  DvaeConv2dImpl(int64_t in, int64_t out, int64_t kernel);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor w, b;

 private:
  int64_t padding_;
};
TORCH_MODULE(DvaeConv2d);

// id_path + post_gain * res_path, where res_path is ReLU-conv four times. The encoder's
// kernels are 3, 3, 3, 1; the decoder's 1, 3, 3, 3.
class DvaeBlockImpl : public torch::nn::Module {
 public:
  enum class Kind { encoder, decoder };
  DvaeBlockImpl(int64_t in, int64_t out, int64_t layers, Kind kind);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  DvaeConv2d id_path_{nullptr};
  Stack res_path_;
  double post_gain_;
};
TORCH_MODULE(DvaeBlock);

class DvaeEncoderImpl : public torch::nn::Module {
 public:
  explicit DvaeEncoderImpl(const DvaeConfig& config);
  // [B, C, H, W] pixels mapped by map_pixels -> [B, K, H/f, W/f] logits.
  torch::Tensor forward(const torch::Tensor& x);

 private:
  DvaeConfig config_;
  Stack blocks_;
};
TORCH_MODULE(DvaeEncoder);

class DvaeDecoderImpl : public torch::nn::Module {
 public:
  explicit DvaeDecoderImpl(const DvaeConfig& config);
  // [B, K, h, w] one-hot or relaxed codes -> [B, 2C, h*f, w*f]: logit-Laplace mu, then ln b.
  torch::Tensor forward(const torch::Tensor& z);

 private:
  DvaeConfig config_;
  Stack blocks_;
};
TORCH_MODULE(DvaeDecoder);

// Encoder and decoder together, with the token-level operations stage 2 needs. Its
// parameters are named encoder.* and decoder.*.
class DvaeImpl : public torch::nn::Module, public ImageTokenizer {
 public:
  explicit DvaeImpl(const DvaeConfig& config);

  // [B, 3, H, W] images in [0, 1] -> [B, H/f, W/f] int64 tokens (argmax, no noise).
  torch::Tensor encode_tokens(const torch::Tensor& images) override;
  // [B, h, w] tokens -> [B, 3, h*f, w*f] images in [0, 1].
  torch::Tensor decode_tokens(const torch::Tensor& tokens) override;
  int64_t vocab_size() const override { return config_.vocab_size; }
  int64_t downsampling_factor() const override { return config_.downsampling_factor(); }
  torch::nn::Module& module() override { return *this; }
  // Decoder output -> images in [0, 1]: unmap(sigmoid(mu)).
  static torch::Tensor reconstruction(const torch::Tensor& decoder_output);
  // Decoder output -> sigmoid(mu), pixels in the mapped range [eps, 1 - eps], unclamped.
  static torch::Tensor mapped_reconstruction(const torch::Tensor& decoder_output);

  const DvaeConfig& config() const { return config_; }
  DvaeEncoder encoder{nullptr};
  DvaeDecoder decoder{nullptr};

 private:
  DvaeConfig config_;
};
TORCH_MODULE(Dvae);

}  // namespace dalle::models
