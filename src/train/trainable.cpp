#include "dalle/train/trainable.h"

#include <fnmatch.h>

#include <algorithm>

#include "dalle/error.h"

namespace dalle::train {

int64_t freeze_all_but(torch::nn::Module& model, const std::vector<std::string>& patterns, const std::string& what) {
  const auto parameters = model.named_parameters();
  if (patterns.empty()) return static_cast<int64_t>(parameters.size());
  std::vector<bool> used(patterns.size(), false);
  int64_t trained = 0;
  for (const auto& item : parameters) {
    bool matched = false;
    for (size_t p = 0; p < patterns.size(); ++p) {
      if (fnmatch(patterns[p].c_str(), item.key().c_str(), 0) == 0) matched = used[p] = true;
    }
    item.value().requires_grad_(matched);
    trained += matched ? 1 : 0;
  }
  for (size_t p = 0; p < patterns.size(); ++p) {
    if (!used[p]) {
      throw Error(what + ": optimizer.trainable's pattern \"" + patterns[p] + "\" matches no parameter (the first: " +
                  parameters.begin()->key() + "; every name is in the model's state dict)");
    }
  }
  if (trained == 0) throw Error(what + ": optimizer.trainable leaves no parameter to train");
  return trained;
}

void freeze_part_all_but(torch::nn::Module& part, const std::vector<std::string>& patterns, const std::string& prefix) {
  if (patterns.empty()) return;
  for (auto& item : part.named_parameters()) {
    const auto name = prefix + item.key();
    item.value().requires_grad_(std::any_of(patterns.begin(), patterns.end(), [&](const std::string& pattern) {
      return fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
    }));
  }
}

std::vector<std::string> trainable_patterns(std::vector<std::string> trainable, const models::AdapterConfig& adapter) {
  if (adapter.enabled()) {
    trainable.push_back("*.lora_A.weight");
    trainable.push_back("*.lora_B.weight");
  }
  return trainable;
}

std::vector<std::string> store_frozen_matrices(torch::nn::Module& model, const std::string& prefix,
                                               torch::ScalarType storage) {
  torch::NoGradGuard no_grad;
  std::vector<std::string> stored;
  for (auto& item : model.named_parameters()) {
    // Matrices only: a norm reads its fp32 input with its own gains' type, autocast or not.
    if (item.value().requires_grad() || item.value().dim() < 2 || !item.key().starts_with(prefix)) continue;
    item.value().set_data(item.value().to(storage));
    stored.push_back(item.key());
  }
  return stored;
}

std::vector<torch::Tensor> trained_only(const std::vector<torch::Tensor>& parameters) {
  std::vector<torch::Tensor> trained;
  for (const auto& parameter : parameters) {
    if (parameter.requires_grad()) trained.push_back(parameter);
  }
  return trained;
}

}  // namespace dalle::train
