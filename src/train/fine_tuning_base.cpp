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

namespace {

const char* const kFrozenCopyConfig =
    "# The frozen weights of this run's init_from, under the model's names: the base its checkpoints\n"
    "# refer to (docs/fine-tuning.md).\n";

bool copy_exists(const std::string& directory) {
  return std::filesystem::exists(std::filesystem::path(directory) / io::kWeightsFile);
}

}  // namespace

void write_frozen_copy(const std::string& directory, const NamedTensors& ours, const std::vector<std::string>& frozen,
                       const io::TensorMap& released) {
  if (copy_exists(directory)) return;
  io::Checkpoint copy;
  copy.config_yaml = kFrozenCopyConfig;
  for (const auto& name : frozen) {
    const auto found = released.find(name);
    copy.weights.emplace(name, (found != released.end() ? found->second : ours[name]).detach().cpu());
  }
  io::save_checkpoint(directory, copy);
}

void write_frozen_copy(const std::string& directory, const std::vector<io::TensorSpec>& specs,
                       const std::function<void(io::SafetensorsWriter*)>& write) {
  if (copy_exists(directory)) return write(nullptr);
  io::save_checkpoint(directory, kFrozenCopyConfig, specs, [&write](io::SafetensorsWriter& writer) { write(&writer); });
}

}  // namespace dalle::train
