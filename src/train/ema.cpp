#include "dalle/train/ema.h"

#include <torch/torch.h>

#include "dalle/io/state_dict.h"

namespace dalle::train {

Ema::Ema(const torch::nn::Module& module, double decay) : decay_(decay) {
  if (decay < 0.0 || decay >= 1.0) throw Error("the EMA decay must be in [0, 1)");
  for (const auto& [name, tensor] : io::state_dict(module)) shadow_.emplace(name, tensor.detach().clone());
}

void Ema::update(const torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (const auto& item : module.named_parameters()) {
    if (forgotten_.count(item.key()) == 0) shadow_.at(item.key()).lerp_(item.value().detach(), 1.0 - decay_);
  }
  for (const auto& item : module.named_buffers()) shadow_.at(item.key()).copy_(item.value());
}

void Ema::overwrite_rows(const std::string& name, const torch::Tensor& index, const torch::Tensor& values) {
  auto found = shadow_.find(name);
  if (found == shadow_.end()) throw Error("EMA: no parameter named '" + name + "'");
  torch::NoGradGuard no_grad;
  found->second.index_copy_(0, index.to(found->second.device()), values.detach().to(found->second.dtype()));
}

void Ema::copy_to(torch::nn::Module& module) const {
  io::load_state_dict(module, shadow_, "EMA weights", {forgotten_.begin(), forgotten_.end()});
}

void Ema::swap(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (const auto& item : module.named_parameters()) {
    const auto found = shadow_.find(item.key());
    if (found == shadow_.end()) continue;  // forgotten
    auto held = item.value().data();
    item.value().set_data(found->second);
    found->second = std::move(held);
  }
}

void Ema::forget(const std::vector<std::string>& names) {
  for (const auto& name : names) {
    shadow_.erase(name);
    forgotten_.insert(name);
  }
}

void Ema::load(const io::TensorMap& weights) {
  for (auto& [name, tensor] : shadow_) {
    auto found = weights.find(name);
    if (found == weights.end() || found->second.sizes() != tensor.sizes()) {
      throw Error("the checkpoint's EMA weights do not fit the model at '" + name + "'");
    }
    tensor.copy_(found->second);
  }
}

}  // namespace dalle::train
