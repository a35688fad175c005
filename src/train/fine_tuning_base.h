#pragma once
// The base a fine-tuning run's checkpoints refer to for its frozen weights
// (TrainerState::refer_to_base): whether a checkpoint holds them as the model does, and the
// copy written when none does. Private to the library.
#include <torch/types.h>

#include <string>
#include <vector>

#include "dalle/io/safetensors.h"

namespace dalle::train {

using NamedTensors = torch::OrderedDict<std::string, torch::Tensor>;

// Whether `weights` holds each of `frozen` under its name with the value `ours` holds, or,
// for those `ours` no longer holds whole (a sharded build's blocks), the value `cut` holds.
bool holds_as_they_are(const io::TensorMap& weights, const NamedTensors& ours, const std::vector<std::string>& frozen,
                       const io::TensorMap& cut = {});
// Writes the `frozen` weights as `ours` holds them (or, for those it does not hold whole, as
// `released` does) as the checkpoint `directory`, unless one is there.
void write_frozen_copy(const std::string& directory, const NamedTensors& ours, const std::vector<std::string>& frozen,
                       const io::TensorMap& released);

}  // namespace dalle::train
