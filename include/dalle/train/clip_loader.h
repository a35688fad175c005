#pragma once
// Loads a CLIP model from a checkpoint directory (config.yaml with `kind: clip` and a
// `model:` section, model.safetensors, state.safetensors), such as the one
// scripts/export_open_clip.py writes from an open_clip model, or from a run directory
// (its latest checkpoint). The config is read as a ClipTrainConfig: an exported one holds
// only `kind` and `model`.
#include <string>

#include "dalle/models/clip.h"

namespace dalle::train {

// The EMA weights when the checkpoint has them; the model is in eval mode.
models::Clip load_trained_clip(const std::string& run_or_checkpoint);

}  // namespace dalle::train
