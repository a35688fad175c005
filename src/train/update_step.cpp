#include "dalle/train/update_step.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "dalle/error.h"
#include "dalle/log.h"
#include "dalle/train/adamw.h"

namespace dalle::train {

UpdateStep::UpdateStep(torch::optim::Optimizer& optimizer, ModelPrecision& precision, UpdateOptions options,
                       Ema* ema, const torch::nn::Module* averaged)
    : optimizer_(optimizer),
      precision_(precision),
      options_(std::move(options)),
      ema_(ema),
      averaged_(averaged),
      reducer_(std::make_shared<distributed::LocalReducer>()) {
  if ((ema_ == nullptr) != (averaged_ == nullptr)) {
    throw Error(options_.what + ": an update step's moving average needs both the average and its module");
  }
}

void UpdateStep::set_reducer(std::shared_ptr<distributed::GradientReducer> reducer) {
  if (!reducer) throw Error(options_.what + ": an update step needs a gradient reducer");
  reducer_ = std::move(reducer);
}

// As torch's clip_grad_norm_, with the norm of the whole model as the reducer measures it.
double UpdateStep::clip_gradients() {
  if (options_.grad_clip <= 0 && !options_.measure_norm) return 0;
  const auto& parameters = precision_.parameters();
  const double norm = reducer_->gradient_norm(parameters);
  if (options_.grad_clip > 0 && std::isfinite(norm)) {
    const double factor = std::min(1.0, options_.grad_clip / (norm + 1e-6));
    clip_factor_ = factor;
    torch::NoGradGuard no_grad;
    for (const auto& parameter : parameters) {
      if (parameter.grad().defined()) parameter.grad().mul_(factor);
    }
  }
  return norm;
}

// Gradients the reducer keeps compressed are made one at a time, as AdamW reaches them.
void UpdateStep::step_optimizer() {
  if (!reducer_->keeps_gradients()) {
    optimizer_.step();
    return;
  }
  auto* adamw = dynamic_cast<AdamW*>(&optimizer_);
  if (adamw == nullptr) throw Error(options_.what + ": a reducer that keeps gradients compressed needs dalle's AdamW");
  adamw->step_with([this](const torch::Tensor& parameter) {
    auto kept = reducer_->take_gradient(parameter, clip_factor_);
    return kept.defined() ? kept : parameter.grad();
  });
}

UpdateResult UpdateStep::apply(const torch::Tensor& loss, int64_t update) {
  optimizer_.zero_grad();
  clip_factor_ = 1.0;
  reducer_->before_backward(precision_.parameters());
  // A gradient the reducer keeps from update to update (PowerSGD's error feedback) is added
  // to by this backward, so it is brought to this backward's scales first.
  precision_.scale_held_gradients();
  precision_.scaled(loss).backward();
  // Averaging commutes with the fp16 scales, so what backward started averaging finishes
  // first; what must see true gradients (PowerSGD's error feedback would otherwise carry one
  // update's scale into the next) is reduced after unscaling, and only for an update taken.
  reducer_->reduce_scaled(precision_.parameters());
  const auto finite = reducer_->agree(precision_.finite_flags());
  UpdateResult result;
  if (precision_.unscale_and_update(finite)) {
    reducer_->reduce_unscaled(precision_.parameters());
    result.grad_norm = clip_gradients();
  } else {
    result.grad_norm = std::nan("");
  }
  // A norm that overflows is as unusable as a non-finite gradient.
  result.skipped = !std::isfinite(result.grad_norm);
  if (result.skipped) {
    log::warn(options_.what, ": gradients not finite at update ", update, "; the update is skipped");
    return result;
  }
  step_optimizer();
  if (options_.after_step) options_.after_step();
  if (ema_) ema_->update(*averaged_);
  return result;
}

}  // namespace dalle::train
