#pragma once
// Fine-tunes DALL-E Mega / Mini's BART prior (models/bart_prior.h) on a token dataset, or
// trains one from random weights: the captions' text, encoded again with min-dalle's BART
// tokenizer, goes through the encoder; the decoder reads each image's tokens after the
// start code (codes - 1) and is trained, teacher-forced, to predict the next one with
// cross-entropy. Captions are replaced by the empty caption (<s> </s>) with probability
// `caption_dropout`, so that super-conditioned sampling keeps its unconditioned half. The
// rest is every trainer's: AdamW, a cosine learning rate, clipping, an EMA of the weights,
// fp32 / bf16 / fp16 (one loss scale), data parallelism, a run directory with metrics and
// checkpoints that resumes exactly. The tokens must come from the VQGAN whose codes the
// detokenizer decodes (Mega's: 16 x 16 of 16384).
#include <cstdint>
#include <memory>
#include <string>

#include "dalle/config.h"
#include "dalle/models/bart_prior.h"
#include "dalle/train/precision.h"
#include "dalle/train/recipe.h"
#include "dalle/train/schedule.h"
#include "dalle/train/trainers/prior_trainer.h"

namespace dalle::train {

struct BartPriorTrainConfig {
  std::string kind = "bart_prior";  // read first by dalle-train to pick the recipe's struct
  std::string init;       // a bart_prior checkpoint to start from; empty: random weights
  std::string tokenizer;  // folder with min-dalle's vocab.json and merges.txt
  models::BartPriorConfig model;
  PriorDataConfig data;
  CosineSchedule learning_rate{1e-5, 1e-6, 10'000};
  OptimizerConfig optimizer{.beta1 = 0.9, .beta2 = 0.999, .epsilon = 1e-8, .weight_decay = 0.0, .grad_clip = 1.0,
                            .ema_decay = 0.999, .trainable = {}};
  RunConfig run{.steps = 10'000, .log_every = 100, .validate_every = 1000, .checkpoint_every = 1000};
  PrecisionConfig precision;
  DistributedConfig distributed;
  models::AdapterConfig adapter;  // low-rank adapters, trained with the rest frozen

  void visit(ConfigVisitor& v);
};

struct BartPriorStepMetrics {
  int64_t step = 0;
  double loss = 0, grad_norm = 0, learning_rate = 0;
  bool skipped = false;  // non-finite gradients: the weights were left as they were
};

struct BartPriorValidation {
  double loss = 0;  // EMA weights, the first 256 validation captions; NaN without a validation set
};

class BartPriorTrainer {
 public:
  // Creates `run_directory` (from `init`'s weights, if given) or resumes the run in it.
  BartPriorTrainer(BartPriorTrainConfig config, std::string run_directory);
  ~BartPriorTrainer();

  // Trains until config.run.steps updates are done, validating and checkpointing on schedule,
  // or until a stop is requested (stop_request.h): then it checkpoints and returns early.
  void run();
  int64_t step() const;
  BartPriorStepMetrics last_metrics() const;
  BartPriorValidation validate();
  models::BartPrior& model();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace dalle::train
