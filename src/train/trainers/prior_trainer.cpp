#include "dalle/train/trainers/prior_trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <map>
#include <optional>
#include <unordered_set>

#include "dalle/data/image.h"
#include "dalle/data/image_grid.h"
#include "dalle/data/loader.h"
#include "dalle/data/token_dataset.h"
#include "dalle/distributed/sharded_parameters.h"
#include "dalle/distributed/sharded_reducer.h"
#include "dalle/io/state_dict.h"
#include "dalle/device.h"
#include "dalle/io/atomic_file.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/sharded_checkpoint.h"
#include "dalle/io/state_dict.h"
#include "dalle/log.h"
#include "dalle/text/tokenizer.h"
#include "dalle/train/adamw.h"
#include "dalle/train/ema.h"
#include "dalle/train/gradient_scaler.h"
#include "dalle/models/trained.h"
#include "dalle/train/optimizer_state.h"
#include "dalle/train/precision.h"
#include "dalle/train/model_precision.h"
#include "dalle/train/resblock_runner.h"
#include "dalle/train/sharded_prior.h"
#include "dalle/train/stochastic_rounding.h"
#include "dalle/train/update_step.h"
#include "train/run_directory.h"
#include "train/trainers/prior_trainer_state.h"
#include "train/trainers/trainer_support.h"
#include "train/training_loop.h"

namespace dalle::train {
namespace fs = std::filesystem;
using torch::indexing::Slice;

void PriorLearningRate::visit(ConfigVisitor& v) {
  v.field("peak", peak, "learning rate reached after the warmup (DALL-E: 4.5e-4)", {.min = 0.0, .max = 1.0});
  v.field("warmup_steps", warmup_steps, "updates of linear warmup from 0 (DALL-E: 5000)", {.min = 0});
  v.field("decay", decay, "after the warmup: cosine down to `end` at the last update, or plateau halving (DALL-E)",
          {.choices = {"cosine", "plateau"}});
  v.field("end", end, "cosine: the learning rate at the last update", {.min = 0.0, .max = 1.0});
  v.field("plateau_factor", plateau_factor, "plateau: factor applied at each reduction (DALL-E: 0.5)",
          {.min = 0.0, .max = 1.0});
  v.field("plateau_patience", plateau_patience,
          "plateau: validations without a better validation loss before a reduction", {.min = 1});
  v.field("plateau_reductions", plateau_reductions, "plateau: the most reductions (DALL-E: 5)", {.min = 0});
}

torch::ScalarType PriorTrainConfig::checkpointed_inputs_type(const std::string& who) const {
  if (checkpointed_inputs != "float32" && precision.precision() == Precision::fp32) {
    throw Error(who + ": checkpointed_inputs " + checkpointed_inputs +
                " needs precision.mode bfloat16 or float16 (a float32 run keeps float32 activations)");
  }
  return float_type_named(checkpointed_inputs);
}

double PriorLearningRate::at(int64_t step, int64_t total_steps, int64_t reductions) const {
  if (step < warmup_steps) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (decay == "plateau") return peak * std::pow(plateau_factor, static_cast<double>(reductions));
  const double span = static_cast<double>(std::max<int64_t>(total_steps - warmup_steps, 1));
  const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / span);
  return end + 0.5 * (peak - end) * (1.0 + std::cos(M_PI * progress));
}

void PriorTrainConfig::visit(ConfigVisitor& v) {
  v.section("model", "transformer sizes and options", model);
  v.field("init_from", init_from,
          "prior run or checkpoint whose weights (its moving average) the run starts from, with a fresh optimizer "
          "and this schedule, instead of a random initialisation; its model section must be this one, but for what "
          "only training reads (dropout, text_loss_weight) (empty: random)");
  v.section("data", "token datasets and batching", data);
  v.section("learning_rate", "warmup, then cosine or plateau decay", learning_rate);
  visit_shared_sections(v, {optimizer, run, precision, distributed});
  v.section("adapter", "low-rank adapters (LoRA) trained with the rest of the model frozen (docs/fine-tuning.md)",
            adapter);
  v.field("checkpoint_activations_every", checkpoint_activations_every,
          "recompute the activations of resblocks 0, k, 2k, ... in backward instead of keeping them "
          "(1: every resblock; 0: none)",
          {.min = 0});
  v.field("checkpointed_inputs", checkpointed_inputs,
          "storage of the input each checkpointed resblock keeps for its backward (every resblock's when sharded, "
          "else checkpoint_activations_every's): bfloat16 or float16 halve what checkpointing holds, as DALL-E's "
          "16-bit activations did (the recomputation starts from the rounded input; needs precision.mode bfloat16 "
          "or float16; bfloat16 has float32's range); float32 keeps them exact",
          dtype_choices({"float32", "bfloat16", "float16"}));
  v.field("frozen_weights", frozen_weights,
          "storage of the resblocks' frozen weight matrices (optimizer.trainable, adapters) in bfloat16 and float16 "
          "runs, which autocast casts anyway: float16 or bfloat16 halves the frozen base (float16 keeps ruDALL-E's "
          "released weights exactly); float32 (the default) keeps them as loaded",
          dtype_choices({"float32", "bfloat16", "float16"}));
  v.field("keep_best", keep_best,
          "keep the checkpoint of the best validation image loss (data.validation) beside the latest ones, named by "
          "checkpoints/best: loading the run as a model (dalle-generate --prior, dalle-export, init_from) reads it, "
          "the run resumes from its latest");
  v.field("tokenizer", tokenizer, "caption tokenizer model that made the dataset's text tokens (for sample grids)");
  v.field("image_tokenizer", image_tokenizer, "dVAE or VQGAN run that made the image tokens (for sample grids)");
  v.field("sample_captions", sample_captions, "captions drawn at each validation (needs tokenizer and image_tokenizer)");
  v.field("samples_per_caption", samples_per_caption, "images per sample caption", {.min = 1, .max = 64});
  v.section("sampling", "sampling settings of the grids", sampling);
}

using namespace prior_training;

namespace {

void check_dataset(const data::TokenDatasetInfo& info, const models::PriorConfig& model, const std::string& where) {
  std::string problems;
  if (info.text_length != model.text_length) {
    problems += " text_length " + std::to_string(info.text_length) + " (model " + std::to_string(model.text_length) + ")";
  }
  if (info.grid_height != model.grid_size || info.grid_width != model.grid_size) {
    problems += " grid " + std::to_string(info.grid_height) + "x" + std::to_string(info.grid_width) + " (model " +
                std::to_string(model.grid_size) + ")";
  }
  if (info.text_vocab_size > model.text_vocab_size) {
    problems += " text vocabulary " + std::to_string(info.text_vocab_size) + " (model " +
                std::to_string(model.text_vocab_size) + ")";
  }
  if (info.image_vocab_size > model.image_vocab_size) {
    problems += " image vocabulary " + std::to_string(info.image_vocab_size) + " (model " +
                std::to_string(model.image_vocab_size) + ")";
  }
  if (!problems.empty()) throw Error(where + ": the token dataset does not fit the model:" + problems);
}

// The moving average of a trained prior of the same sizes and options, by name. What only
// training reads may differ: a fine-tuning recipe sets its own.
models::TrainedPriorWeights read_init_from(const PriorTrainConfig& config) {
  auto trained = models::read_trained_prior_weights(config.init_from);
  auto wanted = config.model;
  const auto ours = flatten_config(visit_of(wanted)), theirs = flatten_config(visit_of(trained.config));
  std::string differences;
  for (size_t i = 0; i < ours.size() && i < theirs.size(); ++i) {
    if (ours[i] == theirs[i] || only_training_reads(ours[i].first)) continue;
    differences += " model." + ours[i].first + " " + theirs[i].second + " (run " + ours[i].second + ")";
  }
  if (!differences.empty()) {
    throw Error("prior training: init_from " + config.init_from + " is another model:" + differences +
                "; copy its model section into the config");
  }
  trained.source = config.init_from + " (init_from: " + trained.source + ")";
  return trained;
}

}  // namespace

PriorTrainer::PriorTrainer(PriorTrainConfig config, std::string run_directory) {
  if (config.data.train.empty()) throw Error("prior training: data.train must name a token dataset folder");
  config.model.validate();
  state_ = detail::start_trainer<State>(std::move(config), run_directory, "prior");
  auto& s = *state_;
  s.train_set = data::TokenDataset::open(s.config.data.train);
  check_dataset(s.train_set->info(), s.config.model, s.config.data.train);
  if (!s.config.data.validation.empty()) {
    s.validation_set = data::TokenDataset::open(s.config.data.validation);
    check_dataset(s.validation_set->info(), s.config.model, s.config.data.validation);
  }
  if (s.config.keep_best && !s.validation_set) {
    throw Error("prior training: keep_best keeps the checkpoint of the best validation loss: set data.validation");
  }
  if (!s.config.data.retention.empty()) {
    s.retention_set = data::TokenDataset::open(s.config.data.retention);
    check_dataset(s.retention_set->info(), s.config.model, s.config.data.retention);
  }
  check_weights_storage(s.config.precision, s.shards_resblocks(), "prior training");
  s.config.checkpointed_inputs_type("prior training");
  const bool checkpoints = s.shards_resblocks() || s.config.checkpoint_activations_every > 0;
  if (s.config.checkpointed_inputs != "float32" && !checkpoints) {
    log::warn("prior training: checkpointed_inputs ", s.config.checkpointed_inputs,
              " changes nothing: no resblock is checkpointed (checkpoint_activations_every 0, not sharded)");
  }
  // A resumed run has its own weights; init_from is read only to start one.
  const bool starts_from_init = !s.config.init_from.empty() && !s.checkpoints.latest();
  s.parallelize(starts_from_init ? std::make_optional(read_init_from(s.config)) : std::nullopt);
  s.loader = std::make_unique<data::DataLoader<data::TokenDataset>>(
      s.train_set, data::LoaderOptions{.batch_size = s.rank_batch(s.config.data.batch_size),
                                       .workers = s.config.data.workers,
                                       .sampler = s.shard()});
  s.open_run(/*samples=*/true);
  s.install_resblock_runner();
}

// The prior made trainable as the recipe says, in one place (as torchtitan's parallelize):
// built (sharded as it is built, or whole; from init_from when given), placed, its frozen
// blocks stored, its base referred to, its ends cut, and its moving average, optimizer,
// precision, reducer and update step made once, on the shards when sharded (before a resume,
// which then reads only this rank's part of the checkpoint). The resblock runner is installed
// after the resume (checkpoint_activations_every may change on it).
void PriorTrainer::State::parallelize(std::optional<models::TrainedPriorWeights> init) {
  build_model(init ? &*init : nullptr);
  place_model(/*sharded=*/shards != nullptr);
  store_frozen_blocks();
  // Sharded, the blocks were cut as they were built: the base is compared with what they read,
  // unless they read a sharded checkpoint's shards as it stores them (never joined whole; a
  // run's adapters folded in change them).
  if (init && shards && !init->unread.empty() && init->adapters.empty()) {
    refer_to_base_as_read(config.init_from);
  } else if (init && shards) {
    // What the blocks read, a run's adapters folded in, read again block by block to compare.
    refer_to_base(config.init_from, [&init](const models::WeightPicker& wanted) { return init->read(wanted); });
  } else if (init) {
    refer_to_base(config.init_from);
  }
  init.reset();
  // Sharded, the ends are cut before the average and the update state are made, so that no
  // rank ever holds a whole average of the prior (nor a validation copy).
  cut_into_shards();
  if (shards) {
    start_average();
    build_sharded_update();
  } else {
    build_update(parameter_groups(*model, config.optimizer.weight_decay), config.learning_rate.peak,
                 std::make_unique<ModelPrecision>(config.precision, model->parameters(),
                                                  resblock_parameter_groups(model->resblocks()), replicas()),
                 {.measure_norm = true});
  }
}

PriorTrainer::~PriorTrainer() = default;
int64_t PriorTrainer::step() const { return state_->step; }
PriorStepMetrics PriorTrainer::last_metrics() const { return state_->last; }
models::Prior& PriorTrainer::model() { return state_->model; }
const GradientScaler* PriorTrainer::gradient_scaler() const { return state_->precision->scaler(); }

bool only_training_reads(const std::string& model_key) {
  return model_key == "dropout" || model_key == "text_loss_weight";
}

bool PriorTrainer::State::shards_resblocks() const {
  return config.distributed.sharding == "within_node";
}

void PriorTrainer::State::install_resblock_runner() {
  const auto mode = config.precision.precision();
  // Sharded blocks recompute their forward in backward anyway.
  const int64_t checkpoint_every = shards ? 0 : config.checkpoint_activations_every;
  const auto kept_as = config.checkpointed_inputs_type("prior training");
  models::ResblockRunner runner;
  if (mode != Precision::fp32 || checkpoint_every > 0) {
    runner = make_training_runner(model->resblocks(), {.precision = mode,
                                                       .scaler = precision->scaler(),
                                                       .checkpoint_every = checkpoint_every,
                                                       .checkpointed_inputs = kept_as});
  }
  if (shards) {
    if (!runner) {
      runner = [](models::ResblockImpl& block, const torch::Tensor& x, const models::ResblockContext& context) {
        return x + block.branch(x, context);
      };
    }
    runner = shards->runner(std::move(runner), kept_as);
    training_runner = runner;
    validation_runner = shards->runner(validation_inner_runner());
  }
  if (runner) model->set_resblock_runner(std::move(runner));
}

// The blocks as a validation copy runs them: in float32, or under autocast where they hold
// 16-bit weights (frozen_weights, precision.weights).
models::ResblockRunner PriorTrainer::State::validation_inner_runner() const {
  const bool sixteen_bit = config.frozen_weights != "float32" || config.precision.weights != "float32";
  const auto autocast = sixteen_bit ? config.precision.autocast_dtype() : std::nullopt;
  return [autocast](models::ResblockImpl& block, const torch::Tensor& x, const models::ResblockContext& context) {
    AutocastGuard guard(x.device().type(), autocast);
    return x + block.branch(x, context).to(x.scalar_type());
  };
}

std::optional<torch::ScalarType> PriorTrainer::State::frozen_matrix_storage() const {
  if (config.frozen_weights == "float32") return std::nullopt;
  if (!config.precision.autocast_dtype()) {
    throw Error("prior training: frozen_weights " + config.frozen_weights +
                " needs precision.mode bfloat16 or float16 (a float32 run computes without autocast)");
  }
  return float_type_named(config.frozen_weights);
}

// frozen_weights: the resblocks' frozen matrices in 16 bits, shared with the validation model,
// whose blocks then run under autocast as the training runner's do. A sharded prior's were
// rounded as its blocks were built: their shards are kept, and gathered, in 16 bits.
void PriorTrainer::State::store_frozen_blocks() {
  const auto storage = frozen_matrix_storage();
  if (!storage || shards) return;
  const auto stored = store_frozen_matrices(*model, "resblocks.", *storage);
  if (stored.empty()) {
    log::warn(what, ": frozen_weights ", config.frozen_weights, " changes nothing: no resblock matrix is frozen");
    return;
  }
  auto parameters = model->named_parameters();
  int64_t values = 0;
  for (const auto& name : stored) values += parameters[name].numel();
  if (ema_model) {
    auto validation = ema_model->named_parameters();
    for (const auto& name : stored) validation[name].set_data(parameters[name]);
    ema_model->set_resblock_runner(validation_inner_runner());
  }
  log::info(what, ": the resblocks' ", values, " frozen matrix values are kept in ", config.frozen_weights,
            "; validation runs their blocks in ", config.precision.mode);
}

torch::Tensor PriorTrainer::State::batch_tokens(const std::vector<data::TokenExample>& examples,
                                                bool drop_captions) {
  // One draw per example of the global batch, of which this rank's examples take theirs (the
  // sampler deals the batch's positions out in turn): any number of ranks drops the captions
  // one process would.
  const auto draws = drop_captions ? torch::rand({config.data.batch_size}, caption_dropout) : torch::Tensor();
  std::vector<torch::Tensor> rows;
  for (size_t i = 0; i < examples.size(); ++i) {
    auto text = examples[i].text_tokens;
    const int64_t position = static_cast<int64_t>(i) * job->size() + job->rank();
    if (drop_captions && position < draws.size(0) && draws[position].item<double>() < config.data.caption_dropout) {
      text = models::empty_caption(config.model.text_length)[0];
    }
    rows.push_back(torch::cat({text, examples[i].image_tokens.flatten()}));
  }
  return torch::stack(rows).to(device);
}

PriorStepMetrics PriorTrainer::State::train_step(const torch::Tensor& tokens) {
  PriorStepMetrics metrics;
  metrics.learning_rate = config.learning_rate.at(step, config.run.steps, reductions);
  set_learning_rate(metrics.learning_rate);
  model->train();
  const auto loss = models::prior_loss(model->forward(tokens), tokens, config.model);
  const auto update_result = apply_update(loss.total);
  metrics.skipped = update_result.skipped;
  metrics.grad_norm = update_result.grad_norm;
  ++step;
  metrics.step = step;
  metrics.loss = loss.total.item<double>();
  metrics.text_loss = loss.text.item<double>();
  metrics.image_loss = loss.image.item<double>();
  return metrics;
}

void PriorTrainer::State::log_step() const {
  append_metrics({{"step", last.step},
                  {"loss", last.loss},
                  {"text_loss", last.text_loss},
                  {"image_loss", last.image_loss},
                  {"grad_norm", last.grad_norm},
                  {"learning_rate", last.learning_rate}});
}

void PriorTrainer::run() {
  auto& s = *state_;
  s.measure_retention_start();
  int64_t saved = -1;  // the step checkpointed last: a best one is not written twice
  const auto checkpoint = [&] {
    if (saved == s.step) return;
    s.save_checkpoint();
    saved = s.step;
  };
  detail::run_training_loop(
      s, detail::intervals_of(s.config.run),
      {.update =
           [&] {
             const auto batch = s.loader->next();
             s.last = s.train_step(s.batch_tokens(batch.examples, /*drop_captions=*/true));
             return s.last.loss;
           },
       .log = [&] { s.log_step(); },
       .validate =
           [&] {
             const auto validation = validate();
             if (!std::isnan(validation.loss)) {
               log::info("prior: update ", s.step, " loss ", s.last.loss, " validation loss ", validation.loss,
                         " (text ", validation.text_loss, ", image ", validation.image_loss, ")");
             }
             // By the image loss: the run's model draws images; the caption's loss (weighted
             // text_loss_weight in the total) falls long after the images overfit.
             if (s.config.keep_best && validation.image_loss < s.kept_best) {
               s.kept_best = validation.image_loss;
               checkpoint();
               s.mark_best();
             }
             if (!std::isnan(validation.retention_loss)) {
               log::info("prior: update ", s.step, " retention loss ", validation.retention_loss, " (",
                         validation.forgetting >= 0 ? "+" : "", validation.forgetting, " since the start)");
             }
           },
       .checkpoint = checkpoint});
}

void PriorTrainer::State::update_plateau(double validation_loss) {
  if (validation_loss < best_validation * (1.0 - 1e-4)) {
    best_validation = validation_loss;
    validations_since_best = 0;
    return;
  }
  if (++validations_since_best >= config.learning_rate.plateau_patience &&
      reductions < config.learning_rate.plateau_reductions && step >= config.learning_rate.warmup_steps) {
    ++reductions;
    validations_since_best = 0;
    log::info("prior: validation loss on a plateau; learning rate x", config.learning_rate.plateau_factor);
  }
}

namespace {

// Every rank that holds a part of a sharded model draws (their gathers go together); the
// one that `writes` writes the grid to `path`.
void write_sample_grid(models::Prior& model, const PriorTrainConfig& config, const fs::path& path, bool writes) {
  const auto tokenizer = text::Tokenizer::load(config.tokenizer);
  auto decoder = models::load_image_tokenizer(config.image_tokenizer);
  std::vector<torch::Tensor> captions, tiles;
  std::vector<std::string> labels;
  for (const auto& caption : config.sample_captions) {
    const auto ids = torch::tensor(tokenizer.encode(caption).ids, torch::kInt64);
    for (int64_t i = 0; i < config.samples_per_caption; ++i) {
      captions.push_back(ids);
      labels.push_back(caption);
    }
  }
  const auto tokens = models::sample_image_tokens(model, torch::stack(captions), config.sampling);
  if (!writes) return;
  torch::NoGradGuard no_grad;
  const auto images = decoder.model->decode_tokens(tokens.cpu());
  for (int64_t i = 0; i < images.size(0); ++i) tiles.push_back(images[i]);
  data::write_png(path.string(), data::make_grid(tiles, labels, {.columns = config.samples_per_caption * 2,
                                                                 .tile_size = 128}));
}

}  // namespace

PriorValidation PriorTrainer::State::loss_on(data::TokenDataset& set) {
  auto& average = validation_model();
  average->eval();
  const int64_t count = std::min<int64_t>(static_cast<int64_t>(set.size()), 256);
  double total = 0, text = 0, image = 0;
  int64_t batches = 0;
  for (int64_t begin = 0; begin < count; begin += config.data.batch_size) {
    std::vector<data::TokenExample> examples;
    for (int64_t i = begin; i < std::min(count, begin + config.data.batch_size); ++i) {
      std::mt19937_64 rng(static_cast<uint64_t>(i));
      if (auto example = set.get(static_cast<size_t>(i), rng)) examples.push_back(std::move(*example));
    }
    const auto tokens = batch_tokens(examples, /*drop_captions=*/false);
    const auto loss = models::prior_loss(average->forward(tokens), tokens, config.model);
    total += loss.total.item<double>();
    text += loss.text.item<double>();
    image += loss.image.item<double>();
    ++batches;
  }
  return {.loss = total / batches, .text_loss = text / batches, .image_loss = image / batches};
}

void PriorTrainer::State::measure_retention_start() {
  if (!retention_set || !std::isnan(retention_start) || step != 0) return;
  torch::NoGradGuard no_grad;
  const AverageSwappedIn swapped(*this);
  retention_start = loss_on(*retention_set).loss;
  metrics_log.append({{"step", step}, {"retention_loss", retention_start}, {"forgetting", 0.0}});
  log::info("prior: retention loss ", retention_start, " before the first update (", config.data.retention, ")");
}

PriorValidation PriorTrainer::validate() {
  auto& s = *state_;
  torch::NoGradGuard no_grad;
  const State::AverageSwappedIn swapped(s);
  auto& average = s.validation_model();
  PriorValidation result{std::nan(""), std::nan(""), std::nan("")};
  if (s.validation_set) {
    const auto measured = s.loss_on(*s.validation_set);
    result.loss = measured.loss;
    result.text_loss = measured.text_loss;
    result.image_loss = measured.image_loss;
    s.metrics_log.append({{"step", s.step}, {"validation_loss", result.loss}, {"validation_text_loss", result.text_loss},
                      {"validation_image_loss", result.image_loss}});
    if (s.config.learning_rate.decay == "plateau") s.update_plateau(result.loss);
  }
  if (s.retention_set) {
    result.retention_loss = s.loss_on(*s.retention_set).loss;
    // Resumed from a run that never measured its start (before data.retention was set): no rise.
    if (!std::isnan(s.retention_start)) result.forgetting = result.retention_loss - s.retention_start;
    s.metrics_log.append({{"step", s.step}, {"retention_loss", result.retention_loss},
                          {"forgetting", std::isnan(result.forgetting) ? nlohmann::json(nullptr)
                                                                        : nlohmann::json(result.forgetting)}});
  }
  // Sharded, the first machine's ranks draw together.
  const bool draws = s.shards ? s.job->place().node_rank == 0 : s.writes_files;
  if (draws && !s.config.sample_captions.empty() && !s.config.tokenizer.empty() && !s.config.image_tokenizer.empty()) {
    char name[48];
    std::snprintf(name, sizeof name, "samples/step-%09lld.png", static_cast<long long>(s.step));
    write_sample_grid(average, s.config, s.run / name, s.writes_files);
  }
  return result;
}

void PriorTrainer::State::save_extra(io::Checkpoint& checkpoint) const {
  checkpoint.state.emplace("rng.caption_dropout", caption_dropout.get_state());
  checkpoint.state_metadata.insert({{"best_validation", std::to_string(best_validation)},
                                    {"validations_since_best", std::to_string(validations_since_best)},
                                    {"reductions", std::to_string(reductions)}});
  // The shortest texts that read back the same doubles: a resume reports the same rise, and
  // compares validations with the same best.
  const auto exact = [](double value) {
    char text[32];
    return std::string(text, std::to_chars(text, text + sizeof text, value).ptr);
  };
  if (!std::isnan(retention_start)) checkpoint.state_metadata.emplace("retention_start", exact(retention_start));
  if (std::isfinite(kept_best)) checkpoint.state_metadata.emplace("kept_best", exact(kept_best));
}

void PriorTrainer::State::restore_extra(const io::Checkpoint& checkpoint, const std::string&) {
  caption_dropout.set_state(checkpoint.state.at("rng.caption_dropout"));
  const auto& meta = checkpoint.state_metadata;
  best_validation = std::stod(meta.at("best_validation"));
  validations_since_best = std::stoll(meta.at("validations_since_best"));
  reductions = std::stoll(meta.at("reductions"));
  // Absent from a checkpoint of a run without data.retention: measured never, not again.
  const auto start = meta.find("retention_start");
  retention_start = start == meta.end() ? std::numeric_limits<double>::quiet_NaN() : std::stod(start->second);
  const auto best = meta.find("kept_best");
  kept_best = best == meta.end() ? std::numeric_limits<double>::infinity() : std::stod(best->second);
}

void PriorTrainer::State::mark_best() const {
  if (!writes_files) return;
  checkpoints.mark_best(step);
  log::info("prior: update ", step, " has the best validation image loss yet (", kept_best, "): ",
            checkpoints.directory_for(step), " is the run's model");
}

}  // namespace dalle::train
