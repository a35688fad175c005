#pragma once
// What stage 2 needs from an image tokenizer, whichever kind it is (OpenAI's dVAE, a
// VQGAN): images to a grid of integer tokens and back. Tools that only tokenize
// (dalle-encode-images, sampling) work through this interface.
#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>

namespace dalle::models {

class ImageTokenizer {
 public:
  virtual ~ImageTokenizer() = default;

  // [B, C, H, W] images in [0, 1] -> [B, H/f, W/f] int64 tokens (deterministic).
  virtual torch::Tensor encode_tokens(const torch::Tensor& images) = 0;
  // [B, h, w] tokens -> [B, C, h*f, w*f] images in [0, 1].
  virtual torch::Tensor decode_tokens(const torch::Tensor& tokens) = 0;
  // Number of distinct tokens K: every token is in [0, K).
  virtual int64_t vocab_size() const = 0;
  // f: an image side of S becomes a token grid side of S / f.
  virtual int64_t downsampling_factor() const = 0;
  // The module itself, for eval(), to(device) and its weights.
  virtual torch::nn::Module& module() = 0;
};

}  // namespace dalle::models
