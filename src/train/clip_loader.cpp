#include "dalle/train/clip_loader.h"

#include "dalle/config.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/state_dict.h"
#include "run_directory.h"
#include "trainer_support.h"

namespace dalle::train {
namespace {

// What an exported checkpoint's config.yaml holds.
struct ClipCheckpointConfig {
  std::string kind = "clip";
  models::ClipConfig model;

  void visit(ConfigVisitor& v) {
    v.field("kind", kind, "what the checkpoint holds", {.choices = {"clip"}});
    v.section("model", "CLIP's sizes", model);
  }
};

}  // namespace

models::Clip load_trained_clip(const std::string& run_or_checkpoint) {
  const std::string directory = resolve_checkpoint(run_or_checkpoint, "CLIP");
  const auto checkpoint = io::load_checkpoint(directory);
  const auto config = load_config<ClipCheckpointConfig>(
      ConfigSource::from_string(checkpoint.config_yaml, directory + "/config.yaml"));
  const auto ema = detail::with_prefix_removed(checkpoint.state, "ema.");
  models::Clip model(config.model);
  io::load_state_dict(*model, ema.empty() ? checkpoint.weights : ema, directory + "/model.safetensors");
  model->eval();
  return model;
}

}  // namespace dalle::train
