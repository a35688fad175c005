// DALL-E Mega / Mini: min-dalle's caption tokenizer, its BART prior and its VQGAN
// detokenizer, and (`encoder`, from scripts/import-model mega --vqgan) dalle-mini's VQGAN,
// whose encoder turns image prompts into the prior's tokens. sampling.guidance_scale is
// min-dalle's supercondition factor: the same mix of the caption's and the empty caption's
// logits.
#include <torch/torch.h>

#include <filesystem>
#include <optional>

#include "dalle/device.h"
#include "dalle/error.h"
#include "dalle/generate/image_prompt.h"
#include "dalle/models/bart_sampling.h"
#include "dalle/models/token_grid.h"
#include "dalle/models/trained.h"
#include "dalle/runtime.h"
#include "dalle/text/bart_tokenizer.h"
#include "generate/prior_family.h"

namespace dalle::generate {
namespace {

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
  if (config.image_prompt.enabled() && config.encoder.empty()) {
    throw Error(mega + "decodes with min-dalle's VQGAN detokenizer, which has no encoder to turn an image prompt "
                "into tokens: set encoder to dalle-mini's VQGAN (scripts/import-model mega --vqgan FILE adds it "
                "as encoder/)");
  }
  if (!config.clip.empty() && config.clip_tokenizer.empty()) {
    throw Error(mega + "reads BART's caption ids, which no CLIP reads; set clip_tokenizer to CLIP's "
                "bpe_simple_vocab_16e6.txt.gz for imported CLIP weights");
  }
}

// The image encoder must make the detokenizer's codes on the prior's grid.
void check_encoder_fits(const models::TrainedImageTokenizer& encoder, const PipelineConfig& config,
                        const models::BartPriorConfig& prior, int64_t side) {
  if (encoder.model->vocab_size() != prior.codes) {
    throw Error("pipeline: the encoder " + config.encoder + " has " + std::to_string(encoder.model->vocab_size()) +
                " codes, the BART prior's detokenizer " + std::to_string(prior.codes) +
                ": not the VQGAN of its tokens (dalle-mini's vqgan_imagenet_f16_16384)");
  }
  if (encoder.grid_size() != side) {
    throw Error("pipeline: the encoder " + config.encoder + " makes " + std::to_string(encoder.grid_size()) + "x" +
                std::to_string(encoder.grid_size()) + " token grids, the BART prior draws " + std::to_string(side) +
                "x" + std::to_string(side));
  }
}

class MegaFamily : public PriorFamily {
 public:
  MegaFamily(models::TrainedBartPrior prior, int64_t side, text::BartTokenizer tokenizer,
             models::VqganDetokenizer detokenizer, std::optional<models::TrainedImageTokenizer> encoder,
             std::optional<models::ImagePrompt> image_prompt)
      : prior_(std::move(prior)),
        side_(side),
        tokenizer_(std::move(tokenizer)),
        detokenizer_(std::move(detokenizer)),
        encoder_(std::move(encoder)),
        image_prompt_(std::move(image_prompt)) {}

  std::pair<torch::Tensor, bool> caption(const std::string& prompt) const override {
    const auto length = prior_.config.text_length;
    return {torch::tensor(tokenizer_.caption_ids(prompt, length), torch::kInt64),
            static_cast<int64_t>(tokenizer_.encode(prompt).size()) > length};
  }

  torch::Tensor draw(const RowBatch& batch) override {
    const auto& sampling = batch.options;
    const models::BartSamplingOptions options{
        .temperature = sampling.temperature,
        .top_k = sampling.top_k == 0 ? prior_.config.codes : sampling.top_k,
        .supercondition_factor = sampling.guidance_scale,
        .seed = sampling.seed};
    const auto* image_prompt = batch.image_prompt ? batch.image_prompt : image_prompt_ ? &*image_prompt_ : nullptr;
    return models::sample_bart_image_tokens(prior_.model->encoder, prior_.model->decoder, batch.captions, options,
                                            batch.streams, batch.on_token, batch.seeds, batch.graphs, image_prompt)
        .view({batch.captions.size(0), side_, side_});
  }

  // check() refused a request's image prompt when there is no encoder.
  models::ImagePrompt encode_image_prompt(const PromptImage& prompt) override {
    if (!encoder_) throw Error("pipeline: the BART prior has no encoder for image prompts; set encoder");
    return generate::encode_image_prompt(prompt, *encoder_);
  }

  torch::Tensor decode(const torch::Tensor& tokens) override { return detokenizer_->forward(tokens.flatten(1)); }

  void check(const PipelineConfig& config) const override { check_mega_fits(config, prior_.config); }

  void check_clip_reads_captions(const models::ClipConfig&, const std::string&) const override {
    throw Error("pipeline: no CLIP reads BART's caption ids; set clip_tokenizer");  // check_mega_fits said it first
  }

  int64_t image_length() const override { return prior_.config.image_length; }
  int64_t image_size() const override { return side_ * detokenizer_->config().downsampling_factor(); }
  bool filters_per_batch() const override { return true; }
  torch::nn::Module& prior() override { return *prior_.model; }
  const char* kind() const override { return "bart_prior"; }

 private:
  models::TrainedBartPrior prior_;
  int64_t side_;  // of the token grid
  text::BartTokenizer tokenizer_;
  models::VqganDetokenizer detokenizer_;
  std::optional<models::TrainedImageTokenizer> encoder_;  // dalle-mini's VQGAN, for image prompts
  std::optional<models::ImagePrompt> image_prompt_;       // the config's, encoded once
};

}  // namespace

std::unique_ptr<PriorFamily> load_mega_family(PipelineConfig& config, torch::Device device) {
  auto prior = models::load_trained_bart_prior(config.prior, prior_load_type(config));
  apply_adapters(*prior.model, config, "bart_prior");
  quantize_if_int8(*prior.model, config);
  check_mega_fits(config, prior.config);
  const auto side = models::grid_side(prior.config.image_length, "pipeline: the BART prior " + config.prior +
                                                                     "'s image_length");
  if (config.tokenizer.empty()) config.tokenizer = prior.tokenizer;
  if (config.decoder.empty()) config.decoder = prior.image_tokenizer;
  if (config.tokenizer.empty() || config.decoder.empty()) {
    throw Error("pipeline: the BART prior " + config.prior +
                " names no tokenizer folder or detokenizer: set `tokenizer` and `decoder`");
  }
  const std::filesystem::path folder = config.tokenizer;
  auto tokenizer = text::BartTokenizer::load((folder / "vocab.json").string(), (folder / "merges.txt").string());
  if (tokenizer.vocab_size() > prior.config.text_vocab_size) {
    throw Error("pipeline: the BART tokenizer " + config.tokenizer + " has " + std::to_string(tokenizer.vocab_size()) +
                " ids, more than the prior's text_vocab_size " + std::to_string(prior.config.text_vocab_size));
  }
  auto detokenizer = models::load_trained_detokenizer(config.decoder);
  std::optional<models::TrainedImageTokenizer> encoder;
  if (!config.encoder.empty()) {
    encoder = models::load_image_tokenizer(config.encoder);
    check_encoder_fits(*encoder, config, prior.config, side);
  }
  prior.model->to(device);
  detokenizer->to(device);
  std::optional<models::ImagePrompt> image_prompt;
  if (encoder) {
    encoder->model->module().to(device);
    if (config.image_prompt.enabled()) image_prompt = load_image_prompt(config.image_prompt, *encoder);
  }
  return std::make_unique<MegaFamily>(std::move(prior), side, std::move(tokenizer), std::move(detokenizer),
                                      std::move(encoder), std::move(image_prompt));
}

}  // namespace dalle::generate
