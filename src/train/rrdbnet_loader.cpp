#include "dalle/train/rrdbnet_loader.h"

#include "dalle/config.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/state_dict.h"
#include "run_directory.h"
#include "trainer_support.h"

namespace dalle::train {

namespace {

// What an exported checkpoint's config.yaml holds.
struct RrdbNetCheckpointConfig {
  std::string kind = "rrdbnet";
  models::RrdbNetConfig model;

  void visit(ConfigVisitor& v) {
    v.field("kind", kind, "the network the checkpoint holds", {.choices = {"rrdbnet"}});
    v.section("model", "RRDBNet sizes (basicsr's argument names)", model);
  }
};

}  // namespace

models::RrdbNet load_trained_rrdbnet(const std::string& run_or_checkpoint) {
  const std::string directory = resolve_checkpoint(run_or_checkpoint, "super-resolution");
  const auto checkpoint = io::load_checkpoint(directory);
  const auto config = load_config<RrdbNetCheckpointConfig>(
      ConfigSource::from_string(checkpoint.config_yaml, directory + "/config.yaml"));
  const auto ema = detail::with_prefix_removed(checkpoint.state, "ema.");
  models::RrdbNet model(config.model);
  io::load_state_dict(*model, ema.empty() ? checkpoint.weights : ema,
                      directory + (ema.empty() ? "/model.safetensors" : "/state.safetensors (ema.*)"));
  model->eval();
  return model;
}

}  // namespace dalle::train
