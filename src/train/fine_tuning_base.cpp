#include "train/fine_tuning_base.h"

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include "dalle/io/checkpoint.h"
#include "dalle/io/sharded_checkpoint.h"

namespace dalle::train {

namespace {

const char* const kFrozenCopyConfig =
    "# The frozen weights of this run's init_from, under the model's names: the base its checkpoints\n"
    "# refer to (docs/fine-tuning.md).\n";

bool copy_exists(const std::string& directory) {
  return std::filesystem::exists(std::filesystem::path(directory) / io::kWeightsFile);
}

// The name up to and with its first part that is a number ("resblocks.3." of
// "resblocks.3.attn.qkv.weight"), or "" where none is.
std::string block_of(const std::string& name) {
  size_t start = 0;
  while (start < name.size()) {
    const size_t dot = name.find('.', start);
    const size_t end = dot == std::string::npos ? name.size() : dot;
    const bool index = end > start && std::all_of(name.begin() + static_cast<std::ptrdiff_t>(start),
                                                  name.begin() + static_cast<std::ptrdiff_t>(end),
                                                  [](char c) { return c >= '0' && c <= '9'; });
    if (index) return name.substr(0, end + 1);
    start = end + 1;
  }
  return "";
}

const torch::Tensor* found_in(const io::TensorMap& tensors, const std::string& name) {
  const auto found = tensors.find(name);
  return found == tensors.end() ? nullptr : &found->second;
}

}  // namespace

bool holds_as_they_are(const std::string& base, const NamedTensors& ours, const std::vector<std::string>& frozen,
                       const ValuesAsRead& as_read) {
  io::ShardedWeights unread;
  const auto whole = io::inference_weights(io::load_inference_checkpoint(base, unread));
  std::map<std::string, std::set<std::string>> blocks;
  for (const auto& name : frozen) blocks[block_of(name)].insert(name);
  for (const auto& [block, names] : blocks) {
    const auto in_block = [&names = names](const std::string& name) { return names.count(name) > 0; };
    const auto theirs = unread.empty() ? io::TensorMap{} : unread.read(in_block);
    const auto read = as_read ? as_read(in_block) : io::TensorMap{};
    for (const auto& name : names) {
      const auto* joined = found_in(theirs, name);
      const auto* stored = joined ? joined : found_in(whole, name);
      const auto* given = found_in(read, name);
      const auto& value = given ? *given : ours[name];
      if (!stored || stored->sizes() != value.sizes() ||
          !torch::equal(stored->to(value.device(), value.scalar_type()), value)) {
        return false;
      }
    }
  }
  return true;
}

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
