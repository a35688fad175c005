#include "dalle/train/optimizer_state.h"

#include <torch/torch.h>

#include "dalle/error.h"

namespace dalle::train {

io::TensorMap adamw_state(torch::optim::AdamW& optimizer, const torch::nn::Module& module) {
  io::TensorMap state;
  auto& states = optimizer.state();
  for (const auto& item : module.named_parameters()) {
    auto found = states.find(item.value().unsafeGetTensorImpl());
    if (found == states.end()) continue;  // not updated yet
    const auto& adam = static_cast<const torch::optim::AdamWParamState&>(*found->second);
    state.emplace(item.key() + ".exp_avg", adam.exp_avg());
    state.emplace(item.key() + ".exp_avg_sq", adam.exp_avg_sq());
    state.emplace(item.key() + ".step", torch::tensor(adam.step(), torch::kInt64));
  }
  return state;
}

void load_adamw_state(torch::optim::AdamW& optimizer, const torch::nn::Module& module, const io::TensorMap& state) {
  auto& states = optimizer.state();
  for (const auto& item : module.named_parameters()) {
    const std::string& name = item.key();
    auto exp_avg = state.find(name + ".exp_avg");
    if (exp_avg == state.end()) continue;
    auto exp_avg_sq = state.find(name + ".exp_avg_sq");
    auto step = state.find(name + ".step");
    if (exp_avg_sq == state.end() || step == state.end() || exp_avg->second.sizes() != item.value().sizes() ||
        exp_avg_sq->second.sizes() != item.value().sizes()) {
      throw Error("the checkpoint's optimizer state does not fit parameter '" + name + "'");
    }
    auto adam = std::make_unique<torch::optim::AdamWParamState>();
    adam->step(step->second.item<int64_t>());
    // Checkpoints load onto the CPU; the moments live beside their parameter.
    const auto device = item.value().device();
    adam->exp_avg(exp_avg->second.to(device, /*non_blocking=*/false, /*copy=*/true));
    adam->exp_avg_sq(exp_avg_sq->second.to(device, /*non_blocking=*/false, /*copy=*/true));
    states[item.value().unsafeGetTensorImpl()] = std::move(adam);
  }
}

}  // namespace dalle::train
