#include "dalle/models/prior_resblocks.h"

#include <torch/torch.h>

#include "dalle/error.h"

namespace dalle::models {
namespace F = torch::nn::functional;

torch::nn::LayerNorm prior_layer_norm(int64_t width) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({width}).eps(1e-5));
}

AttentionResblockImpl::AttentionResblockImpl(const PriorConfig& config, std::shared_ptr<const LayerMask> mask,
                                             int64_t cache_slot)
    : mask_(std::move(mask)), heads_(config.heads), cache_slot_(cache_slot), dropout_(config.dropout) {
  norm_ = register_module("norm", prior_layer_norm(config.width));
  qkv_ = register_module("qkv", Linear(config.width, 3 * config.width));
  out_ = register_module("out", Linear(config.width, config.width));
  if (config.sandwich_norm) output_norm_ = register_module("output_norm", prior_layer_norm(config.width));
}

torch::Tensor AttentionResblockImpl::branch(const torch::Tensor& x, const ResblockContext& context) {
  const int64_t batch = x.size(0), rows = x.size(1), width = x.size(2);
  // [q | k | v] thirds, each split into heads: [B, H, rows, hd].
  auto parts = qkv_(norm_(x)).chunk(3, -1);
  for (auto& part : parts) part = part.view({batch, rows, heads_, width / heads_}).transpose(1, 2);
  const auto attended = context.cache
                            ? attend_cached(parts[0], parts[1], parts[2], context)
                            : masked_attention(parts[0], parts[1], parts[2], *mask_, context.start, context.path);
  auto out = F::dropout(out_(attended.transpose(1, 2).reshape({batch, rows, width})),
                        F::DropoutFuncOptions().p(dropout_).training(is_training()));
  return output_norm_ ? output_norm_(out) : out;
}

torch::Tensor AttentionResblockImpl::attend_cached(const torch::Tensor& queries, const torch::Tensor& keys,
                                                   const torch::Tensor& values, const ResblockContext& context) {
  auto& cache_keys = context.cache->keys[cache_slot_];
  auto& cache_values = context.cache->values[cache_slot_];
  const auto& mask = context.cache->masks[cache_slot_];
  if (context.position.defined()) {
    // In the cache's own type (autocast makes the new keys 16-bit in a model kept in fp32).
    cache_keys.index_copy_(2, context.position, keys.to(cache_keys.scalar_type()));
    cache_values.index_copy_(2, context.position, values.to(cache_values.scalar_type()));
    const auto visible = mask.index_select(0, context.position).narrow(1, 0, context.keys);
    return at::scaled_dot_product_attention(queries, cache_keys.narrow(2, 0, context.keys),
                                            cache_values.narrow(2, 0, context.keys), visible);
  }
  const int64_t start = context.start, end = start + queries.size(2);
  if (end > mask.size(0)) {
    throw Error("attention: positions beyond the sequence length " + std::to_string(mask.size(0)));
  }
  cache_keys.narrow(2, start, end - start).copy_(keys);
  cache_values.narrow(2, start, end - start).copy_(values);
  const auto visible = mask.narrow(0, start, end - start).narrow(1, 0, end);
  return at::scaled_dot_product_attention(queries, cache_keys.narrow(2, 0, end), cache_values.narrow(2, 0, end),
                                          visible);
}

MlpResblockImpl::MlpResblockImpl(const PriorConfig& config) : gelu_(config.gelu), dropout_(config.dropout) {
  norm_ = register_module("norm", prior_layer_norm(config.width));
  fc_in_ = register_module("fc_in", Linear(config.width, config.mlp_ratio * config.width));
  fc_out_ = register_module("fc_out", Linear(config.mlp_ratio * config.width, config.width));
  if (config.sandwich_norm) output_norm_ = register_module("output_norm", prior_layer_norm(config.width));
}

torch::Tensor MlpResblockImpl::branch(const torch::Tensor& x, const ResblockContext&) {
  auto hidden = F::gelu(fc_in_(norm_(x)), F::GELUFuncOptions().approximate(gelu_ == "tanh" ? "tanh" : "none"));
  auto out = F::dropout(fc_out_(hidden), F::DropoutFuncOptions().p(dropout_).training(is_training()));
  return output_norm_ ? output_norm_(out) : out;
}

}  // namespace dalle::models
