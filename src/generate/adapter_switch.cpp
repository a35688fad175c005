#include "generate/adapter_switch.h"

#include <torch/torch.h>

#include <set>
#include <utility>

#include "dalle/error.h"
#include "dalle/log.h"
#include "generate/prior_family.h"

namespace dalle::generate {

namespace {

constexpr std::string_view kDown = ".lora_A.weight";

// The weights of `prior`'s layers, by name ("resblocks.0.qkv.weight").
io::TensorMap layer_weights(torch::nn::Module& prior) {
  io::TensorMap weights;
  for (const auto& item : prior.named_parameters()) {
    if (item.key().ends_with(".weight")) weights.emplace(item.key(), item.value());
  }
  return weights;
}

// The weights `adapter` changes, by name.
std::vector<std::string> weights_changed_by(const models::AdapterFile& adapter) {
  std::vector<std::string> names;
  for (const auto& [name, tensor] : adapter.tensors) {
    if (name.ends_with(kDown)) names.push_back(name.substr(0, name.size() - kDown.size()) + ".weight");
  }
  return names;
}

}  // namespace

AdapterSwitch::AdapterSwitch(torch::nn::Module& prior, const std::vector<models::NamedAdapter>& named,
                             const PipelineConfig& config, const std::string& family) {
  const auto weights = layer_weights(prior);
  torch::NoGradGuard no_grad;
  for (const auto& [name, path] : named) {
    const auto where = "pipeline: named adapter " + name + " (" + path + ")";
    auto adapter = load_adapter_for(path, config, family);
    io::TensorMap base;
    for (const auto& weight : weights_changed_by(adapter)) {
      const auto found = weights.find(weight);
      if (found == weights.end()) throw Error(where + ": the prior has no layer weight " + weight);
      if (!base_.contains(weight)) {
        const auto& live = found->second;
        base_.emplace(weight, live.detach().to(live.options().device(torch::kCPU), /*non_blocking=*/false,
                                               /*copy=*/true));
      }
      live_.emplace(weight, found->second);
      base.emplace(weight, base_.at(weight));
    }
    // Folded once here, so that an adapter whose shapes do not fit fails the start, not a request.
    models::merge_adapter_tensors(std::move(base), adapter.tensors, adapter.scale(), 1.0, where);
    log::info("pipeline: named adapter ", name, " (", path, ", rank ", adapter.rank, ", ", adapter.tensors.size() / 2,
              " layers) may be chosen by requests");
    adapters_.emplace(name, std::move(adapter));
  }
  folded_.emplace();  // the prior holds its base
}

std::vector<std::string> AdapterSwitch::touched(const std::vector<AdapterChoice>& choices) const {
  std::set<std::string> names;
  for (const auto& choice : choices) {
    for (auto& name : weights_changed_by(adapters_.at(choice.name))) names.insert(std::move(name));
  }
  return {names.begin(), names.end()};
}

void AdapterSwitch::use(const std::vector<AdapterChoice>& choices) {
  if (folded_ == choices) return;
  // Each weight the folded adapters or the chosen ones touch, rebuilt from its base.
  io::TensorMap target;
  if (folded_) {
    for (const auto& name : touched(*folded_)) target.emplace(name, base_.at(name));
  } else {
    target = base_;
  }
  for (const auto& name : touched(choices)) target.emplace(name, base_.at(name));
  for (const auto& choice : choices) {
    const auto& adapter = adapters_.at(choice.name);
    target = models::merge_adapter_tensors(std::move(target), adapter.tensors, adapter.scale(), choice.weight,
                                           "pipeline: named adapter " + choice.name);
  }
  folded_.reset();
  torch::NoGradGuard no_grad;
  for (const auto& [name, weight] : target) live_.at(name).copy_(weight);
  folded_ = choices;
  log::debug("pipeline: ", choices.size(), " named adapters folded into the prior (", target.size(), " weights)");
}

}  // namespace dalle::generate
