#pragma once
// The named adapters of a pipeline (PipelineConfig::named_adapters), folded into its prior for
// each group of requests that chooses them. The prior's weights the adapters touch are kept as
// loaded (the base) in host memory; a switch rebuilds each touched weight from its base there,
// folding the chosen adapters in order with models::merge_adapter_tensors, as a pipeline with
// those files in `adapters` folds them at load, and copies it into the prior in place. So a
// request's images are those of that pipeline bit for bit, and a CUDA graph captured on the
// prior's weights reads the folded ones.
#include <torch/nn/module.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dalle/generate/pipeline.h"
#include "dalle/io/safetensors.h"
#include "dalle/models/adapter.h"

namespace dalle::generate {

class AdapterSwitch {
 public:
  // Loads `named` and keeps the weights of `prior` (a `family` prior, loaded with `config`)
  // they touch; throws naming an adapter that does not fit the prior.
  AdapterSwitch(torch::nn::Module& prior, const std::vector<models::NamedAdapter>& named, const PipelineConfig& config,
                const std::string& family);

  // The prior's weights become the base with `choices` folded in, in order; nothing happens
  // when those are folded already.
  void use(const std::vector<AdapterChoice>& choices);

 private:
  // The weights `choices` touch, by name.
  std::vector<std::string> touched(const std::vector<AdapterChoice>& choices) const;

  std::map<std::string, models::AdapterFile> adapters_;  // by name
  io::TensorMap base_;                                   // touched weights as loaded, on the CPU
  io::TensorMap live_;                                   // the same weights in the prior
  std::optional<std::vector<AdapterChoice>> folded_;     // none: unknown (a switch failed mid-way)
};

}  // namespace dalle::generate
