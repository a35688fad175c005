#pragma once
// DALL-E Mega / Mini's prior, as min-dalle 0.4.11 computes it (docs/mega-prior.md): a BART
// encoder over the caption and a decoder over image tokens that reads it through
// cross-attention. NormFormer-style blocks: a LayerNorm before and after each attention, a
// GLU feed-forward with a LayerNorm inside; no Linear has a bias. Module and parameter names
// are min-dalle's (`encoder.pt`, `decoder.pt`), so its released weights load by name:
//   encoder: embed_tokens, embed_positions, layernorm_embedding, final_ln,
//            layers.N.{pre_self_attn_layer_norm, self_attn.{q,k,v,out}_proj,
//                      self_attn_layer_norm, glu.{ln0, fc0, fc1, ln1, fc2}}
//   decoder: the same, lm_head, and per layer pre_encoder_attn_layer_norm,
//            encoder_attn.{q,k,v,out}_proj, encoder_attn_layer_norm
// Sampling: models/bart_sampling.h; the image decoder: models/vqgan_detokenizer.h; the
// caption tokenizer: text/bart_tokenizer.h.
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <vector>

#include "dalle/config.h"
#include "dalle/io/safetensors.h"
#include "dalle/models/decode_graphs.h"
#include "dalle/models/linear.h"

namespace dalle::models {

// min-dalle's <pad>: captions are masked where they hold it (as keys only).
inline constexpr int64_t kBartPadId = 1;

struct BartPriorConfig {
  int64_t layers = 24;              // in the encoder and in the decoder
  int64_t heads = 32;
  int64_t width = 2048;
  int64_t glu_width = 4096;
  int64_t text_vocab_size = 50272;
  int64_t text_length = 64;
  int64_t image_vocab_size = 16415;  // the decoder's tables have one row more
  int64_t image_length = 256;        // a 16 x 16 grid
  int64_t codes = 16384;             // the detokenizer's codes: the logits sampled; the last starts each image

  void visit(ConfigVisitor& v);
  void validate() const;
};

// DALL-E Mega's and Mini's sizes (min-dalle's MinDalle.__init__).
BartPriorConfig dalle_mega_config();
BartPriorConfig dalle_mini_config();

class BartAttentionImpl : public torch::nn::Module {
 public:
  BartAttentionImpl(int64_t width, int64_t heads);
  // queries [B, Lq, d], keys and values [B, H, Lk, hd] (from `split`), `visible` [B or 1, 1,
  // Lq or 1, Lk] bool -> [B, Lq, d].
  torch::Tensor attend(const torch::Tensor& queries, const torch::Tensor& keys, const torch::Tensor& values,
                       const torch::Tensor& visible);
  // [B, L, d] -> [B, H, L, hd], head h taking features h * hd ...
  torch::Tensor split(const torch::Tensor& x) const;

  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};

 private:
  int64_t heads_;
};
TORCH_MODULE(BartAttention);

class BartGluImpl : public torch::nn::Module {
 public:
  BartGluImpl(int64_t width, int64_t glu_width);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::LayerNorm ln0{nullptr}, ln1{nullptr};
  Linear fc0{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(BartGlu);

class BartEncoderLayerImpl : public torch::nn::Module {
 public:
  explicit BartEncoderLayerImpl(const BartPriorConfig& config);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& visible);

  torch::nn::LayerNorm pre_self_attn_layer_norm{nullptr}, self_attn_layer_norm{nullptr};
  BartAttention self_attn{nullptr};
  BartGlu glu{nullptr};
};
TORCH_MODULE(BartEncoderLayer);

class BartEncoderImpl : public torch::nn::Module {
 public:
  explicit BartEncoderImpl(const BartPriorConfig& config);
  // Captions [B, text_length] -> their encoding [B, text_length, width].
  torch::Tensor forward(const torch::Tensor& text);

  torch::nn::Embedding embed_tokens{nullptr}, embed_positions{nullptr};
  torch::nn::LayerNorm layernorm_embedding{nullptr}, final_ln{nullptr};
  torch::nn::ModuleList layers{nullptr};

 private:
  BartPriorConfig config_;
};
TORCH_MODULE(BartEncoder);

// What decoding image tokens one at a time keeps: per layer, the self-attention's keys and
// values of every position so far [B, H, image_length, hd], and the cross-attention's keys
// and values of the caption, computed once.
struct BartDecoderCache {
  std::vector<torch::Tensor> keys, values;
  std::vector<torch::Tensor> caption_keys, caption_values;
  torch::Tensor caption_visible;  // [B, 1, 1, text_length]
  int64_t length = 0;             // positions written
};

class BartDecoderLayerImpl : public torch::nn::Module {
 public:
  explicit BartDecoderLayerImpl(const BartPriorConfig& config);
  // x [B, L, d] at positions [start, start + L); self-attention over the cache's `keys` and
  // `values` (written here), cross-attention over the caption's.
  torch::Tensor forward(const torch::Tensor& x, int64_t start, torch::Tensor& keys, torch::Tensor& values,
                        const torch::Tensor& caption_keys, const torch::Tensor& caption_values,
                        const torch::Tensor& caption_visible);
  // One row per image at the position `position` ([1] int64 on the device) holds, attending to
  // the first `keys_read` slots of `keys` and `values` (the later ones masked).
  torch::Tensor step(const torch::Tensor& x, const torch::Tensor& position, int64_t keys_read, torch::Tensor& keys,
                     torch::Tensor& values, const torch::Tensor& caption_keys, const torch::Tensor& caption_values,
                     const torch::Tensor& caption_visible);

  torch::nn::LayerNorm pre_self_attn_layer_norm{nullptr}, self_attn_layer_norm{nullptr};
  torch::nn::LayerNorm pre_encoder_attn_layer_norm{nullptr}, encoder_attn_layer_norm{nullptr};
  BartAttention self_attn{nullptr}, encoder_attn{nullptr};
  BartGlu glu{nullptr};

 private:
  // x + self-attention of h (its keys and values already in the cache), then the rest.
  torch::Tensor after_keys_written(const torch::Tensor& x, const torch::Tensor& h, const torch::Tensor& keys,
                                   const torch::Tensor& values, const torch::Tensor& visible,
                                   const torch::Tensor& caption_keys, const torch::Tensor& caption_values,
                                   const torch::Tensor& caption_visible);
};
TORCH_MODULE(BartDecoderLayer);

class BartDecoderImpl : public torch::nn::Module {
 public:
  explicit BartDecoderImpl(const BartPriorConfig& config);
  // An empty cache for `encoding` [B, text_length, width] of captions `text` [B, text_length],
  // its tensors from `make` when given.
  BartDecoderCache start(const torch::Tensor& encoding, const torch::Tensor& text, const TensorMaker& make = {});
  // The next `tokens` [B, L] (image codes, or min-dalle's start token) -> logits [B, L,
  // image_vocab_size + 1] of the tokens that follow each, causally, the cache extended by L.
  torch::Tensor forward(const torch::Tensor& tokens, BartDecoderCache& cache);
  // One token per row, `tokens` [B, 1], at the position `position` ([1] int64 on the device)
  // holds, attending to the cache's first `keys` slots -> logits [B, 1, image_vocab_size + 1].
  // Fixed shapes, no host synchronisation, cache.length untouched: a step a CUDA graph can
  // capture (models/decode_graphs.h).
  torch::Tensor forward_step(const torch::Tensor& tokens, BartDecoderCache& cache, const torch::Tensor& position,
                             int64_t keys);
  const BartPriorConfig& config() const { return config_; }

  torch::nn::Embedding embed_tokens{nullptr}, embed_positions{nullptr};
  torch::nn::LayerNorm layernorm_embedding{nullptr}, final_ln{nullptr};
  torch::nn::ModuleList layers{nullptr};
  Linear lm_head{nullptr};

 private:
  BartPriorConfig config_;
};
TORCH_MODULE(BartDecoder);

// The encoder and the decoder under min-dalle's file names (`encoder.pt`, `decoder.pt`) as
// prefixes: the one module an exported checkpoint's weights (`encoder.*`, `decoder.*`) load into.
class BartPriorImpl : public torch::nn::Module {
 public:
  explicit BartPriorImpl(const BartPriorConfig& config);

  BartEncoder encoder{nullptr};
  BartDecoder decoder{nullptr};
};
TORCH_MODULE(BartPrior);

// min-dalle's state dicts are missing the gains of the LayerNorms that feed a Linear
// (pre_*_layer_norm, glu.ln0, glu.ln1: converted from Flax LayerNorms without a scale),
// which its strict=False load leaves at 1. `state` with those gains added as ones where
// `module` has them and `state` has not; anything else missing is left for the load to name.
io::TensorMap with_unit_layer_norm_gains(const io::TensorMap& state, torch::nn::Module& module);

}  // namespace dalle::models
