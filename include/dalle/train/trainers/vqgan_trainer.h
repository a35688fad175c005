#pragma once
// Trains a VQGAN image tokenizer (taming-transformers' recipe without the perceptual loss):
// an L1 or MSE reconstruction loss on images in [-1, 1], the quantizer's loss (the gumbel
// quantizer's KL to uniform, or the vector quantizer's codebook + commitment terms, with
// restarts of unused codes), and optionally a PatchGAN discriminator with hinge losses from
// a configured update on, its weight balanced adaptively at the decoder's last layer.
// `trainable: decoder` with `init_from` fine-tunes the decoder of a trained VQGAN on the
// tokens its frozen encoder gives (the argmax codes, as at inference): every image keeps its
// tokens, so the token datasets and priors made with them stay valid.
// The run directory, checkpoints, exact resume, EMA, metrics and validation are the dVAE
// trainer's.
#include <cstdint>
#include <memory>
#include <string>

#include "dalle/config.h"
#include "dalle/models/vqgan.h"
#include "dalle/train/trainers/dvae_trainer.h"
#include "dalle/train/precision.h"
#include "dalle/train/recipe.h"
#include "dalle/train/schedule.h"
#include "dalle/train/trainers/tokenizer_validation.h"

namespace dalle::train {

struct DiscriminatorConfig {
  bool enabled = false;
  int64_t start = 10'000;
  double weight = 0.8;
  bool adaptive_weight = true;
  int64_t channels = 64;
  int64_t layers = 3;

  void visit(ConfigVisitor& v) {
    v.field("enabled", enabled, "train a PatchGAN discriminator and add its hinge loss to the generator's");
    v.field("start", start, "update from which the discriminator trains and its loss counts (taming: disc_start)",
            {.min = 0});
    v.field("weight", weight, "weight of the generator's adversarial loss (taming: disc_weight 0.8)", {.min = 0.0});
    v.field("adaptive_weight", adaptive_weight,
            "scale the adversarial loss by |grad reconstruction| / |grad adversarial| at the decoder's last layer");
    v.field("channels", channels, "channels of the discriminator's first conv (taming: 64)", {.min = 1, .max = 4096});
    v.field("layers", layers, "stride-2 convs; images must be at least 3 * 2^layers pixels wide (taming: 3)",
            {.min = 1, .max = 8});
  }
};

struct VqganTrainConfig {
  std::string kind = "vqgan";
  models::VqganConfig model;
  std::string init_from;
  std::string trainable = "all";
  data::ImageDataConfig data;
  std::string reconstruction_loss = "l1";
  CosineSchedule learning_rate{1e-4, 1e-5, 500'000};
  CosineSchedule temperature{0.9, 1e-6, 1'000'001};
  double kl_weight = 1e-8;
  double commitment = 0.25;
  int64_t restart_every = 200;
  DiscriminatorConfig discriminator;
  // taming's Adam: betas 0.5, 0.9, no weight decay; the discriminator's too.
  OptimizerConfig optimizer{.beta1 = 0.5, .beta2 = 0.9, .epsilon = 1e-8, .weight_decay = 0.0, .ema_decay = 0.999,
                            .trainable = {}};
  RunConfig run{.steps = 500'000, .log_every = 100, .validate_every = 1000, .checkpoint_every = 1000};
  PrecisionConfig precision;
  DistributedConfig distributed;
  int64_t grid_images = 8;

  void visit(ConfigVisitor& v);
};

struct VqganStepMetrics {
  int64_t step = 0;  // updates done, this one included
  double loss = 0;            // everything the generator minimised
  double reconstruction = 0;  // L1 or MSE on [-1, 1] images
  double quantizer = 0;       // weighted: kl_weight * KL, or codebook + commitment * commitment term
  double adversarial = 0;     // generator hinge loss (0 before the discriminator starts)
  double adversarial_weight = 0;  // weight * adaptive factor actually applied
  double discriminator = 0;   // discriminator hinge loss
  double temperature = 0, learning_rate = 0;
  int64_t restarted = 0;      // codes restarted at this update
  bool skipped = false;       // non-finite gradients: the generator's weights were left as they were
};

class VqganTrainer {
 public:
  // Creates `run_directory` or resumes the run in it.
  VqganTrainer(VqganTrainConfig config, std::string run_directory);
  ~VqganTrainer();

  // Trains until config.run.steps updates are done, validating and checkpointing on schedule,
  // or until a stop is requested (stop_request.h): then it checkpoints and returns early.
  void run();
  int64_t step() const;
  // PSNR and codebook usage on the validation set, with the EMA weights; writes a grid.
  TokenizerValidation validate();
  models::Vqgan& model();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace dalle::train
