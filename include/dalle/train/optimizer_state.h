#pragma once
// AdamW's per-parameter state as named tensors, so that it goes into a checkpoint beside the
// weights and comes back onto the right parameters: "<param>.exp_avg", "<param>.exp_avg_sq",
// "<param>.step".
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

#include "dalle/io/safetensors.h"

namespace dalle::train {

io::TensorMap adamw_state(torch::optim::AdamW& optimizer, const torch::nn::Module& module);
void load_adamw_state(torch::optim::AdamW& optimizer, const torch::nn::Module& module, const io::TensorMap& state);

}  // namespace dalle::train
