#pragma once
// CLIP reranking: score candidate images against one caption and keep the best.
#include <torch/types.h>

#include <cstdint>
#include <vector>

#include "dalle/models/clip.h"

namespace dalle::models {

struct RerankResult {
  std::vector<int64_t> indices;  // into the candidates, best first
  std::vector<double> scores;    // their scores, descending
};

// CLIP's logits of one caption against each image: exp(logit_scale) * cosine similarity of
// the image and text features. `images` [N, 3, H, W] in [0, 1] of any size (clip_preprocess
// brings them to the model's, as its config says); `tokens` [L], or [T, L] for T renderings
// of the caption (ruclip's Predictor: the prompt in each of its templates), whose raw text
// features are averaged before normalising, as ruclip's get_text_latents does (ruDALL-E's
// cherry_pick_by_ruclip ranks by the cosine alone, which orders the same). Images are
// encoded `batch_size` at a time without gradients. Returns [N] scores (float, on the
// model's device).
torch::Tensor clip_scores(Clip& model, const torch::Tensor& images, const torch::Tensor& tokens,
                          int64_t batch_size = 32);

// The `top_k` highest of `scores` [N] (all of them when top_k >= N), highest first; equal
// scores keep the lower index first.
RerankResult top_k_scores(const torch::Tensor& scores, int64_t top_k);

// clip_scores, then top_k_scores.
RerankResult clip_rerank(Clip& model, const torch::Tensor& images, const torch::Tensor& tokens, int64_t top_k,
                         int64_t batch_size = 32);

}  // namespace dalle::models
