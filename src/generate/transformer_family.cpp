// DALL-E's and ruDALL-E's sparse transformer prior: our caption tokenizer (SentencePiece) or
// ruDALL-E's (YouTokenToMe), the prior, and a dVAE or VQGAN that decodes its tokens and
// encodes image prompts (or, with `encoder`, another one of the same codes that encodes them).
#include <torch/torch.h>

#include <algorithm>
#include <optional>

#include "dalle/device.h"
#include "dalle/error.h"
#include "dalle/generate/image_prompt.h"
#include "dalle/models/trained.h"
#include "dalle/runtime.h"
#include "dalle/text/tokenizer.h"
#include "dalle/text/yttm_tokenizer.h"
#include "generate/prior_family.h"

namespace dalle::generate {
namespace {

// ruDALL-E's tokenizer feeds a prior of ruDALL-E's layout; a CLIP cannot read its ids (ruCLIP
// reads its own bpe.model, framed its own way: clip_tokenizer).
void check_yttm_fits(const text::YttmTokenizer& yttm, const models::PriorConfig& prior, const PipelineConfig& config) {
  if (yttm.vocab_size() > prior.text_vocab_size) {
    throw Error("pipeline: the YouTokenToMe tokenizer " + config.tokenizer + " has " +
                std::to_string(yttm.vocab_size()) + " ids, more than the prior's text_vocab_size " +
                std::to_string(prior.text_vocab_size));
  }
  if (!config.clip.empty() && config.clip_tokenizer.empty()) {
    throw Error("pipeline: a CLIP cannot read ruDALL-E's caption ids (" + config.tokenizer +
                "); set clip_tokenizer to the imported CLIP's own tokenizer: ruCLIP's bpe.model "
                "(scripts/import-model clip adds both), or CLIP's bpe_simple_vocab_16e6.txt.gz");
  }
}

// A decoder or encoder must make the prior's grid of tokens.
void check_grid_fits(const models::TrainedImageTokenizer& model, const std::string& key, const std::string& path,
                     const models::PriorConfig& prior) {
  if (model.grid_size() != prior.grid_size) {
    throw Error("pipeline: the " + key + " " + path + " makes " + std::to_string(model.grid_size()) + "x" +
                std::to_string(model.grid_size()) + " token grids, the prior samples " +
                std::to_string(prior.grid_size) + "x" + std::to_string(prior.grid_size));
  }
}

class TransformerFamily : public PriorFamily {
 public:
  TransformerFamily(models::TrainedPrior prior, std::optional<text::Tokenizer> tokenizer,
                    std::optional<text::YttmTokenizer> yttm, models::TrainedImageTokenizer decoder,
                    std::optional<models::TrainedImageTokenizer> encoder,
                    std::optional<models::ImagePrompt> image_prompt)
      : prior_(std::move(prior)),
        tokenizer_(std::move(tokenizer)),
        yttm_(std::move(yttm)),
        decoder_(std::move(decoder)),
        encoder_(std::move(encoder)),
        image_prompt_(std::move(image_prompt)) {}

  std::pair<torch::Tensor, bool> caption(const std::string& prompt) const override {
    if (tokenizer_) {
      const auto encoding = tokenizer_->encode(prompt);
      return {torch::tensor(encoding.ids, torch::kInt64), encoding.truncated};
    }
    const auto ids = yttm_->caption_ids(prompt, prior_.config.text_length);
    const bool ended = std::find(ids.begin(), ids.end(), yttm_->eos_id()) != ids.end();
    return {torch::tensor(ids, torch::kInt64), !ended};
  }

  torch::Tensor draw(const RowBatch& batch) override {
    const auto* image_prompt = batch.image_prompt ? batch.image_prompt : image_prompt_ ? &*image_prompt_ : nullptr;
    return models::sample_image_tokens(prior_.model, batch.captions, batch.options, image_prompt, batch.on_token,
                                       batch.streams, batch.filters, batch.seeds, batch.graphs);
  }

  models::ImagePrompt encode_image_prompt(const PromptImage& prompt) override {
    return generate::encode_image_prompt(prompt, encoder_ ? *encoder_ : decoder_);
  }

  torch::Tensor decode(const torch::Tensor& tokens) override { return decoder_.model->decode_tokens(tokens); }

  void check(const PipelineConfig&) const override {}

  // Without clip_tokenizer the CLIP reads the caption tokenizer's ids: a CLIP trained by
  // dalle-train-clip with that tokenizer (ruDALL-E's was refused when it loaded).
  void check_clip_reads_captions(const models::ClipConfig& clip, const std::string& path) const override {
    if (clip.text_pooling != "eos" || clip.eos_id != text::Tokenizer::kEndId) {
      throw Error("pipeline: the CLIP model " + path + " pools text at " + clip.text_pooling +
                  "; reranking feeds it the caption tokenizer's ids, which needs eos pooling at id " +
                  std::to_string(text::Tokenizer::kEndId) +
                  " (a CLIP trained by dalle-train-clip). For imported CLIP weights set clip_tokenizer to CLIP's "
                  "bpe_simple_vocab_16e6.txt.gz (ruCLIP: its bpe.model)");
    }
    if (tokenizer_->vocab_size() > clip.vocab_size || tokenizer_->text_length() > clip.context_length) {
      throw Error("pipeline: the caption tokenizer (" + std::to_string(tokenizer_->vocab_size()) + " ids, " +
                  std::to_string(tokenizer_->text_length()) + " per caption) does not fit the CLIP model " + path +
                  " (" + std::to_string(clip.vocab_size) + " ids, context " + std::to_string(clip.context_length) +
                  ")");
    }
  }

  int64_t image_length() const override { return prior_.config.image_length(); }
  torch::nn::Module& prior() override { return *prior_.model; }
  const char* kind() const override { return "prior"; }
  int64_t image_size() const override { return decoder_.image_size; }

 private:
  models::TrainedPrior prior_;
  std::optional<text::Tokenizer> tokenizer_;    // ours, or
  std::optional<text::YttmTokenizer> yttm_;     // ruDALL-E's
  models::TrainedImageTokenizer decoder_;       // a dVAE or VQGAN
  std::optional<models::TrainedImageTokenizer> encoder_;  // `encoder`, when it is not the decoder
  std::optional<models::ImagePrompt> image_prompt_;
};

}  // namespace

std::unique_ptr<PriorFamily> load_transformer_family(PipelineConfig& config, torch::Device device) {
  auto prior = models::load_trained_prior(config.prior, prior_load_type(config));
  apply_adapters(*prior.model, config, "prior");
  quantize_if_int8(*prior.model, config);
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
  check_grid_fits(decoder, "decoder", config.decoder, prior.config);
  std::optional<models::TrainedImageTokenizer> encoder;
  if (!config.encoder.empty()) {
    encoder = models::load_image_tokenizer(config.encoder);
    check_grid_fits(*encoder, "encoder", config.encoder, prior.config);
    if (encoder->model->vocab_size() != decoder.model->vocab_size()) {
      throw Error("pipeline: the encoder " + config.encoder + " has " + std::to_string(encoder->model->vocab_size()) +
                  " codes, the decoder " + std::to_string(decoder.model->vocab_size()) +
                  ": its tokens are not the decoder's");
    }
  }
  prior.model->to(device);
  decoder.model->module().to(device);
  if (encoder) encoder->model->module().to(device);
  std::optional<models::ImagePrompt> image_prompt;
  if (config.image_prompt.enabled()) {
    image_prompt = load_image_prompt(config.image_prompt, encoder ? *encoder : decoder);
  }
  return std::make_unique<TransformerFamily>(std::move(prior), std::move(tokenizer), std::move(yttm),
                                             std::move(decoder), std::move(encoder), std::move(image_prompt));
}

}  // namespace dalle::generate
