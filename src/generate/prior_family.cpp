#include "generate/prior_family.h"

#include <filesystem>

#include "dalle/device.h"
#include "dalle/io/checkpoint.h"
#include "dalle/log.h"
#include "dalle/models/adapter.h"
#include "dalle/models/linear.h"
#include "dalle/models/trained.h"

namespace dalle::generate {

// The families, by the `kind` their checkpoints' configs give (models::prior_kind); each is
// defined in its own file. A new family adds its file and one line here.
std::unique_ptr<PriorFamily> load_transformer_family(PipelineConfig& config, torch::Device device);
std::unique_ptr<PriorFamily> load_mega_family(PipelineConfig& config, torch::Device device);

namespace {

struct Registered {
  const char* kind;
  std::unique_ptr<PriorFamily> (*load)(PipelineConfig&, torch::Device);
};

const Registered kFamilies[] = {
    {"prior", load_transformer_family},
    {"bart_prior", load_mega_family},
};

}  // namespace

torch::ScalarType prior_load_type(const PipelineConfig& config) {
  return config.dtype == "int8" ? torch::kFloat32 : float_type_named(config.dtype);
}

models::AdapterFile load_adapter_for(const std::string& path, const PipelineConfig& config, const std::string& family) {
  auto adapter = models::load_adapter_file(path);
  if (!adapter.family.empty() && adapter.family != family) {
    throw Error("pipeline: the adapter " + path + " was trained on a " + adapter.family + ", the prior " +
                config.prior + " is a " + family);
  }
  std::error_code ignored;
  const auto ours = std::filesystem::weakly_canonical(io::resolve_checkpoint(config.prior, "prior"), ignored);
  if (!adapter.base.empty() && std::filesystem::weakly_canonical(adapter.base, ignored) != ours) {
    // The base's path is where it was trained, often on another machine: compared, never opened.
    log::warn("pipeline: the adapter ", path, " was trained on ", adapter.base, ", not on ", config.prior,
              "; it is folded in all the same (a copy of the base under another path is fine, another model is not)");
  }
  return adapter;
}

void apply_adapters(torch::nn::Module& prior, const PipelineConfig& config, const std::string& family) {
  for (const auto& spec : config.adapters) {
    const auto weighted = models::parse_weighted_adapter(spec);
    const auto adapter = load_adapter_for(weighted.path, config, family);
    models::apply_adapter(prior, adapter, weighted.weight);
    log::info("pipeline: adapter ", weighted.path, " (rank ", adapter.rank, ", ", adapter.tensors.size() / 2,
              " layers) folded into the prior with weight ", weighted.weight);
  }
}

void quantize_if_int8(torch::nn::Module& prior, const PipelineConfig& config) {
  if (config.dtype != "int8") return;
  const auto layers = models::quantize_linears_int8(prior);
  log::info("pipeline: the prior's ", layers, " linear layers hold int8 weights");
}

std::unique_ptr<PriorFamily> load_prior_family(PipelineConfig& config, torch::Device device) {
  const auto kind = models::prior_kind(config.prior);
  for (const auto& family : kFamilies) {
    if (kind == family.kind) return family.load(config, device);
  }
  // Another kind (a dVAE's run given as the prior, say) is refused by the transformer's loader,
  // which names what it found.
  return load_transformer_family(config, device);
}

}  // namespace dalle::generate
