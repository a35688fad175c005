#pragma once
// An exponential moving average of a module's weights, kept beside the module:
// shadow = decay * shadow + (1 - decay) * weight after each update. Buffers are copied.
#include <torch/nn/module.h>

#include <set>
#include <string>
#include <vector>

#include "dalle/io/safetensors.h"

namespace dalle::train {

class Ema {
 public:
  Ema(const torch::nn::Module& module, double decay);

  void update(const torch::nn::Module& module);
  // Writes the averaged weights into `module` (e.g. a copy used for evaluation); the
  // parameters it does not average (forget) are left as they are there.
  void copy_to(torch::nn::Module& module) const;

  // Exchanges the averaged parameters' values with `module`'s, without a copy: called again,
  // it puts them back (validation on the average of a model that holds no copy of it).
  void swap(torch::nn::Module& module);

  const io::TensorMap& weights() const { return shadow_; }
  // Sets rows `index` of the average of parameter `name` to `values`: for changes that are
  // not optimizer steps (a codebook restart), which averaging would only blur.
  void overwrite_rows(const std::string& name, const torch::Tensor& index, const torch::Tensor& values);
  // Restores from a checkpoint; names and shapes must be the module's.
  void load(const io::TensorMap& weights);
  // Stops averaging the parameters `names`: averaged elsewhere (in shards), or frozen.
  void forget(const std::vector<std::string>& names);

 private:
  double decay_;
  io::TensorMap shadow_;
  std::set<std::string> forgotten_;
};

}  // namespace dalle::train
