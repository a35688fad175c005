#pragma once
// A checkpoint is a directory: config.yaml (the effective config), model.safetensors (the
// weights) and state.safetensors (optimizer moments, RNG states, loader position and
// counters as tensors plus string metadata). Directories are written under a temporary
// name and renamed into place, so a run killed at any moment leaves only complete
// checkpoints behind.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dalle/io/safetensors.h"

namespace dalle::io {

struct Checkpoint {
  std::string config_yaml;
  TensorMap weights;
  TensorMap state;
  Metadata state_metadata;
};

void save_checkpoint(const std::string& directory, const Checkpoint& checkpoint);
Checkpoint load_checkpoint(const std::string& directory);

// The checkpoints of one run: <root>/step-<N>/ directories, a `latest` file naming the
// newest complete one, and pruning to the newest `keep` (0 keeps all).
class CheckpointStore {
 public:
  explicit CheckpointStore(std::string root, int keep = 3);

  // Saves the checkpoint of `step` and returns its directory.
  std::string save(int64_t step, const Checkpoint& checkpoint);
  // The newest complete checkpoint's directory, if any.
  std::optional<std::string> latest() const;
  std::vector<int64_t> steps() const;

 private:
  std::string directory_for(int64_t step) const;
  void prune() const;

  std::string root_;
  int keep_;
};

// A checkpoint directory: `run_or_checkpoint` itself when it holds model.safetensors, else
// the latest checkpoint of the run it names. `what` names the model in the error.
std::string resolve_checkpoint(const std::string& run_or_checkpoint, const std::string& what);

}  // namespace dalle::io
