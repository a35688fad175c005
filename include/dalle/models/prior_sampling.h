#pragma once
// Drawing image tokens from the prior: KV-cached decoding (each new token costs one step
// over cached keys and values), temperature, top-k and top-p filtering, classifier-free
// guidance against the empty caption, and image prompts whose given positions are kept.
//
// The randomness is counter-based: each row of a batch draws from its own stream, one
// uniform number per image position, fixed by (seed, stream, position). A row's tokens
// therefore do not depend on the batch it is sampled in, and the draws are made on the
// device without a round trip to the host per token.
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "dalle/config.h"
#include "dalle/models/decode_graphs.h"
#include "dalle/models/prior.h"

namespace dalle::models {

struct SamplingOptions {
  double temperature = 1.0;
  int64_t top_k = 0;           // 0: no top-k filtering
  double top_p = 1.0;          // 1: no nucleus filtering
  double guidance_scale = 1.0; // logits = uncond + scale * (cond - uncond); 1: no guidance
  bool use_cache = true;       // false recomputes the whole prefix for every token (the reference)
  int64_t seed = 0;

  void visit(ConfigVisitor& v);
};

// Image tokens fixed in advance (the top rows of an image, say): `tokens` [B or 1, N]
// holds codes, `known` [N] bool marks the positions kept; the rest are sampled.
struct ImagePrompt {
  torch::Tensor tokens;
  torch::Tensor known;
};

// Filters one step's logits [B, classes] by top-k and top-p after the temperature.
torch::Tensor filter_logits(const torch::Tensor& logits, const SamplingOptions& options);

// A top-k and top-p per row of a batch (ruDALL-E's schedule draws rows of several stages at
// once); each row filtered exactly as filter_logits filters it with its own values.
struct RowFilters {
  std::vector<int64_t> top_k;
  std::vector<double> top_p;
};
torch::Tensor filter_logits(const torch::Tensor& logits, double temperature, const RowFilters& filters);
// The same with the filters on the logits' device: top_k [B, 1] int64, top_p [B, 1] float32.
torch::Tensor filter_logits(const torch::Tensor& logits, double temperature, const torch::Tensor& top_k,
                            const torch::Tensor& top_p);

// The draws of `streams` under `seed`: [streams, positions] float32, uniform in (0, 1),
// computed on the host with integer arithmetic, the same on every machine.
torch::Tensor sampling_uniforms(int64_t seed, const std::vector<uint64_t>& streams, int64_t positions);
// The same with a seed per stream (dalle-serve batches requests of different seeds): row r
// is exactly row 0 of sampling_uniforms(seeds[r], {streams[r]}, positions).
torch::Tensor sampling_uniforms(const std::vector<int64_t>& seeds, const std::vector<uint64_t>& streams,
                                int64_t positions);
// Each row's seed: `row_seeds` when given (one per row, checked), else `seed` for all `rows`.
std::vector<int64_t> seeds_of_rows(int64_t seed, const std::vector<int64_t>& row_seeds, int64_t rows);

// One code per row of `probabilities` [B, classes] (rows need not sum to 1): the code whose
// interval of the cumulative sum holds `uniforms` [B]. A code of probability 0 is never drawn.
torch::Tensor draw_codes(const torch::Tensor& probabilities, const torch::Tensor& uniforms);

// Called by the samplers after each image position with the positions done, their total and
// the codes just drawn ([B] int64 on the sampler's device; progress, previews).
using TokenCallback = std::function<void(int64_t done, int64_t total, const torch::Tensor& drawn)>;

// captions [B, text_length] (0 = padding) -> image tokens [B, grid, grid]. Row b draws from
// stream `streams[b]` (empty: stream b) of seed `row_seeds[b]` (empty: options.seed), filtered
// by `row_filters` in place of the options' top_k and top_p when given. `on_token` follows
// each image position (its codes are a view: copy them to keep them). With the cache, the
// captions and an image prompt's leading codes go through the model at once, then each
// position is one step of fixed shapes with no host synchronisation; `graphs` keeps the
// steps' tensors across calls and, on a GPU, replays the steps as CUDA graphs.
torch::Tensor sample_image_tokens(Prior& prior, const torch::Tensor& captions, const SamplingOptions& options,
                                  const ImagePrompt* prompt = nullptr, const TokenCallback& on_token = {},
                                  const std::vector<uint64_t>& streams = {}, const RowFilters* row_filters = nullptr,
                                  const std::vector<int64_t>& row_seeds = {}, DecodeGraphs* graphs = nullptr);

}  // namespace dalle::models
