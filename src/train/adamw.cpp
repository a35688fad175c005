#include "dalle/train/adamw.h"

#include <torch/torch.h>

#include <cmath>

#include "dalle/error.h"

namespace dalle::train {

AdamW::AdamW(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::AdamWOptions defaults,
             torch::ScalarType moments)
    : torch::optim::AdamW(std::move(groups), std::move(defaults)), moments_(moments) {
  if (moments_ != torch::kFloat32 && moments_ != torch::kBFloat16) {
    throw Error("AdamW moments are stored in fp32 or bf16");
  }
}

torch::Tensor AdamW::step(LossClosure closure) {
  if (moments_ == torch::kFloat32) return torch::optim::AdamW::step(std::move(closure));
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure) {
    torch::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups()) {
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    if (options.amsgrad()) throw Error("AdamW with 16-bit moments does not implement amsgrad");
    const auto [beta1, beta2] = options.betas();
    for (auto& parameter : group.params()) {
      if (!parameter.grad().defined()) continue;
      auto& slot = state()[parameter.unsafeGetTensorImpl()];
      if (!slot) {
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        fresh->exp_avg(torch::zeros_like(parameter, torch::TensorOptions().dtype(moments_)));
        fresh->exp_avg_sq(torch::zeros_like(parameter, torch::TensorOptions().dtype(moments_)));
        slot = std::move(fresh);
      }
      auto& adam = static_cast<torch::optim::AdamWParamState&>(*slot);
      const auto grad = parameter.grad().to(torch::kFloat32);
      parameter.mul_(1 - options.lr() * options.weight_decay());
      adam.step(adam.step() + 1);
      auto exp_avg = adam.exp_avg().to(torch::kFloat32).mul_(beta1).add_(grad, 1 - beta1);
      auto exp_avg_sq = adam.exp_avg_sq().to(torch::kFloat32).mul_(beta2).addcmul_(grad, grad, 1 - beta2);
      const double correction1 = 1 - std::pow(beta1, static_cast<double>(adam.step()));
      const double correction2 = 1 - std::pow(beta2, static_cast<double>(adam.step()));
      const auto denominator = (exp_avg_sq.sqrt() / std::sqrt(correction2)).add_(options.eps());
      parameter.addcdiv_(exp_avg, denominator, -options.lr() / correction1);
      adam.exp_avg().copy_(exp_avg);
      adam.exp_avg_sq().copy_(exp_avg_sq);
    }
  }
  return loss;
}

}  // namespace dalle::train
