#include "dalle/models/prior_sampling.h"

#include <torch/torch.h>

#include <limits>
#include <numeric>
#include <sstream>

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
  const auto on = torch::TensorOptions().device(logits.device());
  return filter_logits(logits, temperature, torch::tensor(filters.top_k, on.dtype(torch::kInt64)).unsqueeze(1),
                       torch::tensor(filters.top_p, on.dtype(torch::kFloat64)).to(torch::kFloat32).unsqueeze(1));
}

namespace {

// Logits already divided by their temperature, filtered by top_k and top_p [B, 1] tensors.
torch::Tensor filter_scaled(torch::Tensor filtered, const torch::Tensor& top_k, const torch::Tensor& top_p) {
  constexpr double kMinusInfinity = -std::numeric_limits<double>::infinity();
  const int64_t classes = filtered.size(-1);
  // k outside (0, classes) filters nothing: its threshold is the row's smallest logit.
  const auto k = torch::where((top_k > 0) & (top_k < classes), top_k, classes);
  const auto kth = std::get<0>(filtered.sort(-1, /*descending=*/true)).gather(1, k - 1);
  filtered = filtered.masked_fill(filtered < kth, kMinusInfinity);
  auto [sorted, order] = filtered.sort(-1, /*descending=*/true);
  const auto cumulative = sorted.softmax(-1).cumsum(-1);
  const auto drop = ((cumulative - sorted.softmax(-1)) >= top_p) & (top_p < 1.0);
  return filtered.masked_fill(torch::zeros_like(drop).scatter(-1, order, drop), kMinusInfinity);
}

}  // namespace

torch::Tensor filter_logits(const torch::Tensor& logits, double temperature, const torch::Tensor& top_k,
                            const torch::Tensor& top_p) {
  return filter_scaled(logits.to(torch::kFloat32) / temperature, top_k, top_p);
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

void check_inputs(const PriorConfig& config, const torch::Tensor& captions, const ImagePrompt* prompt,
                  const std::vector<uint64_t>& streams, const RowFilters* row_filters) {
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
  if (row_filters && (static_cast<int64_t>(row_filters->top_k.size()) != captions.size(0) ||
                      row_filters->top_k.size() != row_filters->top_p.size())) {
    throw Error("sampling: row filters for " + std::to_string(row_filters->top_k.size()) + " rows, " +
                std::to_string(captions.size(0)) + " captions");
  }
}

// How a step's logits become codes: the image classes, guidance, the filters, the draw.
struct Choice {
  SamplingOptions options;
  int64_t batch = 0;
  int64_t text_classes = 0;
  bool guided = false;
  torch::Tensor top_k, top_p;  // [B, 1] on the device, with row filters; else undefined
  // [1] float32 on the device: the options' temperature and guidance scale as tensors a
  // captured step reads (kept()); undefined: the options' numbers.
  torch::Tensor temperature, guidance_scale;

  // logits [rows, classes] (the guided rows' unconditional half after the conditional) and
  // uniforms [B] -> codes [B].
  torch::Tensor codes(const torch::Tensor& logits, const torch::Tensor& uniforms) const {
    // In float32 whatever the prior computes in: guidance subtracts nearly equal logits.
    auto image = logits.narrow(1, text_classes, logits.size(1) - text_classes).to(torch::kFloat32);
    if (guided) {
      const auto conditional = image.narrow(0, 0, batch), unconditional = image.narrow(0, batch, batch);
      const auto difference = conditional - unconditional;
      image = unconditional +
              (guidance_scale.defined() ? guidance_scale * difference : options.guidance_scale * difference);
    }
    torch::Tensor filtered;
    if (temperature.defined()) {
      filtered = filter_scaled(image / temperature, top_k, top_p);
    } else {
      filtered = top_k.defined() ? filter_logits(image, options.temperature, top_k, top_p)
                                 : filter_logits(image, options);
    }
    return draw_codes(filtered.softmax(-1), uniforms);
  }
  // The same choice with every setting a request may change (temperature, filters, guidance
  // scale) in `graphs`' tensors rather than in numbers a captured step would bake in: one
  // graph serves every request of a batch shape. It draws the same codes (float32 tensors
  // hold what float32 arithmetic makes of the numbers; row filters equal the options').
  Choice kept(DecodeGraphs& graphs, const torch::Device& device) const {
    const auto floats = torch::TensorOptions().dtype(torch::kFloat32).device(device);
    auto choice = *this;
    choice.temperature = graphs.buffer("temperature", {1}, floats).fill_(options.temperature);
    choice.guidance_scale = graphs.buffer("guidance_scale", {1}, floats).fill_(options.guidance_scale);
    choice.top_k = graphs.buffer("top_k", {batch, 1}, floats.dtype(torch::kInt64));
    choice.top_p = graphs.buffer("top_p", {batch, 1}, floats);
    if (top_k.defined()) {
      choice.top_k.copy_(top_k);
      choice.top_p.copy_(top_p);
    } else {
      choice.top_k.fill_(options.top_k);
      choice.top_p.fill_(options.top_p);
    }
    return choice;
  }
  // The rows the model reads of `codes` [B]: twice over under guidance.
  torch::Tensor model_rows(const torch::Tensor& codes) const { return guided ? torch::cat({codes, codes}) : codes; }
};

// The reference: the whole prefix recomputed for every token.
torch::Tensor sample_uncached(Prior& prior, const torch::Tensor& inputs, const Choice& choice,
                              const torch::Tensor& uniforms, const ImagePrompt* prompt,
                              const TokenCallback& on_token) {
  const auto& config = prior->config();
  const int64_t total = config.image_length();
  const auto known = prompt ? prompt->known.to(torch::kBool).cpu() : torch::Tensor();
  auto sequence = inputs;
  std::vector<torch::Tensor> codes;
  for (int64_t position = 0; position < total; ++position) {
    const auto next = prompt && known[position].item<bool>()
                          ? prompt->tokens.expand({choice.batch, total}).select(1, position).to(inputs.device())
                          : choice.codes(prior->forward(sequence).select(1, -1), uniforms.select(1, position));
    codes.push_back(next);
    sequence = torch::cat({sequence, choice.model_rows(next).unsqueeze(1)}, 1);
    if (on_token) on_token(position + 1, total, next);
  }
  return torch::stack(codes, 1);
}

// The tensors a decoding step reads and writes, kept by a DecodeGraphs across calls.
struct StepState {
  KvCache cache;
  torch::Tensor token;     // [rows, 1]: the codes the next step feeds the model
  torch::Tensor position;  // [1]: the sequence position of `token`
  torch::Tensor codes;     // [B, image_length]: drawn so far
  torch::Tensor uniforms;  // [B, image_length]: the draws
  torch::Tensor known;     // [image_length] bool: the image prompt's kept positions (none without one)
  torch::Tensor prompt;    // [B, image_length]: its codes
};

StepState step_state(Prior& prior, DecodeGraphs& graphs, const torch::Tensor& uniforms, const ImagePrompt* prompt,
                     int64_t rows) {
  const auto& config = prior->config();
  const int64_t batch = uniforms.size(0), total = config.image_length();
  const auto device = uniforms.device();
  const auto integers = torch::TensorOptions().dtype(torch::kInt64).device(device);
  StepState state;
  state.cache = prior->make_cache(rows, graphs.maker());
  state.token = graphs.buffer("token", {rows, 1}, integers);
  state.position = graphs.buffer("position", {1}, integers);
  state.codes = graphs.buffer("codes", {batch, total}, integers);
  state.uniforms = graphs.buffer("uniforms", {batch, total}, uniforms.options());
  state.uniforms.copy_(uniforms);
  state.known = graphs.buffer("known", {total}, integers.dtype(torch::kBool));
  state.prompt = graphs.buffer("prompt", {batch, total}, integers);
  if (prompt) {
    state.known.copy_(prompt->known.to(torch::kBool));
    state.prompt.copy_(prompt->tokens.expand({batch, total}));
    state.codes.copy_(state.prompt);  // the leading codes the steps do not draw
  } else {
    state.known.zero_();
  }
  return state;
}

// The codes of image index `index` ([1] on the device) from `logits` [rows, classes], into the
// state's codes and next token; an image prompt's known positions keep its codes.
void draw_into(StepState& state, const Choice& choice, const torch::Tensor& logits, const torch::Tensor& index) {
  auto next = choice.codes(logits, state.uniforms.index_select(1, index).squeeze(1));
  next = torch::where(state.known.index_select(0, index), state.prompt.index_select(1, index).squeeze(1), next);
  state.codes.index_copy_(1, index, next.unsqueeze(1));
  state.token.copy_(choice.model_rows(next).unsqueeze(1));
}

// What a captured step holds as constants: the prior and the rows it runs (twice the batch
// under guidance). The settings a request chooses are tensors it reads (Choice::kept), and an
// image prompt's kept positions and codes too, so that none of them drops a graph.
std::string step_signature(const Prior& prior, int64_t rows) {
  std::ostringstream out;
  out << "prior " << prior.get() << " rows " << rows;
  return out.str();
}

// With the KV cache: the captions and the image prompt's leading known codes in one call, then
// one fixed-shape step per image position, replayed from a CUDA graph where `graphs` captures.
torch::Tensor sample_cached(Prior& prior, const torch::Tensor& inputs, const Choice& given_choice,
                            const torch::Tensor& uniforms, const ImagePrompt* prompt, const TokenCallback& on_token,
                            DecodeGraphs& graphs) {
  const auto& config = prior->config();
  const int64_t total = config.image_length(), rows = inputs.size(0);
  const auto device = inputs.device();
  graphs.expect(step_signature(prior, rows));
  auto state = step_state(prior, graphs, uniforms, prompt, rows);
  const auto choice = given_choice.kept(graphs, device);
  int64_t leading = 0;  // prompt codes before the first position to draw
  if (prompt) {
    const auto known = prompt->known.to(torch::kBool).cpu();
    while (leading < total && known[leading].item<bool>()) ++leading;
  }
  const auto given = state.prompt.narrow(1, 0, leading);
  const auto prefill = torch::cat({inputs, choice.guided ? torch::cat({given, given}) : given}, 1);
  const auto logits = prior->forward_cached(prefill, state.cache).select(1, -1);
  for (int64_t index = 0; index < leading; ++index) {
    if (on_token) on_token(index + 1, total, state.prompt.select(1, index));
  }
  if (leading == total) return state.prompt.clone();
  state.position.fill_(config.text_length + leading);
  draw_into(state, choice, logits, state.position - config.text_length);
  if (on_token) on_token(leading + 1, total, state.codes.select(1, leading));
  for (int64_t index = leading + 1; index < total; ++index) {
    const int64_t keys = graphs.keys_for(config.text_length + index, config.length(), device);
    graphs.run(keys, device, [&] {
      const auto step_logits = prior->forward_step(state.token, state.cache, state.position, keys).select(1, 0);
      state.position.add_(1);
      draw_into(state, choice, step_logits, state.position - config.text_length);
    });
    if (on_token) on_token(index + 1, total, state.codes.select(1, index));
  }
  return state.codes.clone();
}

}  // namespace

torch::Tensor sample_image_tokens(Prior& prior, const torch::Tensor& captions, const SamplingOptions& options,
                                  const ImagePrompt* prompt, const TokenCallback& on_token,
                                  const std::vector<uint64_t>& streams, const RowFilters* row_filters,
                                  const std::vector<int64_t>& row_seeds, DecodeGraphs* graphs) {
  const auto& config = prior->config();
  check_inputs(config, captions, prompt, streams, row_filters);
  torch::NoGradGuard no_grad;
  const int64_t batch = captions.size(0), total = config.image_length();
  const auto device = prior->parameters().front().device();
  Choice choice{.options = options,
                .batch = batch,
                .text_classes = config.text_classes(),
                .guided = options.guidance_scale != 1.0,
                .top_k = {},
                .top_p = {},
                .temperature = {},
                .guidance_scale = {}};
  if (row_filters) {
    const auto on = torch::TensorOptions().device(device);
    choice.top_k = torch::tensor(row_filters->top_k, on.dtype(torch::kInt64)).unsqueeze(1);
    choice.top_p = torch::tensor(row_filters->top_p, on.dtype(torch::kFloat64)).to(torch::kFloat32).unsqueeze(1);
  }
  auto inputs = captions.to(device);
  if (choice.guided) inputs = torch::cat({inputs, empty_caption(config.text_length, batch).to(device)});
  std::vector<uint64_t> row_streams = streams;
  if (row_streams.empty()) {
    row_streams.resize(static_cast<size_t>(batch));
    std::iota(row_streams.begin(), row_streams.end(), uint64_t{0});
  }
  const auto uniforms = sampling_uniforms(seeds_of_rows(options.seed, row_seeds, batch), row_streams, total).to(device);
  torch::Tensor codes;
  if (!options.use_cache) {
    codes = sample_uncached(prior, inputs, choice, uniforms, prompt, on_token);
  } else {
    DecodeGraphs eager(/*enabled=*/false);
    codes = sample_cached(prior, inputs, choice, uniforms, prompt, on_token, graphs ? *graphs : eager);
  }
  return codes.view({batch, config.grid_size, config.grid_size});
}

}  // namespace dalle::models
