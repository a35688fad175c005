#pragma once
// The two quantizers a VQGAN can use between encoder and decoder.
// - GumbelQuantizer, ruDALL-E's: a 1x1 conv `proj` to logits over the codes, a codebook
//   `embed` (an Embedding). Training draws a hard gumbel-softmax sample (one-hot forward,
//   the relaxed sample's gradient backward); tokens are the logits' argmax.
// - VectorQuantizer, the classic VQ-VAE one, laid out as taming's (`embedding`): the nearest
//   code, the straight-through estimator, codebook and commitment losses.
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>

#include <cstdint>
#include <optional>

namespace dalle::models {

// One pass through a quantizer. Loss terms that a quantizer does not have are undefined.
struct Quantized {
  torch::Tensor codes;       // [B, D, h, w]: what post_quant_conv receives
  torch::Tensor tokens;      // [B, h, w] int64
  torch::Tensor kl;          // gumbel: KL(q || uniform), summed over codes, mean over positions
  torch::Tensor codebook;    // vector: mean (sg[z] - e)^2, moves the codes to the encoder
  torch::Tensor commitment;  // vector: mean (z - sg[e])^2, keeps the encoder near its codes
};

class GumbelQuantizerImpl : public torch::nn::Module {
 public:
  // `in` is the width of what it receives (after quant_conv, so the VQGAN's embed_dim).
  GumbelQuantizerImpl(int64_t in, int64_t codes, int64_t dim);

  torch::Tensor logits(const torch::Tensor& z);
  // Training pass: a hard gumbel-softmax sample at `temperature`, noise from `generator`.
  Quantized forward(const torch::Tensor& z, double temperature, std::optional<at::Generator> generator = std::nullopt);
  // [B, h, w] tokens -> [B, D, h, w] code vectors.
  torch::Tensor lookup(const torch::Tensor& tokens);

  torch::nn::Conv2d proj{nullptr};
  torch::nn::Embedding embed{nullptr};
};
TORCH_MODULE(GumbelQuantizer);

class VectorQuantizerImpl : public torch::nn::Module {
 public:
  VectorQuantizerImpl(int64_t codes, int64_t dim);

  // [B, D, h, w] -> [B, h, w]: index of the nearest code (Euclidean; the lowest index on ties).
  torch::Tensor nearest(const torch::Tensor& z);
  // Training pass: codes = z + sg[e - z], so the decoder's gradient reaches the encoder.
  Quantized forward(const torch::Tensor& z);
  torch::Tensor lookup(const torch::Tensor& tokens);
  // Replaces every code whose `usage` count is zero by an encoder output drawn at random
  // from `z` ([B, D, h, w]); returns the indices of the replaced codes. A remedy for codes
  // that no encoder output is ever nearest to, which otherwise never receive a gradient.
  torch::Tensor restart_unused(const torch::Tensor& usage, const torch::Tensor& z, at::Generator generator);

  torch::nn::Embedding embedding{nullptr};
};
TORCH_MODULE(VectorQuantizer);

}  // namespace dalle::models
