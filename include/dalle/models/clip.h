#pragma once
// CLIP: a contrastive text-image model, a ViT image tower and a causal text transformer
// projected into one embedding space. Module and parameter names are open_clip's `CLIP`
// (and OpenAI CLIP's) for ViT models, so that an exported ViT-B/32 state dict loads by
// name (scripts/export_open_clip.py, docs/clip.md):
//   visual.{conv1.weight, class_embedding, positional_embedding, ln_pre.*,
//           transformer.resblocks.N.*, ln_post.*, proj}
//   token_embedding.weight, positional_embedding, transformer.resblocks.N.*, ln_final.*,
//   text_projection, logit_scale
// Text features are read at one position per caption: `argmax` (the largest id, CLIP's
// end-of-text token in its BPE) or `eos` (the first `eos_id`: our SentencePiece tokenizer's
// end of text, id 3, and ruCLIP's, id 3 of its YouTokenToMe model). ruCLIP (the `ruclip`
// package, ruDALL-E's reranker) is this model under the same names with eos pooling and its
// own image preprocessing (scripts/export_ruclip.py).
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <array>
#include <cstdint>

#include "dalle/models/clip_config.h"
#include "dalle/models/clip_transformer.h"
#include "dalle/models/clip_vision.h"

namespace dalle::models {

// The per-channel mean and standard deviation CLIP's images are normalised with.
inline constexpr std::array<double, 3> kClipMean{0.48145466, 0.4578275, 0.40821073};
inline constexpr std::array<double, 3> kClipStd{0.26862954, 0.26130258, 0.27577711};

// Images [B, 3, H, W] (or [3, H, W]) in [0, 1] -> the model's input [B, 3, image_size,
// image_size], as config.preprocess says, then (x - image_mean) / image_std per channel:
// * open_clip, open_clip's (and OpenAI CLIP's) evaluation transform: the shorter side resized
//   to image_size (bicubic, antialiased; the longer side truncated as torchvision does),
//   then the centred square, its offsets rounded half to even as Python's round();
// * ruclip, ruclip's RuCLIPProcessor: torchvision's RandomResizedCrop(image_size,
//   scale=(1, 1), ratio=(1, 1)), which takes the centred square of the shorter side (offsets
//   floored), then resizes it to image_size (bilinear, antialiased). Where the sides differ
//   by one pixel torchvision places that square at random (offset 0 or 1); here at 0.
// Both are torchvision's tensor path: PIL, which the Python packages feed, rounds its
// resized pixels to 8 bits, so their inputs differ by up to one 8-bit level.
torch::Tensor clip_preprocess(const torch::Tensor& images, const ClipConfig& config);
// open_clip's transform at `image_size` with CLIP's mean and std (kClipMean, kClipStd).
torch::Tensor clip_preprocess(const torch::Tensor& images, int64_t image_size);

struct ClipLogits {
  torch::Tensor per_image;  // [images, texts]: exp(logit_scale) * cosine similarity
  torch::Tensor per_text;   // [texts, images], the transpose
};

class ClipImpl : public torch::nn::Module {
 public:
  explicit ClipImpl(const ClipConfig& config);

  // Preprocessed images [B, 3, image_size, image_size] -> [B, embed_dim], L2-normalised if asked.
  torch::Tensor encode_image(const torch::Tensor& images, bool normalize = false);
  // Token ids [B, L] (L <= context_length, int64) -> [B, embed_dim], L2-normalised if asked.
  torch::Tensor encode_text(const torch::Tensor& tokens, bool normalize = false);
  // The position of each row whose feature is pooled, per config.text_pooling: [B] int64.
  torch::Tensor pooling_positions(const torch::Tensor& tokens) const;
  // exp(logit_scale) * image_features @ text_features^T on features to be normalised here.
  ClipLogits logits_from_features(const torch::Tensor& image_features, const torch::Tensor& text_features) const;
  ClipLogits logits(const torch::Tensor& images, const torch::Tensor& tokens);

  // open_clip's initialisation of the text tower (normal embeddings, per-layer stds) and of
  // the projections; the image tower keeps PyTorch's defaults, as open_clip's does.
  void reset_parameters();

  const ClipConfig& config() const { return config_; }
  const std::vector<ClipResidualBlock>& text_blocks() const { return transformer->blocks(); }

  ClipVisionTransformer visual{nullptr};
  torch::nn::Embedding token_embedding{nullptr};
  torch::Tensor positional_embedding;  // [context_length, text_width]
  ClipTransformer transformer{nullptr};
  torch::nn::LayerNorm ln_final{nullptr};
  torch::Tensor text_projection;  // [text_width, embed_dim]
  torch::Tensor logit_scale;      // scalar; the logits are scaled by its exponential

 private:
  void check_tokens(const torch::Tensor& tokens) const;
  ClipConfig config_;
};
TORCH_MODULE(Clip);

}  // namespace dalle::models
