#pragma once
// Activation checkpointing: run a function without keeping its intermediate activations
// and recompute them in the backward pass, trading one more forward for the memory.
#include <torch/types.h>

#include <functional>

namespace dalle::train {

// fn(x), whose backward reruns fn on the saved input with the random generator state and
// autocast state of the first run, so that dropout masks and precisions repeat exactly.
// Gradients reach x and every parameter fn uses, as without checkpointing.
torch::Tensor checkpointed(const std::function<torch::Tensor(const torch::Tensor&)>& fn, const torch::Tensor& x);

}  // namespace dalle::train
