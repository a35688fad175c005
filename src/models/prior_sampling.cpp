#include "dalle/models/prior_sampling.h"

#include <torch/torch.h>

#include <limits>
#include <numeric>

#include "dalle/seed.h"
#include "dalle/error.h"

namespace dalle::models {
using torch::indexing::Slice;

void SamplingOptions::visit(ConfigVisitor& v) {
  v.field("temperature", temperature, "divides the logits before sampling (DALL-E: 1)", {.min = 1e-4, .max = 100.0});
  v.field("top_k", top_k, "sample among the k likeliest codes (0: all)", {.min = 0});
  v.field("top_p", top_p, "sample among the likeliest codes whose probabilities sum to p (1: all)",
          {.min = 1e-6, .max = 1.0});
  v.field("guidance_scale", guidance_scale,
          "classifier-free guidance: logits = uncond + scale * (cond - uncond), uncond from the empty caption "
          "(1: no guidance, one model call per token; for DALL-E Mega / Mini, min-dalle's supercondition factor, "
          "16)",
          {.min = 0.0, .max = 100.0});
  v.field("use_cache", use_cache, "decode with the KV cache (false: recompute the whole prefix per token)");
  v.field("seed", seed, "seed of the sampling; the same seed gives the same images", {.min = 0});
}

torch::Tensor filter_logits(const torch::Tensor& logits, const SamplingOptions& options) {
  constexpr double kMinusInfinity = -std::numeric_limits<double>::infinity();
  auto filtered = logits.to(torch::kFloat32) / options.temperature;
  const int64_t classes = filtered.size(-1);
  if (options.top_k > 0 && options.top_k < classes) {
    const auto kth = std::get<0>(filtered.topk(options.top_k, -1)).index({Slice(), Slice(-1, torch::indexing::None)});
    filtered = filtered.masked_fill(filtered < kth, kMinusInfinity);
  }
  if (options.top_p < 1.0) {
    auto [sorted, order] = filtered.sort(-1, /*descending=*/true);
    const auto cumulative = sorted.softmax(-1).cumsum(-1);
    // Drop a code when the codes before it already reach top_p; the likeliest always stays.
    auto drop = (cumulative - sorted.softmax(-1)) >= options.top_p;
    filtered = filtered.masked_fill(torch::zeros_like(drop).scatter(-1, order, drop), kMinusInfinity);
  }
  return filtered;
}

torch::Tensor filter_logits(const torch::Tensor& logits, double temperature, const RowFilters& filters) {
  constexpr double kMinusInfinity = -std::numeric_limits<double>::infinity();
  auto filtered = logits.to(torch::kFloat32) / temperature;
  const int64_t classes = filtered.size(-1);
  const auto on = torch::TensorOptions().device(filtered.device());
  // k outside (0, classes) filters nothing: its threshold is the row's smallest logit.
  auto k = torch::tensor(filters.top_k, on.dtype(torch::kInt64)).unsqueeze(1);
  k = torch::where((k > 0) & (k < classes), k, classes);
  const auto kth = std::get<0>(filtered.sort(-1, /*descending=*/true)).gather(1, k - 1);
  filtered = filtered.masked_fill(filtered < kth, kMinusInfinity);
  const auto p = torch::tensor(filters.top_p, on.dtype(torch::kFloat64)).to(torch::kFloat32).unsqueeze(1);
  auto [sorted, order] = filtered.sort(-1, /*descending=*/true);
  const auto cumulative = sorted.softmax(-1).cumsum(-1);
  const auto drop = ((cumulative - sorted.softmax(-1)) >= p) & (p < 1.0);
  return filtered.masked_fill(torch::zeros_like(drop).scatter(-1, order, drop), kMinusInfinity);
}

torch::Tensor sampling_uniforms(int64_t seed, const std::vector<uint64_t>& streams, int64_t positions) {
  return sampling_uniforms(std::vector<int64_t>(streams.size(), seed), streams, positions);
}

torch::Tensor sampling_uniforms(const std::vector<int64_t>& seeds, const std::vector<uint64_t>& streams,
                                int64_t positions) {
  if (seeds.size() != streams.size()) {
    throw Error("sampling: " + std::to_string(seeds.size()) + " seeds for " + std::to_string(streams.size()) +
                " streams");
  }
  auto uniforms = torch::empty({static_cast<int64_t>(streams.size()), positions}, torch::kFloat32);
  auto* out = uniforms.data_ptr<float>();
  for (size_t row = 0; row < streams.size(); ++row) {
    for (int64_t position = 0; position < positions; ++position) {
      // The top 23 bits, centred in their interval: exact in float32 and never 0 or 1.
      const uint64_t bits =
          mix_seed(static_cast<uint64_t>(seeds[row]), streams[row], static_cast<uint64_t>(position)) >> 41;
      *out++ = (static_cast<float>(bits) + 0.5f) * 0x1p-23f;
    }
  }
  return uniforms;
}

std::vector<int64_t> seeds_of_rows(int64_t seed, const std::vector<int64_t>& row_seeds, int64_t rows) {
  if (row_seeds.empty()) return std::vector<int64_t>(static_cast<size_t>(rows), seed);
  if (static_cast<int64_t>(row_seeds.size()) != rows) {
    throw Error("sampling: " + std::to_string(row_seeds.size()) + " seeds for " + std::to_string(rows) + " rows");
  }
  return row_seeds;
}

torch::Tensor draw_codes(const torch::Tensor& probabilities, const torch::Tensor& uniforms) {
  const auto cumulative = probabilities.to(torch::kFloat32).cumsum(-1);
  const auto target = uniforms.to(cumulative.device()).unsqueeze(1) * cumulative.narrow(1, cumulative.size(1) - 1, 1);
  // The first code whose cumulative sum reaches the target: a code of probability 0 repeats
  // the sum before it and so is never the first to reach it.
  return torch::searchsorted(cumulative, target).squeeze(1).clamp_max(cumulative.size(1) - 1);
}

namespace {

class TokenSource {
 public:
  TokenSource(Prior& prior, const torch::Tensor& captions, bool use_cache)
      : prior_(prior), use_cache_(use_cache), sequence_(captions) {
    if (use_cache_) cache_ = prior_->make_cache(captions.size(0));
  }
  // Logits [B, classes] for the position after the last token given.
  torch::Tensor next_logits() {
    const auto logits = use_cache_ ? prior_->forward_cached(pending(), cache_) : prior_->forward(sequence_);
    return logits.select(1, logits.size(1) - 1);
  }
  void append(const torch::Tensor& codes) { sequence_ = torch::cat({sequence_, codes.unsqueeze(1)}, 1); }

 private:
  torch::Tensor pending() const { return sequence_.index({Slice(), Slice(cache_.length, torch::indexing::None)}); }
  Prior& prior_;
  bool use_cache_;
  torch::Tensor sequence_;
  KvCache cache_;
};

void check_inputs(const PriorConfig& config, const torch::Tensor& captions, const ImagePrompt* prompt,
                  const std::vector<uint64_t>& streams) {
  if (captions.dim() != 2 || captions.size(1) != config.text_length) {
    throw Error("sampling: expected captions [batch, " + std::to_string(config.text_length) + "]");
  }
  if (!streams.empty() && static_cast<int64_t>(streams.size()) != captions.size(0)) {
    throw Error("sampling: " + std::to_string(streams.size()) + " streams for " + std::to_string(captions.size(0)) +
                " captions");
  }
  if (prompt && (prompt->known.numel() != config.image_length() || prompt->tokens.size(-1) != config.image_length())) {
    throw Error("sampling: an image prompt needs tokens and a known-mask for all " +
                std::to_string(config.image_length()) + " positions");
  }
}

}  // namespace

torch::Tensor sample_image_tokens(Prior& prior, const torch::Tensor& captions, const SamplingOptions& options,
                                  const ImagePrompt* prompt, const TokenCallback& on_token,
                                  const std::vector<uint64_t>& streams, const RowFilters* row_filters,
                                  const std::vector<int64_t>& row_seeds) {
  const auto& config = prior->config();
  check_inputs(config, captions, prompt, streams);
  if (row_filters && (static_cast<int64_t>(row_filters->top_k.size()) != captions.size(0) ||
                      row_filters->top_k.size() != row_filters->top_p.size())) {
    throw Error("sampling: row filters for " + std::to_string(row_filters->top_k.size()) + " rows, " +
                std::to_string(captions.size(0)) + " captions");
  }
  torch::NoGradGuard no_grad;
  const bool guided = options.guidance_scale != 1.0;
  const int64_t batch = captions.size(0), total = config.image_length();
  const auto device = prior->parameters().front().device();
  auto inputs = captions.to(device);
  if (guided) inputs = torch::cat({inputs, empty_caption(config.text_length, batch).to(device)});
  std::vector<uint64_t> row_streams = streams;
  if (row_streams.empty()) {
    row_streams.resize(static_cast<size_t>(batch));
    std::iota(row_streams.begin(), row_streams.end(), uint64_t{0});
  }
  const auto uniforms = sampling_uniforms(seeds_of_rows(options.seed, row_seeds, batch), row_streams, total).to(device);
  const auto known = prompt ? prompt->known.to(torch::kBool).cpu() : torch::Tensor();
  const auto prompt_tokens = prompt ? prompt->tokens.expand({batch, total}).to(device) : torch::Tensor();

  TokenSource source(prior, inputs, options.use_cache);
  std::vector<torch::Tensor> codes;
  for (int64_t position = 0; position < total; ++position) {
    torch::Tensor next;
    if (prompt && known[position].item<bool>()) {
      // No model call: the token joins the pending ones the next call takes in one step.
      next = prompt_tokens.select(1, position);
    } else {
      // In float32 whatever the prior computes in: guidance subtracts nearly equal logits.
      auto logits = source.next_logits()
                        .index({Slice(), Slice(config.text_classes(), torch::indexing::None)})
                        .to(torch::kFloat32);
      if (guided) {
        const auto conditional = logits.index({Slice(0, batch)}), unconditional = logits.index({Slice(batch)});
        logits = unconditional + options.guidance_scale * (conditional - unconditional);
      }
      const auto filtered =
          row_filters ? filter_logits(logits, options.temperature, *row_filters) : filter_logits(logits, options);
      next = draw_codes(filtered.softmax(-1), uniforms.select(1, position));
    }
    codes.push_back(next);
    if (position + 1 < total) source.append(guided ? torch::cat({next, next}) : next);
    if (on_token) on_token(position + 1, total, next);
  }
  return torch::stack(codes, 1).view({batch, config.grid_size, config.grid_size});
}

}  // namespace dalle::models
