#pragma once
// Trained and exported models, loaded from a checkpoint directory (config.yaml,
// model.safetensors, state.safetensors) or from a run directory (its latest checkpoint).
// The weights are the moving average when the checkpoint keeps one (the weights otherwise),
// and every model comes back in eval mode on the CPU.
//
// A loader reads only what describes the model in config.yaml: its `kind`, its `model`
// section (required: a model's config names its sizes) and the few keys named below. The
// rest of a training recipe is the trainer's, so recipes may change without orphaning the
// models trained by them, and an exported folder (scripts/export_*.py) needs nothing more.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <torch/types.h>

#include "dalle/io/sharded_checkpoint.h"
#include "dalle/models/bart_prior.h"
#include "dalle/models/clip.h"
#include "dalle/models/dvae.h"
#include "dalle/models/image_tokenizer.h"
#include "dalle/models/prior.h"
#include "dalle/models/rrdbnet.h"
#include "dalle/models/vqgan.h"
#include "dalle/models/vqgan_detokenizer.h"

namespace dalle::models {

// The image tokenizers also read `data.image_size`, the side they were trained at (256 when
// absent, the trainers' default).
struct TrainedDvae {
  Dvae model{nullptr};
  int64_t image_size = 0;
};
TrainedDvae load_trained_dvae(const std::string& run_or_checkpoint);

struct TrainedVqgan {
  Vqgan model{nullptr};
  int64_t image_size = 0;
};
TrainedVqgan load_trained_vqgan(const std::string& run_or_checkpoint);

// Either kind, as its `kind` says (`dvae` when absent).
struct TrainedImageTokenizer {
  std::string kind;  // "dvae" or "vqgan"
  std::shared_ptr<ImageTokenizer> model;
  int64_t image_size = 0;
  int64_t grid_size() const { return image_size / model->downsampling_factor(); }
};
TrainedImageTokenizer load_image_tokenizer(const std::string& run_or_checkpoint);

// [B, C, S, S] images in [0, 1], S the tokenizer's image_size -> the same images encoded to
// tokens and decoded again, clamped to [0, 1]: what a perfect prior drawing through this
// tokenizer could show. Without gradients; on the images' device.
torch::Tensor round_trip(TrainedImageTokenizer& tokenizer, const torch::Tensor& images);

// The prior also reads the `tokenizer` and `image_tokenizer` it was trained with, which
// generation uses unless told otherwise.
template <class Model, class Config>
struct TrainedPriorOf {
  Model model{nullptr};
  Config config;
  std::string tokenizer;        // caption tokenizer
  std::string image_tokenizer;  // the image decoder's run or checkpoint
  std::string checkpoint;       // the directory read
};
using TrainedPrior = TrainedPriorOf<Prior, PriorConfig>;
// `dtype` (float32, bfloat16 or float16) is the weights' type in memory. The model is built
// in it, so a 16-bit prior never holds a float32 copy of its weights; the checkpoint's
// tensors are views of its mapped file (io::read_safetensors), read once into the model. Building sets torch's default dtype for a moment:
// load models from one thread at a time.
TrainedPrior load_trained_prior(const std::string& run_or_checkpoint, torch::ScalarType dtype = torch::kFloat32);

// Picks weights by their state-dict name.
using WeightPicker = std::function<bool(const std::string&)>;

// A trained prior's inference weights by state-dict name (its moving average where it keeps
// one, ruDALL-E's names imported, a run's adapters folded in as read) and its model section,
// without building the model: views of the mapped weights file. A sharded checkpoint's shards
// (and a sharded base's, beneath a fine-tuning run's) are joined only as they are read, one
// group at a time, and a run's adapters are folded into
// the weights they adapt only as those are read: what a prior built one block at a time
// copies into each block, never holding the model twice.
struct TrainedPriorWeights {
  PriorConfig config;
  io::TensorMap weights;       // what was read whole (without the adapters)
  io::ShardedWeights unread;   // a sharded checkpoint's own parameters (as stored), joined when read
  std::string source;  // where the weights came from, for errors
  io::TensorMap adapters;      // a run's adapters, folded into the weights they adapt as those are read
  double adapter_scale = 0;    // alpha / rank
  bool moving_average = false;  // the weights are the checkpoint's moving average
  // The weights `wanted` picks by name, adapters folded in.
  io::TensorMap read(const WeightPicker& wanted) const;
};
TrainedPriorWeights read_trained_prior_weights(const std::string& run_or_checkpoint);

// A prior of `config` holding `weights`, each resblock filled as soon as it is built (a sharded
// checkpoint's groups joined one block at a time) and then handed to `built`, which may take
// its values and empty it; the embeddings and head are filled last. A missing, unexpected,
// misshapen or non-finite weight is refused by name (io::load_state_dict). The pages of a
// mapped file each block was copied from are released once it is filled. Built in torch's
// default dtype, in eval mode: the prior plus one block's values read, never the prior twice.
Prior build_trained_prior(const PriorConfig& config, const TrainedPriorWeights& weights,
                          const ResblockBuilt& built = nullptr);
// The same from any reader of weights by name (the mean of several checkpoints', read as the
// blocks are built); `source` names them in errors.
using WeightReader = std::function<io::TensorMap(const WeightPicker& wanted)>;
Prior build_trained_prior(const PriorConfig& config, const WeightReader& read, const std::string& source,
                          const ResblockBuilt& built = nullptr);

// Which prior a run or checkpoint holds, as its `kind` says: "prior" (the sparse
// transformer, also when `kind` is absent) or "bart_prior" (DALL-E Mega / Mini).
std::string prior_kind(const std::string& run_or_checkpoint);

// DALL-E Mega / Mini's encoder-decoder prior (kind bart_prior; scripts/import-model mega
// writes one from min-dalle's files). It also reads its `tokenizer`, a folder holding
// vocab.json and merges.txt, and its `image_tokenizer`, the detokenizer's checkpoint.
// `dtype` as for load_trained_prior.
using TrainedBartPrior = TrainedPriorOf<BartPrior, BartPriorConfig>;
TrainedBartPrior load_trained_bart_prior(const std::string& run_or_checkpoint,
                                         torch::ScalarType dtype = torch::kFloat32);

// min-dalle's VQGAN detokenizer (kind vqgan_detokenizer): a decoder without an encoder.
VqganDetokenizer load_trained_detokenizer(const std::string& run_or_checkpoint);

Clip load_trained_clip(const std::string& run_or_checkpoint);
RrdbNet load_trained_rrdbnet(const std::string& run_or_checkpoint);

}  // namespace dalle::models
