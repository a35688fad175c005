#include "dalle/models/trained.h"

#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <unordered_set>
#include <vector>

#include "dalle/config.h"
#include "dalle/error.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/state_dict.h"
#include "dalle/model_config.h"
#include "dalle/models/adapter.h"
#include "dalle/models/rudalle_import.h"

namespace dalle::models {

namespace {

// A checkpoint with the parts of its config.yaml a loader reads.
struct CheckpointConfig {
  std::string directory;
  io::Checkpoint checkpoint;
  ConfigSource source;
};

// `unread`: where a sharded checkpoint may leave its shards unread (else they are joined).
CheckpointConfig open_checkpoint(const std::string& run_or_checkpoint, const std::string& what,
                                 io::ShardedWeights* unread = nullptr) {
  auto directory = io::resolve_checkpoint(run_or_checkpoint, what);
  auto checkpoint =
      unread ? io::load_inference_checkpoint(directory, *unread) : io::load_inference_checkpoint(directory);
  auto source = ConfigSource::from_string(checkpoint.config_yaml, directory + "/config.yaml");
  return {std::move(directory), std::move(checkpoint), std::move(source)};
}

// Binds `kind` (one allowed value, also its default), the `model` section and `extra`.
template <class ModelConfig>
ModelConfig read_model_config(const ConfigSource& source, const std::string& kind,
                              const ConfigVisit& extra = nullptr) {
  std::string read_kind = kind;
  ModelConfig model;
  bind_config_parts(
      source,
      [&](ConfigVisitor& v) {
        v.field("kind", read_kind, "", {.choices = {kind}});
        v.section("model", "", model);
        if (extra) extra(v);
      },
      {"model"});
  require_model_sizes<ModelConfig>(source);
  model.validate();
  return model;
}

// Where a checkpoint's inference weights come from, for errors.
std::string weights_source(const CheckpointConfig& opened) {
  const bool averaged = !io::with_prefix_removed(opened.checkpoint.state, "ema.").empty();
  return opened.directory + "/" + io::kWeightsFile + (averaged ? " with the moving average of state.safetensors" : "");
}

// The checkpoint's inference weights (its moving average where it keeps one) into `module`.
void load_weights(torch::nn::Module& module, const io::TensorMap& weights, const std::string& source) {
  io::load_state_dict(module, weights, source);
  module.eval();
}
void load_weights(torch::nn::Module& module, const CheckpointConfig& opened) {
  load_weights(module, io::inference_weights(opened.checkpoint), weights_source(opened));
}

// A model of `kind` whose config.yaml describes it by its `model` section alone.
template <class Model, class ModelConfig>
Model load_model(const std::string& run_or_checkpoint, const std::string& what, const std::string& kind) {
  const auto opened = open_checkpoint(run_or_checkpoint, what);
  Model model(read_model_config<ModelConfig>(opened.source, kind));
  load_weights(*model, opened);
  return model;
}

// Tensors created in its scope default to `dtype`: a module built there has its parameters in it.
class DefaultDtype {
 public:
  explicit DefaultDtype(torch::ScalarType dtype) : previous_(torch::get_default_dtype()) {
    torch::set_default_dtype(c10::scalarTypeToTypeMeta(dtype));
  }
  ~DefaultDtype() { torch::set_default_dtype(previous_); }
  DefaultDtype(const DefaultDtype&) = delete;
  DefaultDtype& operator=(const DefaultDtype&) = delete;

 private:
  caffe2::TypeMeta previous_;
};

void check_weight_dtype(torch::ScalarType dtype, const std::string& what) {
  if (dtype != torch::kFloat32 && dtype != torch::kBFloat16 && dtype != torch::kFloat16) {
    throw Error(what + ": weights in " + c10::toString(dtype) + "; expected float32, bfloat16 or float16");
  }
}

// A prior checkpoint opened, its config.yaml read into `trained` (the model section of
// `kind`, the tokenizers it names) and the adapters it trained, if any.
struct PriorOpened {
  CheckpointConfig opened;
  AdapterConfig adapter;
};

template <class Trained>
PriorOpened open_prior(const std::string& run_or_checkpoint, const std::string& what, const std::string& kind,
                       Trained& trained, io::ShardedWeights* unread = nullptr) {
  PriorOpened prior{open_checkpoint(run_or_checkpoint, what, unread), {}};
  trained.config = read_model_config<decltype(trained.config)>(prior.opened.source, kind, [&](ConfigVisitor& v) {
    v.field("tokenizer", trained.tokenizer, "");
    v.field("image_tokenizer", trained.image_tokenizer, "");
    v.section("adapter", "", prior.adapter);
  });
  trained.checkpoint = prior.opened.directory;
  return prior;
}

// A run that trained adapters: they are folded into the layers they adapt.
io::TensorMap with_adapters_folded(io::TensorMap weights, const PriorOpened& prior) {
  const auto adapters = adapter_tensors(weights);
  if (adapters.empty()) return weights;
  const auto& directory = prior.opened.directory;
  return merge_adapter_tensors(std::move(weights), adapters, prior.adapter.scale_of_adapters_in(directory), 1.0,
                               directory);
}

// ruDALL-E's released weights keep its own names (scripts/export_rudalle_prior.py).
io::TensorMap with_dalle_names(const io::TensorMap& weights, const PriorConfig& config) {
  return weights.count("text_embeddings.weight") > 0 ? import_rudalle_state(weights, config) : weights;
}

// A prior of `kind`, its sizes and the tokenizers it names read from config.yaml, built in
// `dtype`; `adapt` renames or completes the checkpoint's weights for the built model.
template <class Trained>
Trained load_prior(const std::string& run_or_checkpoint, torch::ScalarType dtype, const std::string& what,
                   const std::string& kind,
                   const std::function<io::TensorMap(const io::TensorMap&, Trained&)>& adapt) {
  check_weight_dtype(dtype, what);
  Trained trained;
  const auto prior = open_prior(run_or_checkpoint, what, kind, trained);
  {
    const DefaultDtype building(dtype);
    trained.model = decltype(trained.model)(trained.config);
  }
  const auto weights = with_adapters_folded(adapt(io::inference_weights(prior.opened.checkpoint), trained), prior);
  load_weights(*trained.model, weights, weights_source(prior.opened));
  return trained;
}

int64_t trained_image_size(const ConfigSource& source) {
  return peek_integer(source, "data.image_size", 256, {.min = 8, .max = 4096});
}

}  // namespace

TrainedDvae load_trained_dvae(const std::string& run_or_checkpoint) {
  const auto opened = open_checkpoint(run_or_checkpoint, "dVAE");
  TrainedDvae trained{Dvae(read_model_config<DvaeConfig>(opened.source, "dvae")), trained_image_size(opened.source)};
  load_weights(*trained.model, opened);
  return trained;
}

TrainedVqgan load_trained_vqgan(const std::string& run_or_checkpoint) {
  const auto opened = open_checkpoint(run_or_checkpoint, "VQGAN");
  TrainedVqgan trained{Vqgan(read_model_config<VqganConfig>(opened.source, "vqgan")),
                       trained_image_size(opened.source)};
  load_weights(*trained.model, opened);
  return trained;
}

TrainedImageTokenizer load_image_tokenizer(const std::string& run_or_checkpoint) {
  const std::string directory = io::resolve_checkpoint(run_or_checkpoint, "dVAE or VQGAN");
  const auto kind = peek_choice(ConfigSource::from_file(directory + "/config.yaml"), "kind", "dvae", {"dvae", "vqgan"});
  if (kind == "vqgan") {
    auto trained = load_trained_vqgan(directory);
    return {kind, trained.model.ptr(), trained.image_size};
  }
  auto trained = load_trained_dvae(directory);
  return {kind, trained.model.ptr(), trained.image_size};
}

torch::Tensor round_trip(TrainedImageTokenizer& tokenizer, const torch::Tensor& images) {
  if (images.dim() != 4 || images.size(2) != tokenizer.image_size || images.size(3) != tokenizer.image_size) {
    throw Error("round trip through a " + tokenizer.kind + ": expected [B, C, " + std::to_string(tokenizer.image_size) +
                ", " + std::to_string(tokenizer.image_size) + "] images, got " + c10::str(images.sizes()));
  }
  torch::NoGradGuard no_grad;
  return tokenizer.model->decode_tokens(tokenizer.model->encode_tokens(images)).clamp(0, 1);
}

namespace {

// A sharded checkpoint's shards (and a sharded base's) stay unread where its weights need no
// renaming and its adapters are whole. A run's adapters are kept apart, checked against the
// weights they adapt, and folded as those are read.
TrainedPriorWeights read_prior_weights(const std::string& run_or_checkpoint, TrainedPrior& trained) {
  io::ShardedWeights unread;
  const auto prior = open_prior(run_or_checkpoint, "prior", "prior", trained, &unread);
  auto weights = io::inference_weights(prior.opened.checkpoint);
  const bool moving_average =
      !io::with_prefix_removed(prior.opened.checkpoint.state, "ema.").empty() || unread.moving_average();
  const auto unread_names = unread.names();
  if (weights.count("text_embeddings.weight") ||
      std::any_of(unread_names.begin(), unread_names.end(), is_adapter_tensor)) {
    weights.merge(unread.read([](const std::string&) { return true; }));
    unread = {};
  }
  weights = with_dalle_names(weights, trained.config);
  TrainedPriorWeights read{trained.config, {}, std::move(unread), weights_source(prior.opened), {}, 0.0,
                           moving_average};
  read.adapters = adapter_tensors(weights);
  if (!read.adapters.empty()) {
    read.adapter_scale = prior.adapter.scale_of_adapters_in(prior.opened.directory);
    weights = without_adapter_tensors(weights);
    const std::unordered_set<std::string> in_shards(unread_names.begin(), unread_names.end());
    for (const auto& [name, tensor] : read.adapters) {
      if (!weights.count(adapted_weight(name)) && !in_shards.count(adapted_weight(name))) {
        throw Error(prior.opened.directory + ": the model has no linear layer " + adapted_weight(name) +
                    " for adapter " + name);
      }
    }
  }
  read.weights = std::move(weights);
  return read;
}

}  // namespace

// Built one block at a time: a sharded run's prior is joined block by block into the model,
// never whole beside it.
TrainedPrior load_trained_prior(const std::string& run_or_checkpoint, torch::ScalarType dtype) {
  check_weight_dtype(dtype, "prior");
  TrainedPrior trained;
  const auto weights = read_prior_weights(run_or_checkpoint, trained);
  const DefaultDtype building(dtype);
  trained.model = build_trained_prior(trained.config, weights);
  return trained;
}

TrainedPriorWeights read_trained_prior_weights(const std::string& run_or_checkpoint) {
  TrainedPrior trained;  // its config and names only: the model is never built
  return read_prior_weights(run_or_checkpoint, trained);
}

namespace {

// Weights copied into the model: the pages of a mapped file they were read from leave the
// process's memory (read again from the file if they are read again).
void release_read(const io::TensorMap& read) {
  for (const auto& [name, tensor] : read) io::release_pages(tensor);
}

}  // namespace

Prior build_trained_prior(const PriorConfig& config, const TrainedPriorWeights& weights, const ResblockBuilt& built) {
  return build_trained_prior(config, [&weights](const WeightPicker& wanted) { return weights.read(wanted); },
                             weights.source, built);
}

Prior build_trained_prior(const PriorConfig& config, const WeightReader& read_weights, const std::string& source,
                          const ResblockBuilt& built) {
  std::unordered_set<std::string> in_blocks;
  Prior prior(config, [&](size_t b, ResblockImpl& block) {
    const std::string prefix = "resblocks." + std::to_string(b) + ".";
    const auto read = read_weights([&prefix](const std::string& name) { return name.starts_with(prefix); });
    io::load_state_dict(block, io::with_prefix_removed(read, prefix), source + ", " + prefix);
    release_read(read);
    for (const auto& [name, value] : io::state_dict(block)) in_blocks.insert(prefix + name);
    if (built) built(b, block);
  });
  const auto read = read_weights([&in_blocks](const std::string& name) { return in_blocks.count(name) == 0; });
  io::load_state_dict(*prior, read, source, in_blocks);
  release_read(read);
  prior->eval();
  return prior;
}

io::TensorMap TrainedPriorWeights::read(const WeightPicker& wanted) const {
  auto picked = unread.read(wanted);
  for (const auto& [name, tensor] : weights) {
    if (wanted(name)) picked.emplace(name, tensor);
  }
  if (adapters.empty()) return picked;
  io::TensorMap adapting_picked;
  for (const auto& [name, tensor] : adapters) {
    if (picked.count(adapted_weight(name))) adapting_picked.emplace(name, tensor);
  }
  return merge_adapter_tensors(std::move(picked), adapting_picked, adapter_scale, 1.0, source);
}

std::string prior_kind(const std::string& run_or_checkpoint) {
  const std::string directory = io::resolve_checkpoint(run_or_checkpoint, "prior");
  return peek_choice(ConfigSource::from_file(directory + "/config.yaml"), "kind", "prior", {"prior", "bart_prior"});
}

TrainedBartPrior load_trained_bart_prior(const std::string& run_or_checkpoint, torch::ScalarType dtype) {
  return load_prior<TrainedBartPrior>(run_or_checkpoint, dtype, "BART prior", "bart_prior",
                                      [](const io::TensorMap& weights, TrainedBartPrior& trained) {
                                        // min-dalle's released files lack some LayerNorm gains,
                                        // which its own load leaves at one.
                                        return with_unit_layer_norm_gains(weights, *trained.model);
                                      });
}

VqganDetokenizer load_trained_detokenizer(const std::string& run_or_checkpoint) {
  return load_model<VqganDetokenizer, VqganConfig>(run_or_checkpoint, "VQGAN detokenizer", "vqgan_detokenizer");
}

Clip load_trained_clip(const std::string& run_or_checkpoint) {
  return load_model<Clip, ClipConfig>(run_or_checkpoint, "CLIP", "clip");
}

RrdbNet load_trained_rrdbnet(const std::string& run_or_checkpoint) {
  return load_model<RrdbNet, RrdbNetConfig>(run_or_checkpoint, "super-resolution", "rrdbnet");
}

}  // namespace dalle::models
