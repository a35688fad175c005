#include "dalle/train/adamw.h"

#include <torch/torch.h>

#include <cmath>

#include "dalle/error.h"
#include "dalle/train/stochastic_rounding.h"

namespace dalle::train {

AdamW::AdamW(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::AdamWOptions defaults,
             torch::ScalarType moments)
    : torch::optim::AdamW(std::move(groups), std::move(defaults)), moments_(moments) {
  if (moments_ != torch::kFloat32 && moments_ != torch::kBFloat16) {
    throw Error("AdamW moments are stored in float32 or bfloat16");
  }
}

bool AdamW::steps_as_torch() const {
  if (moments_ != torch::kFloat32) return false;
  for (const auto& group : param_groups()) {
    for (const auto& parameter : group.params()) {
      if (parameter.scalar_type() != torch::kFloat32) return false;
    }
  }
  return true;
}

bool AdamW::fuses() const {
  for (const auto& group : param_groups()) {
    if (static_cast<const torch::optim::AdamWOptions&>(group.options()).amsgrad()) return false;
    for (const auto& parameter : group.params()) {
      const auto device = parameter.device();
      if (device != group.params().front().device()) return false;
      if (!device.is_cpu() && !(device.is_cuda() && fused_on_cuda_)) return false;
    }
  }
  return true;
}

torch::Tensor AdamW::step(LossClosure closure) {
  const bool as_torch = steps_as_torch();
  if (as_torch && !fuses()) return torch::optim::AdamW::step(std::move(closure));
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure) {
    torch::AutoGradMode enable_grad(true);
    loss = closure();
  }
  if (as_torch) {
    fused_step();
  } else {
    step_with([](const torch::Tensor& parameter) { return parameter.grad(); });
  }
  return loss;
}

// Torch's AdamW, each group's parameters that have gradients stepped by one kernel. The
// kernel takes each parameter's step count, already advanced, as a float32 tensor beside it.
void AdamW::fused_step() {
  for (auto& group : param_groups()) {
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    std::vector<torch::Tensor> parameters, gradients, exp_avgs, exp_avg_sqs, steps;
    for (auto& parameter : group.params()) {
      if (!parameter.grad().defined()) continue;
      auto& slot = state()[parameter.unsafeGetTensorImpl()];
      if (!slot) {
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        fresh->exp_avg(torch::zeros_like(parameter, torch::MemoryFormat::Preserve));
        fresh->exp_avg_sq(torch::zeros_like(parameter, torch::MemoryFormat::Preserve));
        slot = std::move(fresh);
      }
      auto& adam = static_cast<torch::optim::AdamWParamState&>(*slot);
      adam.step(adam.step() + 1);
      parameters.push_back(parameter);
      gradients.push_back(parameter.grad());
      exp_avgs.push_back(adam.exp_avg());
      exp_avg_sqs.push_back(adam.exp_avg_sq());
      steps.push_back(torch::full({}, static_cast<double>(adam.step()), parameter.options().dtype(torch::kFloat32)));
    }
    if (parameters.empty()) continue;
    const auto [beta1, beta2] = options.betas();
    at::_fused_adamw_(parameters, gradients, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, options.lr(), beta1,
                      beta2, options.weight_decay(), options.eps(), /*amsgrad=*/false, /*maximize=*/false);
  }
}

// The same arithmetic as torch's AdamW, operation for operation: a float32 model steps as it would.
void AdamW::step_with(const GradientOf& gradient_of) {
  torch::NoGradGuard no_grad;
  uint64_t place = 0;
  for (auto& group : param_groups()) {
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    if (options.amsgrad()) throw Error("this AdamW (16-bit state, or gradients given as it steps) has no amsgrad");
    for (auto& parameter : group.params()) step_parameter(parameter, gradient_of(parameter), options, place++);
  }
}

void AdamW::step_parameter(torch::Tensor& parameter, const torch::Tensor& gradient,
                           const torch::optim::AdamWOptions& options, uint64_t place) {
  if (!gradient.defined()) return;
  auto& slot = state()[parameter.unsafeGetTensorImpl()];
  if (!slot) {
    auto fresh = std::make_unique<torch::optim::AdamWParamState>();
    fresh->exp_avg(torch::zeros_like(parameter, torch::TensorOptions().dtype(moments_)));
    fresh->exp_avg_sq(torch::zeros_like(parameter, torch::TensorOptions().dtype(moments_)));
    slot = std::move(fresh);
  }
  auto& adam = static_cast<torch::optim::AdamWParamState&>(*slot);
  const auto [beta1, beta2] = options.betas();
  const bool rounds = parameter.scalar_type() != torch::kFloat32;
  // A float32 parameter is updated in place; a 16-bit one through a float32 copy.
  auto value = rounds ? parameter.to(torch::kFloat32) : parameter;
  const auto grad = gradient.to(torch::kFloat32);
  value.mul_(1 - options.lr() * options.weight_decay());
  adam.step(adam.step() + 1);
  auto exp_avg = adam.exp_avg().to(torch::kFloat32).mul_(beta1).add_(grad, 1 - beta1);
  auto exp_avg_sq = adam.exp_avg_sq().to(torch::kFloat32).mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  const double correction1 = 1 - std::pow(beta1, static_cast<double>(adam.step()));
  const double correction2 = 1 - std::pow(beta2, static_cast<double>(adam.step()));
  const auto denominator = (exp_avg_sq.sqrt() / std::sqrt(correction2)).add_(options.eps());
  value.addcdiv_(exp_avg, denominator, -options.lr() / correction1);
  if (rounds) {
    auto generator = rounding_generator(parameter.device(),
                                        mix_seed(mix_seed(rounding_seed_, place), static_cast<uint64_t>(adam.step())));
    parameter.copy_(round_stochastically(value, parameter.scalar_type(), generator));
  }
  adam.exp_avg().copy_(exp_avg);
  adam.exp_avg_sq().copy_(exp_avg_sq);
}

}  // namespace dalle::train
