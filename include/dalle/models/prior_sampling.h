#pragma once
// Drawing image tokens from the prior: KV-cached decoding (each new token costs one step
// over cached keys and values), temperature, top-k and top-p filtering, classifier-free
// guidance against the empty caption, and image prompts whose given positions are kept.
#include <torch/types.h>

#include <cstdint>
#include <functional>

#include "dalle/config.h"
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

// captions [B, text_length] (0 = padding) -> image tokens [B, grid, grid]. `on_token` is
// called after each image position (for progress).
torch::Tensor sample_image_tokens(Prior& prior, const torch::Tensor& captions, const SamplingOptions& options,
                                  const ImagePrompt* prompt = nullptr,
                                  const std::function<void(int64_t done, int64_t total)>& on_token = {});

}  // namespace dalle::models
