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

// An image prompt's tokens must be the detokenizer's codes where they are kept: the decoder
// reads them back (its last code starts each image, the rows above are not codes at all).
void check_prompt(const BartPriorConfig& config, const ImagePrompt& prompt, int64_t images) {
  const int64_t length = config.image_length;
  const auto& tokens = prompt.tokens;
  const bool shaped = prompt.known.numel() == length && tokens.dim() == 2 && tokens.size(1) == length &&
                      (tokens.size(0) == 1 || tokens.size(0) == images);
  if (!shaped) {
    throw Error("BART sampling: an image prompt needs tokens [1 or " + std::to_string(images) + ", " +
                std::to_string(length) + "] and a known-mask of " + std::to_string(length) + " positions; got " +
                c10::str(tokens.sizes()) + " and " + std::to_string(prompt.known.numel()));
  }
  const auto kept = tokens.cpu().to(torch::kInt64).index({Slice(), prompt.known.cpu().to(torch::kBool).flatten()});
  if (kept.numel() > 0 && (kept.min().item<int64_t>() < 0 || kept.max().item<int64_t>() >= config.codes)) {
    throw Error("BART sampling: an image prompt's kept tokens must lie in [0, " + std::to_string(config.codes) +
                "), the detokenizer's codes");
  }
}

// How many positions from the first an image prompt keeps (none without one).
int64_t leading_known(const ImagePrompt* prompt, int64_t length) {
  if (!prompt) return 0;
  const auto known = prompt->known.cpu().to(torch::kBool).flatten();
  int64_t leading = 0;
  while (leading < length && known[leading].item<bool>()) ++leading;
  return leading;
}

// What a captured step holds as constants: the decoder and the images it draws. The settings
// a request chooses are tensors it reads (KeptSettings), so that none of them drops a graph.
std::string step_signature(const BartDecoder& decoder, int64_t images) {
  std::ostringstream out;
  out << "bart " << decoder.get() << " images " << images;
  return out.str();
}

// supercondition_weights with its settings in [1] tensors of `steps` (float32 tensors hold what
// float32 arithmetic makes of the numbers: the same weights).
struct KeptSettings {
  torch::Tensor factor, complement, temperature, kth;  // kth: top_k - 1, [1, 1] int64

  KeptSettings(DecodeGraphs& steps, const BartSamplingOptions& options, const torch::Device& device) {
    const auto floats = torch::TensorOptions().dtype(torch::kFloat32).device(device);
    factor = steps.buffer("factor", {1}, floats).fill_(options.supercondition_factor);
    complement = steps.buffer("complement", {1}, floats).fill_(1 - options.supercondition_factor);
    temperature = steps.buffer("temperature", {1}, floats).fill_(options.temperature);
    kth = steps.buffer("kth", {1, 1}, floats.dtype(torch::kInt64)).fill_(options.top_k - 1);
  }

  torch::Tensor weights(const torch::Tensor& logits) const {
    const int64_t images = logits.size(0) / 2;
    const auto unconditioned = logits.narrow(0, 0, images), conditioned = logits.narrow(0, images, images);
    const auto mixed = unconditioned * complement + conditioned * factor;
    const auto threshold = std::get<0>(mixed.sort(-1, /*descending=*/true)).gather(1, kth.expand({images, 1}));
    const auto largest = std::get<0>(mixed.max(-1, /*keepdim=*/true));
    return ((mixed - largest) / temperature).exp() * (mixed >= threshold);
  }
};

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
                                       DecodeGraphs* graphs, const ImagePrompt* prompt) {
  const auto& config = decoder->config();
  check_sampling(config, captions, options, streams);
  const int64_t images = captions.size(0), length = config.image_length;
  if (prompt) check_prompt(config, *prompt, images);
  torch::NoGradGuard no_grad;
  const auto device = decoder->lm_head->weight.device();
  const auto rows = captions.to(device);
  const auto text = torch::cat({empty_captions(rows), rows});
  // torch's generator is not captured: min-dalle's own draws run eagerly.
  DecodeGraphs eager(/*enabled=*/false);
  auto& steps = graphs && !options.torch_draws ? *graphs : eager;
  steps.expect(step_signature(decoder, images));
  const KeptSettings settings(steps, options, device);
  auto cache = decoder->start(encoder->forward(text), text, steps.maker());
  const auto integers = rows.options().dtype(torch::kInt64);
  auto previous = steps.buffer("previous", {images, 1}, integers).fill_(config.codes - 1);
  auto position = steps.buffer("position", {1}, integers).zero_();
  auto codes = steps.buffer("codes", {images, length}, integers);
  auto uniforms = steps.buffer("uniforms", {images, length}, rows.options().dtype(torch::kFloat32));
  // The prompt as the steps read it: the positions kept and their codes (none kept without one).
  auto known = steps.buffer("known", {length}, integers.dtype(torch::kBool));
  auto forced = steps.buffer("forced", {images, length}, integers);
  if (prompt) {
    known.copy_(prompt->known.to(torch::kBool).flatten());
    forced.copy_(prompt->tokens.to(torch::kInt64).expand({images, length}));
    codes.copy_(forced);  // the leading codes no step writes
  } else {
    known.zero_();
  }
  if (options.torch_draws) {
    if (options.seed > 0) torch::manual_seed(static_cast<uint64_t>(options.seed));
  } else {
    uniforms.copy_(stream_uniforms(options, streams, row_seeds, images, length));
  }
  // The next code of every image at `position` from the decoder's logits [2B, vocab]: drawn,
  // then the prompt's where it keeps the position; it is what both rows of the image read next.
  const auto choose = [&](const torch::Tensor& logits) {
    const auto image_logits = logits.narrow(1, 0, config.codes).to(torch::kFloat32);
    const auto weights =
        options.torch_draws ? supercondition_weights(image_logits, options) : settings.weights(image_logits);
    const auto drawn = options.torch_draws ? torch::multinomial(weights, 1).squeeze(1)
                                           : draw_codes(weights, uniforms.index_select(1, position).squeeze(1));
    const auto next = torch::where(known.index_select(0, position), forced.index_select(1, position).squeeze(1), drawn);
    codes.index_copy_(1, position, next.unsqueeze(1));
    previous.copy_(next.unsqueeze(1));
    position.add_(1);
  };
  // Kept top rows: the start code and the kept codes through the decoder at once, as training
  // reads them; its last logits give the first free position. torch's generator draws at every
  // position, so min-dalle's draws take every step.
  const int64_t leading = options.torch_draws ? 0 : leading_known(prompt, length);
  for (int64_t index = 0; index < leading; ++index) {
    if (on_token) on_token(index + 1, length, codes.select(1, index));
  }
  if (leading == length) return codes.clone();
  int64_t first = 0;
  if (leading > 0) {
    const auto prefix = torch::cat({previous, forced.narrow(1, 0, leading)}, 1);
    const auto logits = decoder->forward(torch::cat({prefix, prefix}), cache).select(1, leading);
    position.fill_(leading);
    choose(logits);
    if (on_token) on_token(leading + 1, length, codes.select(1, leading));
    first = leading + 1;
  }
  for (int64_t index = first; index < length; ++index) {
    const int64_t keys = steps.keys_for(index + 1, length, device);
    steps.run(keys, device, [&] {
      choose(decoder->forward_step(torch::cat({previous, previous}), cache, position, keys).select(1, 0));
    });
    if (on_token) on_token(index + 1, length, codes.select(1, index));
  }
  return codes.clone();
}

}  // namespace dalle::models
