#include "dalle/models/export_weights.h"

#include <filesystem>

#include "dalle/config.h"
#include "dalle/error.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/state_dict.h"
#include "dalle/models/trained.h"

namespace dalle::models {

namespace fs = std::filesystem;

namespace {

// Loads the checkpoint as the model its config describes, as the tools that read the export
// will: a config without sizes, NaN weights, or weights that do not fit the config are
// refused here rather than shipped. The prior's config has no `kind`; OpenAI's imported
// dVAE has none either, but no prior key.
void check_loadable(const std::string& directory, const std::string& config_yaml) {
  const auto kind = peek_choice(ConfigSource::from_string(config_yaml, directory + "/config.yaml"), "kind", "",
                                {"dvae", "vqgan", "clip", "rrdbnet"});
  if (kind == "clip") {
    load_trained_clip(directory);
  } else if (kind == "rrdbnet") {
    load_trained_rrdbnet(directory);
  } else if (kind.empty() && config_yaml.find("text_vocab_size") != std::string::npos) {
    load_trained_prior(directory);
  } else {
    load_image_tokenizer(directory);
  }
}

}  // namespace

ExportedWeights export_weights(const std::string& run_or_checkpoint, const std::string& out,
                               const std::vector<std::string>& config_overrides) {
  ExportedWeights exported;
  exported.checkpoint = io::resolve_checkpoint(run_or_checkpoint, "trained model");
  // Only an empty folder or an earlier export may be replaced, never a run or the source.
  if (fs::exists(out) && !fs::is_empty(out) && !fs::exists(fs::path(out) / "model.safetensors")) {
    throw Error(out + ": exists and is not a checkpoint directory; choose another output folder");
  }
  if (fs::exists(out) && fs::equivalent(out, exported.checkpoint)) {
    throw Error(out + ": is the checkpoint being exported; choose another output folder");
  }
  auto checkpoint = io::load_checkpoint(exported.checkpoint);
  check_loadable(exported.checkpoint, checkpoint.config_yaml);
  if (!config_overrides.empty()) {
    // The exported config is complete, so a key it lacks is a typo, not an addition.
    auto config = ConfigSource::from_string(checkpoint.config_yaml, exported.checkpoint + "/config.yaml");
    for (const auto& assignment : config_overrides) config.replace(assignment);
    checkpoint.config_yaml = config.yaml();
  }
  auto ema = io::with_prefix_removed(checkpoint.state, "ema.");
  exported.moving_average = !ema.empty();
  io::Checkpoint weights_only{std::move(checkpoint.config_yaml),
                              exported.moving_average ? std::move(ema) : std::move(checkpoint.weights), {}, {}};
  exported.tensors = static_cast<int64_t>(weights_only.weights.size());
  io::save_checkpoint(out, weights_only);
  return exported;
}

}  // namespace dalle::models
