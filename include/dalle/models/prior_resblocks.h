#pragma once
// The prior's residual blocks: attention (over a layer's sparse mask, or through the KV
// cache when decoding) and MLP, each its own module so that gradient scaling, activation
// checkpointing and sharding can wrap them from outside (models/prior.h).
#include <torch/nn/module.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dalle/models/linear.h"
#include "dalle/models/prior_config.h"
#include "dalle/models/sparse_attention.h"

namespace dalle::models {

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

// The LayerNorm of the resblocks and of the prior's head (eps 1e-5).
torch::nn::LayerNorm prior_layer_norm(int64_t width);

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

}  // namespace dalle::models
