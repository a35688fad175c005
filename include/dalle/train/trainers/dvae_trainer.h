#pragma once
// Trains OpenAI's dVAE as DALL-E describes it: gumbel-softmax relaxation with a cosine
// temperature schedule, KL against the uniform prior with a cosine-warmed weight, the
// logit-Laplace reconstruction loss, AdamW with a cosine learning rate, and an EMA of the
// weights. A run directory holds the effective config, metrics.jsonl, reconstruction grids
// and checkpoints; a trainer opened on a directory with a checkpoint resumes from it and
// continues exactly as an uninterrupted run would.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dalle/config.h"
#include "dalle/data/caption_dataset.h"
#include "dalle/models/dvae.h"
#include "dalle/train/precision.h"
#include "dalle/train/recipe.h"
#include "dalle/train/schedule.h"
#include "dalle/train/trainers/tokenizer_validation.h"

namespace dalle::train {

struct DvaeTrainConfig {
  std::string kind = "dvae";  // read first by dalle-train-vae to pick the recipe's struct
  models::DvaeConfig model;
  data::ImageDataConfig data;
  CosineSchedule learning_rate{1e-4, 1.25e-6, 1'200'000};
  CosineSchedule temperature{1.0, 1.0 / 16, 150'000};
  CosineSchedule kl_weight{0.0, 6.6, 5'000};
  bool straight_through = false;
  // DALL-E's AdamW: weight decay 1e-4; its EMA decay 0.999.
  OptimizerConfig optimizer{.beta1 = 0.9, .beta2 = 0.999, .epsilon = 1e-8, .weight_decay = 1e-4, .ema_decay = 0.999,
                            .trainable = {}};
  RunConfig run{.steps = 1'200'000, .log_every = 100, .validate_every = 1000, .checkpoint_every = 1000};
  PrecisionConfig precision;
  DistributedConfig distributed;
  int64_t grid_images = 8;
  std::string reconstruction_loss = "logit_laplace";

  void visit(ConfigVisitor& v);
};

struct DvaeStepMetrics {
  int64_t step = 0;  // updates done, this one included
  double loss = 0, reconstruction = 0, kl = 0;
  double temperature = 0, kl_weight = 0, learning_rate = 0;
  bool skipped = false;  // non-finite gradients: the weights were left as they were
};

// PSNR of argmax-decoded reconstructions with the EMA weights, codebook usage.
using DvaeValidation = TokenizerValidation;

class DvaeTrainer {
 public:
  // Creates `run_directory` or resumes the run in it.
  DvaeTrainer(DvaeTrainConfig config, std::string run_directory);
  ~DvaeTrainer();

  // Trains until config.run.steps updates are done, validating and checkpointing on schedule,
  // or until a stop is requested (stop_request.h): then it checkpoints and returns early.
  void run();
  int64_t step() const;
  // PSNR and codebook usage on the validation set, with the EMA weights; writes a grid.
  DvaeValidation validate();
  models::Dvae& model();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace dalle::train
