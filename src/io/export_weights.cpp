#include "dalle/io/export_weights.h"

#include <filesystem>

#include "dalle/config.h"
#include "dalle/error.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/state_dict.h"

namespace dalle::io {

namespace fs = std::filesystem;

ExportedWeights export_weights(const std::string& run_or_checkpoint, const std::string& out,
                               const std::vector<std::string>& config_overrides) {
  ExportedWeights exported;
  exported.checkpoint = resolve_checkpoint(run_or_checkpoint, "trained model");
  // Only an empty folder or an earlier export may be replaced, never a run or the source.
  if (fs::exists(out) && !fs::is_empty(out) && !fs::exists(fs::path(out) / "model.safetensors")) {
    throw Error(out + ": exists and is not a checkpoint directory; choose another output folder");
  }
  if (fs::exists(out) && fs::equivalent(out, exported.checkpoint)) {
    throw Error(out + ": is the checkpoint being exported; choose another output folder");
  }
  auto checkpoint = load_checkpoint(exported.checkpoint);
  if (!config_overrides.empty()) {
    // The exported config is complete, so a key it lacks is a typo, not an addition.
    auto config = ConfigSource::from_string(checkpoint.config_yaml, exported.checkpoint + "/config.yaml");
    for (const auto& assignment : config_overrides) config.replace(assignment);
    checkpoint.config_yaml = config.yaml();
  }
  auto ema = with_prefix_removed(checkpoint.state, "ema.");
  exported.moving_average = !ema.empty();
  Checkpoint weights_only{std::move(checkpoint.config_yaml),
                              exported.moving_average ? std::move(ema) : std::move(checkpoint.weights), {}, {}};
  exported.tensors = static_cast<int64_t>(weights_only.weights.size());
  save_checkpoint(out, weights_only);
  return exported;
}

}  // namespace dalle::io
