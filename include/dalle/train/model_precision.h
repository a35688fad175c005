#pragma once
// The precision of a trainer whose model has no resblock list (the dVAE, the VQGAN): its
// forward runs under autocast, and in fp16 one dynamic scale, with GradientScaler's update
// rule, covers all of its gradients. (The prior scales per resblock: resblock_runner.h.)
#include <torch/types.h>

#include <memory>
#include <optional>
#include <vector>

#include "dalle/io/safetensors.h"
#include "dalle/train/gradient_scaler.h"
#include "dalle/train/precision.h"

namespace dalle::train {

class ModelPrecision {
 public:
  ModelPrecision(const PrecisionConfig& config, std::vector<torch::Tensor> parameters);

  // For an AutocastGuard around the forward pass; empty in fp32.
  std::optional<torch::ScalarType> autocast_dtype() const { return autocast_; }
  // What to backpropagate: the loss times the scale in fp16, the loss itself otherwise.
  torch::Tensor scaled(const torch::Tensor& loss) const;
  double scale() const { return scaler_ ? scaler_->scale(0) : 1.0; }
  // After backward: unscales the gradients and says whether the optimizer may step; false
  // when a gradient is not finite (the update is then skipped, and the scale backs off).
  bool unscale_and_update();
  const GradientScaler* scaler() const { return scaler_.get(); }

  // The scale's state for checkpoints, under `prefix` (nothing outside fp16).
  void save_state(io::TensorMap& checkpoint_state, const std::string& prefix) const;
  void load_state(const io::TensorMap& checkpoint_state, const std::string& prefix);

 private:
  std::optional<torch::ScalarType> autocast_;
  std::vector<torch::Tensor> parameters_;
  std::unique_ptr<GradientScaler> scaler_;
};

}  // namespace dalle::train
