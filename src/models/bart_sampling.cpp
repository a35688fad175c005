#include "dalle/models/bart_sampling.h"

#include <torch/torch.h>

#include <cmath>
#include <numeric>

#include "dalle/error.h"
#include "dalle/models/prior_sampling.h"

namespace dalle::models {

using torch::indexing::Slice;

torch::Tensor empty_captions(const torch::Tensor& captions) {
  const auto length = (captions != kBartPadId).sum(1, /*keepdim=*/true);
  auto empty = torch::full_like(captions, kBartPadId);
  empty.index_put_({Slice(), 0}, captions.index({Slice(), 0}));
  empty.index_put_({Slice(), 1}, captions.gather(1, (length - 1).clamp_min(0)).squeeze(1));
  return empty;
}

torch::Tensor supercondition_weights(const torch::Tensor& logits, const BartSamplingOptions& options) {
  const int64_t images = logits.size(0) / 2;
  const auto unconditioned = logits.narrow(0, 0, images), conditioned = logits.narrow(0, images, images);
  const auto f = options.supercondition_factor;
  const auto mixed = unconditioned * (1 - f) + conditioned * f;
  const auto kth = std::get<0>(mixed.sort(-1, /*descending=*/true)).narrow(1, options.top_k - 1, 1);
  const auto largest = std::get<0>(mixed.max(-1, /*keepdim=*/true));
  return ((mixed - largest) / options.temperature).exp() * (mixed >= kth);
}

torch::Tensor sample_bart_image_tokens(BartEncoder& encoder, BartDecoder& decoder, const torch::Tensor& captions,
                                       const BartSamplingOptions& options, const std::vector<uint64_t>& streams,
                                       const TokenCallback& on_token,
                                       const std::vector<int64_t>& row_seeds) {
  const auto& config = decoder->config();
  if (captions.dim() != 2 || captions.size(1) != config.text_length) {
    throw Error("BART sampling: expected captions [B, " + std::to_string(config.text_length) + "], got " +
                c10::str(captions.sizes()));
  }
  const int64_t images = captions.size(0);
  if (!(options.temperature > 0) || !std::isfinite(options.temperature) ||
      !std::isfinite(options.supercondition_factor)) {
    throw Error("BART sampling: temperature must be positive and finite, and the supercondition factor finite");
  }
  if (options.top_k < 1 || options.top_k > config.codes) {
    throw Error("BART sampling: top_k " + std::to_string(options.top_k) + " outside [1, " +
                std::to_string(config.codes) + "]");
  }
  if (!streams.empty() && static_cast<int64_t>(streams.size()) != images) {
    throw Error("BART sampling: " + std::to_string(streams.size()) + " streams for " + std::to_string(images) +
                " images");
  }
  torch::NoGradGuard no_grad;
  const auto device = decoder->lm_head->weight.device();
  const auto rows = captions.to(device);
  const auto text = torch::cat({empty_captions(rows), rows});
  auto cache = decoder->start(encoder->forward(text), text);
  std::vector<uint64_t> row_streams = streams;
  if (row_streams.empty()) {
    row_streams.resize(static_cast<size_t>(images));
    std::iota(row_streams.begin(), row_streams.end(), uint64_t{0});
  }
  // Drawn on the host, moved once: no copy to the device per step.
  const auto uniforms = options.torch_draws
                            ? torch::Tensor()
                            : sampling_uniforms(seeds_of_rows(options.seed, row_seeds, images), row_streams,
                                                config.image_length)
                                  .to(device);
  if (options.torch_draws && options.seed > 0) torch::manual_seed(static_cast<uint64_t>(options.seed));
  auto previous = torch::full({images, 1}, config.codes - 1, rows.options());
  std::vector<torch::Tensor> codes;
  for (int64_t position = 0; position < config.image_length; ++position) {
    const auto logits = decoder->forward(torch::cat({previous, previous}), cache).select(1, 0);
    const auto weights = supercondition_weights(logits.narrow(1, 0, config.codes).to(torch::kFloat32), options);
    previous = options.torch_draws ? torch::multinomial(weights, 1)
                                   : draw_codes(weights, uniforms.select(1, position)).unsqueeze(1);
    codes.push_back(previous);
    if (on_token) on_token(position + 1, config.image_length, previous.squeeze(1));
  }
  return torch::cat(codes, 1);
}

}  // namespace dalle::models
