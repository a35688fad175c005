#pragma once
// Trains a super-resolution RRDBNet as Real-ESRNet, the first stage of Real-ESRGAN's
// recipe: (low-res, high-res) pairs made on the fly from an image dataset by a seeded
// degradation (blur, downscale, noise, JPEG; data/degradation.h), an L1 loss between the
// network's output and the high-resolution image (no perceptual or adversarial loss: that
// is the second, Real-ESRGAN stage), Adam(W) with a cosine learning rate and an EMA of the
// weights. Validation compares the EMA network's PSNR on held-out images with bicubic
// upscaling of the same low-res inputs and writes (low-res | ours | original) grids. The
// run directory, checkpoints and exact resume are the other trainers'.
#include <cstdint>
#include <memory>
#include <string>

#include "dalle/config.h"
#include "dalle/data/degradation.h"
#include "dalle/models/rrdbnet.h"
#include "dalle/train/trainers/dvae_trainer.h"
#include "dalle/train/precision.h"
#include "dalle/train/recipe.h"
#include "dalle/train/schedule.h"

namespace dalle::train {

struct SuperResTrainConfig {
  std::string kind = "rrdbnet";  // what load_trained_rrdbnet checks in a checkpoint
  models::RrdbNetConfig model;
  data::ImageDataConfig data;  // image_size: the high-resolution crop side
  data::DegradationConfig degradation;
  CosineSchedule learning_rate{2e-4, 2e-6, 1'000'000};
  // Real-ESRNet's Adam: betas 0.9, 0.99, no weight decay; its EMA decay 0.999.
  OptimizerConfig optimizer{.beta1 = 0.9, .beta2 = 0.99, .epsilon = 1e-8, .weight_decay = 0.0, .ema_decay = 0.999,
                            .trainable = {}};
  RunConfig run{.steps = 1'000'000, .log_every = 100, .validate_every = 5000, .checkpoint_every = 5000};
  PrecisionConfig precision;
  DistributedConfig distributed;
  int64_t validation_images = 64;
  int64_t grid_images = 8;

  void visit(ConfigVisitor& v);
  // Throws when the values are inconsistent with each other (image size and scale).
  void validate() const;
};

struct SuperResStepMetrics {
  int64_t step = 0;  // updates done, this one included
  double loss = 0;   // L1 between output and high-res image, in [0, 1] pixel units
  double learning_rate = 0;
  bool skipped = false;  // non-finite gradients (fp16): the weights were left as they were
};

struct SuperResValidation {
  double psnr = 0;          // dB, the EMA network's output against the original
  double bicubic_psnr = 0;  // dB, bicubic upscaling of the same low-res inputs
  int64_t images = 0;
};

// Which examples of a global batch a rank holds: every ranks-th, from its rank on.
struct BatchShare {
  int64_t rank = 0, ranks = 1;
};

class SuperResTrainer {
 public:
  // Creates `run_directory` or resumes the run in it.
  SuperResTrainer(SuperResTrainConfig config, std::string run_directory);
  ~SuperResTrainer();

  // Trains until config.run.steps updates are done, validating and checkpointing on schedule,
  // or until a stop is requested (stop_request.h): then it checkpoints and returns early.
  void run();
  int64_t step() const;
  // PSNR of the EMA network and of bicubic upscaling on the validation images; writes a
  // grid and a metrics line.
  SuperResValidation validate();
  models::RrdbNet& model();

  // The (low-res, high-res) pair of high-res images [B, C, S, S] for update `step`: each
  // image degraded with a generator seeded by (seed, step, index in the global batch), so
  // that any number of ranks degrades an image as one process does.
  static torch::Tensor degrade_batch(const torch::Tensor& high, const SuperResTrainConfig& config, int64_t step,
                                     BatchShare share = {});

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace dalle::train
