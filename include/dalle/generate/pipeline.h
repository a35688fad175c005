#pragma once
// Text to images, ruDALL-E's pipeline as one library call: caption tokenizer -> N samples
// per prompt from the prior (batched, KV-cached) -> image decoder -> CLIP reranking ->
// the best K -> super-resolution. Reranking and super-resolution are optional stages;
// dalle-generate is a thin command line over this class. The prior is the sparse
// transformer (with our tokenizer or ruDALL-E's) or DALL-E Mega / Mini's BART prior (with
// min-dalle's tokenizer and VQGAN detokenizer; docs/generate.md).
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dalle/config.h"
#include "dalle/generate/image_prompt.h"
#include "dalle/models/prior_sampling.h"

namespace dalle::generate {

// ruDALL-E's way of drawing a prompt's N candidates: in stages of narrowing top_k and top_p,
// the candidates split evenly between the stages in order (fewer candidates than stages take
// stages spread over the schedule). Empty: `sampling` for all.
struct SamplingSchedule {
  std::vector<int64_t> top_k;
  std::vector<double> top_p;

  void visit(ConfigVisitor& v);
  int64_t stages() const { return static_cast<int64_t>(top_k.size()); }
  // The stage candidate `candidate` of `candidates` draws in (0 without a schedule).
  int64_t stage_of(int64_t candidate, int64_t candidates) const;
  // `sampling` with the top_k and top_p of `stage` (`sampling` itself without a schedule).
  models::SamplingOptions options(int64_t stage, const models::SamplingOptions& sampling) const;
};

struct PipelineConfig {
  std::string prior;      // prior run directory or checkpoint
  std::string tokenizer;  // caption tokenizer model; empty: the prior run's
  std::string decoder;    // dVAE or VQGAN run or checkpoint; empty: the prior run's
  std::string encoder;    // dVAE or VQGAN that encodes image prompts; empty: the decoder (none for a BART prior)
  std::string clip;       // CLIP run or checkpoint; empty: no reranking
  std::string clip_tokenizer;  // imported CLIP's own (BPE merges, ruCLIP's bpe.model); empty: the caption tokenizer
  std::vector<std::string> clip_templates;  // the prompt as CLIP reads it, each with {}; empty: the prompt alone
  std::string superres;   // RRDBNet run or checkpoint; empty: no super-resolution
  std::vector<std::string> adapters;  // adapter files folded into the prior, "FILE" or "FILE:WEIGHT"
  // Adapters requests may choose by name (PromptRequest::adapters), "NAME=FILE" each: loaded
  // at start, folded into the prior for the batches of the requests that choose them.
  std::vector<std::string> named_adapters;
  int64_t candidates = 4;  // N images sampled per prompt
  int64_t keep = 0;        // K images kept per prompt, the best by CLIP score; 0: all N
  int64_t batch_size = 32; // images sampled at once
  std::string dtype = "float32";  // the prior's weights and arithmetic: float32, bfloat16, float16 or int8 (CPU)
  models::SamplingOptions sampling;
  SamplingSchedule schedule;       // ruDALL-E's top_k / top_p stages; empty: `sampling` alone
  ImagePromptConfig image_prompt;  // image tokens every sample keeps
  int64_t tile = 192;      // super-resolution tile side in input pixels (0: whole images)
  int64_t tile_overlap = 24;
  std::string device = "auto";  // auto: cuda when available, else cpu
  int64_t threads = 0;          // torch intra-op threads (0: one per idle core)
  bool cuda_graphs = true;      // on a GPU, each decoding step replayed from a CUDA graph

  void visit(ConfigVisitor& v);
  // K as used: `keep`, or N when 0.
  int64_t kept() const { return keep == 0 ? candidates : keep; }
};

// A model folder holds generate.yaml, a pipeline config whose relative model paths (prior,
// tokenizer, decoder, encoder, clip, clip_tokenizer, superres) name what lies in the folder.
inline constexpr const char* kModelFolderConfig = "generate.yaml";
// The folder's pipeline config, its relative model paths made to point into the folder.
PipelineConfig read_model_folder(const std::string& folder);

// A named adapter (PipelineConfig::named_adapters) a request folds into the prior, and its weight.
struct AdapterChoice {
  std::string name;
  double weight = 1.0;
  auto operator<=>(const AdapterChoice&) const = default;
};

// One prompt of a generate call with settings of its own, as dalle-serve's requests ask:
// Pipeline::prepare(prompt) starts from the config's. Prompts whose temperature, guidance scale
// and use_cache agree share batches (for a BART prior, top_k too), as do prompts choosing the
// same adapters; the seed, filters,
// candidates, keep and super-resolution may differ row by row, and a prompt's images are
// what a pipeline configured with its settings draws for it at `stream_index`.
struct PromptRequest {
  std::string prompt;
  int64_t stream_index = 0;  // candidate c draws sampling stream sampling_stream(stream_index, c) of sampling.seed
  int64_t candidates = 4;    // N
  int64_t keep = 0;          // K, the best by CLIP score; 0: all N
  models::SamplingOptions sampling;
  SamplingSchedule schedule;  // replaces sampling.top_k and top_p per candidate when not empty
  bool superres = true;       // upscale, when the pipeline has a super-resolution model
  // Image positions between previews of its candidates while they are drawn (0: none); the
  // last preview comes when they are all drawn, before reranking and super-resolution.
  int64_t preview_every = 0;
  // How many of its candidates are previewed, the first ones (0: all). Each preview decodes
  // the candidates it shows, which can cost as much as drawing them on a small prior.
  int64_t preview_candidates = 0;
  // An image prompt of its own, in place of the config's image_prompt (none: the config's).
  // A request with one batches only with requests sharing this object.
  std::shared_ptr<const PromptImage> image_prompt;
  // Named adapters folded into the prior for its candidates, after the config's `adapters`.
  // prepare() puts them in named_adapters' order (the order they are folded in, which rounds)
  // and drops those of weight 0.
  std::vector<AdapterChoice> adapters;

  int64_t kept() const { return keep == 0 ? candidates : keep; }
};

// A request as Pipeline::prepare checked it, with the settings its images are drawn and recorded
// with. generate takes only those its own pipeline prepared. Plain data (a request's own image
// prompt is shared, never written): it may be copied and read on any thread.
class PreparedRequest {
 public:
  PreparedRequest() = default;  // prepared by no pipeline: generate refuses it

  const PromptRequest& request() const { return request_; }
  // The pipeline's config as the request changes it (candidates, keep, sampling, schedule, its
  // own image prompt, its adapters as files after `adapters`; superres cleared when off): what
  // its images' sidecars record.
  const PipelineConfig& settings() const { return settings_; }

 private:
  friend class Pipeline;
  PreparedRequest(PromptRequest request, PipelineConfig settings, uint64_t pipeline)
      : request_(std::move(request)), settings_(std::move(settings)), pipeline_(pipeline) {}

  PromptRequest request_;
  PipelineConfig settings_;
  uint64_t pipeline_ = 0;  // the pipeline that prepared it (Pipeline::Stages::id); 0: none
};

struct GeneratedImage {
  int64_t request = 0;       // which of generate's prompts or requests it answers
  int64_t prompt_index = 0;  // the prompt index of its sampling streams (the request's stream_index)
  std::string prompt;
  int64_t candidate = 0;  // which of the prompt's N samples
  int64_t rank = 0;       // 0 = best CLIP score; the sampling order without reranking
  int64_t seed = 0;       // the sampling seed; with prompt_index and candidate it fixes the draws
  int64_t top_k = 0;      // the filtering it was drawn with (its schedule stage's, if any)
  double top_p = 1.0;
  torch::Tensor tokens;   // [grid, grid] int64 image tokens
  torch::Tensor image;    // [3, H, W] in [0, 1], after super-resolution when it is on
  std::optional<double> clip_score;  // cosine similarity x CLIP's logit scale
};

// A candidate as drawn so far (PromptRequest::preview_every).
struct Preview {
  int64_t request = 0;    // which of generate's requests
  int64_t candidate = 0;  // which of its N samples
  int64_t drawn = 0;      // image positions drawn so far, of `total`
  int64_t total = 0;
  torch::Tensor tokens;   // [grid, grid] int64: the tokens drawn, 0 where none is yet
  torch::Tensor image;    // [3, H, W] in [0, 1]: the tokens drawn decoded, blank (white) where none is yet
};
// Called on generate's thread with the previews of a batch's rows at one position.
using PreviewCallback = std::function<void(const std::vector<Preview>&)>;

// The key of the PNG text chunk (iTXt) in which every written image carries its sidecar JSON.
inline constexpr const char* kPngTextKeyword = "dalle";

// The sampling stream (models/prior_sampling.h) of candidate `candidate` of prompt `prompt_index`.
inline uint64_t sampling_stream(int64_t prompt_index, int64_t candidate) {
  return (static_cast<uint64_t>(prompt_index) << 32) | static_cast<uint64_t>(candidate);
}

// Threads. prepare(), image_size(), image_tokens() and config() may be called from any thread
// at any time, while another thread runs generate() too: they are const, read only settings
// and sizes the constructor fixed, which generate() never changes, and touch no torch state
// (they make no tensor, run no model, set no thread count). generate() is not safe to call
// from several threads at once: it runs the models with the process's torch threads and one
// set of loaded weights, so concurrent calls would only contend for the same cores. Callers
// with many clients (dalle-serve) prepare each request where it arrives and queue it to one
// thread, which batches them into one generate() call. The constructor, moves and the
// destructor must overlap no other call.
class Pipeline {
 public:
  explicit Pipeline(PipelineConfig config);
  ~Pipeline();
  Pipeline(Pipeline&&) noexcept;
  Pipeline& operator=(Pipeline&&) noexcept;

  // For each prompt, its K images in rank order. Batches of batch_size candidates run
  // across prompts; candidate c of prompt i draws from sampling stream
  // sampling_stream(i, c) of sampling.seed, so its image does not depend on batch_size
  // or on the other prompts. generate(prompts) is generate of prepare(prompts[i], i) for
  // each i, its errors naming the prompt.
  std::vector<GeneratedImage> generate(const std::vector<std::string>& prompts);
  // For each request, in order, its K images in rank order; every request must come from this
  // pipeline's prepare(), and is not checked again. Requests with a preview_every are shown to
  // `on_preview` as they are drawn; previews change no draw.
  std::vector<GeneratedImage> generate(const std::vector<PreparedRequest>& requests,
                                       const PreviewCallback& on_preview = {});

  // Sets a request's own settings on the config's (the fields of PromptRequest).
  using RequestSettings = std::function<void(PromptRequest&)>;
  // The request the config makes of `prompt` at prompt index `stream_index`, as `settings`
  // changes it, checked: throws Error, naming the field, for what generate cannot do. The one
  // call a request needs before generate; any thread may make it.
  PreparedRequest prepare(std::string prompt, int64_t stream_index = 0, const RequestSettings& settings = {}) const;
  // The side of the square images generate returns, with or without super-resolution
  // (the same when the pipeline has none).
  int64_t image_size(bool superres) const;
  // The image positions (tokens) each candidate is drawn in.
  int64_t image_tokens() const;

  // The config with every default resolved (tokenizer and decoder paths, device).
  const PipelineConfig& config() const;

 private:
  struct Stages;
  // `request` checked (errors begin with `where`) and prepared by this pipeline.
  PreparedRequest prepared(PromptRequest request, const std::string& where) const;

  std::unique_ptr<Stages> stages_;
};

// Writes one PNG and one JSON sidecar per image (every setting, the prompt, seed, tokens,
// score) as PPPP-RR.png/json (prompt, rank), and grid.png with a row per prompt. Every
// file is written to a temporary name and renamed.
// Each PNG carries its sidecar's JSON in an iTXt chunk under kPngTextKeyword.
void write_generation(const std::string& directory, const PipelineConfig& config,
                      const std::vector<GeneratedImage>& images);

// The JSON sidecar of `image` made with `config` (as write_generation writes it), as text.
std::string image_metadata(const PipelineConfig& config, const GeneratedImage& image);
// `image` as PNG carrying image_metadata(config, image) in its text chunk.
std::string encode_generated_png(const PipelineConfig& config, const GeneratedImage& image);

}  // namespace dalle::generate
