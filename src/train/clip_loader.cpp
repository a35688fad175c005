#include "dalle/train/clip_loader.h"

#include "dalle/config.h"
#include "dalle/model_config.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/state_dict.h"
#include "dalle/train/clip_trainer.h"
#include "run_directory.h"
#include "trainer_support.h"

namespace dalle::train {

models::Clip load_trained_clip(const std::string& run_or_checkpoint) {
  const std::string directory = resolve_checkpoint(run_or_checkpoint, "CLIP");
  const auto checkpoint = io::load_checkpoint(directory);
  const auto config = load_model_config<ClipTrainConfig>(checkpoint.config_yaml, directory + "/config.yaml");
  const auto ema = detail::with_prefix_removed(checkpoint.state, "ema.");
  models::Clip model(config.model);
  if (ema.empty()) io::load_state_dict(*model, checkpoint.weights, directory + "/model.safetensors");
  else io::load_state_dict(*model, ema, directory + "/state.safetensors (ema.*)");
  model->eval();
  return model;
}

}  // namespace dalle::train
