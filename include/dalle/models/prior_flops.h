#pragma once
// The model FLOPs of training the prior, one rule shared by the benchmark (its MFU) and the
// capacity planner (dalle-plan's step time), so that the two never count differently.
#include <torch/nn/module.h>

#include <cstdint>

#include "dalle/models/prior.h"

namespace dalle::models {

// The weights of `module`'s matrix multiplies: every Linear's weight matrix. Embeddings are
// lookups, not multiplies; biases and norms are too few to count.
int64_t matrix_weights(const torch::nn::Module& module);

// Model FLOPs of one trained token, forward and backward (PaLM's accounting, appendix B): 6
// per weight of every matrix multiply and 6 x layers x sequence x width for causal
// attention's scores and weighted sums (PaLM's 12 L T d halved for the causal mask), counted
// dense: the sparse masks compute less, and recomputation under checkpointing is not counted.
double prior_flops_per_token(double matrix_weights, const PriorConfig& config);

}  // namespace dalle::models
