#pragma once
// DALL-E's stage 2: a decoder-only transformer over [caption BPE tokens | image tokens].
// Attention and MLP are separate pre-LayerNorm residual blocks ("resblocks"), each its own
// module, handed out as a list so that gradient scaling, activation checkpointing and
// sharding can wrap them from outside. ruDALL-E's variations (sandwich LayerNorms, tanh
// GELU, a second LayerNorm before the logits) are options of this one model; its weights
// load through `import_rudalle_state` (models/rudalle_import.h).
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dalle/models/decode_graphs.h"
#include "dalle/models/linear.h"
#include "dalle/models/prior_config.h"
#include "dalle/models/prior_resblocks.h"

namespace dalle::models {

// Called while a prior is built, once per resblock, as soon as the block's initial weights are
// drawn and before the next block holds any: a caller that takes the values (cuts them into
// shards, from outside the model) and empties the block's parameters builds a prior that never
// holds more than one resblock whole.
using ResblockBuilt = std::function<void(size_t index, ResblockImpl& block)>;

// The prior's two parts outside its resblocks: the embeddings (tokens into the residual
// stream) and the head (final LayerNorms and logits).
enum class PriorEnd { embeddings, head };
// An EndRunner runs one end's computation, `part`, on `input` (the tokens; the stream); the
// default is part(input). Wrappers (sharding gathers the end's parameters around it) replace
// it without touching the model, as a ResblockRunner does for the blocks.
using EndPart = std::function<torch::Tensor(const torch::Tensor&)>;
using EndRunner = std::function<torch::Tensor(PriorEnd end, const EndPart& part, const torch::Tensor& input)>;

class PriorImpl : public torch::nn::Module {
 public:
  // With `built`, the blocks are built one at a time and handed to it; the weights drawn are
  // those of a build without it from the same random state, bit for bit.
  explicit PriorImpl(PriorConfig config, const ResblockBuilt& built = nullptr);

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
  void set_end_runner(EndRunner runner) { end_runner_ = std::move(runner); }
  // The parameters of one end, named as in the state dict ("text_embedding.weight", ...).
  std::vector<std::pair<std::string, torch::Tensor>> end_parameters(PriorEnd end) const;
  const PriorConfig& config() const { return config_; }

 private:
  torch::Tensor embed(const torch::Tensor& tokens, int64_t start);
  // Image codes at grid cells `cells` (positions after the caption), row and column added.
  torch::Tensor embed_image(const torch::Tensor& codes, const torch::Tensor& cells);
  torch::Tensor run(const torch::Tensor& tokens, const ResblockContext& context);
  torch::Tensor through_resblocks(torch::Tensor x, const ResblockContext& context);
  torch::Tensor head(const torch::Tensor& x);
  torch::Tensor run_end(PriorEnd end, const EndPart& part, const torch::Tensor& input);
  // GPT-style initial values of every parameter, in the order of named_parameters(); each
  // resblock handed to `built` (when set) once its values are drawn.
  void init_weights(const ResblockBuilt& built);
  void init_parameters(const std::string& prefix, torch::nn::Module& module);

  PriorConfig config_;
  torch::nn::Embedding text_embedding_{nullptr}, text_position_embedding_{nullptr}, image_embedding_{nullptr},
      image_row_embedding_{nullptr}, image_column_embedding_{nullptr};
  std::vector<std::shared_ptr<ResblockImpl>> resblocks_;
  std::vector<std::vector<std::vector<int64_t>>> block_shapes_;  // of emptied blocks, while built one at a time
  torch::nn::LayerNorm final_norm_{nullptr}, head_norm_{nullptr};
  Linear to_logits_{nullptr};
  ResblockRunner runner_;
  EndRunner end_runner_;
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

}  // namespace dalle::models
