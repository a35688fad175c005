#pragma once
// ruDALL-E Malevich's prior weights under this project's names (docs/prior.md lists them).
#include "dalle/io/safetensors.h"
#include "dalle/models/prior_config.h"

namespace dalle::models {

// ruDALL-E's state dict (its own names, from scripts/export_rudalle_prior.py) renamed to
// this model's; its unused last text position row and its mask buffers are dropped.
io::TensorMap import_rudalle_state(const io::TensorMap& rudalle, const PriorConfig& config);

}  // namespace dalle::models
