#pragma once
// DALL-E's stage 2: a decoder-only transformer over [caption BPE tokens | image tokens].
// Attention and MLP are separate pre-LayerNorm residual blocks ("resblocks"), each its own
// module, handed out as a list so that gradient scaling, activation checkpointing and
// sharding can wrap them from outside. ruDALL-E's variations (sandwich LayerNorms, tanh
// GELU, a second LayerNorm before the logits) are options of this one model; its weights
// load through `import_rudalle_state` (docs/prior.md lists the names).
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dalle/config.h"
#include "dalle/io/safetensors.h"
#include "dalle/models/decode_graphs.h"
#include "dalle/models/linear.h"
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

// Keys and values of every attention resblock for the positions decoded so far, and each
// one's mask on the cache's device (no copy from the host per step).
struct KvCache {
  std::vector<torch::Tensor> keys, values;  // per attention resblock: [B, H, capacity, hd]
  std::vector<torch::Tensor> masks;         // per attention resblock: [capacity, capacity] bool
  int64_t length = 0;
};

// What a resblock needs besides its input.
struct ResblockContext {
  int64_t start = 0;            // position of the first row of the input
  KvCache* cache = nullptr;     // when given, keys and values are appended to and read from it
  AttentionPath path = AttentionPath::sparse;
  // A decoding step (forward_step): one row at the position this [1] int64 tensor holds on the
  // device, attending to the cache's first `keys` slots; `start` is unused.
  torch::Tensor position;
  int64_t keys = 0;
};

// A residual block: the model computes x + branch(x).
class ResblockImpl : public torch::nn::Module {
 public:
  virtual torch::Tensor branch(const torch::Tensor& x, const ResblockContext& context) = 0;
};

class AttentionResblockImpl : public ResblockImpl {
 public:
  AttentionResblockImpl(const PriorConfig& config, std::shared_ptr<const LayerMask> mask, int64_t cache_slot);
  torch::Tensor branch(const torch::Tensor& x, const ResblockContext& context) override;
  const LayerMask& mask() const { return *mask_; }

 private:
  // Attention through the context's cache: the new keys and values written, then read back.
  torch::Tensor attend_cached(const torch::Tensor& queries, const torch::Tensor& keys, const torch::Tensor& values,
                              const ResblockContext& context);

  std::shared_ptr<const LayerMask> mask_;
  int64_t heads_, cache_slot_;
  double dropout_;
  torch::nn::LayerNorm norm_{nullptr}, output_norm_{nullptr};
  Linear qkv_{nullptr}, out_{nullptr};
};

class MlpResblockImpl : public ResblockImpl {
 public:
  explicit MlpResblockImpl(const PriorConfig& config);
  torch::Tensor branch(const torch::Tensor& x, const ResblockContext& context) override;

 private:
  std::string gelu_;
  double dropout_;
  torch::nn::LayerNorm norm_{nullptr}, output_norm_{nullptr};
  Linear fc_in_{nullptr}, fc_out_{nullptr};
};

// Runs one resblock; the default is x + block.branch(x). Wrappers (gradient scaling,
// activation checkpointing) replace it without touching the model.
using ResblockRunner =
    std::function<torch::Tensor(ResblockImpl& block, const torch::Tensor& x, const ResblockContext& context)>;

class PriorImpl : public torch::nn::Module {
 public:
  explicit PriorImpl(PriorConfig config);

  // tokens [B, n]: caption ids (0 = padding) then image codes, positions 0 .. n-1.
  // Returns logits [B, n, text_classes + image_vocab_size].
  torch::Tensor forward(const torch::Tensor& tokens);
  // tokens [B, k] at positions cache.length .. cache.length + k - 1; grows the cache.
  torch::Tensor forward_cached(const torch::Tensor& tokens, KvCache& cache);
  // One image code per row, `codes` [B, 1], at the position `position` ([1] int64 on the
  // device, at least text_length) holds, attending to the cache's first `keys` slots (the
  // later ones masked) -> logits [B, 1, classes]. Fixed shapes, no check that reads the
  // device and no cache.length: a step a CUDA graph can capture (models/decode_graphs.h).
  torch::Tensor forward_step(const torch::Tensor& codes, KvCache& cache, const torch::Tensor& position, int64_t keys);
  // A cache for `batch` rows on the model's device, its tensors from `make` when given.
  KvCache make_cache(int64_t batch, const TensorMaker& make = {}) const;

  const std::vector<std::shared_ptr<ResblockImpl>>& resblocks() const { return resblocks_; }
  void set_resblock_runner(ResblockRunner runner) { runner_ = std::move(runner); }
  const PriorConfig& config() const { return config_; }

 private:
  torch::Tensor embed(const torch::Tensor& tokens, int64_t start);
  torch::Tensor run(const torch::Tensor& tokens, const ResblockContext& context);
  torch::Tensor through_resblocks(torch::Tensor x, const ResblockContext& context);
  void init_weights();

  PriorConfig config_;
  torch::nn::Embedding text_embedding_{nullptr}, text_position_embedding_{nullptr}, image_embedding_{nullptr},
      image_row_embedding_{nullptr}, image_column_embedding_{nullptr};
  std::vector<std::shared_ptr<ResblockImpl>> resblocks_;
  torch::nn::LayerNorm final_norm_{nullptr}, head_norm_{nullptr};
  Linear to_logits_{nullptr};
  ResblockRunner runner_;
};
TORCH_MODULE(Prior);

struct PriorLoss {
  torch::Tensor total, text, image;
};

// Next-token cross-entropy: text positions predict the next caption id among the text
// classes (padding ids included), position text_length - 1 and the image positions
// predict the next image code among the image classes; each type is averaged over its
// own targets, then weighted text_loss_weight : 1 - text_loss_weight.
PriorLoss prior_loss(const torch::Tensor& logits, const torch::Tensor& tokens, const PriorConfig& config);

// The empty caption as the tokenizer encodes it ([eos, padding...]): the unconditional
// input of caption dropout and classifier-free guidance.
torch::Tensor empty_caption(int64_t text_length, int64_t batch = 1);

// ruDALL-E's state dict (its own names, from scripts/export_rudalle_prior.py) renamed to
// this model's; its unused last text position row and its mask buffers are dropped.
io::TensorMap import_rudalle_state(const io::TensorMap& rudalle, const PriorConfig& config);

}  // namespace dalle::models
