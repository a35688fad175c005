#pragma once
// How a prior's resblocks run while it trains, installed from outside the model through
// PriorImpl::set_resblock_runner: each branch in the configured precision, with DALL-E's
// per-resblock gradient scaling in fp16, and activation checkpointing of every k-th
// resblock. The residual stream stays fp32 in value and gradient.
#include <cstdint>

#include "dalle/models/prior.h"
#include "dalle/train/gradient_scaler.h"
#include "dalle/train/precision.h"

namespace dalle::train {

struct ResblockTraining {
  Precision precision = Precision::fp32;
  // fp16 only: one group per resblock, in the order of the resblocks. In backward, the
  // gradient entering resblock i is multiplied by scaler->scale(i) and cast to fp16, the
  // block backpropagates in fp16, non-finite values of the gradient leaving it are set to 0,
  // and that gradient is divided by the scale, in fp32, before it joins the residual stream.
  GradientScaler* scaler = nullptr;
  // Resblocks 0, k, 2k, ... recompute their activations in backward (0: none, 1: all).
  int64_t checkpoint_every = 0;
  // The type those resblocks keep their inputs in (activation_checkpoint.h's kept_input).
  torch::ScalarType checkpointed_inputs = torch::kFloat32;
};

using Resblocks = std::vector<std::shared_ptr<models::ResblockImpl>>;

// For a prior: prior->set_resblock_runner(make_training_runner(prior->resblocks(), ...)).
models::ResblockRunner make_training_runner(const Resblocks& resblocks, ResblockTraining training);

// The scaler's groups: each resblock's parameters, in order.
std::vector<std::vector<torch::Tensor>> resblock_parameter_groups(const Resblocks& resblocks);

}  // namespace dalle::train
