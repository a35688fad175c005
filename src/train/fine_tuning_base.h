#pragma once
// The base a fine-tuning run's checkpoints refer to for its frozen weights
// (TrainerState::refer_to_base): whether a checkpoint holds them as the model does, and the
// copy written when none does. Private to the library.
#include <torch/types.h>

#include <functional>
#include <string>
#include <vector>

#include "dalle/io/safetensors.h"
#include "dalle/io/safetensors_writer.h"

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
// The same for frozen weights never held whole: declared by `specs`, in order, and handed to
// the writer by `write` as they are made; where a copy is there already, `write` runs with no
// writer (what it gathers to make them, every rank gathers).
void write_frozen_copy(const std::string& directory, const std::vector<io::TensorSpec>& specs,
                       const std::function<void(io::SafetensorsWriter*)>& write);

}  // namespace dalle::train
