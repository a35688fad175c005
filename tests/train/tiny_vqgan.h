#pragma once
// The smallest VQGAN the trainer tests train: 16x16 images to 8x8 tokens from 32 codes,
// in seconds on a CPU. Shared by the VQGAN tests and by tests that need an image tokenizer.
#include <string>

#include "dalle/train/trainers/vqgan_trainer.h"
#include "trainer_harness.h"

namespace dalle::testing {

inline train::VqganTrainConfig tiny_vqgan_config(const std::string& train, const std::string& validation,
                                                 int64_t steps, const std::string& quantizer = "gumbel") {
  train::VqganTrainConfig config;
  config.model.ch = 8;
  config.model.ch_mult = {1, 2};
  config.model.num_res_blocks = 1;
  config.model.attn_resolutions = {8};
  config.model.z_channels = 8;
  config.model.embed_dim = 8;
  config.model.n_embed = 32;
  config.model.resolution = 16;
  config.model.norm_groups = 4;
  config.model.quantizer = quantizer;
  config.data.train = train;
  config.data.validation = validation;
  config.data.image_size = 16;
  config.data.batch_size = 8;
  config.learning_rate = {.start = 3e-3, .end = 3e-3, .steps = 0};
  config.temperature = {.start = 1.0, .end = 0.5, .steps = 20};
  config.kl_weight = 1e-3;
  config.optimizer.beta1 = 0.9;
  config.optimizer.beta2 = 0.99;
  config.run = quick_run(steps);
  config.grid_images = 2;
  config.optimizer.ema_decay = 0.8;
  return config;
}

}  // namespace dalle::testing
