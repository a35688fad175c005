#include "dalle/train/rrdbnet_loader.h"

#include "dalle/config.h"
#include "dalle/model_config.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/state_dict.h"
#include "dalle/train/superres_trainer.h"
#include "run_directory.h"
#include "trainer_support.h"

namespace dalle::train {

models::RrdbNet load_trained_rrdbnet(const std::string& run_or_checkpoint) {
  // An exported checkpoint holds `kind` and `model` only; a training run's the whole recipe.
  const std::string directory = resolve_checkpoint(run_or_checkpoint, "super-resolution");
  const auto checkpoint = io::load_checkpoint(directory);
  const auto config = load_model_config<SuperResTrainConfig>(checkpoint.config_yaml, directory + "/config.yaml");
  const auto ema = detail::with_prefix_removed(checkpoint.state, "ema.");
  models::RrdbNet model(config.model);
  io::load_state_dict(*model, ema.empty() ? checkpoint.weights : ema,
                      directory + (ema.empty() ? "/model.safetensors" : "/state.safetensors (ema.*)"));
  model->eval();
  return model;
}

}  // namespace dalle::train
