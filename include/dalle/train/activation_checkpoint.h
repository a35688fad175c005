#pragma once
// Activation checkpointing: run a function without keeping its intermediate activations
// and recompute them in the backward pass, trading one more forward for the memory.
#include <ATen/core/Generator.h>
#include <torch/types.h>

#include <functional>
#include <optional>

namespace dalle::train {

// The random and autocast state a forward ran in, so that backward can rerun it exactly
// (activation checkpointing, sharded blocks).
class ForwardState {
 public:
  ForwardState() = default;
  // The state now, of a forward on `x`'s device.
  explicit ForwardState(const torch::Tensor& x);
  // fn(input) with grad enabled, in the captured state; the generator then goes back to
  // where it was, so that what follows draws as if nothing had been rerun.
  torch::Tensor rerun(const std::function<torch::Tensor(const torch::Tensor&)>& fn, const torch::Tensor& input);

 private:
  at::Generator generator_;
  torch::Tensor generator_state_;
  std::optional<torch::ScalarType> autocast_;
};

// The input a checkpointed block keeps for its backward: x itself, or x rounded to `kept_as`
// (16 bits halve what checkpointing holds; the recomputation then starts from the rounded
// input, as DALL-E's 16-bit activations did, while the forward used x exactly) ...
torch::Tensor kept_input(const torch::Tensor& x, torch::ScalarType kept_as);
// ... and that kept input back in x's type, as the leaf the recomputation differentiates.
torch::Tensor recomputation_input(const torch::Tensor& kept, torch::ScalarType type);

// fn(x), whose backward reruns fn on the kept input (kept_input(x, kept_as)) with the random
// generator state and autocast state of the first run, so that dropout masks and precisions
// repeat exactly. Gradients reach x and every parameter fn uses, as without checkpointing,
// also when x requires none (fn's parameters train behind frozen layers).
torch::Tensor checkpointed(const std::function<torch::Tensor(const torch::Tensor&)>& fn, const torch::Tensor& x,
                           torch::ScalarType kept_as = torch::kFloat32);

}  // namespace dalle::train
