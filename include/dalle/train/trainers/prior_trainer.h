#pragma once
// Trains the transformer prior on a token dataset (from dalle-encode-images) as DALL-E
// describes it: AdamW (0.9, 0.96, eps 1e-8, weight decay 4.5e-2 on the matrices), linear
// warmup then a cosine decay or halving on plateau, gradient clipping at norm 4, an EMA of
// the weights, and caption dropout so that the same model is also unconditional (for
// classifier-free guidance). A run directory holds the effective config, metrics.jsonl,
// sample grids from fixed validation captions and checkpoints; reopening it resumes
// exactly where it stopped.
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "dalle/config.h"
#include "dalle/models/adapter.h"
#include "dalle/models/prior.h"
#include "dalle/models/prior_sampling.h"
#include "dalle/train/gradient_scaler.h"
#include "dalle/train/precision.h"
#include "dalle/train/recipe.h"

namespace dalle::train {

struct PriorDataConfig {
  std::string train;       // token dataset folder
  std::string validation;  // token dataset folder for the validation loss ("" -> none)
  std::string retention;   // token dataset of what the model knew before this run ("" -> none)
  int64_t batch_size = 16;
  int64_t workers = 2;
  double caption_dropout = 0.1;

  void visit(ConfigVisitor& v) {
    v.field("train", train, "token dataset folder to train on, from dalle-encode-images (required)");
    v.field("validation", validation, "token dataset folder for the validation loss (empty: none)");
    v.field("retention", retention,
            "fine-tuning: a token dataset of what the model knew before this run (held-out images of its own "
            "training data): its loss is measured before the first update and at each validation, as "
            "retention_loss and forgetting (its rise since the start) in metrics.jsonl (empty: none)");
    v.field("batch_size", batch_size, "captioned images per update", {.min = 1, .max = 1 << 16});
    v.field("workers", workers, "loader threads (0: load on the training thread)", {.min = 0, .max = 64});
    v.field("caption_dropout", caption_dropout,
            "probability of training an example on the empty caption, which classifier-free guidance needs",
            {.min = 0.0, .max = 1.0});
  }
};

// Linear warmup to `peak`, then either half a cosine down to `end` at the last update, or
// `peak` multiplied by `plateau_factor` whenever the validation loss has not improved for
// `plateau_patience` validations (at most `plateau_reductions` times).
struct PriorLearningRate {
  double peak = 4.5e-4;
  int64_t warmup_steps = 5000;
  std::string decay = "plateau";
  double end = 0.0;
  double plateau_factor = 0.5;
  int64_t plateau_patience = 3;
  int64_t plateau_reductions = 5;

  void visit(ConfigVisitor& v);
  double at(int64_t step, int64_t total_steps, int64_t reductions) const;
};

struct PriorTrainConfig {
  models::PriorConfig model;
  std::string init_from;  // prior run or checkpoint whose weights start the run ("" -> random)
  PriorDataConfig data;
  PriorLearningRate learning_rate;
  // DALL-E's AdamW: betas 0.9, 0.96, weight decay 4.5e-2 on the weight matrices only
  // (gains, biases and embeddings have none), the global norm clipped at 4.
  OptimizerConfig optimizer{
      .beta1 = 0.9, .beta2 = 0.96, .epsilon = 1e-8, .weight_decay = 4.5e-2, .grad_clip = 4.0, .ema_decay = 0.99,
      .trainable = {}};
  RunConfig run{.steps = 430'000, .log_every = 100, .validate_every = 1000, .checkpoint_every = 1000};
  PrecisionConfig precision;
  DistributedConfig distributed;
  models::AdapterConfig adapter;  // low-rank adapters, trained with the rest frozen
  int64_t checkpoint_activations_every = 0;  // resblocks 0, k, 2k, ... recompute in backward; 0: none
  std::string checkpointed_inputs = "float32";  // storage of the inputs checkpointed resblocks keep
  std::string frozen_weights = "float32";  // storage of the resblocks' frozen matrices: float32, bfloat16 or float16
  std::string tokenizer;        // caption tokenizer model, for the sample grids
  std::string image_tokenizer;  // dVAE or VQGAN run that made the tokens, for the sample grids
  // Keep the checkpoint of the best validation image loss beside the latest ones; loading the run as a
  // model (generation, export, init_from) reads it.
  bool keep_best = false;
  std::vector<std::string> sample_captions;
  int64_t samples_per_caption = 2;
  models::SamplingOptions sampling;

  void visit(ConfigVisitor& v);
  // The type checkpointed resblocks keep their inputs in (checkpointed_inputs); 16 bits need a
  // 16-bit precision.mode, as the trainer and the planner (`who`) both require: throws Error.
  torch::ScalarType checkpointed_inputs_type(const std::string& who) const;
};

// Whether a run's model section may set `key` (as flatten_config names it) apart from its
// init_from's: only training reads it (dropout, text_loss_weight), the weights mean the same.
bool only_training_reads(const std::string& model_key);

struct PriorStepMetrics {
  int64_t step = 0;
  double loss = 0, text_loss = 0, image_loss = 0, grad_norm = 0, learning_rate = 0;
  bool skipped = false;  // non-finite gradients: the weights were left as they were
};

struct PriorValidation {
  double loss = 0, text_loss = 0, image_loss = 0;  // EMA weights; NaN without a validation set
  // On data.retention (NaN without it): the loss, and its rise since before the first update.
  double retention_loss = std::numeric_limits<double>::quiet_NaN();
  double forgetting = std::numeric_limits<double>::quiet_NaN();
};

class PriorTrainer {
 public:
  PriorTrainer(PriorTrainConfig config, std::string run_directory);
  ~PriorTrainer();

  // Trains until config.run.steps updates are done, validating and checkpointing on schedule,
  // or until a stop is requested (stop_request.h): then it checkpoints and returns early.
  void run();
  int64_t step() const;
  PriorStepMetrics last_metrics() const;
  // Validation loss (EMA weights) and, when the config names a tokenizer and an image
  // tokenizer, a grid of samples for the sample captions.
  PriorValidation validate();
  models::Prior& model();
  // fp16 only (else null): the per-resblock gradient scales.
  const GradientScaler* gradient_scaler() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace dalle::train
