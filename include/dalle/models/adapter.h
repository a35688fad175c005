#pragma once
// Low-rank adapters (LoRA, Hu et al. 2021) on a model's linear layers, for fine-tuning a
// released model with its weights frozen: each adapted models::Linear adds
// (alpha / rank) * B A x, and only A and B train. An adapter file is a safetensors file of
// those tensors under the layers' names ("resblocks.3.qkv.lora_A.weight", peft's
// convention) with its rank, alpha and base model in the metadata; inference folds it into
// the base weights (W += weight * (alpha / rank) * B A), so that an adapted model samples
// as fast as the base.
#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dalle/config.h"
#include "dalle/io/safetensors.h"

namespace dalle::models {

struct AdapterConfig {
  int64_t rank = 0;  // 0: no adapters
  double alpha = 16;
  std::vector<std::string> targets;  // module-name globs; empty: every linear layer

  void visit(ConfigVisitor& v);
  bool enabled() const { return rank > 0; }
  double scale() const { return alpha / static_cast<double>(rank); }
  // scale(), for the checkpoint `where` whose weights hold adapters: refused unless this, its
  // config's adapter section, names their rank.
  double scale_of_adapters_in(const std::string& where) const;
};

// Adds an adapter to every models::Linear of `model` whose module name matches one of
// config.targets (fnmatch globs, `*` crossing dots), in `type` (by default its layer's weight's:
// training passes float32, as a layer cut into shards keeps only an empty weight). Returns the
// adapted layers' names; throws for a pattern that matches no linear layer.
std::vector<std::string> add_adapters(torch::nn::Module& model, const AdapterConfig& config,
                                      std::optional<torch::ScalarType> type = std::nullopt);
// Folds every adapter of `model` into its layer's weight and removes it.
void merge_adapters(torch::nn::Module& model);

bool is_adapter_tensor(const std::string& name);
// The weight an adapter tensor's pair folds into ("<layer>.weight").
std::string adapted_weight(const std::string& adapter_tensor);
// The adapter tensors of a state dict, and the rest.
io::TensorMap adapter_tensors(const io::TensorMap& weights);
io::TensorMap without_adapter_tensors(const io::TensorMap& weights);

struct AdapterFile {
  io::TensorMap tensors;  // "<layer>.lora_A.weight" [rank, in], "<layer>.lora_B.weight" [out, rank]
  int64_t rank = 0;
  double alpha = 0;
  std::string base;    // the checkpoint the adapter was trained on, as the run named it
  std::string family;  // "prior" or "bart_prior"
  double scale() const { return alpha / static_cast<double>(rank); }
};
// Written atomically; `tensors` may hold other names, of which only the adapters' are kept.
void save_adapter_file(const std::string& path, const io::TensorMap& tensors, const AdapterConfig& config,
                       const std::string& base, const std::string& family);
// Refuses a file that is no adapter, holds a layer without its pair or pairs whose ranks differ.
AdapterFile load_adapter_file(const std::string& path);

// `weights` with each adapter pair folded into its layer's weight, times `weight`:
// W += weight * scale * B A (computed in float32, rounded once to W's dtype); the adapter
// tensors are gone from the result. Throws naming a layer `weights` lacks or shapes that differ.
io::TensorMap merge_adapter_tensors(io::TensorMap weights, const io::TensorMap& adapter, double scale,
                                    double weight = 1.0, const std::string& source = "adapter");
// The same into a built model's weights (a base already loaded).
void apply_adapter(torch::nn::Module& model, const AdapterFile& adapter, double weight);

// "FILE" or "FILE:WEIGHT" (weight 1 by default), as --adapter takes it.
struct WeightedAdapter {
  std::string path;
  double weight = 1.0;
};
WeightedAdapter parse_weighted_adapter(const std::string& spec);

// "NAME=FILE", an adapter a request may choose by name (dalle-serve's --adapter); NAME is 1 to
// 64 of letters, digits, '-', '_' and '.'.
struct NamedAdapter {
  std::string name;
  std::string path;
};
NamedAdapter parse_named_adapter(const std::string& spec);

}  // namespace dalle::models
