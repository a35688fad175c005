// The pipeline's orchestration: requests grouped into batches, their rows drawn and decoded by
// the prior's family (generate/prior_family.h), reranked by CLIP, kept and upscaled.
#include "dalle/generate/pipeline.h"

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "dalle/device.h"
#include "dalle/error.h"
#include "dalle/input_limits.h"
#include "dalle/log.h"
#include "dalle/models/adapter.h"
#include "dalle/models/clip_rerank.h"
#include "dalle/models/tiled_upscale.h"
#include "dalle/models/token_grid.h"
#include "dalle/models/trained.h"
#include "dalle/runtime.h"
#include "dalle/text/clip_tokenizer.h"
#include "dalle/text/yttm_tokenizer.h"
#include "generate/adapter_switch.h"
#include "generate/prior_family.h"

namespace dalle::generate {

namespace {

// config.named_adapters, parsed; throws for a malformed one or a name given twice.
std::vector<models::NamedAdapter> named_adapters_of(const PipelineConfig& config) {
  std::vector<models::NamedAdapter> named;
  std::set<std::string> names;
  for (const auto& spec : config.named_adapters) {
    try {
      named.push_back(models::parse_named_adapter(spec));
    } catch (const Error& error) {
      throw Error(std::string("pipeline: named_adapters: ") + error.what());
    }
    if (!names.insert(named.back().name).second) {
      throw Error("pipeline: named_adapters names " + named.back().name + " twice");
    }
  }
  return named;
}

void check_config(const PipelineConfig& config) {
  if (config.prior.empty()) throw Error("pipeline: `prior` is required (a prior run directory or checkpoint)");
  config.image_prompt.validate();
  const auto& schedule = config.schedule;
  if (schedule.top_k.size() != schedule.top_p.size()) {
    throw Error("pipeline: schedule.top_k has " + std::to_string(schedule.top_k.size()) + " stages, schedule.top_p " +
                std::to_string(schedule.top_p.size()) + "; give one top_p per top_k");
  }
  if (config.dtype == "int8" && config.device == "cuda") {
    throw Error("pipeline: dtype int8 runs on the CPU (FBGEMM's kernels): set device cpu or auto, or use bfloat16 "
                "on a GPU");
  }
  if (!named_adapters_of(config).empty() && config.dtype == "int8") {
    throw Error("pipeline: named_adapters are folded into the prior's weights as requests choose them, which int8 "
                "weights cannot take: use another dtype, or fold the adapters at load with `adapters`");
  }
  if (config.kept() > config.candidates) {
    throw Error("pipeline: keep (" + std::to_string(config.keep) + ") exceeds candidates (" +
                std::to_string(config.candidates) + ")");
  }
  if (config.kept() < config.candidates && config.clip.empty()) {
    throw Error("pipeline: keeping " + std::to_string(config.kept()) + " of " + std::to_string(config.candidates) +
                " candidates needs a CLIP model to choose them: set `clip`, or keep: 0");
  }
  if (!config.clip_templates.empty() && config.clip_tokenizer.empty()) {
    throw Error("pipeline: clip_templates are read by the CLIP's own tokenizer: set clip_tokenizer, or clear "
                "clip_templates");
  }
  for (const auto& templ : config.clip_templates) {
    try {
      text::fill_clip_template(templ, "");
    } catch (const Error& error) {
      throw Error(std::string("pipeline: clip_templates: ") + error.what());
    }
  }
}

// CLIP's own tokenizer: argmax pooling finds its end of text, the largest id.
void check_clip_fits(const models::ClipConfig& clip, const text::ClipTokenizer& tokenizer, const std::string& path,
                     const std::string& merges) {
  const bool pools_its_end = clip.text_pooling == "argmax" || clip.eos_id == tokenizer.end_id();
  if (tokenizer.vocab_size() != clip.vocab_size || !pools_its_end) {
    throw Error("pipeline: the CLIP tokenizer " + merges + " (" + std::to_string(tokenizer.vocab_size()) +
                " ids, end of text " + std::to_string(tokenizer.end_id()) + ") does not fit the CLIP model " + path +
                " (" + std::to_string(clip.vocab_size) + " ids, " + clip.text_pooling + " pooling)");
  }
}

// ruCLIP's tokenizer (YouTokenToMe): its ids within the CLIP's table, pooled at its EOS,
// which is not its largest id, with room for BOS and EOS.
void check_clip_fits(const models::ClipConfig& clip, const text::YttmTokenizer& tokenizer, const std::string& path,
                     const std::string& model) {
  const bool pools_its_end = clip.text_pooling == "eos" && clip.eos_id == tokenizer.eos_id();
  if (tokenizer.vocab_size() > clip.vocab_size || !pools_its_end || clip.context_length < 2) {
    throw Error("pipeline: the YouTokenToMe CLIP tokenizer " + model + " (" + std::to_string(tokenizer.vocab_size()) +
                " ids, end of text " + std::to_string(tokenizer.eos_id()) + ") does not fit the CLIP model " + path +
                " (" + std::to_string(clip.vocab_size) + " ids, " + clip.text_pooling + " pooling" +
                (clip.text_pooling == "eos" ? " at id " + std::to_string(clip.eos_id) : std::string()) +
                ", context " + std::to_string(clip.context_length) + ")");
  }
}

// One candidate of one request: a row of a sampling batch.
struct Row {
  size_t request = 0;
  int64_t candidate = 0;
};

// The sampling candidate `candidate` of `request` draws with: its schedule stage's filter.
models::SamplingOptions sampling_of(const PromptRequest& request, int64_t candidate) {
  return request.schedule.options(request.schedule.stage_of(candidate, request.candidates), request.sampling);
}

// The requests, by position, in groups that may share batches (equal keys), in order of
// each group's first request.
template <class Key>
std::vector<std::vector<size_t>> group_requests(const std::vector<PromptRequest>& requests, const Key& key_of) {
  std::vector<std::vector<size_t>> groups;
  std::map<decltype(key_of(requests.front())), size_t> group_of_key;
  for (size_t index = 0; index < requests.size(); ++index) {
    const auto [at, added] = group_of_key.emplace(key_of(requests[index]), groups.size());
    if (added) groups.emplace_back();
    groups[at->second].push_back(index);
  }
  return groups;
}

}  // namespace

// What a pipeline loaded. After the constructor, generate() alone changes anything here (the
// decoding graphs, whatever a model's forward keeps); the methods any thread may call read
// config, id, the sizes below and family->check(), which reads its prior's config alone.
struct Pipeline::Stages {
  PipelineConfig config;
  torch::Device device = torch::kCPU;
  std::unique_ptr<PriorFamily> family;
  // Which pipeline this is, for the requests it prepared: unique in the process, never 0.
  uint64_t id = next_id();
  // Fixed once the models are loaded: tokens per image, the decoded and the upscaled image's
  // side (the decoded one without super-resolution).
  int64_t image_tokens = 0, decoded_size = 0, upscaled_size = 0;
  models::Clip clip{nullptr};
  std::optional<text::ClipTokenizer> clip_tokenizer{};  // the imported CLIP's own: CLIP's BPE, or
  std::optional<text::YttmTokenizer> clip_yttm{};       // ruCLIP's YouTokenToMe model
  models::RrdbNet superres{nullptr};
  // The decoding steps' graphs and tensors, kept between batches on a GPU (on the CPU each
  // batch makes its own tensors and frees them).
  std::unique_ptr<models::DecodeGraphs> graphs =
      device.is_cuda() && config.cuda_graphs ? std::make_unique<models::DecodeGraphs>() : nullptr;
  // The named adapters requests may choose (none without named_adapters), and their names in
  // the order they are folded.
  std::unique_ptr<AdapterSwitch> adapters{};
  std::vector<std::string> adapter_names{};

  // Samples and decodes the candidates `rows`, requests' prompts encoded in `captions`,
  // showing `on_preview` those whose request asks for previews.
  std::vector<GeneratedImage> sample(const std::vector<Row>& rows, const std::vector<PromptRequest>& requests,
                                     const std::vector<torch::Tensor>& captions, log::Progress& progress,
                                     const PreviewCallback& on_preview);
  // The previews of the batch's `rows` due after `done` of `total` positions, whose codes
  // so far are `drawn`, one [B] tensor per position.
  std::vector<Preview> previews(const std::vector<Row>& rows, const std::vector<PromptRequest>& requests,
                                const std::vector<torch::Tensor>& drawn, int64_t total);
  // Refuses what generate cannot do of `request`, `where` beginning the messages; the config
  // with the settings `request` gives its own.
  PipelineConfig check(const PromptRequest& request, const std::string& where) const;
  // Reranks (with CLIP), keeps and upscales the candidates of one request.
  void finish(std::vector<GeneratedImage>& candidates, const PromptRequest& request, const torch::Tensor& clip_caption);
  // The prompt as CLIP reads it: the caption tokenizer's `caption` [L], or with CLIP's own
  // tokenizer the ids of each of clip_templates (of the prompt alone without them) [T, L].
  torch::Tensor clip_caption(const std::string& prompt, const torch::Tensor& caption) const;
  // Scores the candidates against their prompt (as CLIP reads it) and orders them best first.
  void rerank(std::vector<GeneratedImage>& candidates, const torch::Tensor& caption);
  void upscale(std::vector<GeneratedImage>& images);
  // The settings a batch's rows must share: models::SamplingOptions arithmetic the sampler
  // applies to the whole batch (and top_k, for a family that filters whole batches).
  // A request's own image prompt is the batch's: it shares batches with no other request. The
  // adapters chosen are the prior's for the batch.
  std::tuple<double, double, bool, int64_t, const PromptImage*, std::vector<AdapterChoice>> batch_key(
      const PromptRequest& request) const {
    const auto& s = request.sampling;
    return {s.temperature,
            s.guidance_scale,
            s.use_cache,
            family->filters_per_batch() ? s.top_k : 0,
            request.image_prompt.get(),
            request.adapters};
  }
  // `choices` in the order of named_adapters (unknown names last, for check() to refuse), those
  // of weight 0 left out.
  std::vector<AdapterChoice> ordered(std::vector<AdapterChoice> choices) const;
  // Refuses a choice of no named adapter, one chosen twice or a weight that is not finite.
  void check_adapters(const std::vector<AdapterChoice>& choices) const;

  static uint64_t next_id() {
    static std::atomic<uint64_t> last{0};
    return ++last;
  }
};

Pipeline::Pipeline(PipelineConfig config) {
  check_config(config);
  // Resolved, like the device, so that each sidecar says how many threads drew it: the
  // samples depend on it (sums taken in another order now and then pick another token).
  config.threads = set_torch_threads(config.threads);
  // int8 has CPU kernels only: `auto` means the CPU for it.
  const auto device = resolve_device(config.dtype == "int8" ? "cpu" : config.device, "pipeline");
  config.device = device.is_cuda() ? "cuda" : "cpu";
  auto family = load_prior_family(config, device);
  stages_ = std::make_unique<Stages>(Stages{std::move(config), device, std::move(family)});
  auto& s = *stages_;
  if (!s.config.clip.empty()) {
    s.clip = models::load_trained_clip(s.config.clip);
    if (s.config.clip_tokenizer.empty()) {
      s.family->check_clip_reads_captions(s.clip->config(), s.config.clip);
    } else if (text::YttmTokenizer::recognises(s.config.clip_tokenizer)) {
      s.clip_yttm = text::YttmTokenizer::load(s.config.clip_tokenizer);
      check_clip_fits(s.clip->config(), *s.clip_yttm, s.config.clip, s.config.clip_tokenizer);
    } else {
      s.clip_tokenizer = text::ClipTokenizer::load(s.config.clip_tokenizer);
      check_clip_fits(s.clip->config(), *s.clip_tokenizer, s.config.clip, s.config.clip_tokenizer);
    }
    s.clip->to(device);
  }
  if (!s.config.superres.empty()) {
    s.superres = models::load_trained_rrdbnet(s.config.superres);
    s.superres->to(device);
  }
  if (const auto named = named_adapters_of(s.config); !named.empty()) {
    s.adapters = std::make_unique<AdapterSwitch>(s.family->prior(), named, s.config, s.family->kind());
    for (const auto& adapter : named) s.adapter_names.push_back(adapter.name);
  }
  s.image_tokens = s.family->image_length();
  s.decoded_size = s.family->image_size();
  s.upscaled_size = s.superres ? s.decoded_size * s.superres->config().scale : s.decoded_size;
}

Pipeline::~Pipeline() = default;
Pipeline::Pipeline(Pipeline&&) noexcept = default;
Pipeline& Pipeline::operator=(Pipeline&&) noexcept = default;

const PipelineConfig& Pipeline::config() const { return stages_->config; }

namespace {

// The request `config` makes of `prompt` at prompt index `stream_index`.
PromptRequest request_of(const PipelineConfig& config, std::string prompt, int64_t stream_index) {
  return {.prompt = std::move(prompt), .stream_index = stream_index, .candidates = config.candidates,
          .keep = config.keep, .sampling = config.sampling, .schedule = config.schedule, .superres = true,
          .preview_every = 0, .preview_candidates = 0, .image_prompt = nullptr, .adapters = {}};
}

// "FILE:WEIGHT", the weight written so that it reads back the same.
std::string weighted_adapter(const std::string& path, double weight) {
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text, weight).ptr;
  return path + ":" + std::string(text, end);
}

// `config` with the settings `request` gives its own (its sidecars' record, and what check()
// holds it to). A request's own image prompt is recorded by its rows, not its pixels; its
// named adapters by their files, after the config's, as `adapters` would fold them at load.
PipelineConfig with_settings_of(const PromptRequest& request, PipelineConfig config) {
  if (!request.adapters.empty()) {
    std::map<std::string, std::string> path_of;
    for (auto& [name, path] : named_adapters_of(config)) path_of.emplace(std::move(name), std::move(path));
    for (const auto& choice : request.adapters) {
      config.adapters.push_back(weighted_adapter(path_of.at(choice.name), choice.weight));
    }
  }
  config.named_adapters.clear();
  config.candidates = request.candidates;
  config.keep = request.keep;
  config.sampling = request.sampling;
  config.schedule = request.schedule;
  if (request.image_prompt) {
    config.image_prompt = {.image = "(the request's image)", .top_rows = request.image_prompt->top_rows, .mask = ""};
  }
  return config;
}

// The rows' captions, streams, seeds and filters as one batch; `options` carries the batch's
// shared arithmetic (batch_key) with the first row's filter, `filters` stays null when every
// row shares that filter.
RowBatch batch_of(const std::vector<Row>& rows, const std::vector<PromptRequest>& requests,
                  const std::vector<torch::Tensor>& captions, models::RowFilters& filters) {
  RowBatch batch{};  // filters null: every row shares options' filter
  std::vector<torch::Tensor> batch_captions;
  for (const auto& row : rows) {
    const auto& request = requests[row.request];
    batch_captions.push_back(captions[row.request]);
    batch.streams.push_back(sampling_stream(request.stream_index, row.candidate));
    batch.seeds.push_back(request.sampling.seed);
    const auto drawn_with = sampling_of(request, row.candidate);
    filters.top_k.push_back(drawn_with.top_k);
    filters.top_p.push_back(drawn_with.top_p);
  }
  batch.captions = torch::stack(batch_captions);
  batch.options = requests[rows.front().request].sampling;
  batch.options.top_k = filters.top_k.front();
  batch.options.top_p = filters.top_p.front();
  const bool one_filter =
      std::all_of(filters.top_k.begin(), filters.top_k.end(), [&](int64_t k) { return k == batch.options.top_k; }) &&
      std::all_of(filters.top_p.begin(), filters.top_p.end(), [&](double p) { return p == batch.options.top_p; });
  if (!one_filter) batch.filters = &filters;
  return batch;
}

// Whether candidate `candidate` of `request` is previewed at all.
bool previewed(const PromptRequest& request, int64_t candidate) {
  return request.preview_every > 0 && (request.preview_candidates == 0 || candidate < request.preview_candidates);
}

bool wants_preview(const PromptRequest& request, int64_t candidate, int64_t done, int64_t total) {
  return previewed(request, candidate) && (done % request.preview_every == 0 || done == total);
}

// The side of the square grid of `positions` tokens.
int64_t grid_side(int64_t positions) { return models::grid_side(positions, "pipeline: the prior's image positions"); }

// `images` [B, 3, H, W] blank (white) but for the pixels of the first `done` of the grid's
// positions.
torch::Tensor blank_undrawn(const torch::Tensor& images, int64_t done, int64_t total) {
  const auto side = grid_side(total);
  const auto scale = images.size(-1) / side;
  const auto drawn = (torch::arange(total) < done).to(images.dtype()).view({side, side});
  const auto mask = drawn.repeat_interleave(scale, 0).repeat_interleave(scale, 1);
  return images * mask + (1 - mask);
}

// `row`'s preview after `done` of `total` positions: its tokens so far and their image.
Preview preview_of(const Row& row, int64_t done, int64_t total, const torch::Tensor& tokens,
                   const torch::Tensor& image) {
  return {.request = static_cast<int64_t>(row.request), .candidate = row.candidate, .drawn = done, .total = total,
          .tokens = tokens.to(torch::kCPU), .image = image};
}

// The previews of the rows whose request asks for them once every position is drawn: the
// images as drawn, before reranking and super-resolution.
void show_final_previews(const std::vector<Row>& rows, const std::vector<PromptRequest>& requests,
                         const torch::Tensor& tokens, const torch::Tensor& decoded, const PreviewCallback& on_preview) {
  const auto total = tokens.size(1) * tokens.size(2);
  std::vector<Preview> out;
  for (size_t index = 0; index < rows.size(); ++index) {
    if (!previewed(requests[rows[index].request], rows[index].candidate)) continue;
    const auto i = static_cast<int64_t>(index);
    out.push_back(preview_of(rows[index], total, total, tokens[i], decoded[i]));
  }
  on_preview(out);
}

}  // namespace

std::vector<Preview> Pipeline::Stages::previews(const std::vector<Row>& rows, const std::vector<PromptRequest>& requests,
                                                const std::vector<torch::Tensor>& drawn, int64_t total) {
  const auto done = static_cast<int64_t>(drawn.size());
  std::vector<int64_t> due;
  for (size_t index = 0; index < rows.size(); ++index) {
    const auto& row = rows[index];
    if (wants_preview(requests[row.request], row.candidate, done, total)) due.push_back(static_cast<int64_t>(index));
  }
  if (due.empty()) return {};
  torch::NoGradGuard no_grad;
  const auto so_far = torch::stack(drawn, 1).index_select(0, torch::tensor(due).to(drawn.front().device()));
  const auto side = grid_side(total);
  const auto tokens = torch::constant_pad_nd(so_far, {0, total - done}).view({-1, side, side});
  const auto images = blank_undrawn(family->decode(tokens).to(torch::kCPU).to(torch::kFloat32), done, total);
  std::vector<Preview> out;
  for (size_t i = 0; i < due.size(); ++i) {
    const auto at = static_cast<int64_t>(i);
    out.push_back(preview_of(rows[static_cast<size_t>(due[i])], done, total, tokens[at], images[at]));
  }
  return out;
}

std::vector<GeneratedImage> Pipeline::Stages::sample(const std::vector<Row>& rows,
                                                     const std::vector<PromptRequest>& requests,
                                                     const std::vector<torch::Tensor>& captions,
                                                     log::Progress& progress, const PreviewCallback& on_preview) {
  models::RowFilters filters;
  auto batch = batch_of(rows, requests, captions, filters);
  batch.graphs = graphs.get();
  std::optional<models::ImagePrompt> image_prompt;
  if (const auto& own = requests[rows.front().request].image_prompt) {
    image_prompt = family->encode_image_prompt(*own);
    batch.image_prompt = &*image_prompt;
  }
  const auto count = static_cast<int64_t>(rows.size());
  const bool shows_previews = on_preview && std::any_of(rows.begin(), rows.end(), [&](const Row& row) {
                                return previewed(requests[row.request], row.candidate);
                              });
  std::vector<torch::Tensor> drawn;
  batch.on_token = [&](int64_t done, int64_t total, const torch::Tensor& codes) {
    progress.advance(count);
    if (!shows_previews || done == total) return;  // the last one comes from the decoded images
    drawn.push_back(codes);
    if (auto due = previews(rows, requests, drawn, total); !due.empty()) on_preview(due);
  };
  const auto tokens = family->draw(batch);
  torch::NoGradGuard no_grad;
  const auto decoded = family->decode(tokens).to(torch::kCPU);
  if (shows_previews) show_final_previews(rows, requests, tokens, decoded, on_preview);
  std::vector<GeneratedImage> images;
  for (size_t index = 0; index < rows.size(); ++index) {
    const auto& row = rows[index];
    const auto& request = requests[row.request];
    GeneratedImage image;
    image.request = static_cast<int64_t>(row.request);
    image.prompt_index = request.stream_index;
    image.prompt = request.prompt;
    image.candidate = row.candidate;
    image.rank = row.candidate;
    image.seed = request.sampling.seed;
    image.top_k = filters.top_k[index];
    image.top_p = filters.top_p[index];
    image.tokens = tokens[static_cast<int64_t>(index)].to(torch::kCPU);
    image.image = decoded[static_cast<int64_t>(index)];
    images.push_back(std::move(image));
  }
  return images;
}

torch::Tensor Pipeline::Stages::clip_caption(const std::string& prompt, const torch::Tensor& caption) const {
  if (!clip_tokenizer && !clip_yttm) return caption;
  std::vector<std::string> renderings;
  for (const auto& templ : config.clip_templates) renderings.push_back(text::fill_clip_template(templ, prompt));
  if (renderings.empty()) renderings.push_back(prompt);
  const int64_t length = clip->config().context_length;
  std::vector<torch::Tensor> rows;
  for (const auto& rendering : renderings) {
    const auto ids = clip_yttm ? clip_yttm->ruclip_ids(rendering, length) : clip_tokenizer->tokenize(rendering, length);
    rows.push_back(torch::tensor(ids, torch::kInt64));
  }
  return torch::stack(rows);
}

void Pipeline::Stages::rerank(std::vector<GeneratedImage>& candidates, const torch::Tensor& caption) {
  std::vector<torch::Tensor> images;
  for (const auto& candidate : candidates) images.push_back(candidate.image);
  const auto ranking = models::clip_rerank(clip, torch::stack(images).to(device), caption.to(device),
                                           static_cast<int64_t>(candidates.size()), config.batch_size);
  std::vector<GeneratedImage> ranked;
  for (size_t rank = 0; rank < ranking.indices.size(); ++rank) {
    auto image = std::move(candidates[static_cast<size_t>(ranking.indices[rank])]);
    image.rank = static_cast<int64_t>(rank);
    image.clip_score = ranking.scores[rank];
    ranked.push_back(std::move(image));
  }
  candidates = std::move(ranked);
}

void Pipeline::Stages::upscale(std::vector<GeneratedImage>& images) {
  std::vector<torch::Tensor> batch;
  for (const auto& image : images) batch.push_back(image.image);
  models::SuperResolveOptions options;
  options.tiles.tile = config.tile;
  options.tiles.overlap = config.tile_overlap;
  const auto upscaled = models::super_resolve(*superres, torch::stack(batch).to(device), options).to(torch::kCPU);
  for (size_t i = 0; i < images.size(); ++i) images[i].image = upscaled[static_cast<int64_t>(i)];
}

void Pipeline::Stages::finish(std::vector<GeneratedImage>& candidates, const PromptRequest& request,
                              const torch::Tensor& clip_caption) {
  if (clip) rerank(candidates, clip_caption);
  candidates.resize(static_cast<size_t>(request.kept()));
  if (superres && request.superres) upscale(candidates);
}

PreparedRequest Pipeline::prepare(std::string prompt, int64_t stream_index, const RequestSettings& settings) const {
  auto request = request_of(stages_->config, std::move(prompt), stream_index);
  if (settings) settings(request);
  return prepared(std::move(request), "pipeline");
}

PreparedRequest Pipeline::prepared(PromptRequest request, const std::string& where) const {
  const auto& s = *stages_;
  request.adapters = s.ordered(std::move(request.adapters));
  auto settings = s.check(request, where);
  if (!request.superres) settings.superres.clear();
  return {std::move(request), std::move(settings), s.id};
}

int64_t Pipeline::image_size(bool superres) const {
  return superres ? stages_->upscaled_size : stages_->decoded_size;
}

int64_t Pipeline::image_tokens() const { return stages_->image_tokens; }

PipelineConfig Pipeline::Stages::check(const PromptRequest& request, const std::string& where) const {
  check_prompt(request.prompt, where);
  try {
    check_adapters(request.adapters);
    auto changed = with_settings_of(request, config);
    check_config(changed);
    family->check(changed);
    if (request.candidates < 1 || request.stream_index < 0 || request.stream_index > UINT32_MAX ||
        request.candidates > UINT32_MAX) {
      throw Error("pipeline: candidates must be at least 1, and it and stream_index fit the 32 bits of a "
                  "sampling stream's halves");
    }
    if (request.preview_every < 0) {
      throw Error("pipeline: preview_every is " + std::to_string(request.preview_every) +
                  "; give the image positions between previews, or 0 for none");
    }
    if (const auto& own = request.image_prompt) {
      const auto grid = grid_side(image_tokens);
      if (own->top_rows < 1 || own->top_rows >= grid) {
        throw Error("pipeline: an image prompt keeps " + std::to_string(own->top_rows) + " token rows; the " +
                    std::to_string(grid) + "-row grid takes 1 to " + std::to_string(grid - 1));
      }
      if (own->image.dim() != 3 || own->image.size(0) != 3) {
        throw Error("pipeline: an image prompt's image must be [3, H, W]");
      }
    }
    if (request.preview_candidates < 0) {
      throw Error("pipeline: preview_candidates is " + std::to_string(request.preview_candidates) +
                  "; give how many candidates to preview, or 0 for all");
    }
    return changed;
  } catch (const Error& error) {
    if (where == "pipeline") throw;
    throw Error(std::string(error.what()) + " (" + where.substr(std::string("pipeline: ").size()) + ")");
  }
}

std::vector<AdapterChoice> Pipeline::Stages::ordered(std::vector<AdapterChoice> choices) const {
  std::erase_if(choices, [](const AdapterChoice& choice) { return choice.weight == 0; });
  const auto position = [&](const AdapterChoice& choice) {
    return std::find(adapter_names.begin(), adapter_names.end(), choice.name) - adapter_names.begin();
  };
  std::stable_sort(choices.begin(), choices.end(),
                   [&](const AdapterChoice& a, const AdapterChoice& b) { return position(a) < position(b); });
  return choices;
}

void Pipeline::Stages::check_adapters(const std::vector<AdapterChoice>& choices) const {
  std::set<std::string> chosen;
  for (const auto& choice : choices) {
    if (std::find(adapter_names.begin(), adapter_names.end(), choice.name) == adapter_names.end()) {
      std::string known;
      for (const auto& name : adapter_names) {
        if (!known.empty()) known += ", ";
        known += name;
      }
      throw Error("pipeline: adapters: no named adapter " + excerpt(choice.name) + "; " +
                  (known.empty() ? "this pipeline has none (named_adapters)" : "it has " + known));
    }
    if (!chosen.insert(choice.name).second) throw Error("pipeline: adapters: " + choice.name + " is chosen twice");
    if (!std::isfinite(choice.weight)) throw Error("pipeline: adapters: " + choice.name + "'s weight is not finite");
  }
}

std::vector<GeneratedImage> Pipeline::generate(const std::vector<std::string>& prompts) {
  if (prompts.empty()) throw Error("pipeline: no prompts");
  // Before any sampling: a request the sidecars cannot hold must not cost a run.
  std::vector<PreparedRequest> requests;
  for (size_t index = 0; index < prompts.size(); ++index) {
    const auto stream_index = static_cast<int64_t>(index);
    requests.push_back(prepared(request_of(stages_->config, prompts[index], stream_index),
                                "pipeline: prompt " + std::to_string(index)));
  }
  return generate(requests);
}

std::vector<GeneratedImage> Pipeline::generate(const std::vector<PreparedRequest>& prepared_requests,
                                               const PreviewCallback& on_preview) {
  auto& s = *stages_;
  if (prepared_requests.empty()) throw Error("pipeline: no prompts");
  std::vector<PromptRequest> requests;
  for (size_t index = 0; index < prepared_requests.size(); ++index) {
    if (prepared_requests[index].pipeline_ != s.id) {
      throw Error("pipeline: request " + std::to_string(index) + " was not prepared by this pipeline (prepare())");
    }
    requests.push_back(prepared_requests[index].request());
  }
  std::vector<torch::Tensor> captions, clip_captions;
  int64_t rows = 0;
  for (size_t index = 0; index < requests.size(); ++index) {
    auto [ids, truncated] = s.family->caption(requests[index].prompt);
    if (truncated) log::warn("pipeline: prompt ", index, " is longer than the prior's text and was cut");
    captions.push_back(std::move(ids));
    if (s.clip) clip_captions.push_back(s.clip_caption(requests[index].prompt, captions.back()));
    rows += requests[index].candidates;
  }
  log::Progress progress("generate", rows * s.family->image_length());
  std::vector<GeneratedImage> kept;
  // Batches run across a group's requests; a request is reranked and upscaled once its last
  // candidate is drawn.
  for (const auto& group : group_requests(requests, [&](const PromptRequest& r) { return s.batch_key(r); })) {
    if (s.adapters) s.adapters->use(requests[group.front()].adapters);
    std::vector<Row> group_rows;
    for (const auto index : group) {
      for (int64_t candidate = 0; candidate < requests[index].candidates; ++candidate) {
        group_rows.push_back({index, candidate});
      }
    }
    std::map<size_t, std::vector<GeneratedImage>> pending;
    for (size_t first = 0; first < group_rows.size(); first += static_cast<size_t>(s.config.batch_size)) {
      const auto last = std::min(group_rows.size(), first + static_cast<size_t>(s.config.batch_size));
      const std::vector<Row> batch(group_rows.begin() + static_cast<std::ptrdiff_t>(first),
                                   group_rows.begin() + static_cast<std::ptrdiff_t>(last));
      for (auto& image : s.sample(batch, requests, captions, progress, on_preview)) {
        const auto index = static_cast<size_t>(image.request);
        auto& candidates = pending[index];
        candidates.push_back(std::move(image));
        if (static_cast<int64_t>(candidates.size()) < requests[index].candidates) continue;
        s.finish(candidates, requests[index], s.clip ? clip_captions[index] : torch::Tensor());
        for (auto& done : candidates) kept.push_back(std::move(done));
        pending.erase(index);
      }
    }
  }
  progress.finish();
  // In the requests' order: groups may have finished them out of it.
  std::stable_sort(kept.begin(), kept.end(),
                   [](const GeneratedImage& a, const GeneratedImage& b) { return a.request < b.request; });
  return kept;
}

}  // namespace dalle::generate
