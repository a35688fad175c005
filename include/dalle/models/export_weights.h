#pragma once
// A trained run's weights for inference only: the checkpoint's moving average of the
// weights (or its weights when it keeps none) as model.safetensors, beside its config.yaml
// and an empty state.safetensors: a third to a quarter of a training checkpoint's size, and
// loadable wherever a run or checkpoint is (dalle-generate, dalle-encode-images, ...). The
// checkpoint is loaded as its kind of model first, so that weights no tool could load are
// refused rather than shipped. The weights can be the mean of a run's newest checkpoints'
// (latest weight averaging, as fairseq's average_checkpoints), which costs nothing at
// inference; whether it beats the last checkpoint is for each run to measure.
#include <cstdint>
#include <string>
#include <vector>

namespace dalle::models {

struct ExportedWeights {
  std::string checkpoint;  // the checkpoint directory that was read (the newest, when averaged)
  std::vector<std::string> averaged;  // every checkpoint directory whose weights were averaged
  bool moving_average = false;  // true when the weights written are the EMA
  int64_t tensors = 0;
  int64_t merged_adapters = 0;  // layers whose adapters were folded into their weights
  bool streamed = false;  // a sharded prior read, checked and written one resblock at a time
};

// Reads `run_or_checkpoint` (a run directory: its best checkpoint when it keeps one, else its
// latest: io::resolve_checkpoint) and writes the
// checkpoint directory `out` atomically; an existing `out` is replaced only once the new
// one is complete. `config_overrides` ("key.path=value") rewrite keys of the exported
// config.yaml, such as the paths a prior names for its tokenizers once they are shipped
// beside it; a key the run's config does not have, or a value of another kind, is refused.
// A run that trained low-rank adapters is written merged: each adapter folded into its
// layer's weight, the config's adapter.rank set to 0. `average_last` > 1 writes the mean of the inference weights of the run's newest
// `average_last` checkpoints (its config, and any integer tensor, are the newest's); a
// checkpoint directory, a run with fewer checkpoints, or checkpoints whose tensors differ in
// name or shape are refused. A sharded run's prior (no base, no adapters; averaged or not) is
// never whole in memory: each resblock is joined from the shards (of each checkpoint averaged,
// and averaged), checked by loading it into its block of a prior built one block at a time,
// written and freed before the next is read.
ExportedWeights export_weights(const std::string& run_or_checkpoint, const std::string& out,
                               const std::vector<std::string>& config_overrides = {}, int64_t average_last = 1);

struct ExportedAdapter {
  std::string checkpoint;  // the checkpoint directory that was read
  std::string base;        // the checkpoint the run started from, as the adapter file names it
  int64_t layers = 0;
};
// The adapters of a fine-tuning run's checkpoint (its best or latest, as above; their moving average), alone, as an
// adapter file (models/adapter.h) `out`, naming the base the run started from.
ExportedAdapter export_adapter(const std::string& run_or_checkpoint, const std::string& out);

}  // namespace dalle::models
