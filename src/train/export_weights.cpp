#include "dalle/train/export_weights.h"

#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <sstream>

#include "dalle/error.h"
#include "dalle/io/checkpoint.h"
#include "run_directory.h"
#include "trainer_support.h"

namespace dalle::train {

namespace fs = std::filesystem;

namespace {

// Rewrites existing keys only: the exported config is complete, so a key it lacks is a typo.
std::string overridden_config(const std::string& yaml, const std::string& checkpoint,
                              const std::vector<std::string>& overrides) {
  if (overrides.empty()) return yaml;
  YAML::Node root = YAML::Load(yaml);
  for (const auto& assignment : overrides) {
    const auto equals = assignment.find('=');
    if (equals == std::string::npos) throw Error("--set " + assignment + ": expected key.path=value");
    const auto key = assignment.substr(0, equals);
    std::vector<YAML::Node> path{root};
    std::stringstream parts(key);
    for (std::string part; std::getline(parts, part, '.');) {
      if (!path.back().IsMap() || !path.back()[part]) {
        throw Error("--set " + assignment + ": " + checkpoint + "/config.yaml has no key '" + key + "'");
      }
      path.push_back(path.back()[part]);
    }
    path.back() = YAML::Load(assignment.substr(equals + 1));
  }
  YAML::Emitter out;
  out << root;
  return std::string(out.c_str()) + "\n";
}

}  // namespace

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
  auto checkpoint = io::load_checkpoint(exported.checkpoint);
  checkpoint.config_yaml = overridden_config(checkpoint.config_yaml, exported.checkpoint, config_overrides);
  auto ema = detail::with_prefix_removed(checkpoint.state, "ema.");
  exported.moving_average = !ema.empty();
  io::Checkpoint weights_only{std::move(checkpoint.config_yaml),
                              exported.moving_average ? std::move(ema) : std::move(checkpoint.weights), {}, {}};
  exported.tensors = static_cast<int64_t>(weights_only.weights.size());
  io::save_checkpoint(out, weights_only);
  return exported;
}

}  // namespace dalle::train
