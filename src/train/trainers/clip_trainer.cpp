#include "dalle/train/trainers/clip_trainer.h"

#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "dalle/data/caption_dataset.h"
#include "dalle/data/caption_neighbours.h"
#include "dalle/data/caption_words.h"
#include "dalle/data/loader.h"
#include "dalle/device.h"
#include "dalle/io/checkpoint.h"
#include "dalle/log.h"
#include "dalle/seed.h"
#include "dalle/text/tokenizer.h"
#include "dalle/train/adamw.h"
#include "dalle/train/ema.h"
#include "dalle/models/trained.h"
#include "dalle/train/model_precision.h"
#include "dalle/train/update_step.h"
#include "train/run_directory.h"
#include "train/trainers/trainer_support.h"
#include "train/training_loop.h"

namespace dalle::train {
namespace fs = std::filesystem;

void ClipTrainConfig::visit(ConfigVisitor& v) {
  v.field("kind", kind, "what the run trains (clip); checkpoints carry it", {.choices = {"clip"}});
  v.section("model", "CLIP sizes (open_clip's names; text_pooling must be eos with our tokenizer)", model);
  v.section("data", "image-caption datasets and batching; validation is the held-out set for retrieval accuracy",
            data);
  v.field("tokenizer", tokenizer,
          "SentencePiece caption tokenizer model (dalle-tokenizer train); its text_length must not exceed "
          "model.context_length, its vocabulary model.vocab_size (required)");
  v.field("warmup_steps", warmup_steps, "updates of linear learning-rate warmup to learning_rate.start (CLIP: 2000)",
          {.min = 0});
  v.field("through_tokenizer", through_tokenizer,
          "dVAE or VQGAN run or export: every training and validation image is encoded and decoded by it "
          "first, so that CLIP learns the decoder's images it will rerank (its image size must be "
          "data.image_size; empty: the images as they are)");
  v.field("through_tokenizer_cache_mb", through_tokenizer_cache_mb,
          "MiB of through_tokenizer round trips kept (float32, on the training device) after an image's "
          "first one, so that later epochs skip the tokenizer: the same values, several times faster "
          "(0: every image round-tripped at every use; randomly cropped images always are)",
          {.min = 0, .max = 1 << 24});
  v.field("hard_negatives", hard_negatives,
          "share of each training batch replaced by images whose captions differ from those of the batch's "
          "first images in one span of up to three words (another item, colour or position): negatives that "
          "a random batch seldom holds (0: random batches, as CLIP)",
          {.min = 0.0, .max = 0.5});
  v.field("word_dropout", word_dropout,
          "share of training captions shown without the words of dropped_words, each drawn per image and "
          "update: with the colour names, CLIP also learns what an item looks like whatever its colour, and "
          "a reranker can ask it so of a combination it never saw (0: captions as they are)",
          {.min = 0.0, .max = 1.0});
  v.field("dropped_words", dropped_words,
          "the words word_dropout leaves out of a caption, matched whole (e.g. the dataset's colour names)");
  v.section("learning_rate", "cosine learning-rate schedule after the warmup (CLIP: 5e-4 -> 0)", learning_rate);
  visit_shared_sections(v, {optimizer, run, precision, distributed});
  v.field("max_logit_scale", max_logit_scale,
          "logit_scale is clamped to [0, this] after every update: the logits' scale at most e^this "
          "(CLIP: ln 100)",
          {.min = 0.0, .max = 10.0});
  v.field("validation_images", validation_images,
          "held-out images scored at each validation: each image with one of its captions, retrieved among "
          "all of them",
          {.min = 2, .max = 65536});
}

double ClipTrainConfig::learning_rate_at(int64_t step) const {
  if (step < warmup_steps) {
    return learning_rate.start * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  }
  return learning_rate.at(step - warmup_steps);
}

torch::Tensor clip_contrastive_loss(const torch::Tensor& logits_per_image) {
  if (logits_per_image.dim() != 2 || logits_per_image.size(0) != logits_per_image.size(1)) {
    throw Error("clip loss: expected square [N, N] logits");
  }
  const auto labels = torch::arange(logits_per_image.size(0), logits_per_image.options().dtype(torch::kInt64));
  namespace F = torch::nn::functional;
  return (F::cross_entropy(logits_per_image, labels) + F::cross_entropy(logits_per_image.t(), labels)) / 2;
}

// The through_tokenizer round trip of each dataset image, kept after its first use: a
// centre-cropped image's round trip is the same at every epoch and costs more than the
// CLIP update (on 2 cores the demo recipe's update takes 2.1 s in the first epoch, 0.6 s
// after it). Kept in float32 on the training device until the budget is spent; the
// images beyond it, and randomly cropped ones, are round-tripped at every use.
class RoundTrips {
 public:
  enum class Split { train, validation };

  RoundTrips(models::TrainedImageTokenizer tokenizer, int64_t budget_bytes)
      : tokenizer_(std::move(tokenizer)), budget_bytes_(budget_bytes) {}

  // [B, 3, S, S] on `device`: the round trips of `examples`, images of `split`; `keep`:
  // their round trips are the same at every use (no random crop).
  torch::Tensor of(const std::vector<data::ImageCaptionExample>& examples, Split split, bool keep,
                   torch::Device device) {
    std::vector<size_t> missing;
    for (size_t i = 0; i < examples.size(); ++i) {
      if (!kept_.count(key(split, examples[i]))) missing.push_back(i);
    }
    std::vector<torch::Tensor> fresh;
    for (auto i : missing) fresh.push_back(examples[i].image);
    const auto made = fresh.empty() ? torch::Tensor() : models::round_trip(tokenizer_, torch::stack(fresh).to(device));
    std::vector<torch::Tensor> rows(examples.size());
    for (size_t m = 0; m < missing.size(); ++m) {
      rows[missing[m]] = made[static_cast<int64_t>(m)];
      const auto bytes = static_cast<int64_t>(rows[missing[m]].nbytes());
      // An image twice in one batch is kept (and counted) once.
      if (keep && used_bytes_ + bytes <= budget_bytes_ &&
          kept_.emplace(key(split, examples[missing[m]]), rows[missing[m]].clone()).second) {
        used_bytes_ += bytes;
      }
    }
    for (size_t i = 0; i < examples.size(); ++i) {
      if (!rows[i].defined()) rows[i] = kept_.at(key(split, examples[i]));
    }
    return torch::stack(rows);
  }
  int64_t kept() const { return static_cast<int64_t>(kept_.size()); }

 private:
  static std::pair<Split, int64_t> key(Split split, const data::ImageCaptionExample& example) {
    return {split, example.index};
  }

  models::TrainedImageTokenizer tokenizer_;
  int64_t budget_bytes_, used_bytes_ = 0;
  std::map<std::pair<Split, int64_t>, torch::Tensor> kept_;
};

struct ClipTrainer::State : detail::ImageTrainerState<ClipTrainConfig, models::Clip> {
  text::Tokenizer tokenizer;
  std::optional<RoundTrips> round_trips;              // through config.through_tokenizer
  std::optional<data::CaptionNeighbours> neighbours;  // of the training set, for hard_negatives

  State(ClipTrainConfig c, fs::path r)
      : ImageTrainerState("clip", std::move(c), std::move(r)), tokenizer(text::Tokenizer::load(config.tokenizer)) {}

  torch::Tensor tokenize(const std::vector<std::string>& captions) const;
  torch::Tensor pixels(const std::vector<data::ImageCaptionExample>& examples, RoundTrips::Split split);
  torch::Tensor global_batch(const torch::Tensor& local);
  data::Batch<data::ImageCaptionExample> next_batch();
  ClipStepMetrics train_step(const std::vector<data::ImageCaptionExample>& examples);
  // open_clip's bound on the logit scale, kept after every step.
  void bound_logit_scale() {
    torch::NoGradGuard no_grad;
    model->logit_scale.clamp_(0.0, config.max_logit_scale);
  }
  void log_step(const ClipStepMetrics& metrics);
  bool may_change_on_resume(const std::string& key) const override {
    return ImageTrainerState::may_change_on_resume(key) || key == "validation_images" ||
           key == "through_tokenizer_cache_mb";
  }
};

namespace {

void validate_settings(const ClipTrainConfig& config) {
  if (config.data.train.empty() || config.data.validation.empty()) {
    throw Error("clip training: data.train and data.validation must name dataset folders");
  }
  if (config.tokenizer.empty()) throw Error("clip training: tokenizer must name a SentencePiece model");
  config.model.validate();
  if (config.model.text_pooling != "eos" || config.model.eos_id != text::Tokenizer::kEndId) {
    throw Error("clip training: the SentencePiece tokenizer ends captions with id " +
                std::to_string(text::Tokenizer::kEndId) +
                ", which is not their largest id: set model.text_pooling: eos and model.eos_id: " +
                std::to_string(text::Tokenizer::kEndId));
  }
  if (std::min(config.learning_rate.start, config.learning_rate.end) < 0.0) {
    throw Error("clip training: learning_rate.start and learning_rate.end cannot be negative");
  }
  if (config.data.batch_size < 2) throw Error("clip training: data.batch_size must be at least 2 (negatives)");
  if (config.word_dropout > 0.0 && config.dropped_words.empty()) {
    throw Error("clip training: word_dropout needs the words to drop: set dropped_words");
  }
  if (config.hard_negatives < 0.0 || config.hard_negatives > 0.5) {
    throw Error("clip training: hard_negatives must be between 0 and 0.5 (at most half of a batch are neighbours "
                "of the other half)");
  }
}

void check_tokenizer(const text::Tokenizer& tokenizer, const models::ClipConfig& model, const std::string& path) {
  if (tokenizer.vocab_size() > model.vocab_size) {
    throw Error(path + ": the tokenizer has " + std::to_string(tokenizer.vocab_size()) +
                " ids, more than model.vocab_size (" + std::to_string(model.vocab_size) + ")");
  }
  if (tokenizer.text_length() > model.context_length) {
    throw Error(path + ": the tokenizer encodes " + std::to_string(tokenizer.text_length()) +
                " ids per caption, more than model.context_length (" + std::to_string(model.context_length) + ")");
  }
}

// open_clip's split: no decay for gains, biases, the class embedding and logit_scale (fewer
// than two dimensions); matrices and the token and position embeddings decay.
std::vector<torch::optim::OptimizerParamGroup> parameter_groups(models::ClipImpl& model,
                                                                const ClipTrainConfig& config) {
  std::vector<torch::Tensor> decayed, undecayed;
  for (const auto& parameter : model.parameters()) (parameter.dim() >= 2 ? decayed : undecayed).push_back(parameter);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (auto [parameters, decay] : {std::pair{decayed, config.optimizer.weight_decay}, std::pair{undecayed, 0.0}}) {
    auto options = std::make_unique<torch::optim::AdamWOptions>(config.learning_rate_at(0));
    options->weight_decay(decay);
    groups.emplace_back(parameters, std::move(options));
  }
  return groups;
}

models::TrainedImageTokenizer open_through_tokenizer(const ClipTrainConfig& config, torch::Device device) {
  auto tokenizer = models::load_image_tokenizer(config.through_tokenizer);
  if (tokenizer.image_size != config.data.image_size) {
    throw Error("clip training: through_tokenizer " + config.through_tokenizer + " was trained on " +
                std::to_string(tokenizer.image_size) + "px images, data.image_size is " +
                std::to_string(config.data.image_size) + ": they must be equal");
  }
  tokenizer.model->module().to(device);
  return tokenizer;
}

}  // namespace

ClipTrainer::ClipTrainer(ClipTrainConfig config, std::string run_directory) {
  validate_settings(config);
  state_ = detail::start_trainer<State>(std::move(config), run_directory, "CLIP");
  auto& s = *state_;
  check_tokenizer(s.tokenizer, s.config.model, s.config.tokenizer);
  s.model = models::Clip(s.config.model);
  s.place_model();
  s.build_update(parameter_groups(*s.model, s.config), s.config.learning_rate_at(0),
                 std::make_unique<ModelPrecision>(s.config.precision, s.model->parameters(), s.replicas()),
                 {.after_step = [&s] { s.bound_logit_scale(); }});
  if (const double ranks = static_cast<double>(s.job->size()); ranks > 1) {
    s.model->logit_scale.register_hook([ranks](const torch::Tensor& gradient) { return gradient / ranks; });
  }

  if (!s.config.through_tokenizer.empty()) {
    s.round_trips.emplace(open_through_tokenizer(s.config, s.device), s.config.through_tokenizer_cache_mb << 20);
  }
  s.open_images();
  if (s.config.hard_negatives > 0) {
    s.neighbours.emplace(*s.images.train);
    log::info("clip: ", 100 * s.neighbours->coverage(), "% of the training captions have a neighbour (hard_negatives)");
  }
  s.open_run(/*samples=*/false);
}

ClipTrainer::~ClipTrainer() = default;

int64_t ClipTrainer::step() const { return state_->step; }
models::Clip& ClipTrainer::model() { return state_->model; }

torch::Tensor ClipTrainer::State::tokenize(const std::vector<std::string>& captions) const {
  // The deterministic encoding: BPE-dropout draws from a per-thread generator, which an
  // exact resume cannot restore.
  const int64_t length = tokenizer.text_length();
  auto tokens = torch::empty({static_cast<int64_t>(captions.size()), length}, torch::kInt64);
  auto rows = tokens.accessor<int64_t, 2>();
  for (size_t i = 0; i < captions.size(); ++i) {
    const auto ids = tokenizer.encode(captions[i]).ids;
    for (int64_t j = 0; j < length; ++j) rows[static_cast<int64_t>(i)][j] = ids[static_cast<size_t>(j)];
  }
  return tokens.to(device);
}

// The loader's next batch, its last hard_negatives share replaced by neighbours of its first
// captions, a word_dropout share of its captions shortened. The draws are seeded by the
// update so that a resumed run sees the same batches.
data::Batch<data::ImageCaptionExample> ClipTrainer::State::next_batch() {
  auto batch = detail::next_nonempty_batch(images);
  if (neighbours) {
    data::replace_with_neighbours(batch.examples, config.hard_negatives, *neighbours, *images.train,
                                  static_cast<uint64_t>(config.run.seed), static_cast<uint64_t>(step));
  }
  if (config.word_dropout > 0.0) {
    constexpr uint64_t kWordDropoutStream = 0x776f7264;  // "word": draws apart from the neighbours'
    data::drop_words(batch.examples, config.word_dropout, config.dropped_words,
                     mix_seed(static_cast<uint64_t>(config.run.seed), kWordDropoutStream),
                     static_cast<uint64_t>(step));
  }
  return batch;
}

// What CLIP sees of a batch of [0, 1] images of `split`: on the device, through the image
// tokenizer when one is set, resized and normalised.
torch::Tensor ClipTrainer::State::pixels(const std::vector<data::ImageCaptionExample>& examples,
                                         RoundTrips::Split split) {
  const bool cropped_at_random = split == RoundTrips::Split::train && config.data.random_crop;
  const auto seen = round_trips ? round_trips->of(examples, split, !cropped_at_random, device)
                                : detail::stack_images(examples).to(device);
  return models::clip_preprocess(seen, config.model);
}

// The features of the whole global batch, this rank's `local` rows (which keep their
// gradient) among the other ranks' (gathered as values), so that the contrastive loss sees
// every negative one process would see.
torch::Tensor ClipTrainer::State::global_batch(const torch::Tensor& local) {
  if (job->size() == 1) return local;
  const auto values = local.detach().to(job->group()->device()).contiguous();
  auto gathered = torch::empty({job->size() * values.size(0), values.size(1)}, values.options());
  job->group()->all_gather(values, gathered);
  auto parts = gathered.to(local.device()).chunk(job->size());
  parts[static_cast<size_t>(job->rank())] = local;
  return torch::cat(parts);
}

ClipStepMetrics ClipTrainer::State::train_step(const std::vector<data::ImageCaptionExample>& examples) {
  ClipStepMetrics metrics;
  metrics.learning_rate = config.learning_rate_at(step);
  set_learning_rate(metrics.learning_rate);

  std::vector<std::string> captions;
  for (const auto& example : examples) captions.push_back(example.caption);
  const auto input = pixels(examples, RoundTrips::Split::train);
  const auto tokens = tokenize(captions);
  torch::Tensor image_features, text_features;
  {
    AutocastGuard autocast(input.device().type(), precision->autocast_dtype());
    image_features = model->encode_image(input);
    text_features = model->encode_text(tokens);
  }
  const auto logits = model
                          ->logits_from_features(global_batch(image_features.to(torch::kFloat32)),
                                                 global_batch(text_features.to(torch::kFloat32)))
                          .per_image;
  const auto loss = clip_contrastive_loss(logits);
  // Every rank computes the global batch's loss, but backpropagates through its own features
  // only: the ranks' gradients sum to the global loss's, which the reducer's mean divides by
  // the ranks (the logit scale's gradient, whole on every rank, is divided by a hook).
  metrics.skipped = apply_update(loss * static_cast<double>(job->size())).skipped;
  ++step;
  metrics.step = step;
  metrics.loss = loss.item<double>();
  const auto labels = torch::arange(logits.size(0), logits.options().dtype(torch::kInt64));
  metrics.accuracy = (logits.argmax(1) == labels).to(torch::kFloat64).mean().item<double>();
  metrics.logit_scale = model->logit_scale.item<double>();
  return metrics;
}

void ClipTrainer::State::log_step(const ClipStepMetrics& m) {
  append_metrics({{"step", m.step},
                  {"loss", m.loss},
                  {"batch_accuracy", m.accuracy},
                  {"logit_scale", m.logit_scale},
                  {"learning_rate", m.learning_rate}});
}

void ClipTrainer::run() {
  auto& s = *state_;
  ClipStepMetrics metrics;
  detail::run_training_loop(
      s, detail::intervals_of(s.config.run),
      {.update =
           [&] {
             metrics = s.train_step(s.next_batch().examples);
             return metrics.loss;
           },
       .log = [&] { s.log_step(metrics); },
       .validate =
           [&] {
             const auto validation = validate();
             log::info("clip: update ", s.step, " loss ", metrics.loss, "; ", validation.images,
                       " held-out images: image->text top-1 ", validation.image_to_text, ", text->image top-1 ",
                       validation.text_to_image);
           },
       .checkpoint = [&] { s.save_checkpoint(); }});
}

ClipValidation ClipTrainer::validate() {
  auto& s = *state_;
  s.ema->copy_to(*s.ema_model);
  s.ema_model->eval();
  torch::NoGradGuard no_grad;
  const auto& images = *s.images.validation;
  const int64_t count = std::min<int64_t>(static_cast<int64_t>(images.size()), s.config.validation_images);
  std::vector<std::string> captions;
  std::vector<torch::Tensor> image_features, text_features;
  for (int64_t begin = 0; begin < count; begin += s.config.data.batch_size) {
    std::vector<data::ImageCaptionExample> examples;
    std::vector<std::string> batch_captions;
    for (int64_t i = begin; i < std::min(count, begin + s.config.data.batch_size); ++i) {
      std::mt19937_64 rng(static_cast<uint64_t>(i));  // the same caption of each image every time
      if (auto example = images.get(static_cast<size_t>(i), rng)) {
        batch_captions.push_back(example->caption);
        examples.push_back(std::move(*example));
      }
    }
    if (examples.empty()) continue;
    const auto pixels = s.pixels(examples, RoundTrips::Split::validation);
    image_features.push_back(s.ema_model->encode_image(pixels).to(torch::kFloat32));
    text_features.push_back(s.ema_model->encode_text(s.tokenize(batch_captions)).to(torch::kFloat32));
    captions.insert(captions.end(), batch_captions.begin(), batch_captions.end());
  }
  if (captions.size() < 2) throw Error("clip: fewer than two readable validation images in " + images.root());
  const auto logits =
      s.ema_model->logits_from_features(torch::cat(image_features), torch::cat(text_features)).per_image;
  const auto best_text = logits.argmax(1), best_image = logits.argmax(0);
  ClipValidation result;
  result.images = static_cast<int64_t>(captions.size());
  const auto caption = [&](const torch::Tensor& index) -> const std::string& {
    return captions[static_cast<size_t>(index.item<int64_t>())];
  };
  for (int64_t i = 0; i < result.images; ++i) {
    // Equal captions are equally right: fashion-compose repeats captions across images.
    const auto& own = captions[static_cast<size_t>(i)];
    result.image_to_text += caption(best_text[i]) == own;
    result.text_to_image += caption(best_image[i]) == own;
  }
  result.image_to_text /= static_cast<double>(result.images);
  result.text_to_image /= static_cast<double>(result.images);
  result.loss = clip_contrastive_loss(logits).item<double>();
  nlohmann::json line = {{"step", s.step},
                         {"validation_images", result.images},
                         {"validation_image_to_text", result.image_to_text},
                         {"validation_text_to_image", result.text_to_image},
                         {"validation_loss", result.loss}};
  if (s.round_trips) line["kept_round_trips"] = s.round_trips->kept();
  s.metrics_log.append(line);
  return result;
}

}  // namespace dalle::train
