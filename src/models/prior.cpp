#include "dalle/models/prior.h"

#include <torch/torch.h>

#include <cmath>
#include <map>

#include "dalle/error.h"

namespace dalle::models {
namespace F = torch::nn::functional;
using torch::indexing::Slice;

namespace {

// A block's parameters without their values (a block built one at a time holds them only while
// they are drawn); their shapes are kept to draw them again.
std::vector<std::vector<int64_t>> emptied(ResblockImpl& block) {
  std::vector<std::vector<int64_t>> shapes;
  for (auto& parameter : block.parameters()) {
    shapes.push_back(parameter.sizes().vec());
    parameter.set_data(torch::empty({0}, parameter.options()));
  }
  return shapes;
}

void refilled(ResblockImpl& block, const std::vector<std::vector<int64_t>>& shapes) {
  auto parameters = block.parameters();
  for (size_t i = 0; i < parameters.size(); ++i) {
    parameters[i].set_data(torch::empty(shapes[i], parameters[i].options()));
  }
}

}  // namespace

PriorImpl::PriorImpl(PriorConfig config, const ResblockBuilt& built) : config_(std::move(config)) {
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
    if (built) block_shapes_.push_back(emptied(*resblocks_.back()));
    resblocks_.push_back(std::make_shared<MlpResblockImpl>(config_));
    if (built) block_shapes_.push_back(emptied(*resblocks_.back()));
  }
  for (const auto& block : resblocks_) blocks->push_back(block);
  final_norm_ = register_module("final_norm", prior_layer_norm(width));
  if (config_.head_norm) head_norm_ = register_module("head_norm", prior_layer_norm(width));
  to_logits_ = register_module("to_logits", Linear(width, config_.text_classes() + config_.image_vocab_size));
  init_weights(built);
  block_shapes_.clear();
}

void PriorImpl::init_weights(const ResblockBuilt& built) {
  torch::NoGradGuard no_grad;
  // named_parameters()' order: the children's in turn (this module has none of its own).
  for (const auto& child : named_children()) {
    if (child.key() != "resblocks") {
      init_parameters(child.key() + ".", *child.value());
      continue;
    }
    for (size_t b = 0; b < resblocks_.size(); ++b) {
      if (built) refilled(*resblocks_[b], block_shapes_[b]);
      init_parameters("resblocks." + std::to_string(b) + ".", *resblocks_[b]);
      if (built) built(b, *resblocks_[b]);
    }
  }
}

void PriorImpl::init_parameters(const std::string& prefix, torch::nn::Module& module) {
  // GPT-style: N(0, 0.02), with the projections into the residual stream scaled down by
  // sqrt(2 * layers) so that the stream's variance does not grow with depth.
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.layers));
  for (auto& item : module.named_parameters()) {
    const auto name = prefix + item.key();
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
    parts.push_back(embed_image(codes, cells));
  }
  return parts.size() == 1 ? parts[0] : torch::cat(parts, 1);
}

torch::Tensor PriorImpl::embed_image(const torch::Tensor& codes, const torch::Tensor& cells) {
  return image_embedding_(codes) + image_row_embedding_(cells.div(config_.grid_size, "floor")) +
         image_column_embedding_(cells.remainder(config_.grid_size));
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
  const int64_t start = context.start;
  const auto x = run_end(
      PriorEnd::embeddings, [this, start](const torch::Tensor& ids) { return embed(ids, start); }, tokens);
  return through_resblocks(x, context);
}

torch::Tensor PriorImpl::through_resblocks(torch::Tensor x, const ResblockContext& context) {
  for (const auto& block : resblocks_) {
    x = runner_ ? runner_(*block, x, context) : x + block->branch(x, context);
  }
  return run_end(PriorEnd::head, [this](const torch::Tensor& stream) { return head(stream); }, x);
}

torch::Tensor PriorImpl::head(const torch::Tensor& x) {
  auto y = final_norm_(x);
  if (head_norm_) y = head_norm_(y);
  return to_logits_(y);
}

torch::Tensor PriorImpl::run_end(PriorEnd end, const EndPart& part, const torch::Tensor& input) {
  return end_runner_ ? end_runner_(end, part, input) : part(input);
}

std::vector<std::pair<std::string, torch::Tensor>> PriorImpl::end_parameters(PriorEnd end) const {
  // named_parameters()' order: the embeddings' modules, the resblocks, then the head's.
  std::vector<std::pair<std::string, torch::Tensor>> parameters;
  bool after_blocks = false;
  for (const auto& item : named_parameters()) {
    if (item.key().starts_with("resblocks.")) {
      after_blocks = true;
      continue;
    }
    if (after_blocks == (end == PriorEnd::head)) parameters.emplace_back(item.key(), item.value());
  }
  return parameters;
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
  const auto cells = position - config_.text_length;
  const auto x = run_end(
      PriorEnd::embeddings, [this, cells](const torch::Tensor& ids) { return embed_image(ids, cells); }, codes);
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

}  // namespace dalle::models
