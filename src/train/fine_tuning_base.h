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

// The values of the weights `wanted` picks by name, as a model read them where it holds them
// no longer whole (a sharded build's blocks, adapters folded in); those it does not give, the
// model holds.
using ValuesAsRead = std::function<io::TensorMap(const std::function<bool(const std::string&)>& wanted)>;
// Whether the checkpoint `base` holds each of `frozen` under its name with the value `ours`
// holds, or `as_read` gives. Compared one block at a time (the names up to their first index,
// "resblocks.3."): `as_read` is asked for one block's values at a time, and a sharded base's
// blocks are joined one at a time, so that neither is ever held whole.
bool holds_as_they_are(const std::string& base, const NamedTensors& ours, const std::vector<std::string>& frozen,
                       const ValuesAsRead& as_read = nullptr);
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
