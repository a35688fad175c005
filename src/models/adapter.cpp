#include "dalle/models/adapter.h"

#include <fnmatch.h>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <set>
#include <sstream>

#include "dalle/error.h"
#include "dalle/models/linear.h"

namespace dalle::models {
namespace {

constexpr std::string_view kDown = ".lora_A.weight", kUp = ".lora_B.weight";

// `layer`'s tensor of `kind` (kDown or kUp). Appended: GCC 12 warns falsely
// (-Wstringop-overflow) on string + string.
std::string tensor_of(const std::string& layer, std::string_view kind) { return std::string(layer).append(kind); }

constexpr const char* kFormat = "dalle-adapter";

bool ends_with(const std::string& name, std::string_view suffix) { return name.ends_with(suffix); }

// "<layer>" of "<layer>.lora_A.weight" / "<layer>.lora_B.weight".
std::string layer_of(const std::string& name) {
  return name.substr(0, name.size() - (ends_with(name, kDown) ? kDown.size() : kUp.size()));
}

std::string shape_text(const torch::Tensor& t) {
  std::string text = "[";
  for (int64_t d = 0; d < t.dim(); ++d) text += (d ? ", " : "") + std::to_string(t.size(d));
  return text + "]";
}

// The layers of `adapter`, each with both tensors, one rank for all.
std::set<std::string> adapted_layers(const io::TensorMap& adapter, const std::string& source) {
  std::set<std::string> layers;
  for (const auto& [name, tensor] : adapter) {
    if (is_adapter_tensor(name)) layers.insert(layer_of(name));
  }
  for (const auto& layer : layers) {
    const auto down = adapter.find(tensor_of(layer, kDown)), up = adapter.find(tensor_of(layer, kUp));
    if (down == adapter.end() || up == adapter.end()) {
      throw Error(source + ": layer " + layer + " has only one of lora_A and lora_B");
    }
    if (down->second.dim() != 2 || up->second.dim() != 2 || up->second.size(1) != down->second.size(0)) {
      throw Error(source + ": layer " + layer + "'s lora_B " + shape_text(up->second) + " and lora_A " +
                  shape_text(down->second) + " do not multiply");
    }
  }
  return layers;
}

// scale * B A in float32.
torch::Tensor low_rank_delta(const io::TensorMap& adapter, const std::string& layer, double scale) {
  return torch::matmul(adapter.at(tensor_of(layer, kUp)).to(torch::kFloat32),
                       adapter.at(tensor_of(layer, kDown)).to(torch::kFloat32)) *
         scale;
}

}  // namespace

void AdapterConfig::visit(ConfigVisitor& v) {
  v.field("rank", rank,
          "rank of the low-rank adapters (LoRA) added to the targeted linear layers, which then train alone with "
          "the rest frozen (0: no adapters)",
          {.min = 0, .max = 4096});
  v.field("alpha", alpha, "the adapters' output is scaled by alpha / rank (LoRA's alpha)", {.min = 0.0});
  v.field("targets", targets,
          "module-name globs of the linear layers to adapt (`*` any text, dots included: \"resblocks.*.qkv\", "
          "\"decoder.layers.*.self_attn.*\"); empty: every linear layer; a pattern matching none is refused");
}

double AdapterConfig::scale_of_adapters_in(const std::string& where) const {
  if (!enabled()) throw Error(where + ": holds adapters, but its config has no adapter.rank");
  return scale();
}

std::vector<std::string> add_adapters(torch::nn::Module& model, const AdapterConfig& config,
                                      std::optional<torch::ScalarType> type) {
  if (!config.enabled()) return {};
  std::vector<bool> used(config.targets.size(), false);
  std::vector<std::string> adapted;
  for (const auto& item : model.named_modules()) {
    auto* linear = dynamic_cast<LinearImpl*>(item.value().get());
    if (linear == nullptr) continue;
    bool matched = config.targets.empty();
    for (size_t p = 0; p < config.targets.size(); ++p) {
      if (fnmatch(config.targets[p].c_str(), item.key().c_str(), 0) == 0) matched = used[p] = true;
    }
    if (!matched) continue;
    linear->add_adapter(config.rank, config.scale(), type);
    adapted.push_back(item.key());
  }
  for (size_t p = 0; p < config.targets.size(); ++p) {
    if (!used[p]) {
      throw Error("adapter.targets' pattern \"" + config.targets[p] + "\" matches no linear layer" +
                  (adapted.empty() ? std::string() : " (one that does: " + adapted.front() + ")"));
    }
  }
  if (adapted.empty()) throw Error("adapter: the model has no linear layer to adapt");
  return adapted;
}

void merge_adapters(torch::nn::Module& model) {
  for (const auto& child : model.modules(/*include_self=*/true)) {
    if (auto* linear = dynamic_cast<LinearImpl*>(child.get())) linear->merge_adapter();
  }
}

bool is_adapter_tensor(const std::string& name) { return ends_with(name, kDown) || ends_with(name, kUp); }

std::string adapted_weight(const std::string& adapter_tensor) { return layer_of(adapter_tensor) + ".weight"; }

io::TensorMap adapter_tensors(const io::TensorMap& weights) {
  io::TensorMap kept;
  for (const auto& [name, tensor] : weights) {
    if (is_adapter_tensor(name)) kept.emplace(name, tensor);
  }
  return kept;
}

io::TensorMap without_adapter_tensors(const io::TensorMap& weights) {
  io::TensorMap kept;
  for (const auto& [name, tensor] : weights) {
    if (!is_adapter_tensor(name)) kept.emplace(name, tensor);
  }
  return kept;
}

void save_adapter_file(const std::string& path, const io::TensorMap& tensors, const AdapterConfig& config,
                       const std::string& base, const std::string& family) {
  io::TensorMap adapter;
  for (const auto& [name, tensor] : adapter_tensors(tensors)) adapter.emplace(name, tensor.detach().cpu());
  if (adapter.empty()) throw Error(path + ": nothing to write, the weights hold no adapter");
  adapted_layers(adapter, path);
  std::ostringstream alpha;
  alpha.precision(17);
  alpha << config.alpha;
  io::write_safetensors(path, adapter,
                        {{"format", kFormat}, {"rank", std::to_string(config.rank)}, {"alpha", alpha.str()},
                         {"base", base}, {"family", family}});
}

AdapterFile load_adapter_file(const std::string& path) {
  auto file = io::read_safetensors(path);
  const auto& meta = file.metadata;
  const auto format = meta.find("format");
  if (format == meta.end() || format->second != kFormat) {
    throw Error(path + ": not an adapter file (its metadata lacks format: " + kFormat +
                "; dalle-export --adapter writes them)");
  }
  AdapterFile adapter;
  try {
    adapter.rank = std::stoll(meta.at("rank"));
    adapter.alpha = std::stod(meta.at("alpha"));
  } catch (const std::exception&) {
    throw Error(path + ": the adapter's rank and alpha are missing or not numbers");
  }
  if (adapter.rank < 1 || !std::isfinite(adapter.alpha)) throw Error(path + ": the adapter's rank or alpha is invalid");
  adapter.base = meta.count("base") ? meta.at("base") : "";
  adapter.family = meta.count("family") ? meta.at("family") : "";
  for (auto& [name, tensor] : file.tensors) {
    if (!is_adapter_tensor(name)) throw Error(path + ": " + name + " is no adapter tensor (lora_A / lora_B)");
  }
  adapted_layers(file.tensors, path);
  for (const auto& [name, tensor] : file.tensors) {
    if (ends_with(name, kDown) && tensor.size(0) != adapter.rank) {
      throw Error(path + ": " + name + " has rank " + std::to_string(tensor.size(0)) + ", the metadata says " +
                  std::to_string(adapter.rank));
    }
  }
  adapter.tensors = std::move(file.tensors);
  return adapter;
}

io::TensorMap merge_adapter_tensors(io::TensorMap weights, const io::TensorMap& adapter, double scale, double weight,
                                    const std::string& source) {
  torch::NoGradGuard no_grad;
  for (const auto& layer : adapted_layers(adapter, source)) {
    const auto found = weights.find(layer + ".weight");
    if (found == weights.end()) throw Error(source + ": the model has no linear layer " + layer);
    const auto delta = low_rank_delta(adapter, layer, scale * weight);
    if (delta.sizes() != found->second.sizes()) {
      throw Error(source + ": layer " + layer + "'s adapter makes " + shape_text(delta) + ", its weight is " +
                  shape_text(found->second));
    }
    found->second = (found->second.to(torch::kFloat32) + delta.to(found->second.device()))
                        .to(found->second.scalar_type());
  }
  return without_adapter_tensors(weights);
}

void apply_adapter(torch::nn::Module& model, const AdapterFile& adapter, double weight) {
  io::TensorMap weights;
  for (const auto& item : model.named_parameters()) {
    if (ends_with(item.key(), ".weight")) weights.emplace(item.key(), item.value());
  }
  const auto merged = merge_adapter_tensors(weights, adapter.tensors, adapter.scale(), weight);
  torch::NoGradGuard no_grad;
  for (const auto& [name, tensor] : merged) {
    if (!tensor.is_same(weights.at(name))) weights.at(name).copy_(tensor);
  }
}

WeightedAdapter parse_weighted_adapter(const std::string& spec) {
  const auto colon = spec.rfind(':');
  if (colon != std::string::npos && colon + 1 < spec.size()) {
    const auto text = spec.substr(colon + 1);
    char* end = nullptr;
    const double weight = std::strtod(text.c_str(), &end);
    if (end != nullptr && *end == '\0') {
      if (!std::isfinite(weight)) throw Error("--adapter " + spec + ": the weight must be a finite number");
      return {spec.substr(0, colon), weight};
    }
  }
  if (spec.empty()) throw Error("--adapter needs a file (FILE or FILE:WEIGHT)");
  return {spec, 1.0};
}

NamedAdapter parse_named_adapter(const std::string& spec) {
  const auto equals = spec.find('=');
  const auto name = spec.substr(0, equals);
  const bool name_ok = !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
  });
  if (equals == std::string::npos || equals + 1 == spec.size() || !name_ok) {
    throw Error("named adapter '" + spec + "': expected NAME=FILE, NAME 1 to 64 letters, digits, '-', '_' or '.' "
                "(an adapter folded for every request is a FILE[:WEIGHT] of `adapters`)");
  }
  return {name, spec.substr(equals + 1)};
}

}  // namespace dalle::models
