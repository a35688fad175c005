#include "train/fine_tuning_base.h"

#include <torch/torch.h>

#include <filesystem>

#include "dalle/io/checkpoint.h"

namespace dalle::train {

bool holds_as_they_are(const io::TensorMap& weights, const NamedTensors& ours, const std::vector<std::string>& frozen,
                       const io::TensorMap& cut) {
  for (const auto& name : frozen) {
    const auto found = weights.find(name);
    const auto was_cut = cut.find(name);
    const auto& value = was_cut != cut.end() ? was_cut->second : ours[name];
    if (found == weights.end() || found->second.sizes() != value.sizes() ||
        !torch::equal(found->second.to(value.device(), value.scalar_type()), value)) {
      return false;
    }
  }
  return true;
}

void write_frozen_copy(const std::string& directory, const NamedTensors& ours, const std::vector<std::string>& frozen,
                       const io::TensorMap& released) {
  if (std::filesystem::exists(std::filesystem::path(directory) / io::kWeightsFile)) return;
  io::Checkpoint copy;
  copy.config_yaml = "# The frozen weights of this run's init_from, under the model's names: the base its checkpoints\n"
                     "# refer to (docs/fine-tuning.md).\n";
  for (const auto& name : frozen) {
    const auto found = released.find(name);
    copy.weights.emplace(name, (found != released.end() ? found->second : ours[name]).detach().cpu());
  }
  io::save_checkpoint(directory, copy);
}

}  // namespace dalle::train
