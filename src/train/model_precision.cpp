#include "dalle/train/model_precision.h"

#include <torch/torch.h>

#include "dalle/io/state_dict.h"
#include "dalle/train/trainable.h"

namespace dalle::train {

ModelPrecision::ModelPrecision(const PrecisionConfig& config, std::vector<torch::Tensor> parameters,
                               int64_t replicas)
    : ModelPrecision(config, parameters, {parameters}, replicas) {
  scales_loss_ = true;
}

ModelPrecision::ModelPrecision(const PrecisionConfig& config, std::vector<torch::Tensor> parameters,
                               std::vector<std::vector<torch::Tensor>> scale_groups, int64_t replicas)
    : autocast_(config.autocast_dtype()), parameters_(trained_only(parameters)), scales_loss_(false) {
  if (config.precision() == Precision::fp16) {
    scaler_ = std::make_unique<GradientScaler>(config.gradient_scaling, std::move(scale_groups), replicas);
  }
}

torch::Tensor ModelPrecision::scaled(const torch::Tensor& loss) const {
  return scaler_ && scales_loss_ ? loss * scale() : loss;
}

void ModelPrecision::scale_held_gradients() {
  if (scaler_) scaler_->scale_held_gradients();
}

torch::Tensor ModelPrecision::finite_flags() const {
  if (scaler_) return scaler_->finite_flags();
  std::vector<torch::Tensor> finite;
  for (const auto& parameter : parameters_) {
    if (parameter.grad().defined()) finite.push_back(torch::isfinite(parameter.grad()).all());
  }
  if (finite.empty()) return torch::ones({1}, torch::kBool);
  for (auto& flag : finite) flag = flag.to(finite.front().device());
  return torch::stack(finite).all().reshape({1});
}

bool ModelPrecision::unscale_and_update(const torch::Tensor& finite_flags) {
  if (scaler_) return scaler_->unscale_and_update(finite_flags);
  return finite_flags.all().item<bool>();
}

void ModelPrecision::save_state(io::TensorMap& checkpoint_state, const std::string& prefix) const {
  if (!scaler_) return;
  for (auto& [name, tensor] : scaler_->state()) checkpoint_state.emplace(prefix + name, tensor);
}

void ModelPrecision::load_state(const io::TensorMap& checkpoint_state, const std::string& prefix) {
  if (!scaler_) return;
  scaler_->load_state(io::with_prefix_removed(checkpoint_state, prefix));
}

}  // namespace dalle::train
