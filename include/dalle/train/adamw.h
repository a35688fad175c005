#pragma once
// AdamW whose two moments are stored in a chosen type, and whose parameters may be stored in
// 16 bits: float32 moments and parameters step as torch's AdamW, through LibTorch's fused
// kernel (_fused_adamw_: one pass over each group's tensors, where torch's loop makes five)
// where it has run; bfloat16 moments halve the optimizer's memory (DALL-E kept its moments in
// 16 bits); a 16-bit parameter (the sharded resblocks' matrices under precision.weights) is
// updated in float32 and rounded back stochastically (train/stochastic_rounding.h), which no
// fused kernel does. Every update is computed in float32.
#include <torch/optim/adamw.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace dalle::train {

class AdamW : public torch::optim::AdamW {
 public:
  AdamW(std::vector<torch::optim::OptimizerParamGroup> groups, torch::optim::AdamWOptions defaults,
        torch::ScalarType moments = torch::kFloat32);

  torch::Tensor step(LossClosure closure = nullptr) override;
  // A step with each parameter's gradient as `gradient_of` gives it when the parameter's turn
  // comes (one made then: a reducer that keeps gradients compressed, gradient_reducer.h);
  // an undefined one leaves the parameter as it is.
  using GradientOf = std::function<torch::Tensor(const torch::Tensor& parameter)>;
  void step_with(const GradientOf& gradient_of);
  torch::ScalarType moments() const { return moments_; }
  // The seed of the stochastic rounding of 16-bit parameters: each parameter's rounding at
  // each of its steps draws from it, its place among the parameters and that step, so that a
  // resumed run rounds as the uninterrupted one. Ranks that hold the same values (the replicas
  // of a shard on other machines) must be given the same seed.
  void set_rounding_seed(uint64_t seed) { rounding_seed_ = seed; }
  // The fused kernel steps float32 state on the CPU; on CUDA only when asked, until
  // scripts/device/gpu-check has run it there (AdamW.FusedOnCudaStepsAsTorchsLoop).
  void fuse_on_cuda(bool fused) { fused_on_cuda_ = fused; }

 private:
  bool steps_as_torch() const;
  bool fuses() const;
  void fused_step();
  void step_parameter(torch::Tensor& parameter, const torch::Tensor& gradient,
                      const torch::optim::AdamWOptions& options, uint64_t place);

  torch::ScalarType moments_;
  uint64_t rounding_seed_ = 0;
  bool fused_on_cuda_ = false;
};

}  // namespace dalle::train
