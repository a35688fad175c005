#include "dalle/train/model_precision.h"

#include <torch/torch.h>

#include "trainer_support.h"

namespace dalle::train {

ModelPrecision::ModelPrecision(const PrecisionConfig& config, std::vector<torch::Tensor> parameters)
    : autocast_(config.autocast_dtype()), parameters_(std::move(parameters)) {
  if (config.precision() == Precision::fp16) {
    scaler_ = std::make_unique<GradientScaler>(config.gradient_scaling,
                                               std::vector<std::vector<torch::Tensor>>{parameters_});
  }
}

torch::Tensor ModelPrecision::scaled(const torch::Tensor& loss) const {
  return scaler_ ? loss * scale() : loss;
}

bool ModelPrecision::unscale_and_update() {
  if (scaler_) return scaler_->unscale_and_update();
  std::vector<torch::Tensor> finite;
  for (const auto& parameter : parameters_) {
    if (parameter.grad().defined()) finite.push_back(torch::isfinite(parameter.grad()).all());
  }
  return finite.empty() || torch::stack(finite).all().item<bool>();
}

void ModelPrecision::save_state(io::TensorMap& checkpoint_state, const std::string& prefix) const {
  if (!scaler_) return;
  for (auto& [name, tensor] : scaler_->state()) checkpoint_state.emplace(prefix + name, tensor);
}

void ModelPrecision::load_state(const io::TensorMap& checkpoint_state, const std::string& prefix) {
  if (!scaler_) return;
  scaler_->load_state(detail::with_prefix_removed(checkpoint_state, prefix));
}

}  // namespace dalle::train
