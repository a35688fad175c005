#include "dalle/generate/pipeline.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <tuple>
#include <utility>

#include "dalle/data/image.h"
#include "dalle/device.h"
#include "dalle/error.h"
#include "dalle/input_limits.h"
#include "dalle/io/atomic_file.h"
#include "dalle/log.h"
#include "dalle/models/bart_sampling.h"
#include "dalle/models/clip_rerank.h"
#include "dalle/models/tiled_upscale.h"
#include "dalle/models/trained.h"
#include "dalle/runtime.h"
#include "dalle/text/bart_tokenizer.h"
#include "dalle/text/clip_tokenizer.h"
#include "dalle/text/tokenizer.h"
#include "dalle/text/yttm_tokenizer.h"

namespace dalle::generate {

namespace fs = std::filesystem;

void SamplingSchedule::visit(ConfigVisitor& v) {
  v.field("top_k", top_k,
          "top_k of each stage (ruDALL-E: 2048, 1536, 1024, 1024, 512, 384, 256, 128); empty: no schedule",
          {.min = 0});
  v.field("top_p", top_p, "top_p of each stage, as many as top_k (ruDALL-E: 0.995, 0.99, 0.99, 0.98, 0.97, 0.96, "
          "0.95, 0.95)", {.min = 1e-6, .max = 1.0});
}

int64_t SamplingSchedule::stage_of(int64_t candidate, int64_t candidates) const {
  return stages() == 0 ? 0 : candidate * stages() / candidates;
}

models::SamplingOptions SamplingSchedule::options(int64_t stage, const models::SamplingOptions& sampling) const {
  auto options = sampling;
  if (stages() == 0) return options;
  options.top_k = top_k.at(static_cast<size_t>(stage));
  options.top_p = top_p.at(static_cast<size_t>(stage));
  return options;
}

void PipelineConfig::visit(ConfigVisitor& v) {
  v.field("prior", prior,
          "prior run directory or checkpoint (required): the sparse transformer, or DALL-E Mega / Mini's BART "
          "prior (kind bart_prior)");
  v.field("tokenizer", tokenizer,
          "caption tokenizer model: ours (SentencePiece) or ruDALL-E's YouTokenToMe bpe.model, told apart by "
          "content; for a BART prior, a folder with min-dalle's vocab.json and merges.txt; empty: the one the "
          "prior was trained with");
  v.field("decoder", decoder,
          "dVAE or VQGAN run or checkpoint (for a BART prior, min-dalle's VQGAN detokenizer); empty: the prior's "
          "image tokenizer");
  v.field("clip", clip,
          "CLIP run or checkpoint that reranks the candidates, trained by dalle-train-clip with the caption "
          "tokenizer; empty: no reranking");
  v.field("clip_tokenizer", clip_tokenizer,
          "CLIP's BPE merges file (bpe_simple_vocab_16e6.txt.gz, from OpenAI CLIP or open_clip) for CLIP weights "
          "imported by scripts/export_open_clip.py; empty: CLIP reads the caption tokenizer's ids");
  v.field("superres", superres, "RRDBNet run or checkpoint that upscales the kept images; empty: none");
  v.field("candidates", candidates, "images sampled per prompt (N; DALL-E: 512, most of the gain by 32)",
          {.min = 1, .max = 65536});
  v.field("keep", keep, "images kept per prompt, the best K by CLIP score (0: all N; needs clip when below N)",
          {.min = 0, .max = 65536});
  v.field("batch_size", batch_size, "images sampled at once", {.min = 1, .max = 65536});
  v.field("dtype", dtype,
          "the prior's weights and arithmetic: float32, or 16 bits at half the memory (bfloat16 has float32's "
          "range and fast CPU kernels; float16 is for GPUs); the other models stay float32",
          {.choices = {"float32", "bfloat16", "float16"}});
  v.section("sampling", "sampling from the prior", sampling);
  v.section("schedule",
            "ruDALL-E's stages: each prompt's candidates split evenly between (top_k, top_p) pairs, in order, "
            "replacing sampling.top_k and sampling.top_p",
            schedule);
  v.section("image_prompt", "an image whose top rows or masked cells every sample keeps (\"continue this picture\")",
            image_prompt);
  v.field("tile", tile, "super-resolution tile side in input pixels (0: whole images at once)", {.min = 0});
  v.field("tile_overlap", tile_overlap, "pixels each super-resolution tile overlaps its neighbours by", {.min = 0});
  v.field("device", device, "where the models run", {.choices = {"auto", "cpu", "cuda"}});
  v.field("threads", threads, "torch intra-op threads (0: one per idle core)", {.min = 0, .max = 1024});
}

PipelineConfig read_model_folder(const std::string& folder) {
  const auto file = fs::path(folder) / kModelFolderConfig;
  if (!fs::is_regular_file(file)) {
    throw Error(folder + ": not a model folder (it has no " + kModelFolderConfig + ", the pipeline config)");
  }
  auto config = load_config<PipelineConfig>(ConfigSource::from_file(file.string()));
  for (auto* path : {&config.prior, &config.tokenizer, &config.decoder, &config.clip, &config.clip_tokenizer,
                     &config.superres}) {
    if (!path->empty() && fs::path(*path).is_relative()) *path = (fs::path(folder) / *path).string();
  }
  return config;
}

namespace {

void check_config(const PipelineConfig& config) {
  if (config.prior.empty()) throw Error("pipeline: `prior` is required (a prior run directory or checkpoint)");
  config.image_prompt.validate();
  const auto& schedule = config.schedule;
  if (schedule.top_k.size() != schedule.top_p.size()) {
    throw Error("pipeline: schedule.top_k has " + std::to_string(schedule.top_k.size()) + " stages, schedule.top_p " +
                std::to_string(schedule.top_p.size()) + "; give one top_p per top_k");
  }
  if (config.kept() > config.candidates) {
    throw Error("pipeline: keep (" + std::to_string(config.keep) + ") exceeds candidates (" +
                std::to_string(config.candidates) + ")");
  }
  if (config.kept() < config.candidates && config.clip.empty()) {
    throw Error("pipeline: keeping " + std::to_string(config.kept()) + " of " + std::to_string(config.candidates) +
                " candidates needs a CLIP model to choose them: set `clip`, or keep: 0");
  }
}

// Without clip_tokenizer the CLIP reads the caption tokenizer's ids: a CLIP trained by
// dalle-train-clip with that tokenizer.
void check_clip_fits(const models::ClipConfig& clip, const text::Tokenizer& tokenizer, const std::string& path) {
  if (clip.text_pooling != "eos" || clip.eos_id != text::Tokenizer::kEndId) {
    throw Error("pipeline: the CLIP model " + path + " pools text at " + clip.text_pooling +
                "; reranking feeds it the caption tokenizer's ids, which needs eos pooling at id " +
                std::to_string(text::Tokenizer::kEndId) +
                " (a CLIP trained by dalle-train-clip). For imported CLIP weights set clip_tokenizer to CLIP's "
                "bpe_simple_vocab_16e6.txt.gz");
  }
  if (tokenizer.vocab_size() > clip.vocab_size || tokenizer.text_length() > clip.context_length) {
    throw Error("pipeline: the caption tokenizer (" + std::to_string(tokenizer.vocab_size()) + " ids, " +
                std::to_string(tokenizer.text_length()) + " per caption) does not fit the CLIP model " + path + " (" +
                std::to_string(clip.vocab_size) + " ids, context " + std::to_string(clip.context_length) + ")");
  }
}

// ruDALL-E's tokenizer feeds a prior of ruDALL-E's layout; a CLIP cannot read its ids.
void check_yttm_fits(const text::YttmTokenizer& yttm, const models::PriorConfig& prior, const PipelineConfig& config) {
  if (yttm.vocab_size() > prior.text_vocab_size) {
    throw Error("pipeline: the YouTokenToMe tokenizer " + config.tokenizer + " has " +
                std::to_string(yttm.vocab_size()) + " ids, more than the prior's text_vocab_size " +
                std::to_string(prior.text_vocab_size));
  }
  if (!config.clip.empty() && config.clip_tokenizer.empty()) {
    throw Error("pipeline: a CLIP cannot read ruDALL-E's caption ids (" + config.tokenizer +
                "); set clip_tokenizer to CLIP's bpe_simple_vocab_16e6.txt.gz for imported CLIP weights");
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

// What min-dalle's sampler and detokenizer cannot do is refused before anything is drawn.
void check_mega_fits(const PipelineConfig& config, const models::BartPriorConfig& prior) {
  const std::string mega = "pipeline: the prior " + config.prior + " is DALL-E Mega / Mini's, which ";
  if (config.schedule.stages() > 0 || config.sampling.top_p != 1.0) {
    throw Error(mega + "filters by top_k alone, as min-dalle does: set sampling.top_p to 1 and leave schedule empty");
  }
  if (config.sampling.top_k > prior.codes) {
    throw Error(mega + "draws from " + std::to_string(prior.codes) + " codes: sampling.top_k " +
                std::to_string(config.sampling.top_k) + " is more (0 keeps them all)");
  }
  if (config.image_prompt.enabled()) {
    throw Error(mega + "decodes with min-dalle's VQGAN detokenizer: it has no encoder to turn an image prompt into "
                "tokens");
  }
  if (!config.clip.empty() && config.clip_tokenizer.empty()) {
    throw Error(mega + "reads BART's caption ids, which no CLIP reads; set clip_tokenizer to CLIP's "
                "bpe_simple_vocab_16e6.txt.gz for imported CLIP weights");
  }
}

// DALL-E Mega / Mini: min-dalle's caption tokenizer, its BART prior and its VQGAN detokenizer.
// sampling.guidance_scale is min-dalle's supercondition factor: the same mix of the
// caption's and the empty caption's logits.
struct MegaStages {
  models::TrainedBartPrior prior;
  text::BartTokenizer tokenizer;
  models::VqganDetokenizer detokenizer{nullptr};

  std::pair<torch::Tensor, bool> caption(const std::string& prompt) const {
    const auto length = prior.config.text_length;
    return {torch::tensor(tokenizer.caption_ids(prompt, length), torch::kInt64),
            static_cast<int64_t>(tokenizer.encode(prompt).size()) > length};
  }
  // Image tokens [rows, side, side] of `captions` [rows, text_length], row r from stream streams[r].
  torch::Tensor draw(const torch::Tensor& captions, const models::SamplingOptions& sampling,
                     const std::vector<uint64_t>& streams, const std::vector<int64_t>& seeds,
                     const std::function<void(int64_t, int64_t)>& on_token) {
    const models::BartSamplingOptions options{
        .temperature = sampling.temperature,
        .top_k = sampling.top_k == 0 ? prior.config.codes : sampling.top_k,
        .supercondition_factor = sampling.guidance_scale,
        .seed = sampling.seed};
    const auto side = static_cast<int64_t>(std::lround(std::sqrt(static_cast<double>(prior.config.image_length))));
    return models::sample_bart_image_tokens(prior.model->encoder, prior.model->decoder, captions, options, streams,
                                            on_token, seeds)
        .view({captions.size(0), side, side});
  }
  torch::Tensor decode(const torch::Tensor& tokens) { return detokenizer->forward(tokens.flatten(1)); }
  int64_t image_size() const {
    const auto side = static_cast<int64_t>(std::lround(std::sqrt(static_cast<double>(prior.config.image_length))));
    return side * detokenizer->config().downsampling_factor();
  }
};

MegaStages load_mega(PipelineConfig& config, torch::Device device) {
  auto prior = models::load_trained_bart_prior(config.prior, float_type_named(config.dtype));
  check_mega_fits(config, prior.config);
  if (config.tokenizer.empty()) config.tokenizer = prior.tokenizer;
  if (config.decoder.empty()) config.decoder = prior.image_tokenizer;
  if (config.tokenizer.empty() || config.decoder.empty()) {
    throw Error("pipeline: the BART prior " + config.prior +
                " names no tokenizer folder or detokenizer: set `tokenizer` and `decoder`");
  }
  const fs::path folder = config.tokenizer;
  auto tokenizer = text::BartTokenizer::load((folder / "vocab.json").string(), (folder / "merges.txt").string());
  if (tokenizer.vocab_size() > prior.config.text_vocab_size) {
    throw Error("pipeline: the BART tokenizer " + config.tokenizer + " has " + std::to_string(tokenizer.vocab_size()) +
                " ids, more than the prior's text_vocab_size " + std::to_string(prior.config.text_vocab_size));
  }
  auto detokenizer = models::load_trained_detokenizer(config.decoder);
  prior.model->to(device);
  detokenizer->to(device);
  return {std::move(prior), std::move(tokenizer), std::move(detokenizer)};
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

struct Pipeline::Stages {
  PipelineConfig config;
  torch::Device device = torch::kCPU;
  models::TrainedPrior prior{};               // the sparse transformer, with
  std::optional<text::Tokenizer> tokenizer{};  // ours, or
  std::optional<text::YttmTokenizer> yttm{};   // ruDALL-E's,
  models::TrainedImageTokenizer decoder{};     // and a dVAE or VQGAN; or instead
  std::optional<MegaStages> mega{};            // DALL-E Mega / Mini's
  models::Clip clip{nullptr};
  std::optional<text::ClipTokenizer> clip_tokenizer{};
  models::RrdbNet superres{nullptr};
  std::optional<models::ImagePrompt> image_prompt{};

  // The image tokens [rows, grid, grid] of `rows`, requests' prompts encoded in `captions`.
  torch::Tensor draw(const std::vector<Row>& rows, const std::vector<PromptRequest>& requests,
                     const std::vector<torch::Tensor>& captions, log::Progress& progress);
  // Samples and decodes those candidates.
  std::vector<GeneratedImage> sample(const std::vector<Row>& rows, const std::vector<PromptRequest>& requests,
                                     const std::vector<torch::Tensor>& captions, log::Progress& progress);
  // Refuses what generate cannot do of `request`; `where` begins the messages.
  void check(const PromptRequest& request, const std::string& where) const;
  // Reranks (with CLIP), keeps and upscales the candidates of one request.
  void finish(std::vector<GeneratedImage>& candidates, const PromptRequest& request, const torch::Tensor& clip_caption);
  // The prompt's ids as the prior reads them, and whether it was cut to fit.
  std::pair<torch::Tensor, bool> caption(const std::string& prompt) const;
  // The prompt as CLIP reads it: CLIP's own ids, or the caption tokenizer's `caption`.
  torch::Tensor clip_caption(const std::string& prompt, const torch::Tensor& caption) const;
  // Scores the candidates against their prompt (as CLIP reads it) and orders them best first.
  void rerank(std::vector<GeneratedImage>& candidates, const torch::Tensor& caption);
  void upscale(std::vector<GeneratedImage>& images);
  int64_t image_length() const { return mega ? mega->prior.config.image_length : prior.config.image_length(); }
  // The settings a batch's rows must share: models::SamplingOptions arithmetic the sampler
  // applies to the whole batch (a BART prior also filters the whole batch by one top_k).
  std::tuple<double, double, bool, int64_t> batch_key(const PromptRequest& request) const {
    const auto& s = request.sampling;
    return {s.temperature, s.guidance_scale, s.use_cache, mega ? s.top_k : 0};
  }
  // The sparse transformer prior, its caption tokenizer (ours or ruDALL-E's) and its image decoder.
  static std::unique_ptr<Stages> load_transformer(PipelineConfig config, torch::Device device);
};

std::unique_ptr<Pipeline::Stages> Pipeline::Stages::load_transformer(PipelineConfig config, torch::Device device) {
  auto prior = models::load_trained_prior(config.prior, float_type_named(config.dtype));
  if (config.tokenizer.empty()) config.tokenizer = prior.tokenizer;
  if (config.decoder.empty()) config.decoder = prior.image_tokenizer;
  if (config.tokenizer.empty() || config.decoder.empty()) {
    throw Error("pipeline: the prior run " + config.prior +
                " names no caption tokenizer or image tokenizer: set `tokenizer` and `decoder`");
  }
  std::optional<text::Tokenizer> tokenizer;
  std::optional<text::YttmTokenizer> yttm;
  if (text::YttmTokenizer::recognises(config.tokenizer)) {
    yttm = text::YttmTokenizer::load(config.tokenizer);
    check_yttm_fits(*yttm, prior.config, config);
  } else {
    tokenizer = text::Tokenizer::load(config.tokenizer);
  }
  auto decoder = models::load_image_tokenizer(config.decoder);
  if (decoder.grid_size() != prior.config.grid_size) {
    throw Error("pipeline: the decoder " + config.decoder + " makes " + std::to_string(decoder.grid_size()) +
                "x" + std::to_string(decoder.grid_size()) + " token grids, the prior samples " +
                std::to_string(prior.config.grid_size) + "x" + std::to_string(prior.config.grid_size));
  }
  prior.model->to(device);
  decoder.model->module().to(device);
  return std::make_unique<Stages>(
      Stages{std::move(config), device, std::move(prior), std::move(tokenizer), std::move(yttm), std::move(decoder)});
}

Pipeline::Pipeline(PipelineConfig config) {
  check_config(config);
  // Resolved, like the device, so that each sidecar says how many threads drew it: the
  // samples depend on it (sums taken in another order now and then pick another token).
  config.threads = set_torch_threads(config.threads);
  const auto device = resolve_device(config.device, "pipeline");
  config.device = device.is_cuda() ? "cuda" : "cpu";
  if (models::prior_kind(config.prior) == "bart_prior") {
    auto mega = load_mega(config, device);
    stages_ = std::make_unique<Stages>(Stages{std::move(config), device});
    stages_->mega.emplace(std::move(mega));
  } else {
    stages_ = Stages::load_transformer(std::move(config), device);
  }
  auto& s = *stages_;
  if (s.config.image_prompt.enabled()) s.image_prompt = load_image_prompt(s.config.image_prompt, s.decoder);
  if (!s.config.clip.empty()) {
    s.clip = models::load_trained_clip(s.config.clip);
    if (s.config.clip_tokenizer.empty()) {
      check_clip_fits(s.clip->config(), *s.tokenizer, s.config.clip);
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
}

Pipeline::~Pipeline() = default;
Pipeline::Pipeline(Pipeline&&) noexcept = default;
Pipeline& Pipeline::operator=(Pipeline&&) noexcept = default;

const PipelineConfig& Pipeline::config() const { return stages_->config; }

torch::Tensor Pipeline::Stages::draw(const std::vector<Row>& rows, const std::vector<PromptRequest>& requests,
                                     const std::vector<torch::Tensor>& captions, log::Progress& progress) {
  std::vector<torch::Tensor> batch_captions;
  std::vector<uint64_t> streams;
  std::vector<int64_t> seeds;
  models::RowFilters filters;  // each row's schedule stage, or its request's own filter
  for (const auto& row : rows) {
    const auto& request = requests[row.request];
    batch_captions.push_back(captions[row.request]);
    streams.push_back(sampling_stream(request.stream_index, row.candidate));
    seeds.push_back(request.sampling.seed);
    const auto drawn_with = sampling_of(request, row.candidate);
    filters.top_k.push_back(drawn_with.top_k);
    filters.top_p.push_back(drawn_with.top_p);
  }
  // The batch's shared arithmetic (batch_key), with the first row's filter when all rows share it.
  auto options = requests[rows.front().request].sampling;
  options.top_k = filters.top_k.front();
  options.top_p = filters.top_p.front();
  const bool one_filter =
      std::all_of(filters.top_k.begin(), filters.top_k.end(), [&](int64_t k) { return k == options.top_k; }) &&
      std::all_of(filters.top_p.begin(), filters.top_p.end(), [&](double p) { return p == options.top_p; });
  const auto count = static_cast<int64_t>(rows.size());
  const auto on_token = [&](int64_t, int64_t) { progress.advance(count); };
  if (mega) return mega->draw(torch::stack(batch_captions), options, streams, seeds, on_token);
  return models::sample_image_tokens(prior.model, torch::stack(batch_captions), options,
                                     image_prompt ? &*image_prompt : nullptr, on_token, streams,
                                     one_filter ? nullptr : &filters, seeds);
}

std::vector<GeneratedImage> Pipeline::Stages::sample(const std::vector<Row>& rows,
                                                     const std::vector<PromptRequest>& requests,
                                                     const std::vector<torch::Tensor>& captions,
                                                     log::Progress& progress) {
  const auto tokens = draw(rows, requests, captions, progress);
  torch::NoGradGuard no_grad;
  const auto decoded = (mega ? mega->decode(tokens) : decoder.model->decode_tokens(tokens)).to(torch::kCPU);
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
    const auto drawn_with = sampling_of(request, row.candidate);
    image.top_k = drawn_with.top_k;
    image.top_p = drawn_with.top_p;
    image.tokens = tokens[static_cast<int64_t>(index)].to(torch::kCPU);
    image.image = decoded[static_cast<int64_t>(index)];
    images.push_back(std::move(image));
  }
  return images;
}

std::pair<torch::Tensor, bool> Pipeline::Stages::caption(const std::string& prompt) const {
  if (mega) return mega->caption(prompt);
  if (tokenizer) {
    const auto encoding = tokenizer->encode(prompt);
    return {torch::tensor(encoding.ids, torch::kInt64), encoding.truncated};
  }
  const auto ids = yttm->caption_ids(prompt, prior.config.text_length);
  const bool ended = std::find(ids.begin(), ids.end(), yttm->eos_id()) != ids.end();
  return {torch::tensor(ids, torch::kInt64), !ended};
}

torch::Tensor Pipeline::Stages::clip_caption(const std::string& prompt, const torch::Tensor& caption) const {
  if (!clip_tokenizer) return caption;
  return torch::tensor(clip_tokenizer->tokenize(prompt, clip->config().context_length), torch::kInt64);
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

PromptRequest Pipeline::request(std::string prompt, int64_t stream_index) const {
  const auto& config = stages_->config;
  return {.prompt = std::move(prompt), .stream_index = stream_index, .candidates = config.candidates,
          .keep = config.keep, .sampling = config.sampling, .schedule = config.schedule, .superres = true};
}

PipelineConfig Pipeline::config_of(const PromptRequest& request) const {
  auto config = stages_->config;
  config.candidates = request.candidates;
  config.keep = request.keep;
  config.sampling = request.sampling;
  config.schedule = request.schedule;
  if (!request.superres) config.superres.clear();
  return config;
}

int64_t Pipeline::image_size(bool superres) const {
  const auto& s = *stages_;
  const auto decoded = s.mega ? s.mega->image_size() : s.decoder.image_size;
  return superres && s.superres ? decoded * s.superres->config().scale : decoded;
}

void Pipeline::check(const PromptRequest& request) const { stages_->check(request, "pipeline"); }

void Pipeline::Stages::check(const PromptRequest& request, const std::string& where) const {
  check_prompt(request.prompt, where);
  try {
    auto changed = config;
    changed.candidates = request.candidates;
    changed.keep = request.keep;
    changed.sampling = request.sampling;
    changed.schedule = request.schedule;
    check_config(changed);
    if (mega) check_mega_fits(changed, mega->prior.config);
    if (request.candidates < 1 || request.stream_index < 0 || request.stream_index > UINT32_MAX ||
        request.candidates > UINT32_MAX) {
      throw Error("pipeline: candidates must be at least 1, and it and stream_index fit the 32 bits of a "
                  "sampling stream's halves");
    }
  } catch (const Error& error) {
    if (where == "pipeline") throw;
    throw Error(std::string(error.what()) + " (" + where.substr(std::string("pipeline: ").size()) + ")");
  }
}

std::vector<GeneratedImage> Pipeline::generate(const std::vector<std::string>& prompts) {
  std::vector<PromptRequest> requests;
  for (size_t index = 0; index < prompts.size(); ++index) {
    requests.push_back(request(prompts[index], static_cast<int64_t>(index)));
  }
  return generate(requests);
}

std::vector<GeneratedImage> Pipeline::generate(const std::vector<PromptRequest>& requests) {
  auto& s = *stages_;
  if (requests.empty()) throw Error("pipeline: no prompts");
  // Before any sampling: a request the sidecars cannot hold must not cost a run.
  for (size_t index = 0; index < requests.size(); ++index) {
    s.check(requests[index], "pipeline: prompt " + std::to_string(index));
  }
  std::vector<torch::Tensor> captions, clip_captions;
  int64_t rows = 0;
  for (size_t index = 0; index < requests.size(); ++index) {
    auto [ids, truncated] = s.caption(requests[index].prompt);
    if (truncated) log::warn("pipeline: prompt ", index, " is longer than the prior's text and was cut");
    captions.push_back(std::move(ids));
    if (s.clip) clip_captions.push_back(s.clip_caption(requests[index].prompt, captions.back()));
    rows += requests[index].candidates;
  }
  log::Progress progress("generate", rows * s.image_length());
  std::vector<GeneratedImage> kept;
  // Batches run across a group's requests; a request is reranked and upscaled once its last
  // candidate is drawn.
  for (const auto& group : group_requests(requests, [&](const PromptRequest& r) { return s.batch_key(r); })) {
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
      for (auto& image : s.sample(batch, requests, captions, progress)) {
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

namespace {

nlohmann::json settings(PipelineConfig config) {
  nlohmann::json json = nlohmann::json::object();
  for (const auto& [key, value] : flatten_config(visit_of(config))) json[key] = value;
  return json;
}

nlohmann::json sidecar(const nlohmann::json& settings, const GeneratedImage& image) {
  const auto codes = image.tokens.flatten().contiguous();
  return {
      {"prompt", image.prompt},
      {"prompt_index", image.prompt_index},
      {"rank", image.rank},
      {"candidate", image.candidate},
      {"seed", image.seed},
      {"sampling_stream", sampling_stream(image.prompt_index, image.candidate)},
      {"top_k", image.top_k},
      {"top_p", image.top_p},
      {"clip_score", image.clip_score ? nlohmann::json(*image.clip_score) : nlohmann::json(nullptr)},
      {"size", {image.image.size(1), image.image.size(2)}},
      {"pipeline", settings},
      {"image_tokens", std::vector<int64_t>(codes.data_ptr<int64_t>(), codes.data_ptr<int64_t>() + codes.numel())}};
}

}  // namespace

void write_generation(const std::string& directory, const PipelineConfig& config,
                      const std::vector<GeneratedImage>& images) {
  if (images.empty()) throw Error("pipeline: no images to write");
  fs::create_directories(directory);
  const auto pipeline_settings = settings(config);
  std::vector<torch::Tensor> tiles;
  std::vector<std::string> labels;
  for (const auto& image : images) {
    char stem[64];
    std::snprintf(stem, sizeof stem, "%04lld-%02lld", static_cast<long long>(image.prompt_index),
                  static_cast<long long>(image.rank));
    const auto metadata = sidecar(pipeline_settings, image).dump(2) + "\n";
    io::write_file_atomic((fs::path(directory) / (std::string(stem) + ".png")).string(),
                          data::png_with_text(data::encode_png(image.image), kPngTextKeyword, metadata));
    io::write_file_atomic((fs::path(directory) / (std::string(stem) + ".json")).string(), metadata);
    tiles.push_back(image.image);
    std::string label = image.prompt;
    if (image.clip_score) label += " (" + std::to_string(*image.clip_score).substr(0, 5) + ")";
    labels.push_back(std::move(label));
  }
  data::write_png((fs::path(directory) / "grid.png").string(),
                  data::make_grid(tiles, labels, {.columns = config.kept(), .tile_size = 128}));
}

std::string image_metadata(const PipelineConfig& config, const GeneratedImage& image) {
  return sidecar(settings(config), image).dump(2) + "\n";
}

std::string encode_generated_png(const PipelineConfig& config, const GeneratedImage& image) {
  return data::png_with_text(data::encode_png(image.image), kPngTextKeyword, image_metadata(config, image));
}

}  // namespace dalle::generate
