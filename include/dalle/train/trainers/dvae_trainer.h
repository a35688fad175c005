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
#include "dalle/models/dvae.h"
#include "dalle/train/precision.h"
#include "dalle/train/schedule.h"
#include "dalle/train/tokenizer_validation.h"

namespace dalle::train {

// Image datasets and batching: the same keys for every image-tokenizer trainer.
struct ImageDataConfig {
  std::string train;       // image-caption dataset folder
  std::string validation;  // held-out images for PSNR and reconstruction grids
  int64_t image_size = 256;
  int64_t batch_size = 8;
  int64_t workers = 2;
  bool random_crop = false;

  void visit(ConfigVisitor& v) {
    v.field("train", train, "image-caption dataset folder to train on (required)");
    v.field("validation", validation, "dataset folder of held-out images for PSNR and grids (required)");
    v.field("image_size", image_size, "images are resized and cropped to this square side", {.min = 8, .max = 4096});
    v.field("batch_size", batch_size, "images per update", {.min = 1, .max = 1 << 16});
    v.field("workers", workers, "loader threads (0: load on the training thread)", {.min = 0, .max = 64});
    v.field("random_crop", random_crop, "crop at random places instead of the centre");
  }
};

using DvaeDataConfig = ImageDataConfig;

struct DvaeTrainConfig {
  std::string kind = "dvae";  // read first by dalle-train-vae to pick the recipe's struct
  models::DvaeConfig model;
  DvaeDataConfig data;
  CosineSchedule learning_rate{1e-4, 1.25e-6, 1'200'000};
  CosineSchedule temperature{1.0, 1.0 / 16, 150'000};
  CosineSchedule kl_weight{0.0, 6.6, 5'000};
  bool straight_through = false;
  double beta1 = 0.9, beta2 = 0.999, epsilon = 1e-8, weight_decay = 1e-4;
  double ema_decay = 0.999;
  PrecisionConfig precision;
  int64_t steps = 1'200'000;
  int64_t log_every = 100;
  int64_t validate_every = 1000;
  int64_t checkpoint_every = 1000;
  int64_t keep_checkpoints = 3;
  int64_t grid_images = 8;
  std::string reconstruction_loss = "logit_laplace";
  int64_t seed = 0;
  int64_t threads = 0;
  std::string device = "auto";

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

  // Trains until config.steps updates are done, validating and checkpointing on schedule,
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

// A trained dVAE from a run directory (its latest checkpoint) or a checkpoint directory:
// the EMA weights, as DALL-E evaluates and tokenizes with them, and the image side it was
// trained at.
struct TrainedDvae {
  models::Dvae model{nullptr};
  int64_t image_size = 0;
};
TrainedDvae load_trained_dvae(const std::string& run_or_checkpoint);

}  // namespace dalle::train
