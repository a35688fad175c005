#pragma once
// What io/checkpoint.cpp and io/sharded_checkpoint.cpp share: the files of a checkpoint
// directory, a fine-tuned checkpoint's base, and the joining of a sharded checkpoint's shards.
// Private to the library.
#include <functional>
#include <string>
#include <vector>

#include "dalle/io/checkpoint.h"
#include "dalle/io/safetensors_writer.h"
#include "dalle/io/sharded_checkpoint.h"

namespace dalle::io::detail {

// config.yaml, model.safetensors and state.safetensors (with its metadata) into `folder`;
// `streamed`: weights after the checkpoint's own, declared by their specs and handed to the
// writer by `write` as they are made.
void write_files(const std::string& folder, const Checkpoint& checkpoint, const std::vector<TensorSpec>& streamed = {},
                 const std::function<void(SafetensorsWriter&)>& write = nullptr);
// Those three files of `directory` (a sharded checkpoint's rank 0 files), the shards left where
// they are.
Checkpoint read_files(const std::string& directory);
// The base's inference weights into every name `checkpoint` lacks (refer_to_base). `unread`:
// where a sharded base may leave its shards' parameters unread (else they are joined).
void fill_from_base(Checkpoint& checkpoint, const std::string& directory, ShardedWeights* unread = nullptr);
// A checkpoint written in shards (its state metadata holds the layout): the shards of
// `directory` joined into `checkpoint`'s weights and state where the layout says, the layout
// taken out of the metadata. Another checkpoint is left as it is. `inference_only`: of the
// shards only what inference_weights reads (the moving average, or the weights where the
// checkpoint keeps none).
void join_shards(const std::string& directory, Checkpoint& checkpoint, bool inference_only = false);

}  // namespace dalle::io::detail
