#include "dalle/io/state_dict.h"

#include <torch/torch.h>

#include <sstream>

namespace dalle::io {

TensorMap state_dict(const torch::nn::Module& module) {
  TensorMap tensors;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) tensors.emplace(item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) tensors.emplace(item.key(), item.value());
  return tensors;
}

namespace {

std::string shape_of(const torch::Tensor& tensor) {
  std::ostringstream out;
  out << tensor.sizes();
  return out.str();
}

// Lists at most a few names, so that a wholly wrong file gives a readable message.
std::string first_names(const std::vector<std::string>& names) {
  std::string text;
  for (size_t i = 0; i < names.size() && i < 5; ++i) text += (i ? ", " : "") + names[i];
  if (names.size() > 5) text += ", ... (" + std::to_string(names.size()) + " in all)";
  return text;
}

}  // namespace

void load_state_dict(torch::nn::Module& module, const TensorMap& tensors, const std::string& source,
                     const std::unordered_set<std::string>& filled_elsewhere) {
  auto targets = state_dict(module);
  for (const auto& name : filled_elsewhere) targets.erase(name);
  std::vector<std::string> missing, unexpected, misshapen;
  for (const auto& [name, target] : targets) {
    auto found = tensors.find(name);
    if (found == tensors.end()) missing.push_back(name);
    else if (found->second.sizes() != target.sizes()) {
      misshapen.push_back(name + " " + shape_of(found->second) + " where the model has " + shape_of(target));
    }
  }
  for (const auto& [name, tensor] : tensors) {
    if (!targets.count(name) && !filled_elsewhere.count(name)) unexpected.push_back(name);
  }
  std::string problems;
  if (!missing.empty()) problems += "\n  missing: " + first_names(missing);
  if (!unexpected.empty()) problems += "\n  unexpected: " + first_names(unexpected);
  if (!misshapen.empty()) problems += "\n  misshapen: " + first_names(misshapen);
  if (!problems.empty()) throw Error(source + " do not fit the model:" + problems);
  // A NaN or infinite weight makes every output NaN (black images) without an error; one
  // pass over the weights is cheap next to reading them.
  for (const auto& [name, target] : targets) {
    const auto& tensor = tensors.at(name);
    if (tensor.is_floating_point() && !torch::isfinite(tensor).all().item<bool>()) {
      throw Error(source + ": tensor '" + name + "' holds NaN or infinite values; refusing to load it");
    }
  }

  torch::NoGradGuard no_grad;
  for (auto& [name, target] : targets) target.copy_(tensors.at(name));
}

TensorMap with_prefix_removed(const TensorMap& tensors, const std::string& prefix) {
  TensorMap out;
  for (const auto& [name, tensor] : tensors) {
    if (name.rfind(prefix, 0) == 0) out.emplace(name.substr(prefix.size()), tensor);
  }
  return out;
}

}  // namespace dalle::io
