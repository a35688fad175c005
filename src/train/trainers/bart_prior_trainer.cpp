#include "dalle/train/trainers/bart_prior_trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "dalle/data/loader.h"
#include "dalle/data/token_dataset.h"
#include "dalle/io/checkpoint.h"
#include "dalle/log.h"
#include "dalle/models/bart_sampling.h"
#include "dalle/models/trained.h"
#include "dalle/text/bart_tokenizer.h"
#include "train/trainer_state.h"

namespace dalle::train {
namespace fs = std::filesystem;

void BartPriorTrainConfig::visit(ConfigVisitor& v) {
  v.field("kind", kind, "prior the recipe trains; dalle-train reads it first (bart_prior: this table)",
          {.choices = {"bart_prior"}});
  v.field("init", init,
          "a bart_prior checkpoint to fine-tune (an imported model folder's prior/, or a run); its sizes replace "
          "`model`; read when the run starts, not when it resumes; empty: random weights of `model`'s sizes");
  v.field("tokenizer", tokenizer, "folder with min-dalle's vocab.json and merges.txt, which encode the captions "
          "(required)");
  v.section("model", "BART prior sizes (DALL-E Mega's by default); ignored with init", model);
  v.section("data", "token datasets (dalle-encode-images with the detokenizer's VQGAN) and batching", data);
  v.section("learning_rate", "cosine learning-rate schedule", learning_rate);
  visit_shared_sections(v, {optimizer, run, precision, distributed});
  v.section("adapter", "low-rank adapters (LoRA) trained with the rest of the model frozen (docs/fine-tuning.md)",
            adapter);
}

struct BartPriorTrainer::State : detail::TrainerState<BartPriorTrainConfig, models::BartPrior> {
  std::optional<text::BartTokenizer> tokenizer;
  std::shared_ptr<data::TokenDataset> train_set, validation_set;
  std::unique_ptr<data::DataLoader<data::TokenDataset>> loader;
  at::Generator caption_dropout;
  BartPriorStepMetrics last;

  State(BartPriorTrainConfig c, fs::path r)
      : TrainerState("BART prior", std::move(c), std::move(r)),
        caption_dropout(at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(config.run.seed) + 1)) {}

  // Captions [B, text_length] (BART ids; the empty caption where dropped) and image tokens
  // [B, image_length] of `examples`, on the device.
  std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<data::TokenExample>& examples, bool drop_captions);
  // Mean cross-entropy of each image token given its caption and the tokens before it.
  torch::Tensor loss(models::BartPrior& prior, const torch::Tensor& captions, const torch::Tensor& images) const;
  BartPriorStepMetrics train_step(const std::vector<data::TokenExample>& examples);

  data::LoaderPosition loader_position() const override { return loader->position(); }
  void seek_loader(const data::LoaderPosition& position) override { loader->seek(position); }
  void save_extra(io::Checkpoint& checkpoint) const override {
    checkpoint.state.emplace("rng.caption_dropout", caption_dropout.get_state());
  }
  void restore_extra(const io::Checkpoint& checkpoint, const std::string&) override {
    caption_dropout.set_state(checkpoint.state.at("rng.caption_dropout"));
  }
};

namespace {

void check_dataset(const data::TokenDatasetInfo& info, const models::BartPriorConfig& model, const std::string& where) {
  if (info.grid_height * info.grid_width != model.image_length || info.image_vocab_size > model.codes) {
    throw Error("BART prior training: " + where + " holds " + std::to_string(info.grid_height) + "x" +
                std::to_string(info.grid_width) + " grids of " + std::to_string(info.image_vocab_size) +
                " image tokens; the prior draws " + std::to_string(model.image_length) + " tokens of " +
                std::to_string(model.codes) + " codes (encode the images with the detokenizer's VQGAN)");
  }
}

}  // namespace

BartPriorTrainer::BartPriorTrainer(BartPriorTrainConfig config, std::string run_directory) {
  if (config.data.train.empty()) throw Error("BART prior training: data.train must name a token dataset folder");
  if (config.tokenizer.empty()) {
    throw Error("BART prior training: `tokenizer` must name a folder with min-dalle's vocab.json and merges.txt");
  }
  models::BartPrior initial{nullptr};
  if (!config.init.empty()) {
    // A run that resumes takes its weights from its own checkpoint: init's sizes, which that
    // checkpoint's config holds, are all it needs of init then.
    const auto resumed = io::CheckpointStore((fs::path(run_directory) / io::kCheckpointsFolder).string()).latest();
    if (resumed) {
      config.model = load_config<BartPriorTrainConfig>(ConfigSource::from_file(*resumed + "/config.yaml")).model;
    } else {
      auto trained = models::load_trained_bart_prior(config.init);
      config.model = trained.config;
      initial = trained.model;
    }
  }
  config.model.validate();
  state_ = detail::start_trainer<State>(std::move(config), run_directory, "BART prior");
  auto& s = *state_;
  const fs::path folder = s.config.tokenizer;
  s.tokenizer = text::BartTokenizer::load((folder / "vocab.json").string(), (folder / "merges.txt").string());
  s.train_set = data::TokenDataset::open(s.config.data.train);
  check_dataset(s.train_set->info(), s.config.model, s.config.data.train);
  if (!s.config.data.validation.empty()) {
    s.validation_set = data::TokenDataset::open(s.config.data.validation);
    check_dataset(s.validation_set->info(), s.config.model, s.config.data.validation);
  }
  s.model = initial.is_empty() ? models::BartPrior(s.config.model) : initial;
  s.model->train();
  s.place_model();
  if (!initial.is_empty()) s.refer_to_base(s.config.init);
  s.build_update(s.model->parameters(), s.config.learning_rate.at(0), {.measure_norm = true});
  s.loader = std::make_unique<data::DataLoader<data::TokenDataset>>(
      s.train_set, data::LoaderOptions{.batch_size = s.rank_batch(s.config.data.batch_size),
                                       .workers = s.config.data.workers,
                                       .sampler = s.shard()});
  s.open_run(/*samples=*/false);
}

BartPriorTrainer::~BartPriorTrainer() = default;
int64_t BartPriorTrainer::step() const { return state_->step; }
BartPriorStepMetrics BartPriorTrainer::last_metrics() const { return state_->last; }
models::BartPrior& BartPriorTrainer::model() { return state_->model; }

std::pair<torch::Tensor, torch::Tensor> BartPriorTrainer::State::batch(const std::vector<data::TokenExample>& examples,
                                                                       bool drop_captions) {
  // One draw per example of the global batch, of which this rank's examples take theirs, as
  // the transformer prior's trainer draws them: any number of ranks drops what one would.
  const auto draws = drop_captions ? torch::rand({config.data.batch_size}, caption_dropout) : torch::Tensor();
  std::vector<torch::Tensor> captions, images;
  for (size_t i = 0; i < examples.size(); ++i) {
    auto caption = torch::tensor(tokenizer->caption_ids(examples[i].caption, config.model.text_length), torch::kInt64);
    const int64_t position = static_cast<int64_t>(i) * job->size() + job->rank();
    if (drop_captions && position < draws.size(0) && draws[position].item<double>() < config.data.caption_dropout) {
      caption = models::empty_captions(caption.unsqueeze(0))[0];
    }
    captions.push_back(caption);
    images.push_back(examples[i].image_tokens.flatten());
  }
  return {torch::stack(captions).to(device), torch::stack(images).to(device)};
}

torch::Tensor BartPriorTrainer::State::loss(models::BartPrior& prior, const torch::Tensor& captions,
                                            const torch::Tensor& images) const {
  const auto start = torch::full({images.size(0), 1}, config.model.codes - 1, images.options());
  torch::Tensor logits;
  {
    AutocastGuard autocast(images.device().type(), precision->autocast_dtype());
    auto cache = prior->decoder->start(prior->encoder->forward(captions), captions);
    logits = prior->decoder->forward(torch::cat({start, images.narrow(1, 0, images.size(1) - 1)}, 1), cache);
  }
  return torch::nn::functional::cross_entropy(logits.to(torch::kFloat32).flatten(0, 1), images.flatten());
}

BartPriorStepMetrics BartPriorTrainer::State::train_step(const std::vector<data::TokenExample>& examples) {
  BartPriorStepMetrics metrics;
  metrics.learning_rate = config.learning_rate.at(step);
  set_learning_rate(metrics.learning_rate);
  const auto [captions, images] = batch(examples, /*drop_captions=*/true);
  const auto total = loss(model, captions, images);
  const auto result = apply_update(total);
  ++step;
  metrics.step = step;
  metrics.skipped = result.skipped;
  metrics.grad_norm = result.grad_norm;
  metrics.loss = total.item<double>();
  return metrics;
}

void BartPriorTrainer::run() {
  auto& s = *state_;
  detail::run_training_loop(
      s, detail::intervals_of(s.config.run),
      {.update =
           [&] {
             s.last = s.train_step(s.loader->next().examples);
             return s.last.loss;
           },
       .log =
           [&] {
             s.append_metrics({{"step", s.last.step},
                               {"loss", s.last.loss},
                               {"grad_norm", s.last.grad_norm},
                               {"learning_rate", s.last.learning_rate}});
           },
       .validate =
           [&] { log::info("BART prior: update ", s.step, " loss ", s.last.loss, " validation loss ", validate().loss); },
       .checkpoint = [&] { s.save_checkpoint(); }});
}

BartPriorValidation BartPriorTrainer::validate() {
  auto& s = *state_;
  if (!s.validation_set) return {std::nan("")};
  torch::NoGradGuard no_grad;
  s.ema->copy_to(*s.ema_model);
  s.ema_model->eval();
  const int64_t count = std::min<int64_t>(static_cast<int64_t>(s.validation_set->size()), 256);
  double total = 0;
  int64_t batches = 0;
  for (int64_t begin = 0; begin < count; begin += s.config.data.batch_size, ++batches) {
    std::vector<data::TokenExample> examples;
    for (int64_t i = begin; i < std::min(count, begin + s.config.data.batch_size); ++i) {
      std::mt19937_64 rng(static_cast<uint64_t>(i));
      if (auto example = s.validation_set->get(static_cast<size_t>(i), rng)) examples.push_back(std::move(*example));
    }
    const auto [captions, images] = s.batch(examples, /*drop_captions=*/false);
    total += s.loss(s.ema_model, captions, images).item<double>();
  }
  const BartPriorValidation result{total / static_cast<double>(batches)};
  s.metrics_log.append({{"step", s.step}, {"validation_loss", result.loss}});
  return result;
}

}  // namespace dalle::train
