#pragma once
// A module's parameters and buffers by their dotted names, as PyTorch's state_dict().
#include <torch/nn/module.h>

#include <string>
#include <unordered_set>

#include "dalle/io/safetensors.h"

namespace dalle::io {

TensorMap state_dict(const torch::nn::Module& module);

// Copies `tensors` into the module's parameters and buffers. Every name must match and every
// shape agree: a missing, unexpected or misshapen tensor is refused by name, and nothing is
// copied unless everything matches. Dtypes are converted to the module's.
// `filled_elsewhere`: the module's names the caller restores itself (a sharded model's
// resblocks), neither looked for in `tensors` nor refused there.
void load_state_dict(torch::nn::Module& module, const TensorMap& tensors, const std::string& source = "weights",
                     const std::unordered_set<std::string>& filled_elsewhere = {});

// The tensors of `tensors` whose name starts with `prefix`, the prefix removed: a part of a
// checkpoint's state, such as its moving average ("ema.").
TensorMap with_prefix_removed(const TensorMap& tensors, const std::string& prefix);

}  // namespace dalle::io
