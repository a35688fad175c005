#pragma once
// A prior family: what the pipeline needs of a text-to-image-token model and the models that
// come with it (its caption tokenizer and its image decoder). The pipeline groups requests,
// batches their candidates, reranks and upscales; a family encodes captions, draws a batch of
// rows, decodes tokens to pixels and refuses the settings it cannot honour. Each family lives
// in its own file and is registered by its checkpoint kind in prior_family.cpp.
#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dalle/error.h"
#include "dalle/generate/image_prompt.h"
#include "dalle/generate/pipeline.h"
#include "dalle/models/adapter.h"
#include "dalle/models/clip_config.h"
#include "dalle/models/decode_graphs.h"
#include "dalle/models/prior_sampling.h"

namespace dalle::generate {

// One batch of candidates to draw, a row each.
struct RowBatch {
  torch::Tensor captions;                  // [rows, text_length] caption ids
  models::SamplingOptions options;         // the arithmetic the rows share, with the first row's filter
  const models::RowFilters* filters;       // each row's top_k and top_p; null when all rows share options'
  std::vector<uint64_t> streams;           // each row's sampling stream
  std::vector<int64_t> seeds;              // each row's seed
  models::TokenCallback on_token;          // after each image position
  models::DecodeGraphs* graphs = nullptr;  // the decoding steps' tensors and graphs, kept across batches
  const models::ImagePrompt* image_prompt = nullptr;  // the rows' request's own; null: the config's
};

class PriorFamily {
 public:
  virtual ~PriorFamily() = default;
  // The prompt's ids as the prior reads them ([text_length] int64), and whether it was cut.
  virtual std::pair<torch::Tensor, bool> caption(const std::string& prompt) const = 0;
  // Image tokens [rows, side, side] of the batch, on the family's device.
  virtual torch::Tensor draw(const RowBatch& batch) = 0;
  // Pixels [rows, 3, H, W] in [0, 1] of `tokens` [rows, side, side].
  virtual torch::Tensor decode(const torch::Tensor& tokens) = 0;
  // Refuses, naming the keys, what this family cannot do of `config` (a request's settings
  // applied to the pipeline's config).
  virtual void check(const PipelineConfig& config) const = 0;
  // Refuses a CLIP (trained by dalle-train-clip, at `path`) that cannot read this family's
  // caption ids, which it is given when the pipeline has no clip_tokenizer.
  virtual void check_clip_reads_captions(const models::ClipConfig& clip, const std::string& path) const = 0;
  virtual int64_t image_length() const = 0;  // tokens per image
  virtual int64_t image_size() const = 0;    // side of a decoded image, in pixels
  // The prior model (named adapters are folded into its weights) and its kind, as adapter
  // files name it ("prior", "bart_prior").
  virtual torch::nn::Module& prior() = 0;
  virtual const char* kind() const = 0;
  // Whether a batch's rows must share top_k (the family filters the whole batch by one).
  virtual bool filters_per_batch() const { return false; }
  // A request's image prompt as the family's tokens (check() refuses one to a family that
  // cannot encode images).
  virtual models::ImagePrompt encode_image_prompt(const PromptImage&) {
    throw Error("pipeline: this prior's family cannot encode an image prompt");
  }
};

// The type a family loads its prior's weights in: config.dtype's, float32 for int8.
torch::ScalarType prior_load_type(const PipelineConfig& config);
// The adapter file `path` for a `family` prior (prior, bart_prior) loaded with `config`: one
// trained for another family is refused, one trained on another base than `config.prior` is
// loaded with a warning.
models::AdapterFile load_adapter_for(const std::string& path, const PipelineConfig& config, const std::string& family);
// Folds config.adapters (FILE or FILE:WEIGHT each, models/adapter.h) into the prior's
// weights, in order (load_adapter_for each).
void apply_adapters(torch::nn::Module& prior, const PipelineConfig& config, const std::string& family);
// With dtype int8, quantizes the prior's matrices (models::quantize_linears_int8) once it is
// loaded in float32.
void quantize_if_int8(torch::nn::Module& prior, const PipelineConfig& config);

// The family of the prior `config.prior` names, loaded with its tokenizer and decoder on
// `device`; fills `config.tokenizer` and `config.decoder` from the prior's run when empty.
std::unique_ptr<PriorFamily> load_prior_family(PipelineConfig& config, torch::Device device);

}  // namespace dalle::generate
