#pragma once
// Which of the prior's parameters AdamW decays: the trainer's optimizer groups, the sharded
// prior's groups and the capacity plan's count all follow this one rule.
#include <torch/types.h>

#include <string>

namespace dalle::train::prior_training {

// Weight decay for the matrices only: DALL-E keeps gains, biases and embeddings undecayed.
inline bool decayed_by_adamw(const std::string& name, const torch::Tensor& parameter) {
  return parameter.dim() == 2 && name.find("embedding") == std::string::npos;
}

}  // namespace dalle::train::prior_training
