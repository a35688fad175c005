#pragma once
// Drawing image tokens from DALL-E Mega / Mini's BART prior as min-dalle 0.4.11 does
// (docs/mega-prior.md, section 5): each image decoded twice, under its caption and under the
// empty caption, the logits "super-conditioned" as u + f (c - u), top-k kept (ties
// included), softmax weights at the temperature. The draws are either min-dalle's own (one
// torch::multinomial over the batch per step, on torch's generator) or ours (each image
// from its own counter-based stream, as models/prior_sampling.h: an image's tokens do not
// depend on its batch).
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "dalle/models/bart_prior.h"
#include "dalle/models/prior_sampling.h"

namespace dalle::models {

struct BartSamplingOptions {
  double temperature = 1.0;
  int64_t top_k = 256;
  double supercondition_factor = 16.0;  // f: u + f (c - u); 1 is the caption alone
  int64_t seed = 0;
  // min-dalle's draws: torch::manual_seed(seed) when seed > 0, then one multinomial over the
  // batch per step, which gives min-dalle's tokens but makes an image depend on its batch.
  bool torch_draws = false;
};

// The unconditioned caption min-dalle pairs with each of `captions` [B, text_length] (pad
// 1): its first and last ids, <s> </s> unless the caption was cut.
torch::Tensor empty_captions(const torch::Tensor& captions);

// min-dalle's unnormalised weights of the next code from decoder logits [2B, codes]: rows
// 0..B-1 unconditioned, B..2B-1 conditioned -> [B, codes].
torch::Tensor supercondition_weights(const torch::Tensor& logits, const BartSamplingOptions& options);

// Image tokens [B, image_length] for `captions` [B, text_length], one image each. Row b draws
// from stream `streams[b]` (empty: b) of seed `row_seeds[b]` (empty: options.seed) unless
// options.torch_draws. `on_token` follows each position (its codes are a view: copy them to
// keep them). Each position is one decoder step of fixed shapes with no host synchronisation;
// `graphs` keeps the steps' tensors across calls and, on a GPU, replays the steps as CUDA
// graphs (not with torch_draws, whose generator a graph does not capture).
//
// An image prompt (`prompt`: tokens [B or 1, image_length] of codes below config.codes, known
// [image_length]) keeps its tokens where `known` says, and both rows of an image (under its
// caption and under the empty one) read them. As in sample_image_tokens, the draws stay
// where they were: position i reads uniform i of the row's stream whether or not the prompt
// keeps the positions before it, and with torch_draws every step still draws once from
// torch's generator, so a free position's draw does not depend on how many are kept. The
// leading known positions (top rows) go through the decoder in one call, teacher-forced;
// later known positions (a mask with holes) are forced inside the steps, from tensors the
// steps read, so that a captured step serves prompted and unprompted calls alike. Without a
// prompt the tokens are the same as with a prompt that keeps nothing.
torch::Tensor sample_bart_image_tokens(BartEncoder& encoder, BartDecoder& decoder, const torch::Tensor& captions,
                                       const BartSamplingOptions& options, const std::vector<uint64_t>& streams = {},
                                       const TokenCallback& on_token = {},
                                       const std::vector<int64_t>& row_seeds = {}, DecodeGraphs* graphs = nullptr,
                                       const ImagePrompt* prompt = nullptr);

}  // namespace dalle::models
