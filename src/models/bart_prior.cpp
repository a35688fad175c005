#include "dalle/models/bart_prior.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "dalle/error.h"

namespace dalle::models {

namespace F = torch::nn::functional;
using torch::indexing::Slice;

void BartPriorConfig::visit(ConfigVisitor& v) {
  v.field("layers", layers, "layers of the encoder, and of the decoder (Mega: 24, Mini: 12)", {.min = 1, .max = 256});
  v.field("heads", heads, "attention heads (Mega: 32, Mini: 16)", {.min = 1});
  v.field("width", width, "model width (Mega: 2048, Mini: 1024)", {.min = 1});
  v.field("glu_width", glu_width, "width of the GLU feed-forward (Mega: 4096, Mini: 2730)", {.min = 1});
  v.field("text_vocab_size", text_vocab_size, "caption BPE ids (Mega: 50272, Mini: 50264)", {.min = 4});
  v.field("text_length", text_length, "caption ids per caption, <s> and </s> included (64)", {.min = 2});
  v.field("image_vocab_size", image_vocab_size,
          "image token ids the decoder embeds, one table row more (Mega: 16415, Mini: 16384)", {.min = 1});
  v.field("image_length", image_length, "image tokens per image (256: a 16 x 16 grid)", {.min = 1});
  v.field("codes", codes, "the detokenizer's codes (16384): the logits sampled, the last also each image's start",
          {.min = 1});
}

void BartPriorConfig::validate() const {
  if (codes > image_vocab_size + 1) {
    throw Error("BART prior: " + std::to_string(codes) + " codes but only " + std::to_string(image_vocab_size + 1) +
                " image token ids");
  }
  if (width % heads != 0) {
    throw Error("BART prior: width " + std::to_string(width) + " is not divisible by heads " + std::to_string(heads));
  }
}

BartPriorConfig dalle_mega_config() {
  return {.layers = 24, .heads = 32, .width = 2048, .glu_width = 4096, .text_vocab_size = 50272,
          .image_vocab_size = 16415};
}

BartPriorConfig dalle_mini_config() {
  return {.layers = 12, .heads = 16, .width = 1024, .glu_width = 2730, .text_vocab_size = 50264,
          .image_vocab_size = 16384};
}

namespace {

Linear unbiased(int64_t in, int64_t out) {
  return Linear(in, out, /*bias=*/false);
}

torch::nn::LayerNorm layer_norm(int64_t width) { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})); }

// Which of the first `keys` cached positions each of `queries` positions [start, start +
// queries) may see: the earlier ones and its own, [1, 1, queries, keys].
torch::Tensor causal_visibility(int64_t start, int64_t queries, int64_t keys, const torch::Device& device) {
  const auto options = torch::TensorOptions().dtype(torch::kInt64).device(device);
  const auto query_positions = torch::arange(start, start + queries, options).unsqueeze(1);
  const auto key_positions = torch::arange(keys, options).unsqueeze(0);
  return (key_positions <= query_positions).view({1, 1, queries, keys});
}

}  // namespace

BartAttentionImpl::BartAttentionImpl(int64_t width, int64_t heads) : heads_(heads) {
  q_proj = register_module("q_proj", unbiased(width, width));
  k_proj = register_module("k_proj", unbiased(width, width));
  v_proj = register_module("v_proj", unbiased(width, width));
  out_proj = register_module("out_proj", unbiased(width, width));
}

torch::Tensor BartAttentionImpl::split(const torch::Tensor& x) const {
  return x.view({x.size(0), x.size(1), heads_, -1}).transpose(1, 2);
}

torch::Tensor BartAttentionImpl::attend(const torch::Tensor& queries, const torch::Tensor& keys,
                                        const torch::Tensor& values, const torch::Tensor& visible) {
  // min-dalle scales the queries before the product.
  const auto q = split(q_proj(queries)) / std::sqrt(static_cast<double>(keys.size(-1)));
  const auto out = at::scaled_dot_product_attention(q, keys, values, visible, 0.0, false, 1.0);
  return out_proj(out.transpose(1, 2).reshape({queries.size(0), queries.size(1), -1}));
}

BartGluImpl::BartGluImpl(int64_t width, int64_t glu_width) {
  ln0 = register_module("ln0", layer_norm(width));
  ln1 = register_module("ln1", layer_norm(glu_width));
  fc0 = register_module("fc0", unbiased(width, glu_width));
  fc1 = register_module("fc1", unbiased(width, glu_width));
  fc2 = register_module("fc2", unbiased(glu_width, width));
}

torch::Tensor BartGluImpl::forward(const torch::Tensor& x) {
  const auto h = ln0(x);
  return fc2(ln1(F::gelu(fc0(h)) * fc1(h)));
}

BartEncoderLayerImpl::BartEncoderLayerImpl(const BartPriorConfig& config) {
  pre_self_attn_layer_norm = register_module("pre_self_attn_layer_norm", layer_norm(config.width));
  self_attn = register_module("self_attn", BartAttention(config.width, config.heads));
  self_attn_layer_norm = register_module("self_attn_layer_norm", layer_norm(config.width));
  glu = register_module("glu", BartGlu(config.width, config.glu_width));
}

torch::Tensor BartEncoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& visible) {
  const auto h = pre_self_attn_layer_norm(x);
  auto out = x + self_attn_layer_norm(self_attn->attend(h, self_attn->split(self_attn->k_proj(h)),
                                                        self_attn->split(self_attn->v_proj(h)), visible));
  return out + glu(out);
}

BartEncoderImpl::BartEncoderImpl(const BartPriorConfig& config) : config_(config) {
  config.validate();
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(config.text_vocab_size, config.width));
  embed_positions = register_module("embed_positions", torch::nn::Embedding(config.text_length, config.width));
  layernorm_embedding = register_module("layernorm_embedding", layer_norm(config.width));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.layers; ++i) layers->push_back(BartEncoderLayer(config));
  final_ln = register_module("final_ln", layer_norm(config.width));
}

torch::Tensor BartEncoderImpl::forward(const torch::Tensor& text) {
  if (text.dim() != 2 || text.size(1) != config_.text_length) {
    throw Error("BART encoder: expected captions [B, " + std::to_string(config_.text_length) + "], got " +
                c10::str(text.sizes()));
  }
  const auto positions = torch::arange(config_.text_length, text.options());
  auto x = layernorm_embedding(embed_tokens(text) + embed_positions(positions));
  const auto visible = (text != kBartPadId).view({text.size(0), 1, 1, text.size(1)});
  for (const auto& layer : *layers) x = layer->as<BartEncoderLayer>()->forward(x, visible);
  return final_ln(x);
}

BartDecoderLayerImpl::BartDecoderLayerImpl(const BartPriorConfig& config) {
  pre_self_attn_layer_norm = register_module("pre_self_attn_layer_norm", layer_norm(config.width));
  self_attn = register_module("self_attn", BartAttention(config.width, config.heads));
  self_attn_layer_norm = register_module("self_attn_layer_norm", layer_norm(config.width));
  pre_encoder_attn_layer_norm = register_module("pre_encoder_attn_layer_norm", layer_norm(config.width));
  encoder_attn = register_module("encoder_attn", BartAttention(config.width, config.heads));
  encoder_attn_layer_norm = register_module("encoder_attn_layer_norm", layer_norm(config.width));
  glu = register_module("glu", BartGlu(config.width, config.glu_width));
}

torch::Tensor BartDecoderLayerImpl::forward(const torch::Tensor& x, int64_t start, torch::Tensor& keys,
                                            torch::Tensor& values, const torch::Tensor& caption_keys,
                                            const torch::Tensor& caption_values,
                                            const torch::Tensor& caption_visible) {
  const int64_t end = start + x.size(1);
  const auto h = pre_self_attn_layer_norm(x);
  keys.index_put_({Slice(), Slice(), Slice(start, end)}, self_attn->split(self_attn->k_proj(h)));
  values.index_put_({Slice(), Slice(), Slice(start, end)}, self_attn->split(self_attn->v_proj(h)));
  return after_keys_written(x, h, keys.narrow(2, 0, end), values.narrow(2, 0, end),
                            causal_visibility(start, x.size(1), end, x.device()), caption_keys, caption_values,
                            caption_visible);
}

torch::Tensor BartDecoderLayerImpl::step(const torch::Tensor& x, const torch::Tensor& position, int64_t keys_read,
                                         torch::Tensor& keys, torch::Tensor& values, const torch::Tensor& caption_keys,
                                         const torch::Tensor& caption_values, const torch::Tensor& caption_visible) {
  const auto h = pre_self_attn_layer_norm(x);
  keys.index_copy_(2, position, self_attn->split(self_attn->k_proj(h)));
  values.index_copy_(2, position, self_attn->split(self_attn->v_proj(h)));
  const auto visible = (torch::arange(keys_read, position.options()) <= position).view({1, 1, 1, keys_read});
  return after_keys_written(x, h, keys.narrow(2, 0, keys_read), values.narrow(2, 0, keys_read), visible,
                            caption_keys, caption_values, caption_visible);
}

torch::Tensor BartDecoderLayerImpl::after_keys_written(const torch::Tensor& x, const torch::Tensor& h,
                                                       const torch::Tensor& keys, const torch::Tensor& values,
                                                       const torch::Tensor& visible, const torch::Tensor& caption_keys,
                                                       const torch::Tensor& caption_values,
                                                       const torch::Tensor& caption_visible) {
  auto out = x + self_attn_layer_norm(self_attn->attend(h, keys, values, visible));
  const auto attended =
      encoder_attn->attend(pre_encoder_attn_layer_norm(out), caption_keys, caption_values, caption_visible);
  out = out + encoder_attn_layer_norm(attended);
  return out + glu(out);
}

BartPriorImpl::BartPriorImpl(const BartPriorConfig& config) {
  encoder = register_module("encoder", BartEncoder(config));
  decoder = register_module("decoder", BartDecoder(config));
}

BartDecoderImpl::BartDecoderImpl(const BartPriorConfig& config) : config_(config) {
  config.validate();
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(config.image_vocab_size + 1, config.width));
  embed_positions = register_module("embed_positions", torch::nn::Embedding(config.image_length, config.width));
  layernorm_embedding = register_module("layernorm_embedding", layer_norm(config.width));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.layers; ++i) layers->push_back(BartDecoderLayer(config));
  final_ln = register_module("final_ln", layer_norm(config.width));
  lm_head = register_module("lm_head", unbiased(config.width, config.image_vocab_size + 1));
}

BartDecoderCache BartDecoderImpl::start(const torch::Tensor& encoding, const torch::Tensor& text,
                                        const TensorMaker& make) {
  if (encoding.dim() != 3 || text.dim() != 2 || encoding.size(0) != text.size(0) ||
      encoding.size(1) != text.size(1) || encoding.size(2) != config_.width) {
    throw Error("BART decoder: an encoding " + c10::str(encoding.sizes()) + " of captions " + c10::str(text.sizes()) +
                "; expected [B, L, " + std::to_string(config_.width) + "] of [B, L]");
  }
  // Made by `make` (kept at fixed addresses), or the computed tensors themselves.
  const auto kept = [&](const std::string& name, const torch::Tensor& value) {
    return make ? make(name, value.sizes(), value.options()).copy_(value) : value;
  };
  BartDecoderCache cache;
  const int64_t batch = encoding.size(0), head_width = config_.width / config_.heads;
  const std::vector<int64_t> sizes = {batch, config_.heads, config_.image_length, head_width};
  const auto zeros = [&](const std::string& name) {
    return make ? make(name, sizes, encoding.options()) : torch::zeros(sizes, encoding.options());
  };
  for (const auto& module : *layers) {
    auto& cross = module->as<BartDecoderLayer>()->encoder_attn;
    const auto slot = std::to_string(cache.keys.size());
    cache.keys.push_back(zeros("keys." + slot));
    cache.values.push_back(zeros("values." + slot));
    cache.caption_keys.push_back(kept("caption_keys." + slot, cross->split(cross->k_proj(encoding))));
    cache.caption_values.push_back(kept("caption_values." + slot, cross->split(cross->v_proj(encoding))));
  }
  cache.caption_visible = kept("caption_visible", (text != kBartPadId).view({batch, 1, 1, text.size(1)}));
  return cache;
}

torch::Tensor BartDecoderImpl::forward(const torch::Tensor& tokens, BartDecoderCache& cache) {
  const int64_t start = cache.length, count = tokens.dim() == 2 ? tokens.size(1) : 0;
  if (cache.keys.empty() || count < 1 || tokens.size(0) != cache.keys.front().size(0) ||
      start + count > config_.image_length) {
    throw Error("BART decoder: " + c10::str(tokens.sizes()) + " tokens after " + std::to_string(start) +
                " of a cache for " + (cache.keys.empty() ? "no" : std::to_string(cache.keys.front().size(0))) +
                " rows; at most " + std::to_string(config_.image_length) + " positions (start() makes the cache)");
  }
  const auto positions = torch::arange(start, start + count, tokens.options());
  auto x = layernorm_embedding(embed_tokens(tokens) + embed_positions(positions));
  for (size_t i = 0; i < layers->size(); ++i) {
    x = layers[i]->as<BartDecoderLayer>()->forward(x, start, cache.keys[i], cache.values[i], cache.caption_keys[i],
                                                    cache.caption_values[i], cache.caption_visible);
  }
  cache.length = start + count;
  return lm_head(final_ln(x));
}

torch::Tensor BartDecoderImpl::forward_step(const torch::Tensor& tokens, BartDecoderCache& cache,
                                            const torch::Tensor& position, int64_t keys) {
  if (cache.keys.empty() || tokens.dim() != 2 || tokens.size(1) != 1 || tokens.size(0) != cache.keys.front().size(0) ||
      position.numel() != 1 || keys < 1 || keys > config_.image_length) {
    throw Error("BART decoder: a step takes tokens [B, 1] for a cache of B rows, one position and 1 .. " +
                std::to_string(config_.image_length) + " keys; got " + c10::str(tokens.sizes()));
  }
  auto x = layernorm_embedding(embed_tokens(tokens) + embed_positions(position));
  for (size_t i = 0; i < layers->size(); ++i) {
    x = layers[i]->as<BartDecoderLayer>()->step(x, position, keys, cache.keys[i], cache.values[i],
                                                 cache.caption_keys[i], cache.caption_values[i],
                                                 cache.caption_visible);
  }
  return lm_head(final_ln(x));
}

io::TensorMap with_unit_layer_norm_gains(const io::TensorMap& state, torch::nn::Module& module) {
  auto completed = state;
  for (const auto& parameter : module.named_parameters()) {
    const auto& name = parameter.key();
    const bool gain_without_scale = name.ends_with("pre_self_attn_layer_norm.weight") ||
                                    name.ends_with("pre_encoder_attn_layer_norm.weight") ||
                                    name.ends_with("glu.ln0.weight") || name.ends_with("glu.ln1.weight");
    if (gain_without_scale && !completed.count(name)) completed[name] = torch::ones_like(parameter.value());
  }
  return completed;
}

}  // namespace dalle::models
