#include "dalle/train/resblock_runner.h"

#include <torch/torch.h>

#include <algorithm>
#include <unordered_map>

#include "dalle/error.h"
#include "dalle/train/activation_checkpoint.h"

namespace dalle::train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Forward: the branch's output as fp32. Backward: the gradient entering the block, times the
// block's scale, in fp16.
class ScaleGradientEnteringBlock : public torch::autograd::Function<ScaleGradientEnteringBlock> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& branch_output, double scale) {
    ctx->saved_data["scale"] = scale;
    return branch_output.to(torch::kFloat32);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const double scale = ctx->saved_data["scale"].toDouble();
    return {(grads[0] * scale).to(torch::kFloat16), torch::Tensor()};
  }
};

// Forward: the block's input unchanged. Backward: the gradient leaving the block with its
// non-finite values set to 0, unscaled to fp32.
class UnscaleGradientLeavingBlock : public torch::autograd::Function<UnscaleGradientLeavingBlock> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& block_input, double scale) {
    ctx->saved_data["scale"] = scale;
    return block_input;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const double scale = ctx->saved_data["scale"].toDouble();
    return {torch::nan_to_num(grads[0], 0.0, 0.0, 0.0).to(torch::kFloat32) / scale, torch::Tensor()};
  }
};

}  // namespace

std::vector<std::vector<torch::Tensor>> resblock_parameter_groups(const Resblocks& resblocks) {
  std::vector<std::vector<torch::Tensor>> groups;
  for (const auto& block : resblocks) groups.push_back(block->parameters());
  return groups;
}

models::ResblockRunner make_training_runner(const Resblocks& resblocks, ResblockTraining training) {
  if (training.precision == Precision::fp16 && (!training.scaler || training.scaler->groups() != resblocks.size())) {
    throw Error("fp16 training needs a gradient scaler with one group per resblock");
  }
  std::unordered_map<const models::ResblockImpl*, int64_t> index;
  std::vector<bool> trains;  // a frozen block behind frozen layers has nothing to recompute for
  for (size_t i = 0; i < resblocks.size(); ++i) {
    index.emplace(resblocks[i].get(), i);
    const auto parameters = resblocks[i]->parameters();
    trains.push_back(
        std::any_of(parameters.begin(), parameters.end(), [](const auto& p) { return p.requires_grad(); }));
  }
  const auto autocast = autocast_dtype(training.precision);

  return [index = std::move(index), trains = std::move(trains), training, autocast](
             models::ResblockImpl& block, const torch::Tensor& x, const models::ResblockContext& context) {
    const int64_t i = index.at(&block);
    // By value: a checkpointed branch runs again in backward, after this frame is gone.
    auto branch = [&block, context, autocast](const torch::Tensor& input) {
      AutocastGuard guard(input.device().type(), autocast);
      return block.branch(input, context);
    };
    const bool checkpoint = training.checkpoint_every > 0 && i % training.checkpoint_every == 0 && !context.cache &&
                            (x.requires_grad() || trains[i]);
    auto run = [&](const torch::Tensor& input) {
      return checkpoint ? checkpointed(branch, input, training.checkpointed_inputs) : branch(input);
    };
    if (training.precision != Precision::fp16) return x + run(x).to(x.scalar_type());
    const double scale = training.scaler->scale(static_cast<size_t>(i));
    const auto output = run(UnscaleGradientLeavingBlock::apply(x, scale));
    return x + ScaleGradientEnteringBlock::apply(output, scale);
  };
}

}  // namespace dalle::train
