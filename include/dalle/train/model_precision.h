#pragma once
// A model's training precision: its forward runs under autocast (bf16, fp16), and in fp16
// dynamic gradient scales, with GradientScaler's update rule, keep its gradients from
// underflowing. Either one scale for all of its gradients, by which the loss is multiplied
// (the dVAE, the VQGAN, CLIP, RRDBNet), or one scale per group that the model applies
// inside its own backward pass (the prior's resblocks: resblock_runner.h), the loss then
// backpropagated as it is.
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
  // One scale for all of `parameters`, applied to the loss.
  ModelPrecision(const PrecisionConfig& config, std::vector<torch::Tensor> parameters, int64_t replicas = 1);
  // One scale per group of `scale_groups`, applied by the model in its backward pass
  // (scaler()). `parameters` are all that train: the groups' and those whose gradients come
  // out of backward unscaled (the prior's embeddings and head).
  ModelPrecision(const PrecisionConfig& config, std::vector<torch::Tensor> parameters,
                 std::vector<std::vector<torch::Tensor>> scale_groups, int64_t replicas = 1);

  // For an AutocastGuard around the forward pass; empty in fp32.
  std::optional<torch::ScalarType> autocast_dtype() const { return autocast_; }
  // What to backpropagate: the loss times the scale when one scale covers the model.
  torch::Tensor scaled(const torch::Tensor& loss) const;
  double scale() const { return scaler_ ? scaler_->scale(0) : 1.0; }
  // Before backward, in fp16: gradients that backward will add to are brought to its scales
  // (GradientScaler::scale_held_gradients).
  void scale_held_gradients();
  // After backward: one boolean per scale group (in fp16), or a single one for every
  // parameter, true where the gradients are finite. Gradients outside the scale groups are
  // checked by the norm of the update step.
  torch::Tensor finite_flags() const;
  // Given the flags: unscales the gradients and says whether the optimizer may step; false
  // when a flag is false (the update is then skipped, and its scales back off).
  bool unscale_and_update(const torch::Tensor& finite_flags);
  // Every parameter that trains.
  const std::vector<torch::Tensor>& parameters() const { return parameters_; }
  // Whether one scale multiplies the loss (else the model scales its groups in backward).
  bool scales_loss() const { return scales_loss_; }
  GradientScaler* scaler() { return scaler_.get(); }
  const GradientScaler* scaler() const { return scaler_.get(); }

  // The scales' state for checkpoints, under `prefix` (nothing outside fp16).
  void save_state(io::TensorMap& checkpoint_state, const std::string& prefix) const;
  void load_state(const io::TensorMap& checkpoint_state, const std::string& prefix);

 private:
  std::optional<torch::ScalarType> autocast_;
  std::vector<torch::Tensor> parameters_;
  std::unique_ptr<GradientScaler> scaler_;
  bool scales_loss_ = true;
};

}  // namespace dalle::train
