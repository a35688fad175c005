#pragma once
// A checkpoint is a directory: config.yaml (the effective config), model.safetensors (the
// weights) and state.safetensors (optimizer moments, RNG states, loader position and
// counters as tensors plus string metadata). Directories are written under a temporary
// name and renamed into place, so a run killed at any moment leaves only complete
// checkpoints behind.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dalle/io/safetensors.h"
#include "dalle/io/safetensors_writer.h"

namespace dalle::io {

// The weights file of a checkpoint (and of an exported model or a classifier directory), and
// the folder of a run directory that holds its checkpoints (CheckpointStore's root).
inline constexpr const char* kWeightsFile = "model.safetensors";
inline constexpr const char* kCheckpointsFolder = "checkpoints";

struct Checkpoint {
  std::string config_yaml;
  TensorMap weights;
  TensorMap state;
  Metadata state_metadata;
};

void save_checkpoint(const std::string& directory, const Checkpoint& checkpoint);
// A checkpoint of weights alone (its state empty) whose weights, declared by `weights` in the
// order they come, are handed to the writer by `write` as they are made: a model too large to
// hold whole is saved one part at a time. The directory appears only once it is complete.
void save_checkpoint(const std::string& directory, const std::string& config_yaml,
                     const std::vector<TensorSpec>& weights, const std::function<void(SafetensorsWriter&)>& write);
// A checkpoint, whole: one written in shards (io/sharded_checkpoint.h) comes back as if
// written by one process, and one that refers to a base (below) with the base's weights filled
// in.
Checkpoint load_checkpoint(const std::string& directory);

// What inference reads of a checkpoint: its weights, with their moving average where it keeps
// one (the average may cover only the trained part of a fine-tuned model).
TensorMap inference_weights(const Checkpoint& checkpoint);
// load_checkpoint(directory), but of a sharded checkpoint only the shards inference_weights
// reads (its moving average, or its weights where it keeps none) are joined, never its
// moments or PowerSGD state: what a model, an export, a fine-tuning run's base or init_from
// reads. Not a checkpoint to resume from.
Checkpoint load_inference_checkpoint(const std::string& directory);

// A fine-tuning run's checkpoint need not hold the weights it never trained: it may refer to
// the checkpoint it started from (its base), whose inference weights fill every name its own
// weights lack when it is loaded. The reference is the base's directory (absolute) and a
// fingerprint of its weights file (size and sampled bytes), so that a base replaced or
// changed since is refused, not silently used.
void refer_to_base(Checkpoint& checkpoint, const std::string& base_directory);
// The base a checkpoint refers to, or "".
std::string base_of(const Checkpoint& checkpoint);
// The config a checkpoint was written with (its config.yaml), read alone.
std::string checkpoint_config(const std::string& directory);

// The checkpoints of one run: <root>/step-<N>/ directories, a `latest` file naming the
// newest complete one, a `best` file naming the one a run chose (its best validation), and
// pruning to the newest `keep` (0 keeps all) and the best.
class CheckpointStore {
 public:
  explicit CheckpointStore(std::string root, int keep = 3);

  // Saves the checkpoint of `step` and returns its directory.
  std::string save(int64_t step, const Checkpoint& checkpoint);
  // A checkpoint written by several ranks: the folder they write the checkpoint of `step`
  // into, made empty by rank 0 (staging) before they write; once all have written, rank 0
  // renames it into place (publish) and returns its directory. A job killed in between
  // leaves only the staging folder, which the next staging removes.
  std::string staging_for(int64_t step) const;
  void stage(int64_t step) const;
  std::string publish(int64_t step);
  // The newest complete checkpoint's directory, if any.
  std::optional<std::string> latest() const;
  // Names `step`'s checkpoint, already written, the run's best: kept by pruning, and what
  // resolve_checkpoint reads of the run.
  void mark_best(int64_t step) const;
  std::optional<std::string> best() const;
  std::vector<int64_t> steps() const;
  // The directory of `step`'s checkpoint (one of steps()).
  std::string directory_for(int64_t step) const;

 private:
  // `latest` names `directory`, and the old steps are pruned.
  void make_latest(const std::string& directory) const;
  void prune() const;

  std::string root_;
  int keep_;
};

// A checkpoint directory: `run_or_checkpoint` itself when it holds model.safetensors, else
// the best checkpoint of the run it names when one is marked, else its latest. `what` names
// the model in the error.
std::string resolve_checkpoint(const std::string& run_or_checkpoint, const std::string& what);

}  // namespace dalle::io
