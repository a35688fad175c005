#pragma once
// Loads a super-resolution network (RRDBNet) from a checkpoint directory, such as one
// written by scripts/export_realesrgan.py from Real-ESRGAN's released weights, or from a
// run directory of dalle-train-sr (its latest checkpoint).
#include <string>

#include "dalle/models/rrdbnet.h"

namespace dalle::train {

// In eval mode, with the EMA weights where the checkpoint has them. The config.yaml's
// `kind` must be rrdbnet (the default) and its `model` section gives the sizes; the
// weights must fit them exactly (a missing, unexpected or misshapen tensor is named).
models::RrdbNet load_trained_rrdbnet(const std::string& run_or_checkpoint);

}  // namespace dalle::train
