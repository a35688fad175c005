#include "dalle/models/bart_sampling.h"

#include <torch/torch.h>

#include <cmath>
#include <numeric>
#include <sstream>

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

namespace {

void check_sampling(const BartPriorConfig& config, const torch::Tensor& captions, const BartSamplingOptions& options,
                    const std::vector<uint64_t>& streams) {
  if (captions.dim() != 2 || captions.size(1) != config.text_length) {
    throw Error("BART sampling: expected captions [B, " + std::to_string(config.text_length) + "], got " +
                c10::str(captions.sizes()));
  }
  if (!(options.temperature > 0) || !std::isfinite(options.temperature) ||
      !std::isfinite(options.supercondition_factor)) {
    throw Error("BART sampling: temperature must be positive and finite, and the supercondition factor finite");
  }
  if (options.top_k < 1 || options.top_k > config.codes) {
    throw Error("BART sampling: top_k " + std::to_string(options.top_k) + " outside [1, " +
                std::to_string(config.codes) + "]");
  }
  if (!streams.empty() && static_cast<int64_t>(streams.size()) != captions.size(0)) {
    throw Error("BART sampling: " + std::to_string(streams.size()) + " streams for " +
                std::to_string(captions.size(0)) + " images");
  }
}

// The constants a captured step holds: a graph of other ones would draw other tokens.
std::string step_signature(const BartDecoder& decoder, const BartSamplingOptions& options, int64_t images) {
  std::ostringstream out;
  out.precision(17);
  out << "bart " << decoder.get() << " images " << images << " temperature " << options.temperature << " top_k "
      << options.top_k << " factor " << options.supercondition_factor;
  return out.str();
}

// The counter-based draws of each image, computed on the host; a call copies them to the device once.
torch::Tensor stream_uniforms(const BartSamplingOptions& options, const std::vector<uint64_t>& streams,
                              const std::vector<int64_t>& row_seeds, int64_t images, int64_t positions) {
  std::vector<uint64_t> row_streams = streams;
  if (row_streams.empty()) {
    row_streams.resize(static_cast<size_t>(images));
    std::iota(row_streams.begin(), row_streams.end(), uint64_t{0});
  }
  return sampling_uniforms(seeds_of_rows(options.seed, row_seeds, images), row_streams, positions);
}

}  // namespace

torch::Tensor sample_bart_image_tokens(BartEncoder& encoder, BartDecoder& decoder, const torch::Tensor& captions,
                                       const BartSamplingOptions& options, const std::vector<uint64_t>& streams,
                                       const TokenCallback& on_token, const std::vector<int64_t>& row_seeds,
                                       DecodeGraphs* graphs) {
  const auto& config = decoder->config();
  check_sampling(config, captions, options, streams);
  torch::NoGradGuard no_grad;
  const int64_t images = captions.size(0), length = config.image_length;
  const auto device = decoder->lm_head->weight.device();
  const auto rows = captions.to(device);
  const auto text = torch::cat({empty_captions(rows), rows});
  // torch's generator is not captured: min-dalle's own draws run eagerly.
  DecodeGraphs eager(/*enabled=*/false);
  auto& steps = graphs && !options.torch_draws ? *graphs : eager;
  steps.expect(step_signature(decoder, options, images));
  auto cache = decoder->start(encoder->forward(text), text, steps.maker());
  const auto integers = rows.options().dtype(torch::kInt64);
  auto previous = steps.buffer("previous", {images, 1}, integers).fill_(config.codes - 1);
  auto position = steps.buffer("position", {1}, integers).zero_();
  auto codes = steps.buffer("codes", {images, length}, integers);
  auto uniforms = steps.buffer("uniforms", {images, length}, rows.options().dtype(torch::kFloat32));
  if (options.torch_draws) {
    if (options.seed > 0) torch::manual_seed(static_cast<uint64_t>(options.seed));
  } else {
    uniforms.copy_(stream_uniforms(options, streams, row_seeds, images, length));
  }
  for (int64_t index = 0; index < length; ++index) {
    const int64_t keys = steps.keys_for(index + 1, length, device);
    steps.run(keys, device, [&] {
      const auto logits = decoder->forward_step(torch::cat({previous, previous}), cache, position, keys).select(1, 0);
      const auto weights = supercondition_weights(logits.narrow(1, 0, config.codes).to(torch::kFloat32), options);
      const auto next = options.torch_draws ? torch::multinomial(weights, 1).squeeze(1)
                                            : draw_codes(weights, uniforms.index_select(1, position).squeeze(1));
      codes.index_copy_(1, position, next.unsqueeze(1));
      previous.copy_(next.unsqueeze(1));
      position.add_(1);
    });
    if (on_token) on_token(index + 1, length, codes.select(1, index));
  }
  return codes.clone();
}

}  // namespace dalle::models
