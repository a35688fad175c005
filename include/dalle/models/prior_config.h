#pragma once
// The sizes and options of DALL-E's prior (models/prior.h), as its recipes name them.
#include <cstdint>
#include <string>
#include <vector>

#include "dalle/config.h"
#include "dalle/models/sparse_attention.h"

namespace dalle::models {

// The ids the caption tokenizer pads short captions with and ends them with
// (text::Tokenizer's kPadId and kEndId; a test holds them together): the prior embeds each
// padded position as its own token, as DALL-E does, and the empty caption is an end.
inline constexpr int64_t kCaptionPadId = 0;
inline constexpr int64_t kCaptionEndId = 3;

struct PriorConfig {
  int64_t text_length = 256;        // caption tokens, bos/eos included
  int64_t text_vocab_size = 16384;  // BPE vocabulary; text_length position-unique padding ids follow it
  int64_t grid_size = 32;           // image tokens form a grid_size x grid_size grid
  int64_t image_vocab_size = 8192;
  int64_t layers = 64;              // attention layers; each has an attention and an MLP resblock
  int64_t width = 3968;
  int64_t heads = 62;
  int64_t mlp_ratio = 4;
  std::vector<std::string> attention = {};  // per-layer kinds; empty: layer_pattern's
  std::string layer_pattern = "dalle";      // "rudalle" for ruDALL-E's weights
  int64_t conv_kernel = 11;
  std::string conv_edges = "clamped";
  std::string attention_path = "sparse";
  bool sandwich_norm = false;       // ruDALL-E: a LayerNorm on each resblock's output before the add
  bool head_norm = false;           // ruDALL-E: a second LayerNorm before the logits
  std::string gelu = "exact";       // "tanh" for ruDALL-E
  double dropout = 0.0;
  double text_loss_weight = 0.125;  // the image loss gets 1 - text_loss_weight

  void visit(ConfigVisitor& v);
  void validate() const;
  SequenceLayout layout() const { return {text_length, grid_size}; }
  int64_t image_length() const { return grid_size * grid_size; }
  int64_t length() const { return text_length + image_length(); }
  // Text ids, position-unique padding ids included: the first logits columns.
  int64_t text_classes() const { return text_vocab_size + text_length; }
  int64_t head_width() const { return width / heads; }
};

}  // namespace dalle::models
