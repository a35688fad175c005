#include "dalle/models/prior.h"

#include <torch/torch.h>

#include <cmath>
#include <map>

#include "dalle/error.h"

namespace dalle::models {
namespace F = torch::nn::functional;
using torch::indexing::Slice;

void PriorConfig::visit(ConfigVisitor& v) {
  v.field("text_length", text_length, "caption tokens, bos and eos included (DALL-E: 256, ruDALL-E: 128)",
          {.min = 2, .max = 4096});
  v.field("text_vocab_size", text_vocab_size,
          "caption BPE vocabulary; text_length position-unique padding ids follow it (DALL-E: 16384)",
          {.min = 4, .max = 1 << 20});
  v.field("grid_size", grid_size, "side of the image token grid (32 for 256px images and an f8 tokenizer)",
          {.min = 1, .max = 256});
  v.field("image_vocab_size", image_vocab_size, "image tokenizer codebook size (DALL-E: 8192)",
          {.min = 2, .max = 1 << 20});
  v.field("layers", layers, "attention layers, each an attention resblock then an MLP resblock (DALL-E: 64)",
          {.min = 1, .max = 1024});
  v.field("width", width, "d_model (DALL-E: 3968, ruDALL-E XL: 2048)", {.min = 1, .max = 65536});
  v.field("heads", heads, "attention heads; width must divide by it (DALL-E: 62)", {.min = 1, .max = 1024});
  v.field("mlp_ratio", mlp_ratio, "MLP hidden width / width", {.min = 1, .max = 64});
  v.field("attention", attention,
          "attention kind per layer (causal, row, column, conv): none for layer_pattern's, one for every layer, or "
          "exactly one per layer",
          {.choices = {"causal", "row", "column", "conv"}});
  v.field("layer_pattern", layer_pattern,
          "the kinds when attention names none: dalle (the paper: column at layers 2, 6, 10, ..., the last conv, "
          "the rest row) or rudalle (its weights' rule: the same, but a last layer at 2, 6, 10, ... stays column)",
          {.choices = {"dalle", "rudalle"}});
  v.field("conv_kernel", conv_kernel, "side of the convolutional mask's neighbourhood (odd)", {.min = 1, .max = 255});
  v.field("conv_edges", conv_edges,
          "clamped: the conv neighbourhood stops at the grid's edges (ruDALL-E v3); wrap: it wraps around them "
          "(ruDALL-E v2)",
          {.choices = {"clamped", "wrap"}});
  v.field("attention_path", attention_path,
          "sparse: compute only the blocks a mask allows; dense: masked attention over the whole sequence "
          "(the reference)",
          {.choices = {"sparse", "dense"}});
  v.field("sandwich_norm", sandwich_norm, "a LayerNorm on each resblock's output before the residual add (ruDALL-E)");
  v.field("head_norm", head_norm, "a second LayerNorm between the final one and the logits (ruDALL-E)");
  v.field("gelu", gelu, "MLP activation: exact GELU, or the tanh approximation (ruDALL-E)",
          {.choices = {"exact", "tanh"}});
  v.field("dropout", dropout, "dropout on each resblock's output in training", {.min = 0.0, .max = 0.9});
  v.field("text_loss_weight", text_loss_weight, "weight of the text loss; the image loss gets the rest (DALL-E: 1/8)",
          {.min = 0.0, .max = 1.0});
}

void PriorConfig::validate() const {
  if (width % heads != 0) {
    throw Error("prior: width " + std::to_string(width) + " does not divide into " + std::to_string(heads) + " heads");
  }
  if (conv_kernel % 2 == 0) throw Error("prior: conv_kernel must be odd, not " + std::to_string(conv_kernel));
  models::layer_pattern(attention, layers, layer_pattern);  // throws on a bad pattern
}

namespace {

Linear linear(int64_t in, int64_t out) { return Linear(in, out); }
torch::nn::LayerNorm layer_norm(int64_t width) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({width}).eps(1e-5));
}

}  // namespace

AttentionResblockImpl::AttentionResblockImpl(const PriorConfig& config, std::shared_ptr<const LayerMask> mask,
                                             int64_t cache_slot)
    : mask_(std::move(mask)), heads_(config.heads), cache_slot_(cache_slot), dropout_(config.dropout) {
  norm_ = register_module("norm", layer_norm(config.width));
  qkv_ = register_module("qkv", linear(config.width, 3 * config.width));
  out_ = register_module("out", linear(config.width, config.width));
  if (config.sandwich_norm) output_norm_ = register_module("output_norm", layer_norm(config.width));
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
  norm_ = register_module("norm", layer_norm(config.width));
  fc_in_ = register_module("fc_in", linear(config.width, config.mlp_ratio * config.width));
  fc_out_ = register_module("fc_out", linear(config.mlp_ratio * config.width, config.width));
  if (config.sandwich_norm) output_norm_ = register_module("output_norm", layer_norm(config.width));
}

torch::Tensor MlpResblockImpl::branch(const torch::Tensor& x, const ResblockContext&) {
  auto hidden = F::gelu(fc_in_(norm_(x)), F::GELUFuncOptions().approximate(gelu_ == "tanh" ? "tanh" : "none"));
  auto out = F::dropout(fc_out_(hidden), F::DropoutFuncOptions().p(dropout_).training(is_training()));
  return output_norm_ ? output_norm_(out) : out;
}

PriorImpl::PriorImpl(PriorConfig config) : config_(std::move(config)) {
  config_.validate();
  const int64_t width = config_.width;
  text_embedding_ = register_module("text_embedding", torch::nn::Embedding(config_.text_classes(), width));
  text_position_embedding_ =
      register_module("text_position_embedding", torch::nn::Embedding(config_.text_length, width));
  image_embedding_ = register_module("image_embedding", torch::nn::Embedding(config_.image_vocab_size, width));
  image_row_embedding_ = register_module("image_row_embedding", torch::nn::Embedding(config_.grid_size, width));
  image_column_embedding_ = register_module("image_column_embedding", torch::nn::Embedding(config_.grid_size, width));

  const auto pattern = layer_pattern(config_.attention, config_.layers, config_.layer_pattern);
  const MaskSpec base{.conv_kernel = config_.conv_kernel, .conv_edges = parse_conv_edges(config_.conv_edges)};
  std::map<AttentionKind, std::shared_ptr<const LayerMask>> masks;
  auto blocks = register_module("resblocks", torch::nn::ModuleList());
  for (int64_t layer = 0; layer < config_.layers; ++layer) {
    auto& mask = masks[pattern[layer]];
    if (!mask) {
      MaskSpec spec = base;
      spec.kind = pattern[layer];
      mask = std::make_shared<const LayerMask>(spec, config_.layout());
    }
    resblocks_.push_back(std::make_shared<AttentionResblockImpl>(config_, mask, layer));
    resblocks_.push_back(std::make_shared<MlpResblockImpl>(config_));
  }
  for (const auto& block : resblocks_) blocks->push_back(block);
  final_norm_ = register_module("final_norm", layer_norm(width));
  if (config_.head_norm) head_norm_ = register_module("head_norm", layer_norm(width));
  to_logits_ = register_module("to_logits", linear(width, config_.text_classes() + config_.image_vocab_size));
  init_weights();
}

void PriorImpl::init_weights() {
  // GPT-style: N(0, 0.02), with the projections into the residual stream scaled down by
  // sqrt(2 * layers) so that the stream's variance does not grow with depth.
  torch::NoGradGuard no_grad;
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.layers));
  for (auto& item : named_parameters()) {
    const auto& name = item.key();
    auto& parameter = item.value();
    const bool is_bias = name.ends_with(".bias");
    const bool is_norm = name.find("norm") != std::string::npos;
    if (is_norm) {
      is_bias ? parameter.zero_() : parameter.fill_(1.0);
    } else if (is_bias) {
      parameter.zero_();
    } else {
      const bool into_residual = name.ends_with(".out.weight") || name.ends_with(".fc_out.weight");
      parameter.normal_(0.0, into_residual ? residual_std : 0.02);
    }
  }
}

torch::Tensor PriorImpl::embed(const torch::Tensor& tokens, int64_t start) {
  const int64_t rows = tokens.size(1), text_length = config_.text_length;
  const int64_t text_rows = std::clamp<int64_t>(text_length - start, 0, rows);
  std::vector<torch::Tensor> parts;
  if (text_rows > 0) {
    const auto positions = torch::arange(start, start + text_rows, tokens.options());
    const auto ids = tokens.index({Slice(), Slice(0, text_rows)});
    const auto padded = torch::where(ids == kCaptionPadId, config_.text_vocab_size + positions, ids);
    parts.push_back(text_embedding_(padded) + text_position_embedding_(positions));
  }
  if (text_rows < rows) {
    const int64_t first = start + text_rows - text_length;
    const auto cells = torch::arange(first, first + rows - text_rows, tokens.options());
    const auto codes = tokens.index({Slice(), Slice(text_rows, torch::indexing::None)});
    parts.push_back(image_embedding_(codes) + image_row_embedding_(cells.div(config_.grid_size, "floor")) +
                    image_column_embedding_(cells.remainder(config_.grid_size)));
  }
  return parts.size() == 1 ? parts[0] : torch::cat(parts, 1);
}

namespace {

void check_tokens(const torch::Tensor& tokens, int64_t start, const PriorConfig& config) {
  if (tokens.dim() != 2 || tokens.scalar_type() != torch::kInt64) {
    throw Error("prior: expected int64 tokens [batch, positions]");
  }
  if (start + tokens.size(1) > config.length() || tokens.size(1) == 0) {
    throw Error("prior: positions " + std::to_string(start) + " .. " + std::to_string(start + tokens.size(1) - 1) +
                " do not fit the sequence of " + std::to_string(config.length()));
  }
  const int64_t text_rows = std::clamp<int64_t>(config.text_length - start, 0, tokens.size(1));
  const auto text = tokens.index({Slice(), Slice(0, text_rows)});
  const auto image = tokens.index({Slice(), Slice(text_rows, torch::indexing::None)});
  if (text.numel() > 0 && (text.min().item<int64_t>() < 0 || text.max().item<int64_t>() >= config.text_vocab_size)) {
    throw Error("prior: caption ids must lie in [0, " + std::to_string(config.text_vocab_size) + ")");
  }
  if (image.numel() > 0 &&
      (image.min().item<int64_t>() < 0 || image.max().item<int64_t>() >= config.image_vocab_size)) {
    throw Error("prior: image codes must lie in [0, " + std::to_string(config.image_vocab_size) + ")");
  }
}

}  // namespace

torch::Tensor PriorImpl::run(const torch::Tensor& tokens, const ResblockContext& context) {
  check_tokens(tokens, context.start, config_);
  return through_resblocks(embed(tokens, context.start), context);
}

torch::Tensor PriorImpl::through_resblocks(torch::Tensor x, const ResblockContext& context) {
  for (const auto& block : resblocks_) {
    x = runner_ ? runner_(*block, x, context) : x + block->branch(x, context);
  }
  x = final_norm_(x);
  if (head_norm_) x = head_norm_(x);
  return to_logits_(x);
}

torch::Tensor PriorImpl::forward(const torch::Tensor& tokens) {
  return run(tokens, {.start = 0,
                      .cache = nullptr,
                      .path = parse_attention_path(config_.attention_path),
                      .position = {},
                      .keys = 0});
}

namespace {

void check_cache(const KvCache& cache, int64_t batch, const PriorConfig& config) {
  if (cache.keys.size() != static_cast<size_t>(config.layers) || cache.masks.size() != cache.keys.size() ||
      cache.keys[0].size(0) != batch) {
    throw Error("prior: the KV cache was made for another model or batch size");
  }
}

}  // namespace

torch::Tensor PriorImpl::forward_cached(const torch::Tensor& tokens, KvCache& cache) {
  check_cache(cache, tokens.size(0), config_);
  auto logits =
      run(tokens, {.start = cache.length, .cache = &cache, .path = AttentionPath::dense, .position = {}, .keys = 0});
  cache.length += tokens.size(1);
  return logits;
}

torch::Tensor PriorImpl::forward_step(const torch::Tensor& codes, KvCache& cache, const torch::Tensor& position,
                                      int64_t keys) {
  check_cache(cache, codes.size(0), config_);
  if (codes.dim() != 2 || codes.size(1) != 1 || position.numel() != 1 || keys < 1 || keys > config_.length()) {
    throw Error("prior: a decoding step takes codes [B, 1], one position and 1 .. " +
                std::to_string(config_.length()) + " keys");
  }
  const auto cell = position - config_.text_length;
  const auto x = image_embedding_(codes) + image_row_embedding_(cell.div(config_.grid_size, "floor")) +
                 image_column_embedding_(cell.remainder(config_.grid_size));
  return through_resblocks(x, {.cache = &cache, .path = AttentionPath::dense, .position = position, .keys = keys});
}

KvCache PriorImpl::make_cache(int64_t batch, const TensorMaker& make) const {
  const auto options = to_logits_->weight.options();
  const TensorMaker zeros =
      make ? make : TensorMaker([](const std::string&, at::IntArrayRef sizes, const torch::TensorOptions& on) {
        return torch::zeros(sizes, on);
      });
  const std::vector<int64_t> sizes = {batch, config_.heads, config_.length(), config_.head_width()};
  KvCache cache;
  std::map<const LayerMask*, torch::Tensor> masks;  // one copy of each kind's mask
  for (const auto& block : resblocks_) {
    const auto* attention = dynamic_cast<const AttentionResblockImpl*>(block.get());
    if (!attention) continue;
    const auto slot = std::to_string(cache.keys.size());
    cache.keys.push_back(zeros("keys." + slot, sizes, options));
    cache.values.push_back(zeros("values." + slot, sizes, options));
    auto& mask = masks[&attention->mask()];
    if (!mask.defined()) {
      mask = zeros("mask." + slot, {config_.length(), config_.length()}, options.dtype(torch::kBool));
      mask.copy_(attention->mask().dense());
    }
    cache.masks.push_back(mask);
  }
  return cache;
}

PriorLoss prior_loss(const torch::Tensor& logits, const torch::Tensor& tokens, const PriorConfig& config) {
  const int64_t text_length = config.text_length, classes = config.text_classes();
  if (tokens.dim() != 2 || tokens.size(1) <= text_length || logits.size(1) != tokens.size(1)) {
    throw Error("prior loss: expected caption and image tokens [batch, positions] with logits for each position");
  }
  const auto text = tokens.index({Slice(), Slice(0, text_length)});
  const auto positions = torch::arange(text_length, tokens.options());
  const auto text_targets =
      torch::where(text == kCaptionPadId, config.text_vocab_size + positions, text).index({Slice(), Slice(1)});
  const auto text_logits = logits.index({Slice(), Slice(0, text_length - 1), Slice(0, classes)}).to(torch::kFloat32);
  const auto image_targets = tokens.index({Slice(), Slice(text_length)});
  const auto image_logits =
      logits.index({Slice(), Slice(text_length - 1, tokens.size(1) - 1), Slice(classes)}).to(torch::kFloat32);
  PriorLoss loss;
  loss.text = F::cross_entropy(text_logits.reshape({-1, classes}), text_targets.reshape({-1}));
  loss.image = F::cross_entropy(image_logits.reshape({-1, config.image_vocab_size}), image_targets.reshape({-1}));
  loss.total = config.text_loss_weight * loss.text + (1.0 - config.text_loss_weight) * loss.image;
  return loss;
}

torch::Tensor empty_caption(int64_t text_length, int64_t batch) {
  auto ids = torch::full({batch, text_length}, kCaptionPadId, torch::kInt64);
  ids.index_put_({Slice(), 0}, kCaptionEndId);
  return ids;
}

io::TensorMap import_rudalle_state(const io::TensorMap& rudalle, const PriorConfig& config) {
  if (config.attention.empty() && config.layer_pattern != "rudalle") {
    throw Error("ruDALL-E import: the model needs layer_pattern: rudalle, the rule its weights were trained with "
                "(with 2, 6, 10, ... layers its last layer is column, not conv)");
  }
  std::map<std::string, std::string> names = {
      {"text_embeddings.weight", "text_embedding.weight"},
      {"image_embeddings.weight", "image_embedding.weight"},
      {"image_row_embeddings.weight", "image_row_embedding.weight"},
      {"image_col_embeddings.weight", "image_column_embedding.weight"},
      {"transformer.final_layernorm.weight", "final_norm.weight"},
      {"transformer.final_layernorm.bias", "final_norm.bias"},
      {"to_logits.0.weight", "head_norm.weight"},
      {"to_logits.0.bias", "head_norm.bias"},
      {"to_logits.1.weight", "to_logits.weight"},
      {"to_logits.1.bias", "to_logits.bias"},
  };
  const std::pair<const char*, const char*> layer_names[] = {
      {"input_layernorm", "0.norm"},
      {"attention.query_key_value", "0.qkv"},
      {"attention.dense", "0.out"},
      {"before_first_addition_layernorm", "0.output_norm"},
      {"post_attention_layernorm", "1.norm"},
      {"mlp.dense_h_to_4h", "1.fc_in"},
      {"mlp.dense_4h_to_h", "1.fc_out"},
      {"before_second_addition_layernorm", "1.output_norm"},
  };
  for (int64_t layer = 0; layer < config.layers; ++layer) {
    for (const auto& [theirs, ours] : layer_names) {
      const std::string block = std::to_string(2 * layer + (ours[0] - '0'));
      for (const char* kind : {".weight", ".bias"}) {
        names["transformer.layers." + std::to_string(layer) + "." + theirs + kind] =
            "resblocks." + block + (ours + 1) + kind;
      }
    }
  }
  io::TensorMap ours;
  for (const auto& [name, tensor] : rudalle) {
    if (name.starts_with("transformer.") && name.ends_with("_mask")) continue;  // rebuilt from the config
    if (name == "text_pos_embeddings.weight") {
      // ruDALL-E keeps text_length + 1 rows; v3 models never use the last.
      ours["text_position_embedding.weight"] = tensor.index({Slice(0, config.text_length)});
      continue;
    }
    const auto it = names.find(name);
    if (it == names.end()) throw Error("ruDALL-E import: unexpected tensor '" + name + "'");
    ours[it->second] = tensor;
  }
  return ours;
}

}  // namespace dalle::models
