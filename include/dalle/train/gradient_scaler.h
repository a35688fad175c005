#pragma once
// Dynamic fp16 gradient scales, one per group of parameters (DALL-E: one per resblock). The
// backward pass multiplies a group's gradients by its scale; `unscale_and_update` divides
// them back, then grows the scale of every group whose gradients were finite and backs off
// the others, and says whether the optimizer may step: a single non-finite gradient skips
// the whole update. The finite flags are taken apart from the update so that data-parallel
// replicas can agree on them first (distributed/gradient_reducer.h).
#include <torch/types.h>

#include <cstdint>
#include <vector>

#include "dalle/io/safetensors.h"
#include "dalle/train/precision.h"

namespace dalle::train {

struct ScaleSummary {
  double min = 0, median = 0, max = 0;
};

class GradientScaler {
 public:
  // `replicas`: data-parallel replicas, which multiply every scale and its bounds.
  GradientScaler(GradientScalingConfig config, std::vector<std::vector<torch::Tensor>> groups, int64_t replicas = 1);

  size_t groups() const { return groups_.size(); }
  double scale(size_t group) const;
  ScaleSummary summary() const;
  int64_t skipped_updates() const { return skipped_; }

  // Before backward: the gradients its groups already hold (what backward will add to:
  // PowerSGD's error feedback, kept as the gradient) multiplied by their scales, so that
  // all of a gradient is at one scale when it is unscaled.
  void scale_held_gradients();
  // After backward: [groups] booleans on the gradients' device, true where a group's
  // gradients are all finite.
  torch::Tensor finite_flags() const;
  // Given the flags (this replica's, or those all replicas agree on): true when every group
  // is finite, and the gradients are then unscaled; false when the update must be skipped.
  // Either way the scales move by the update rule.
  bool unscale_and_update(const torch::Tensor& finite);

  // Scales and backoff history, for checkpoints.
  io::TensorMap state() const;
  void load_state(const io::TensorMap& state);

 private:
  GradientScalingConfig config_;
  std::vector<std::vector<torch::Tensor>> groups_;
  double offset_log2_;                      // log2(replicas)
  std::vector<double> log2_scales_;
  std::vector<int64_t> last_backoff_;       // update of each group's latest division, -1: none
  int64_t updates_ = 0, skipped_ = 0;
};

}  // namespace dalle::train
